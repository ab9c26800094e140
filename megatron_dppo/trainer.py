"""The RL loop: ``train`` (warm start, RL steps, evaluation, checkpoints, clean stop) and ``rl_step``, which
reads exactly like the data flow of one step.

    prompts ─► prompt pruning (DPPO: history, pi_q; pruned prompts are never generated)
            ─► generate G completions (rollout engine)  ─► rewards  ─► advantages on the FULL groups
            ─► completion pruning (none | cppo | dppo): keep mask + weight, full-batch denominator D
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
  (``distributed.map_sharded``) and gathered, so every rank sees the same full batch; advantages, the packing
  plan and the denominator are then computed identically everywhere, and every random pruning draw is made on
  rank 0 with a generator seeded from (seed, step, decision) and broadcast (docs/architecture.md, "Distributed rules").
* Sampling seeds are derived from (seed, step, shard), so a resumed run regenerates exactly what a straight
  run would have generated (resume == straight run, bit for bit, at the same layout).
* The supervised warm start (``train.sft_steps``, ``warm_start.py``) goes through the same engine and loss.
* The trainer owns the learning-rate schedule across phases (constant ``train.sft_lr`` for the warm start, then
  ``optim.*`` counted from the first RL step) and sets the engine's per-group peak LR before each update.
* CPPO reproduces its authors' "mean over kept completions" (the denominator counts kept units); DPPO and
  ``none`` use the full-batch denominator (docs/algorithms.md, "Denominators").

Where the rest lives: ``stages.py`` (each stage of a step and its metrics), ``run.py`` (set-up, tear-down, weight
push, LR schedule), ``lifecycle.py`` (checkpoints, resume, stop signals), ``evaluation.py``, ``warm_start.py``,
``console.py`` (progress bars and printed lines).
"""
from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_dppo import console
from megatron_dppo import distributed as D
from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.config import Config
from megatron_dppo.dapo_stages import overlong_metrics
from megatron_dppo.evaluation import evaluate, evaluate_checkpoint  # noqa: F401 - the CLI's `eval` entry point
from megatron_dppo.lifecycle import STOP_REQUESTED, StopSignals, save
from megatron_dppo.metrics import PhaseTimer, plot_reward_curve
from megatron_dppo.placement import roles
from megatron_dppo.rollout_side import DrawnBatch, draw_batch, serve
from megatron_dppo.run import Run, eval_due, push_weights, rl_learning_rate, set_learning_rate, setup, teardown
from megatron_dppo.stages import (
    build_train_batch,
    correct_rollout_mismatch,
    fill_old_and_reference_logprobs,
    gradient_audit,
    logprob_mismatch,
    merge_update_metrics,
    pack_mini_batches,
    select_completions,
    split_mini_batches,
    step_metrics,
    training_rewards,
    whole_batch_micro_batches,
    write_audit,
)
from megatron_dppo.warm_start import finish_warm_start, sft_step


