"""The rollout side of an RL step, and the loop of a rollout worker (``rollout.placement=separate``).

``draw_batch`` is steps 1-4 of ``trainer.rl_step``: prompts from the sampler, DPPO's prompt-level decision (pi
recorded with the batch), generation, rewards, and DAPO's refill rounds. In the synchronous loop the trainer calls
it itself; with separate placement the rollout workers call it in ``serve`` and send the result, stamped with the
version of the weights that generated it, the sampler position after it, and the worker's idle and CPU seconds.

A worker's loop: for RL step t, wait for weight version >= t - k (``staleness.StalenessGate``), load the newest
version that arrived (with the prompt history the trainer had at that version: the prompt decisions are made from
history up to k + 1 steps old, unbiased because pi is recorded with the batch, tests/unit/test_lagged_pruning.py),
draw the batch, send it; then the next (``train.staleness_mode=fixed``: exactly version t - k, the receiver keeping
every version until the loop is past it). A version the trainer marked due for evaluation is evaluated first, and
the metrics sent the same way (``DueEvaluations``). The first version also carries the trainer's RL step, sampler
position and history, so a resumed trainer repositions the workers (batches that were in flight are generated
again)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from megatron_dppo import distributed as D
from megatron_dppo.algo.pruning import PruneResult
from megatron_dppo.build import Prompt
from megatron_dppo.dapo_stages import keep_all, refill_groups
from megatron_dppo.metrics import PhaseTimer
from megatron_dppo.stages import Rollout, generate, prompts_to_draw, score, select_prompts


@dataclass
class DrawnBatch:
    """What the rollout side hands the trainer for one RL step."""

    step: int
    prompts: list[Prompt]  # the drawn prompts (after a refill: the kept groups' prompts)
    prompt_cut: PruneResult  # keep and pi of every drawn prompt, decided when drawn
    kept: list[Prompt]
    rollout: Rollout  # with rewards and the behaviour log-probs of the engine
    refilled: Any = None  # dapo_stages.Refill (dynamic_sampling.enable), else None
    version: int = 0  # weight version that generated it
    sampler_state: dict | None = None  # the sampler's position after drawing it
    metrics: dict[str, float] = field(default_factory=dict)  # the rollout side's timings (separate placement)


def draw_batch(run, step: int, timer: PhaseTimer) -> DrawnBatch:
    """Steps 1-4 of an RL step (trainer.rl_step explains each)."""
    cfg, G = run.cfg, run.cfg.train.group_size
    prompts = [run.train_prompts[i] for i in run.sampler.take(prompts_to_draw(run))]
    with timer("prune"):
        prompt_cut = select_prompts(run, prompts, step)
    kept = [p for p, k in zip(prompts, prompt_cut.keep.tolist()) if k]
    with timer("generate"):
        rollout = generate(run, kept, G, step, temperature=cfg.rollout.temperature)  # sleeps the engine after
    with timer("reward"):
        rollout.rewards = score(run, run.scorer, rollout)
    refilled = refill_groups(run, step, timer, rollout) if cfg.dynamic_sampling.enable else None
    if refilled is not None:
        prompts = kept = refilled.prompts
        rollout = refilled.rollout
        prompt_cut = keep_all(len(prompts))
    return DrawnBatch(step, prompts, prompt_cut, kept, rollout, refilled)


# ------------------------------------------------------------------------------------------------------------
# A rollout worker
# ------------------------------------------------------------------------------------------------------------
def serve(cfg) -> dict[str, Any]:
    """The loop of a rollout worker process until the trainer's stop message (module docstring)."""
    from megatron_dppo.placement import connect_worker
    from megatron_dppo.staleness import StalenessGate

    ignore_stop_signals()  # the trainer gets them too, stops at a step boundary and sends the stop message
    link = connect_worker(cfg)  # (returns after the trainer's set-up and warm start: its tokenizer is on disk)
    run = build_worker(cfg, link.roles)
    link.join_weights(cfg, run.rollout)  # (HF: received here; vLLM: inside its workers, rollout/vllm_weight_sync.py)
    first = link.weights.wait(0)
    if first is None:
        link.close()
        return {"batches": 0}
    fixed = cfg.train.staleness_mode == "fixed"  # (batch t from exactly version t - k: StalenessGate)
    gate = StalenessGate(cfg.train.max_staleness, fixed=fixed)
    gate.floor = link.weights.arrived[0]  # this run's first version (a resumed trainer may have sent more since)
    step, loaded, used, evals, newest = first.extra["rl_step"], None, [], DueEvaluations(run, link.batches), first

    def take(version) -> float:
        """Load ``version`` (if it is not loaded yet) and evaluate it if it is due; returns the eval seconds."""
        nonlocal loaded
        if version.version != loaded:
            link.weights.load(version)
            run.history.load_state_dict(version.extra["history"])
            loaded = version.version
        return evals.run_if_due(version)

    run.sampler.load_state_dict(first.extra["sampler"])
    while step < cfg.train.steps:
        idle_start = time.monotonic()
        newest = link.weights.wait(gate.fixed_version(step) if fixed else gate.min_version(step), exact=fixed)
        idle = time.monotonic() - idle_start
        if newest is None:  # the trainer stopped (a signal): no more batches wanted
            break
        eval_s = take(newest)  # (a due version is loaded at the latest for batch version + k: see DueEvaluations)
        timer = PhaseTimer()
        drawn = draw_batch(run, step, timer)
        drawn.version, drawn.sampler_state = loaded, run.sampler.state_dict()
        drawn.metrics = {"async/rollout_idle_s": idle, "async/rollout_busy_s": timer.as_metrics()["time/step"],
                         "async/rollout_cpu_s": D.sum_over_ranks(timer.cpu_seconds), "async/rollout_eval_s": eval_s}
        if link.batches is not None:
            link.batches.send(drawn)
        used.append({"step": step, "version": loaded, **drawn.metrics})
        step += 1
    while cfg.eval.every and newest is not None and newest.version < cfg.train.steps:
        newest = link.weights.wait(newest.version + 1, exact=fixed)  # after the last batch: the last version
        if newest is not None and newest.extra.get("eval"):  # (due), and any due one that came after the check
            take(newest)
    link.weights.wait(1 << 62)  # until the stop message (returns None), so no side leaves early
    link.close()
    summary = {"batches": used, "evals": evals.done, "versions_arrived": link.weights.arrived}
    if link.roles.side_rank == 0:  # the worker's record: which version generated each batch, idle / busy / CPU
        # seconds (D.is_main() no longer tells: link.close() destroyed the group, so every worker is "rank 0")
        path = Path(cfg.train.output_dir) / "rollout_worker.json"
        path.write_text(json.dumps(summary, indent=1))
    return summary


