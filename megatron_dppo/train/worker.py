"""The loop of a rollout worker (``rollout.placement=separate``): draw batches with its own copy of the rollout
side and send them to the trainer, with weights that arrive from it by version.

For RL step t a worker waits for weight version >= t - k (``dist.staleness.StalenessGate``), loads the newest
version that arrived (with the prompt history the trainer had at that version: the prompt decisions are made from
history up to k + 1 steps old, unbiased because pi is recorded with the batch, tests/unit/test_lagged_pruning.py),
draws the batch (``draw.draw_batch``), and sends it stamped with that version, the sampler position after it, and
its idle and CPU seconds; then the next (``train.staleness_mode=fixed``: exactly version t - k, the receiver keeping
every version until the loop is past it). A version the trainer marked due for evaluation is evaluated first, and
the metrics sent the same way (``DueEvaluations``). The first version also carries the trainer's RL step, sampler
position and history, so a resumed trainer repositions the workers (batches that were in flight are generated
again). With partial rollouts (``rollout.max_interruptions``) a version that arrives while a batch generates is
loaded mid-batch and the running samples continue under it (``partial_engine``); the batch stays stamped with the
version it started from, its oldest tokens'. With over-provisioning (``rollout.overprovision``) the worker draws with
``overprovision.draw_overprovisioned``: the groups not finished when the batch is complete wait in the sampler's
state for the next batch."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from megatron_dppo.distributed import collectives as D
from megatron_dppo.distributed.placement import WorkerEval, connect_worker
from megatron_dppo.distributed.staleness import StalenessGate
from megatron_dppo.run.metrics import PhaseTimer
from megatron_dppo.run.setup import setup_worker
from megatron_dppo.run.state import RolloutSide
from megatron_dppo.train.draw import draw_batch
from megatron_dppo.train.evaluation import evaluate
from megatron_dppo.train.overprovision import draw_overprovisioned


def serve(cfg) -> dict[str, Any]:
    """The loop of a rollout worker process until the trainer's stop message (module docstring)."""
    ignore_stop_signals()  # the trainer gets them too, stops at a step boundary and sends the stop message
    link = connect_worker(cfg)  # (returns after the trainer's set-up and warm start: its tokenizer is on disk)
    side = setup_worker(cfg, link.roles)
    link.join_weights(cfg, side.engine)  # (HF: received here; vLLM: inside its workers, rollout/vllm_weight_sync.py)
    first = link.weights.wait(0)
    if first is None:
        link.close()
        return {"batches": 0}
    fixed = cfg.train.staleness_mode == "fixed"  # (batch t from exactly version t - k: StalenessGate)
    gate = StalenessGate(cfg.train.max_staleness, fixed=fixed)
    gate.floor = link.weights.arrived[0]  # this run's first version (a resumed trainer may have sent more since)
    step, loaded, used, evals, newest = first.extra["rl_step"], None, [], DueEvaluations(side, link.batches), first
    partial = partial_engine(cfg, side, link.weights)  # rollout.max_interruptions >= 1, else None

    def take(version) -> float:
        """Load ``version`` (if it is not loaded yet: partial rollouts may have loaded its weights mid-batch) and
        its history, and evaluate it if it is due; returns the eval seconds."""
        nonlocal loaded
        if version.version != loaded:
            if partial is None or partial.version != version.version:
                link.weights.load(version)
            if partial is not None:
                partial.version = version.version
            side.pruner.load_state_dict(version.extra["history"])
            loaded = version.version
        return evals.run_if_due(version)

    side.sampler.load_state_dict(first.extra["sampler"])
    while step < cfg.train.steps:
        idle_start = time.monotonic()
        newest = link.weights.wait(gate.fixed_version(step) if fixed else gate.min_version(step), exact=fixed)
        idle = time.monotonic() - idle_start
        if newest is None:  # the trainer stopped (a signal): no more batches wanted
            break
        eval_s = take(newest)  # (a due version is loaded at the latest for batch version + k: see DueEvaluations)
        timer = PhaseTimer()
        if cfg.rollout.overprovision:  # (stamped with its oldest token's version: carried groups may be older)
            drawn = draw_overprovisioned(side, step, timer, loaded, partial)
        else:
            with interruptible(partial):  # (versions arriving now are taken mid-batch: the oldest, ``loaded``, stamps
                drawn = draw_batch(side, step, timer, version=loaded)  # it)
            drawn.version = loaded
        drawn.sampler_state = side.sampler.state_dict()
        drawn.metrics.update({"async/rollout_idle_s": idle, "async/rollout_busy_s": timer.as_metrics()["time/step"],
                              "async/rollout_cpu_s": D.sum_over_ranks(timer.cpu_seconds),
                              "async/rollout_eval_s": eval_s})
        if partial is not None:  # (each worker's own: the versions it took mid-batch)
            drawn.metrics["async/versions_taken_mid_batch"] = float(D.sum_over_ranks(partial.take_count()))
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


def partial_engine(cfg, side: RolloutSide, weights):
    """Partial rollouts (``rollout.max_interruptions`` >= 1, docs/async.md): ``side.engine`` becomes an
    ``InterruptibleEngine`` that, while a batch generates, takes a newer version that reached this worker (HF: at
    the next token; vLLM: at the next chunk of ``rollout.interrupt_chunk_tokens``); returns it, or None when off.
    Each worker takes versions on its own (they generate disjoint shards): the check and the load are local, never
    a collective."""
    if not cfg.rollout.max_interruptions:
        return None
    from megatron_dppo.rollout.partial import InterruptibleEngine, version_callables

    holder: list = []

    def newer() -> bool:
        arrived = weights.arrived
        return bool(arrived) and arrived[-1] > holder[0].version

    def load_newer() -> int:
        version = weights.local_newest(holder[0].version + 1)
        weights.load(version)
        return version.version

    chunk = cfg.rollout.interrupt_chunk_tokens if cfg.rollout.engine == "vllm" else None
    engine = InterruptibleEngine(side.engine, version_callables(newer, load_newer), cfg.rollout.max_interruptions,
                                 chunk)
    holder.append(engine)
    side.engine = engine
    return engine


@contextlib.contextmanager
def interruptible(engine):
    """``engine`` (an ``InterruptibleEngine``, or None) takes new versions mid-generation inside the block only:
    an evaluation outside it uses exactly its due version."""
    if engine is None:
        yield
        return
    engine.active = True
    try:
        yield
    finally:
        engine.active = False


class DueEvaluations:
    """The worker's side of evaluation during training: a weight version marked due (``extra["eval"]``, set by
    ``run.setup.push_weights``) is evaluated once, with exactly its weights and the synchronous loop's seeds (RL step
    version - 1), and the result goes to the trainer on the batch channel (``placement.WorkerEval``; worker main
    rank). The trainer waits for it before it sends a newer version, so in newest mode the receiver's newest is the
    due version and no weight copy is kept for evaluation; in fixed mode (train.staleness_mode) the receiver keeps
    every version anyway and the due one is evaluated when it is loaded for batch version + k. ``done`` records
    each (version, step, seconds)."""

    def __init__(self, side: RolloutSide, sender):
        self.side, self.sender = side, sender
        self.done: list[dict[str, float]] = []

    def run_if_due(self, version) -> float:
        if not version.extra.get("eval") or any(d["version"] == version.version for d in self.done):
            return 0.0
        start = time.monotonic()
        metrics = evaluate(self.side, version.version - 1)
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