# ==============================================================================================================
# One RL step, top to bottom
# ==============================================================================================================
def rl_step(run: Run, step: int) -> dict[str, float]:
    """Run RL step ``step`` and return its metrics (identical on every rank)."""
    cfg, timer = run.cfg, PhaseTimer()
    G = cfg.train.group_size

    # 1-4. The rollout side (rollout_side.draw_batch), here or on the rollout workers (rollout.placement):
    #   1. prompts from the seeded, resumable sampler (CPPO allocation draws B/(1-P) to prune back to B*G);
    #   2. prompt-level pruning (DPPO): low-signal prompts seen before skipped with prob r_q, survivors 1/pi_q
    #      (pi recorded with the batch);
    #   3. G completions for every kept prompt (sharded over ranks, gathered on all; the engine's own log-probs
    #      kept as the behaviour log-probs); the rollout engine then releases its accelerator memory (vLLM sleep);
    #   4. rewards (a failing reward function costs its sample a 0 and a warning);
    #   4b. DAPO dynamic sampling (dynamic_sampling.enable, algo.pruner=none): groups with one reward for all
    #      dropped and more prompts drawn, generated and scored until B groups remain (at most max_rounds rounds);
    #      from there on the kept groups ARE the step's drawn batch.
    drawn = draw_batch(run, step, timer) if run.link is None else receive_batch(run, step, timer)
    prompts, prompt_cut, kept, rollout, refilled = (drawn.prompts, drawn.prompt_cut, drawn.kept, drawn.rollout,
                                                    drawn.refilled)

    # 5. Advantages on the FULL groups (never recomputed from survivors) of the training reward (the task reward
    #    plus DAPO's soft overlong penalty when overlong.buffer > 0); remember mean |A| per prompt.
    advantages = compute_advantages(training_rewards(run, rollout), run.estimator, run.loss_cfg.advantage_eps) \
        if kept else torch.zeros(0, G)
    if kept:
        run.history.update([p.id for p in kept], advantages)

    # 6. Completion-level pruning -> per-completion keep mask and weight 1/(pi_q * pi_{i|q}).
    with timer("prune"):
        completion_cut, total_cut = select_completions(run, prompt_cut, rollout, advantages, step)

    # 7. The surviving sequences, their per-token weights and the fixed full-batch denominator D.
    batch = build_train_batch(run, prompts, prompt_cut, rollout, advantages, total_cut)

    metrics: dict[str, float] = {}
    if len(batch):
        # 8. PPO mini-batches: the drawn prompts split by prompt (from the seed, before pruning acts on the split)
        #    into train.mini_batches parts, each with its own fixed denominator D_m (default: one, the batch).
        mini_batches = split_mini_batches(run, prompts, prompt_cut, rollout, total_cut, batch, step)
        # 9. Dense Prompt Packing of each mini-batch: THD micro-batches, the same count on every DP rank.
        with timer("pack"):
            packed, packing = pack_mini_batches(run, mini_batches)
        # 10. Old-policy (and reference) log-probs, forward only, once per rollout before the first update.
        with timer("logprob"):
            fill_old_and_reference_logprobs(run, packed)
        # (every logging.audit_every steps: the pruned gradient against the full-batch one, at these weights)
        if cfg.logging.audit_every and step % cfg.logging.audit_every == 0:
            metrics.update(gradient_audit(run, prompts, prompt_cut, rollout, advantages, batch,
                                          whole_batch_micro_batches(run, batch, packed)))
        # 11. Rollout correction (loss.rollout_correction): trainer vs rollout-engine IS weights on the pg term.
        metrics.update(correct_rollout_mismatch(run, rollout, mini_batches, packed))
        # 12. Policy updates: for epoch: for mini-batch: one update with its fixed D_m (an empty one is skipped).
        with timer("train"):
            set_learning_rate(run.engine, rl_learning_rate(cfg, step))
            updates = []
            for _epoch in range(cfg.train.epochs):
                for mini_batch, micro_batches in zip(mini_batches, packed):
                    if len(mini_batch):
                        updates.append(run.engine.train_step(micro_batches, mini_batch.denominator))
        metrics.update({f"train/{k}": v for k, v in merge_update_metrics(updates).items()})
        metrics.update(packing)
        metrics.update(logprob_mismatch(rollout, mini_batches, packed, run.engine.last_logprobs))
    else:  # nothing survived (e.g. every group had equal rewards and was dropped): no update this step
        metrics["train/skipped"] = 1.0

    # 13. Weight push: Megatron -> HF names -> rollout engine (separate placement: to the workers, version
    #     step + 1, without waiting for them; also after a step without an update, since they wait for it).
    if len(batch) or run.link is not None:
        with timer("weight_sync"):
            push_weights(run, version=step + 1)

    # 14. Metrics (docs/algorithms.md, "Metrics").
    metrics.update(step_metrics(run, prompt_cut, completion_cut, total_cut, rollout, batch))
    if refilled is not None:  # reward/* over every generated group, dynamic_sampling/*
        metrics.update(refilled.metrics())
    metrics.update(overlong_metrics(run, rollout))
    metrics.update(async_metrics(run, drawn))
    metrics.update(timer.as_metrics())
    metrics["time/step_cpu"] = D.sum_over_ranks(timer.cpu_seconds)  # process CPU seconds of the step, all ranks
    metrics.update(run.handover.take_metrics())  # GPU memory per handover phase (none on CPU)
    metrics["throughput/tokens_per_s"] = metrics["tokens/trained_sequences"] / max(metrics["time/step"], 1e-9)
    write_audit(run, step, prompts, prompt_cut, rollout, advantages, total_cut)
    return metrics



