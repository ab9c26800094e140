"""Several updates per rollout end to end (CLI, 2 processes, gloo): train.mini_batches = 2, train.epochs = 2 with
DPPO, dual clip and truncated-IS rollout correction.

A crash right after a checkpoint, then resume == the straight run, bit for bit (every logged metric except
wall-clock times, and every tensor of the final checkpoint), at TP2. (TP2 / DP2 == TP1 for the same updates is
tests/megatron/test_mini_batch_layouts.py: from-scratch CLI runs initialise each layout differently.)
"""
from __future__ import annotations

import shutil

import pytest
import torch
from _e2e_helpers import (
    checkpoint_tensors,
    latest_checkpoint,
    read_metrics,
    run_cli,
    stable_metrics,
    tiny_config,
    write_config,
)

pytestmark = [pytest.mark.multiproc]

SECTIONS = dict(train={"steps": 4, "sft_steps": 0, "mini_batches": 2, "epochs": 2},
                loss={"preset": "grpo", "kl_coef": 0.0, "clip_ratio_c": 3.0, "rollout_correction": "tis"},
                eval={"every": 0})


def _cfg(out, **extra):
    sections = {k: dict(v) for k, v in SECTIONS.items()}
    for k, v in extra.items():
        sections.setdefault(k, {}).update(v)
    return tiny_config(out, **sections)


@pytest.mark.slow  # two 2-process runs: 224 s measured on a shared, loaded 2-core machine
def test_mini_batch_resume_equals_straight_run(tmp_path):
    straight = tmp_path / "straight"
    proc = run_cli(write_config(tmp_path / "run.yaml", _cfg(straight, parallel={"tp": 2})), nproc=2)
    assert "world 2 (tp 2, pp 1, dp 1)" in proc.stdout
    rl = [r for r in read_metrics(straight) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    # four updates per step, the ratio live after the first (clipping acts), the correction measured
    assert all(r["train/updates"] == 4.0 and r["train/update_ok"] == 1.0 for r in rl)
    assert all(r["train/ratio"] != 1.0 for r in rl) and any(r["train/clip_fraction"] > 0 for r in rl)
    assert all("rollout/is_ratio" in r and "rollout/kl_k3" in r for r in rl)
    assert any(r["prune/completion_kept_fraction"] < 1.0 for r in rl)
    assert sorted(p.name for p in (straight / "checkpoints").glob("step_*")) == ["step_00000008", "step_00000016"]

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000016")
    (resumed / "checkpoints" / "latest").write_text("step_00000008\n")
    proc = run_cli(write_config(tmp_path / "resumed.yaml", _cfg(resumed, parallel={"tp": 2})), nproc=2)
    assert "resumed from" in proc.stdout and "RL step 2" in proc.stdout
    assert stable_metrics(read_metrics(resumed)) == stable_metrics(read_metrics(straight))
    a, b = checkpoint_tensors(latest_checkpoint(straight)), checkpoint_tensors(latest_checkpoint(resumed))
    assert sorted(a) == sorted(b) and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
