"""The RL loop: ``train`` (warm start, RL steps, evaluation, checkpoints, clean stop) and ``rl_step``, which
reads exactly like the data flow of one step.

    prompts ─► prompt pruning (DPPO: history, pi_q; pruned prompts are never generated)
            ─► generate G completions (rollout engine)  ─► rewards  ─► advantages on the FULL groups
            ─► completion pruning (the pruner: none | cppo | dppo | pods): keep mask + weight, full-batch denominator D
            ─► PPO mini-batches (split by drawn prompt, from the seed; each with its own fixed D_m)
            ─► Dense Prompt Packing of each mini-batch (THD micro-batches, equal count per DP rank)
            ─► old/ref log-probs (forward only, once per rollout)  ─► rollout correction (tis | mis)
            ─► for epoch: for mini-batch: policy update with its fixed D_m
            ─► weight push (Megatron -> HF names -> rollout engine)  ─► eval  ─► metrics  ─► checkpoint

What this file decides (and the simplifications it makes, stated once):

* By default one optimizer update per rollout batch (on-policy): the PPO ratio is exactly 1 at the update, so
  the old-policy log-prob pass is skipped (old = detached current, ``stages.old_logprobs_needed``; forced with
  ``train.recompute_old_logprobs``) and clipping never binds; the rollout engine's own log-probs against the
  train forward's serve as a mismatch metric. ``train.mini_batches`` / ``train.epochs`` give several updates per
  rollout: the old log-probs are then computed once, before the first update, and the ratio is live afterwards
  (docs/algorithms.md, "Several updates per rollout"); the learning rate is the RL step's for each of them.
* Every process holds a rollout engine. Generation, reward scoring and evaluation are sharded over ranks
  (``dist.collectives.map_sharded``) and gathered, so every rank sees the same full batch; advantages, the packing
  plan and the denominator are then computed identically everywhere, and every random pruning draw is made on
  rank 0 with a generator seeded from (seed, step, decision) and broadcast (docs/architecture.md, "Distributed rules").
* Sampling seeds are derived from (seed, step, shard), so a resumed run regenerates exactly what a straight
  run would have generated (resume == straight run, bit for bit, at the same layout).
* The supervised warm start (``train.sft_steps``, ``warm_start.py``) goes through the same engine and loss.
* The trainer owns the learning-rate schedule across phases (constant ``train.sft_lr`` for the warm start, then
  ``optim.*`` counted from the first RL step) and sets the engine's per-group peak LR before each update.
* CPPO reproduces its authors' "mean over kept completions" (the denominator counts kept units); DPPO and
  ``none`` use the full-batch denominator (docs/algorithms.md, "Denominators").

Where the rest lives: in this package, ``draw.py`` (steps 1-4, the rollout side; ``rollouts.py``: generate and
score; ``dapo.py``: the refill rounds), ``stages.py`` (steps 5-12, the training side), ``step_metrics.py``,
``evaluation.py``, ``warm_start.py``, ``worker.py`` (a rollout worker's loop); in ``megatron_dppo.run``: set-up and
tear-down of the run, the weight push (``setup.py``), checkpoints, resume and stop signals (``lifecycle.py``), the
console and the metrics sinks. A stage takes the half of the run it uses (``RolloutSide`` or ``TrainSide``).
"""
from __future__ import annotations

import dataclasses
import math
import signal
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_dppo.algo.advantages import group_advantages
from megatron_dppo.algo.lr_schedule import lr_at_step
from megatron_dppo.config import Config
from megatron_dppo.distributed import collectives as D
from megatron_dppo.distributed.placement import roles
from megatron_dppo.run import console
from megatron_dppo.run.lifecycle import STOP_REQUESTED, StopSignals, save
from megatron_dppo.run.metrics import PhaseTimer, plot_reward_curve, read_jsonl
from megatron_dppo.run.setup import eval_due, push_weights, setup, teardown
from megatron_dppo.run.state import Run
from megatron_dppo.train.dapo import overlong_metrics
from megatron_dppo.train.draw import DrawnBatch, draw_batch, prompt_state_metrics, update_prompt_state
from megatron_dppo.train.evaluation import evaluate
from megatron_dppo.train.plan import RatePlanner
from megatron_dppo.train.rollouts import counted_episodes, error_metrics, training_rewards
from megatron_dppo.train.stages import (
    build_train_batch,
    correct_rollout_mismatch,
    fill_old_and_reference_logprobs,
    gradient_audit,
    pack_mini_batches,
    select_completions,
    split_mini_batches,
    update_policy,
    whole_batch_micro_batches,
    write_audit,
)
from megatron_dppo.train.step_metrics import logprob_mismatch, reward_model_metrics, step_metrics
from megatron_dppo.train.warm_start import finish_warm_start, sft_step
from megatron_dppo.train.worker import serve