class DueEvaluations:
    """The worker's side of evaluation during training: a weight version marked due (``extra["eval"]``, set by
    ``run.push_weights``) is evaluated once, with exactly its weights and the synchronous loop's seeds (RL step
    version - 1), and the result goes to the trainer on the batch channel (``placement.WorkerEval``; worker main
    rank). The trainer waits for it before it sends a newer version, so in newest mode the receiver's newest is the
    due version and no weight copy is kept for evaluation; in fixed mode (train.staleness_mode) the receiver keeps
    every version anyway and the due one is evaluated when it is loaded for batch version + k. ``done`` records
    each (version, step, seconds)."""

    def __init__(self, run, sender):
        self.run, self.sender = run, sender
        self.done: list[dict[str, float]] = []

    def run_if_due(self, version) -> float:
        from megatron_dppo.evaluation import evaluate
        from megatron_dppo.placement import WorkerEval

        if not version.extra.get("eval") or any(d["version"] == version.version for d in self.done):
            return 0.0
        start = time.monotonic()
        metrics = evaluate(self.run, version.version - 1)
        if self.sender is not None:
            self.sender.send(WorkerEval(version.version, metrics))
        seconds = time.monotonic() - start
        self.done.append({"version": version.version, "step": version.version - 1, "seconds": seconds})
        return seconds


def ignore_stop_signals() -> None:
    """A worker ends on the trainer's stop message, not on the signals that ask the trainer to stop (torchrun and
    Slurm deliver them to every process): dying first would turn the trainer's clean stop into a failure. A dead
    trainer still ends the worker (its receive fails)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1"):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


def build_worker(cfg, r):
    """A Run with what the rollout side needs (tokenizer, prompts, sampler, pruner, history, reward scorer, the
    rollout engine), and no Megatron engine."""
    from megatron_dppo.algo.prompt_history import PromptHistory
    from megatron_dppo.build import (
        build_hf_config,
        build_loss,
        build_rollout,
        build_scorer,
        build_tokenizer,
        eos_ids,
        load_eval_sets,
        load_train_prompts,
        quiet_logs,
        resolve_model_dir,
        train_sources,
    )
    from megatron_dppo.data import PromptSampler
    from megatron_dppo.megatron.arch import ModelArch
    from megatron_dppo.rollout.handover import MemoryHandover
    from megatron_dppo.run import build_pruner
    from megatron_dppo.run_state import Run

    quiet_logs()
    D.set_cpu_threads(r.trainers + r.workers, cfg.train.cpu_threads)
    scorer = build_scorer(cfg, train_sources(cfg))
    tokenizer = build_tokenizer(cfg)
    model_dir = resolve_model_dir(cfg)
    hf_config = build_hf_config(cfg, tokenizer, model_dir)
    arch = ModelArch.from_hf_config(hf_config)
    loss_cfg, estimator = build_loss(cfg)
    prompts, _ = load_train_prompts(cfg, tokenizer, arch)
    eval_sets = load_eval_sets(cfg, tokenizer, arch) if cfg.eval.every else {}  # (the workers evaluate: serve)
    eval_scorers = {name: build_scorer(cfg, [name], cfg.eval.reward, step_budget=False) for name in eval_sets}
    rollout = build_rollout(cfg, hf_config, model_dir, tokenizer)
    return Run(cfg=cfg, info=None, tokenizer=tokenizer, hf_config=hf_config, arch=arch, engine=None,
               rollout=rollout, scorer=scorer, eval_scorers=eval_scorers, train_prompts=prompts, eval_sets=eval_sets,
               sampler=PromptSampler(len(prompts), seed=cfg.train.seed, shuffle=cfg.data.shuffle),
               pruner=build_pruner(cfg, loss_cfg), history=PromptHistory(cfg.algo.history_ema), loss_cfg=loss_cfg,
               estimator=estimator, sink=None, eos_ids=eos_ids(tokenizer, hf_config),
               pad_id=int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0),
               handover=MemoryHandover(rollout, lambda: iter(())))
