"""2 processes (gloo) with DPPO: a crash right after a checkpoint, then resume == the straight run, bit for bit
(every logged metric except wall-clock times, and every tensor of the final checkpoint: weights, Adam state).
Layouts: TP2, and (slow) DP2 with the DistributedOptimizer, whose sharded Adam state has its own resume path."""
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


LAYOUTS = {
    "tp2": ({"parallel": {"tp": 2}}, "world 2 (tp 2, pp 1, dp 1)"),
    "dp2-distopt": ({"parallel": {"tp": 1}, "optim": {"lr": 1.0e-3, "distributed_optimizer": True}},
                    "world 2 (tp 1, pp 1, dp 2)"),
}


@pytest.mark.parametrize("layout", [
    "tp2",
    pytest.param("dp2-distopt", marks=pytest.mark.slow),
])
def test_dppo_resume_equals_straight_run(tmp_path, layout):
    sections, banner = LAYOUTS[layout]
    straight = tmp_path / "straight"
    cfg = tiny_config(straight, logging={"audit_log": True, "audit_every": 2}, **sections)
    config = write_config(tmp_path / "run.yaml", cfg)
    proc = run_cli(config, nproc=2)
    assert banner in proc.stdout

    records = read_metrics(straight)
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    assert [r["step"] for r in records if r["phase"] == "sft"] == [0, 1]
    assert [r["step"] for r in records if r["phase"] == "eval"] == [-1, 1, 3]  # -1: before the first RL step
    # real updates, and DPPO acted: completion level every step, prompt level once prompts came back (16 prompts,
    # 8 per step: from step 2 on)
    assert all(r["reward/std"] > 0 and r["train/grad_norm"] > 0 and r["train/update_ok"] == 1.0 for r in rl)
    assert all(r["prune/completion_kept_fraction"] < 1.0 for r in rl)
    # the gradient audit ran on steps 0 and 2: the pruned estimate points the way of the full-batch gradient
    assert [r["step"] for r in rl if "audit/cosine" in r] == [0, 2]
    assert all(0.0 < r["audit/cosine"] <= 1.0 + 1e-9 for r in rl if "audit/cosine" in r)
    assert all(r["prune/prompt_kept_fraction"] == 1.0 for r in rl[:2])
    assert any(r["prune/prompt_kept_fraction"] < 1.0 for r in rl[2:])
    # checkpoints after RL steps 2 and 4 (engine updates: 2 warm-start + RL steps)
    ckpts = sorted(p.name for p in (straight / "checkpoints").glob("step_*"))
    assert ckpts == ["step_00000004", "step_00000006"]

    # "crash" right after the RL-step-2 checkpoint: its output directory as it was then, plus later metric lines
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    (resumed / "checkpoints" / "latest").write_text("step_00000004\n")
    cfg_resumed = tiny_config(resumed, logging={"audit_log": True, "audit_every": 2}, **sections)
    proc = run_cli(write_config(tmp_path / "resumed.yaml", cfg_resumed), nproc=2)
    assert "resumed from" in proc.stdout and "RL step 2" in proc.stdout

    assert stable_metrics(read_metrics(resumed)) == stable_metrics(records)
    audit = (straight / "audit.jsonl").read_text().splitlines()
    assert len(audit) == 4 * 8 and (resumed / "audit.jsonl").read_text().splitlines() == audit
    a, b = checkpoint_tensors(latest_checkpoint(straight)), checkpoint_tensors(latest_checkpoint(resumed))
    assert sorted(a) == sorted(b) and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
