"""The RL loop and its stages. ``loop.py`` (``train`` and ``rl_step``, which reads like the algorithm); the rollout
side of a step, steps 1-4: ``draw.py`` (draw prompts, prompt-level pruning), ``rollouts.py`` (generate, score),
``dapo.py`` (dynamic sampling's refill rounds, overlong metrics); the training side, steps 5-12: ``stages.py``
(completion pruning, the surviving batch and its denominator, mini-batches, packing, log-probs, rollout
correction, the updates); ``step_metrics.py``; ``evaluation.py``; ``warm_start.py``; ``audit.py`` (the pruned vs
full gradient); ``worker.py`` (a rollout worker's loop under ``rollout.placement=separate``)."""