# ==============================================================================================================
# One RL step, top to bottom
# ==============================================================================================================
def rl_step(run: Run, step: int) -> dict[str, float]:
    """Run RL step ``step`` and return its metrics (identical on every rank)."""
    cfg, timer = run.cfg, PhaseTimer()
    side, trainer = run.rollout_side, run.train_side  # the two halves of the step (run/state.py)

    # 1-4. The rollout side (draw.draw_batch), here or on the rollout workers (rollout.placement):
    #   1. prompts from the seeded, resumable sampler (CPPO allocation draws B/(1-P) to prune back to B*G);
    #   2. prompt-level pruning (DPPO): low-signal prompts seen before skipped with prob r_q, survivors 1/pi_q
    #      (pi recorded with the batch);
    #   3. G completions for every kept prompt (sharded over ranks, gathered on all; the engine's own log-probs
    #      kept as the behaviour log-probs); the rollout engine then releases its accelerator memory (vLLM sleep);
    #      with an env section each completion is a multi-turn episode with a loss mask (train/rollouts.py);
    #   4. rewards (a failing reward function costs its sample a 0 and a warning; a reward model scores beside
    #      it, reward.model, and a failing reward model stops the run);
    #   4b. DAPO dynamic sampling (dynamic_sampling.enable, algo.pruner=none): groups with one reward for all
    #      dropped and more prompts drawn, generated and scored until B groups remain (at most max_rounds rounds);
    #      from there on the kept groups ARE the step's drawn batch.
    planned = run.planner.apply(side, step) if run.planner is not None else {}  # algo.cost_budget: this step's rates
    drawn = draw_batch(side, step, timer) if run.link is None else receive_batch(run, step, timer)
    prompts, prompt_cut, kept, rollout = drawn.prompts, drawn.prompt_cut, drawn.kept, drawn.rollout

    # 5. Advantages on the FULL groups (never recomputed from survivors) of the training reward (the task reward,
    #    or a reward model's score and the rule's, plus DAPO's soft overlong penalty when overlong.buffer > 0);
    #    the groups go into the per-prompt state the prompt level reads (mean |A| or the rewards' spread:
    #    algo.history_score; or the posterior's counts of the raw rewards, dated by the weight version).
    rewards = training_rewards(cfg, rollout)
    advantages = group_advantages(rewards, counted_episodes(cfg, rollout), trainer.estimator,
                                  trainer.loss_cfg.advantage_eps) if kept else torch.zeros(0, cfg.train.group_size)
    update_prompt_state(side, rollout, rewards, advantages, drawn.version, screens=drawn.screens)

    # 6. Completion-level pruning -> per-completion keep mask and weight 1/(pi_q * pi_{i|q}).
    with timer("prune"):
        completion_cut, total_cut = select_completions(trainer, prompt_cut, rollout, advantages, step)

    # 7. The surviving sequences, their per-token weights and the fixed full-batch denominator D.
    batch = build_train_batch(trainer, prompts, prompt_cut, rollout, advantages, total_cut)

    metrics: dict[str, float] = {}
    if len(batch):
        # 8. PPO mini-batches: the drawn prompts split by prompt (from the seed, before pruning acts on the split)
        #    into train.mini_batches parts, each with its own fixed denominator D_m (default: one, the batch).
        mini_batches = split_mini_batches(trainer, prompts, prompt_cut, rollout, total_cut, batch, step)
        # 9. Dense Prompt Packing of each mini-batch: THD micro-batches, the same count on every DP rank.
        with timer("pack"):
            packed, packing = pack_mini_batches(trainer, mini_batches)
        # 10. Old-policy (and reference) log-probs, forward only, once per rollout before the first update.
        with timer("logprob"):
            fill_old_and_reference_logprobs(trainer, packed)
        # (every logging.audit_every steps: the pruned gradient against the full-batch one, at these weights)
        if cfg.logging.audit_every and step % cfg.logging.audit_every == 0:
            metrics.update(gradient_audit(trainer, prompts, prompt_cut, rollout, advantages, batch,
                                          whole_batch_micro_batches(trainer, batch, packed)))
        # 11. Rollout correction (loss.rollout_correction): trainer vs rollout-engine IS weights on the pg term.
        metrics.update(correct_rollout_mismatch(trainer.loss_cfg, rollout, mini_batches, packed))
        # 12. Policy updates: for epoch: for mini-batch: one update with its fixed D_m (an empty one is skipped).
        with timer("train"):
            trainer.engine.set_learning_rate(rl_learning_rate(cfg, step))
            metrics.update(update_policy(trainer, mini_batches, packed))
        metrics.update(packing)
        metrics.update(logprob_mismatch(rollout, mini_batches, packed, trainer.engine.last_logprobs))
    else:  # nothing survived (e.g. every group had equal rewards and was dropped): no update this step
        metrics["train/skipped"] = 1.0

    # 13. Weight push: Megatron -> HF names -> rollout engine (separate placement: to the workers, version
    #     step + 1, without waiting for them; also after a step without an update, since they wait for it).
    if len(batch) or run.link is not None:
        with timer("weight_sync"):
            push_weights(run, version=step + 1)

    # 14. Metrics (docs/algorithms.md, "Metrics").
    metrics.update(step_metrics(prompt_cut, completion_cut, total_cut, rollout, batch, cfg.train.group_size))
    metrics.update(prompt_state_metrics(side))
    metrics.update(planned)
    if drawn.screens is not None:  # screen/*: screened, continued, generated fraction
        metrics.update(drawn.screens.metrics(cfg.train.group_size, len(prompts)))
    if drawn.refilled is not None:  # reward/* over every generated group, dynamic_sampling/*
        metrics.update(drawn.refilled.metrics())
    metrics.update(overlong_metrics(cfg, rollout))
    metrics.update(error_metrics(cfg, rollout))  # (env.errors=exclude: env_error episodes left out)
    metrics.update(reward_model_metrics(cfg, prompt_cut, rollout))  # (reward.model: agreement with the rule)
    metrics.update(async_metrics(run, drawn))
    metrics.update(timer.as_metrics())
    # CPU seconds of the whole step (timed phases or not, child processes included), all ranks: train.cpu_budget_s
    metrics["time/step_cpu"] = D.sum_over_ranks(timer.step_cpu_seconds())
    metrics.update(side.handover.take_metrics())  # GPU memory per handover phase (none on CPU)
    metrics["throughput/tokens_per_s"] = metrics["tokens/trained_sequences"] / max(metrics["time/step"], 1e-9)
    write_audit(run.audit, step, prompts, prompt_cut, rollout, advantages, total_cut, drawn.screens)
    if run.planner is not None:
        run.planner.observe(metrics, [p.id for p in prompts], advantages)
    return metrics


