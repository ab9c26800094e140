"""Partial rollouts end to end (rollout.max_interruptions; docs/async.md, "Partial rollouts"): 1 trainer + 1 HF
rollout worker at max_staleness 1, generation long enough that a version arrives while a batch generates.

* the run trains within the per-token bound (the trainer's gate checks every token's version and would fail the
  run otherwise), samples were interrupted and continued under the next version, and a resume from a checkpoint
  continues the run (the batch in flight generated again);
* a worker killed with SIGKILL after batches were interrupted ends the trainer naming it, and the run resumed from
  its last checkpoint trains every later step once: nothing of the interrupted work is lost or trained twice (a
  partial sample lives only in the worker until its batch is sent, and a batch is trained only as a whole).

Each run takes 30-90 s on the shared 2-core machine: marked slow."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from _e2e_helpers import PY, TINY_MODEL, read_metrics, run_cli, tiny_config, write_config
from test_async_run import _by_hand, _end, _rl

pytestmark = pytest.mark.slow

PARTIAL = ("rollout.placement=separate", "train.max_staleness=1", "rollout.max_interruptions=2")


def _config(tmp_path, name, **train):
    """Long completions (sft_steps 0: the untrained policy rarely stops) in HF calls of 4 rows, so one batch's
    generation outlasts a training step and the next version arrives mid-batch."""
    out = tmp_path / name
    cfg = tiny_config(out, model={"hf_config": {**TINY_MODEL, "max_position_embeddings": 128}},
                      rollout={"max_new_tokens": 48, "batch_size": 4}, packing={"capacity": 128},
                      eval={"every": 0}, checkpoint={"every": 2}, train={"sft_steps": 0, **train})
    return out, write_config(tmp_path / f"{name}.yaml", cfg)


def test_partial_rollouts_train_within_the_per_token_bound_and_resume(tmp_path):
    """With rollout.mask_offpolicy: the older segments' zero loss masks go through packing and the loss."""
    out, cfg = _config(tmp_path, "run", steps=4)
    run_cli(cfg, *PARTIAL, "rollout.mask_offpolicy=true", nproc=2)
    records = _rl(read_metrics(out))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(0.0 <= r["async/token_staleness"] <= 1.0 for r in records)
    assert all(r["async/staleness"] <= 1.0 for r in records)  # the oldest token of each batch
    assert sum(r["async/versions_taken_mid_batch"] for r in records) >= 1, records
    interrupted = [r for r in records if r["async/interrupted_samples"] > 0]
    assert interrupted and all(r["async/token_staleness"] < r["async/staleness"] for r in interrupted)
    assert all(0 < r["async/offpolicy_tokens"] < 1 for r in interrupted)  # (masked: the segments before the last)
    worker = json.loads((out / "rollout_worker.json").read_text())
    assert [b["step"] for b in worker["batches"]] == [0, 1, 2, 3]

    run_cli(cfg, *PARTIAL, "rollout.mask_offpolicy=true", "train.steps=6", nproc=2)  # resumed at step 4
    assert [r["step"] for r in _rl(read_metrics(out))] == [0, 1, 2, 3, 4, 5]


def test_a_worker_killed_after_interruptions_loses_nothing(tmp_path):
    out, cfg = _config(tmp_path, "killed", steps=200)
    cmd = [PY, "-m", "megatron_dppo.cli", "train", "--config", str(cfg), *PARTIAL, "checkpoint.every=1",
           "rollout.worker_timeout_s=120"]
    procs = _by_hand(cmd, world=2)
    trainer, worker = procs
    try:
        deadline = time.monotonic() + 400
        while True:  # until a trained batch had samples continued under a newer version
            records = _rl(read_metrics(out)) if (out / "metrics.jsonl").exists() else []
            if any(r["async/interrupted_samples"] > 0 for r in records) and len(records) >= 2:
                break
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "no interrupted batch"
            time.sleep(0.3)
        os.kill(worker.pid, signal.SIGKILL)  # (the worker is generating the next batches, interrupting them)
        output, _ = trainer.communicate(timeout=120)
    finally:
        _end(procs)
    assert trainer.returncode != 0 and "rollout worker 0 (job rank 1)" in output, output[-3000:]
    trained = [r["step"] for r in _rl(read_metrics(out))]
    resumed = run_cli(cfg, *PARTIAL, "checkpoint.every=1", f"train.steps={len(trained) + 2}", nproc=2)
    resume_at = int(re.search(r"resumed from .* RL step (\d+)\)", resumed.stdout + resumed.stderr).group(1))
    assert resume_at <= len(trained)  # (checkpoint.every=1: the last trained step's, or the one before it)
    after = _rl(read_metrics(out))[len(trained):]
    assert [r["step"] for r in after] == list(range(resume_at, len(trained) + 2))  # each step after it, once
    assert all(0.0 <= r["async/token_staleness"] <= 1.0 for r in after)


OVERPROVISION = ("rollout.placement=separate", "train.max_staleness=2", "rollout.overprovision=0.5",
                 "rollout.interrupt_chunk_tokens=4")


def test_overprovisioned_runs_carry_groups_within_the_bound_and_resume_with_them(tmp_path):
    """rollout.overprovision (APRIL) with partial rollouts: groups left unfinished wait in the worker's sampler
    state; every token trains within k = 2 (the trainer's gate checks each one and would fail the run); the
    checkpoint holds the pending prompts and a resumed run continues them (the sampler refuses to drop them)."""
    out, cfg = _config(tmp_path, "april", steps=4)
    run_cli(cfg, *OVERPROVISION, "rollout.max_interruptions=1", nproc=2)
    records = _rl(read_metrics(out))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["async/staleness"] <= 2.0 and 0.0 <= r["async/token_staleness"] <= 2.0 for r in records)
    assert sum(r["async/carried_prompts"] for r in records) >= 1, records
    assert all(r["async/pending_prompts"] <= 4 for r in records)  # ceil(B 0.5) at most (B = 8)
    state = json.loads((out / "rollout_worker.json").read_text())
    assert [b["step"] for b in state["batches"]] == [0, 1, 2, 3]

    run_cli(cfg, *OVERPROVISION, "rollout.max_interruptions=1", "train.steps=6", nproc=2)  # resumed at step 4
    assert [r["step"] for r in _rl(read_metrics(out))] == [0, 1, 2, 3, 4, 5]
