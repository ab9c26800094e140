"""What a training run is and its plumbing: ``state.py`` (:class:`Run` and its two halves, ``RolloutSide`` and
``TrainSide``), ``build.py`` (config -> tokenizer, prompts, rewards, rollout engine, pruner), ``setup.py`` (set-up,
tear-down, the weight push), ``lifecycle.py`` (checkpoints, resume, stop signals, the output lock), ``console.py``
(progress bars, the step line, the banner) and ``metrics.py`` (timers, JSONL / TensorBoard / W&B sinks, pass@k, the
reward-curve PNG). The RL loop that uses it is ``megatron_dppo.train``."""