def receive_batch(run: Run, step: int, timer: PhaseTimer) -> DrawnBatch:
    """Separate placement: the batch of ``step`` from the rollout workers (staleness checked; the wait is the
    phase ``time/wait_rollout``); the trainer's sampler takes the position after it, so a checkpoint counts every
    prompt handed out for the batches trained."""
    with timer("wait_rollout"):
        drawn = run.link.receive(step)
    run.sampler.load_state_dict(drawn.sampler_state)
    return drawn


def evaluation(run: Run, step: int) -> dict[str, float]:
    """The evaluation after RL step ``step`` (-1: before the first), of the policy after step + 1 updates: here,
    or (separate placement) the rollout workers' of that weight version, which ``push_weights`` marked due; the
    trainer waits for it as the synchronous loop waits for its own (docs/async.md, "Evaluation")."""
    return evaluate(run, step) if run.link is None else run.link.receive_eval(step + 1)


def async_metrics(run: Run, drawn: DrawnBatch) -> dict[str, float]:
    """Separate placement: async/staleness of the batch (versions between its generator and the trained
    weights), async/trainer_wait_s (the trainer idle, waiting for it), the workers' idle/busy/CPU seconds."""
    if run.link is None:
        return {}
    return {"async/staleness": float(run.link.gate.admitted[-1][0] - drawn.version),
            "async/trainer_wait_s": run.link.last_wait_s, **drawn.metrics}


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
    try:
        with StopSignals() as stop:
            # -- supervised warm start
            bar = console.progress_bar(tqdm, cfg, run.sft_step, cfg.train.sft_steps, "warm start")
            while run.sft_step < cfg.train.sft_steps and stopped_by is None:
                m = sft_step(run, run.sft_step)
                run.sft_step += 1
                run.sink.log(run.sft_step - 1, m, phase="sft", global_step=run.sft_step - 1)
                console.progress(bar, {"nll": m["sft/nll"]})
                if run.sft_step == cfg.train.sft_steps:
                    finish_warm_start(run)
                elif checkpoints and cfg.checkpoint.every and run.sft_step % cfg.checkpoint.every == 0:
                    checkpoint()  # warm-start progress is checkpointed like RL steps
                stopped_by = stop.poll()
            console.close_bar(bar)

            # -- RL (with an evaluation before the first step, logged at step -1, and every eval.every steps)
            if cfg.eval.every and run.rl_step == 0 and stopped_by is None:
                run.sink.log(-1, evaluation(run, -1), phase="eval", global_step=cfg.train.sft_steps)
            bar = console.progress_bar(tqdm, cfg, run.rl_step, cfg.train.steps, "RL") if stopped_by is None else None
            while run.rl_step < cfg.train.steps and stopped_by is None:
                step = run.rl_step
                m = rl_step(run, step)
                run.rl_step += 1
                run.sink.log(step, m, global_step=cfg.train.sft_steps + step)
                if eval_due(cfg, run.rl_step):
                    ev = evaluation(run, step)
                    run.sink.log(step, ev, phase="eval", global_step=cfg.train.sft_steps + step)
                    m.update(ev)
                last = m
                console.progress(bar, {"reward": m.get("reward/mean", float("nan")),
                                       "kept": m["prune/total_kept_fraction"], "tok/s": m["throughput/tokens_per_s"]})
                console.print_step(run, step, m)
                if checkpoints and cfg.checkpoint.every and run.rl_step % cfg.checkpoint.every == 0 \
                        and run.rl_step < cfg.train.steps:
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
    from megatron_dppo.metrics import read_jsonl

    records = [r for r in read_jsonl(Path(cfg.train.output_dir) / "metrics.jsonl") if r.get("phase") == "rl"][1:]
    keys = sorted({k for r in records for k in r if k.startswith(("time/", "throughput/", "packing/density"))})
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