def budget_spent(cfg: Config, rl_cpu_s: float) -> bool:
    """Whether the RL phase has used its ``train.cpu_budget_s`` (``rl_cpu_s``: cumulative time/step_cpu)."""
    return cfg.train.cpu_budget_s is not None and rl_cpu_s >= cfg.train.cpu_budget_s


def rl_eval_due(cfg: Config, rl_step: int, cpu_before: float, cpu_after: float) -> bool:
    """Whether the policy after ``rl_step`` RL steps is evaluated: ``eval_due`` (every eval.every steps, and after
    train.steps), or, for the CPU clock (the step took the RL CPU seconds from ``cpu_before`` to ``cpu_after``),
    the step crossed a multiple of ``eval.every_cpu_s``; with either on, also the last step of a run that spent
    ``train.cpu_budget_s``."""
    every = cfg.eval.every_cpu_s
    if eval_due(cfg, rl_step):
        return True
    if not (cfg.eval.every or every):
        return False
    if rl_step == cfg.train.steps or budget_spent(cfg, cpu_after):
        return True
    return bool(every) and math.floor(cpu_after / every) > math.floor(cpu_before / every)


def rl_learning_rate(cfg: Config, rl_step_index: int) -> float:
    """The learning rate of RL step ``rl_step_index``: optim.* counted from the first RL step (warmup, then
    constant or cosine to optim.min_lr). The trainer owns the schedule across phases: train.sft_lr for the warm
    start, then this; the engine's own schedule is configured constant."""
    o = cfg.optim
    return lr_at_step(o, rl_step_index, o.lr, o.min_lr, total_steps=max(cfg.train.steps, o.warmup_steps + 1))


def receive_batch(run: Run, step: int, timer: PhaseTimer) -> DrawnBatch:
    """Separate placement: the batch of ``step`` from the rollout workers (staleness checked; the wait is the
    phase ``time/wait_rollout``); the trainer's sampler takes the position after it, so a checkpoint counts every
    prompt handed out for the batches trained."""
    with timer("wait_rollout"):
        drawn = run.link.receive(step)
    run.rollout_side.sampler.load_state_dict(drawn.sampler_state)
    return drawn


def evaluation(run: Run, step: int) -> dict[str, float]:
    """The evaluation after RL step ``step`` (-1: before the first), of the policy after step + 1 updates: here,
    or (separate placement) the rollout workers' of that weight version, which ``push_weights`` marked due; the
    trainer waits for it as the synchronous loop waits for its own (docs/async.md, "Evaluation")."""
    return evaluate(run.rollout_side, step) if run.link is None else run.link.receive_eval(step + 1)


def async_metrics(run: Run, drawn: DrawnBatch) -> dict[str, float]:
    """Separate placement: async/staleness of the batch (versions between its generator and the trained
    weights), async/trainer_wait_s (the trainer idle, waiting for it), the workers' idle/busy/CPU seconds."""
    if run.link is None:
        return {}
    step = run.link.gate.admitted[-1][0]
    partial = {}
    if drawn.rollout.token_versions is not None:  # partial rollouts (rollout.max_interruptions): per token
        from megatron_dppo.rollout.partial import partial_metrics
        partial = partial_metrics(drawn.rollout.token_versions, step)
    return {"async/staleness": float(step - drawn.version), "async/trainer_wait_s": run.link.last_wait_s,
            **partial, **drawn.metrics}


# ==============================================================================================================
# Entry points
# ==============================================================================================================
def train(cfg: Config, *, checkpoints: bool = True) -> dict[str, Any]:
    """Warm start (optional) + RL, resuming from the latest checkpoint. Returns {"metrics": the last RL step's
    metrics, "stopped_by": the signal number that stopped the run, STOP_REQUESTED (0) for a job-script stop
    request, or None, "rl_step", "sft_step", ...}."""
    from tqdm import tqdm

    if cfg.rollout.placement == "separate" and roles(cfg).is_worker:  # this process is a rollout worker
        return {"metrics": {}, "stopped_by": None, "worker": serve(cfg), "output_dir": cfg.train.output_dir}
    run = setup(cfg, resume=checkpoints)
    run.planner = RatePlanner(cfg.algo.cost_budget) if cfg.algo.planned else None
    clean = False
    start, last, stopped_by = (run.sft_step, run.rl_step), {}, None
    saved: dict[tuple[int, int], Path] = {}  # position -> checkpoint written there (never write one twice)

    def checkpoint() -> Path:
        position = (run.sft_step, run.rl_step)
        if position not in saved:
            saved[position] = save(run)
        return saved[position]

    if start == (cfg.train.sft_steps, cfg.train.steps) and D.is_main():
        print(f"nothing to do: {cfg.train.output_dir} already finished RL step {cfg.train.steps} of "
              f"{cfg.train.steps}; raise train.steps to continue, or use a new train.output_dir (or delete this "
              "one) to start over", flush=True)
    elif run.sft_step == cfg.train.sft_steps and budget_spent(cfg, run.rl_cpu_s) and D.is_main():
        print(f"nothing to do: {cfg.train.output_dir} already spent train.cpu_budget_s={cfg.train.cpu_budget_s} "
              f"({run.rl_cpu_s:.1f} CPU s in {run.rl_step} RL steps); raise it to continue", flush=True)
    try:
        with StopSignals() as stop:
            # -- supervised warm start
            bar = console.progress_bar(tqdm, cfg, run.sft_step, cfg.train.sft_steps, "warm start")
            while run.sft_step < cfg.train.sft_steps and stopped_by is None:
                m = sft_step(run.train_side, run.sft_pairs, run.sft_step)
                run.sft_step += 1
                run.sink.log(run.sft_step - 1, m, phase="sft", global_step=run.sft_step - 1)
                console.progress(bar, {"nll": m["sft/nll"]})
                if run.sft_step == cfg.train.sft_steps:
                    finish_warm_start(run.train_side)
                    push_weights(run)  # the rollout engine (or workers) start RL from the warmed-up policy
                elif checkpoints and cfg.checkpoint.every and run.sft_step % cfg.checkpoint.every == 0:
                    checkpoint()  # warm-start progress is checkpointed like RL steps
                stopped_by = stop.poll()
            console.close_bar(bar)

            # -- RL (with an evaluation before the first step, logged at step -1, and every eval.every steps /
            #    eval.every_cpu_s CPU seconds), up to train.steps or train.cpu_budget_s
            if (cfg.eval.every or cfg.eval.every_cpu_s) and run.rl_step == 0 and stopped_by is None:
                run.sink.log(-1, evaluation(run, -1), phase="eval", global_step=cfg.train.sft_steps)
            bar = console.progress_bar(tqdm, cfg, run.rl_step, cfg.train.steps, "RL") if stopped_by is None else None
            while run.rl_step < cfg.train.steps and not budget_spent(cfg, run.rl_cpu_s) and stopped_by is None:
                step, cpu_before = run.rl_step, run.rl_cpu_s
                m = rl_step(run, step)
                run.rl_step += 1
                run.rl_cpu_s += m["time/step_cpu"]  # (summed over ranks: the same on every rank)
                run.sink.log(step, m, global_step=cfg.train.sft_steps + step)
                if rl_eval_due(cfg, run.rl_step, cpu_before, run.rl_cpu_s):
                    ev = evaluation(run, step)
                    run.sink.log(step, ev, phase="eval", global_step=cfg.train.sft_steps + step)
                    m.update(ev)
                last = m
                console.progress(bar, {"reward": m.get("reward/mean", float("nan")),
                                       "kept": m["prune/total_kept_fraction"], "tok/s": m["throughput/tokens_per_s"]})
                console.print_step(cfg, step, m)
                if checkpoints and cfg.checkpoint.every and run.rl_step % cfg.checkpoint.every == 0 \
                        and run.rl_step < cfg.train.steps and not budget_spent(cfg, run.rl_cpu_s):
                    checkpoint()
                stopped_by = stop.poll()
            console.close_bar(bar)

            # -- final checkpoint (also the one a signal asked for)
            if checkpoints and (run.sft_step, run.rl_step) != start:
                path = checkpoint()  # (the one of this step when a signal came during a checkpoint step)
                if stopped_by is not None and D.is_main():
                    reason = "the job script's stop request" if stopped_by == STOP_REQUESTED \
                        else signal.Signals(stopped_by).name
                    print(f"stopped by {reason}; checkpoint {path}; run the same command again to resume", flush=True)
        clean = True
    finally:
        teardown(run, clean)
    summary = {"metrics": last, "stopped_by": stopped_by, "rl_step": run.rl_step, "sft_step": run.sft_step,
               "output_dir": cfg.train.output_dir}
    if D.is_main() and cfg.logging.plot:
        png = plot_reward_curve(run.sink.jsonl_path, Path(cfg.train.output_dir) / "reward_curve.png")
        if png is not None:
            print(f"reward curve: {png}", flush=True)
            summary["plot"] = str(png)
    return summary


def bench(cfg: Config, steps: int = 5) -> dict[str, float]:
    """``megatron-dppo bench``: 1 warm-up + ``steps`` RL steps, no checkpoints, median time per phase."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sft_steps=0, steps=steps + 1,
                                                             output_dir=str(Path(cfg.train.output_dir) / "bench")),
                              eval=dataclasses.replace(cfg.eval, every=0))
    summary = train(cfg, checkpoints=False)
    if "worker" in summary:  # a rollout worker of rollout.placement=separate: the trainer reports
        return {}
    records = [r for r in read_jsonl(Path(cfg.train.output_dir) / "metrics.jsonl") if r.get("phase") == "rl"][1:]
    keys = sorted({k for r in records for k in r
                   if k.startswith(("time/", "time_cpu/", "throughput/", "packing/density"))})
    out = {k: _median([r[k] for r in records if k in r]) for k in keys}
    if D.is_main():
        print(f"median over {len(records)} RL steps (after 1 warm-up):")
        for k, v in out.items():
            print(f"  {k:32s} {v:10.4f}")
    summary["bench"] = out
    return out


def _median(values: Sequence[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


