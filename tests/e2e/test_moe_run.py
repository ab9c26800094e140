"""A short DPPO run on a tiny Qwen3-MoE policy, 2 processes (gloo): data parallel 2 for attention, the 4 experts
of each MoE layer split over expert parallel 2, routing replay on. The run really trains (finite, non-zero updates,
DPPO prunes, the rollout engine receives every expert), and a crash right after a checkpoint followed by resume
gives the straight run's metrics and final checkpoint bit for bit."""
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

TINY_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 32,
    "tie_word_embeddings": True, "rope_theta": 10000.0,
}


def _config(out, **extra):
    return tiny_config(out, model={"hf_config": dict(TINY_MOE), "tokenizer": "train-sentencepiece",
                                   "moe_routing_replay": True},
                       parallel={"ep": 2}, **extra)


def test_moe_dppo_resume_equals_straight_run(tmp_path):
    straight = tmp_path / "straight"
    proc = run_cli(write_config(tmp_path / "run.yaml", _config(straight)), nproc=2)
    assert "qwen3_moe" in proc.stdout
    records = read_metrics(straight)
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    assert all(r["reward/std"] > 0 and r["train/grad_norm"] > 0 and r["train/update_ok"] == 1.0 for r in rl)
    assert all(r["prune/completion_kept_fraction"] < 1.0 for r in rl)
    # routing replay ran: the old-log-prob pass recorded, the update replayed and measured the router's drift
    assert all(0.0 <= r["train/moe/route_flip_rate"] <= 1.0 for r in rl)
    assert "(0.05M active: 4 experts, top 2, routing replay)" in proc.stdout and "ep 2, etp 1" in proc.stdout
    assert sorted(p.name for p in (straight / "checkpoints").glob("step_*")) == ["step_00000004", "step_00000006"]

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    (resumed / "checkpoints" / "latest").write_text("step_00000004\n")
    proc = run_cli(write_config(tmp_path / "resumed.yaml", _config(resumed)), nproc=2)
    assert "resumed from" in proc.stdout and "RL step 2" in proc.stdout
    assert stable_metrics(read_metrics(resumed)) == stable_metrics(records)
    a, b = checkpoint_tensors(latest_checkpoint(straight)), checkpoint_tensors(latest_checkpoint(resumed))
    assert sorted(a) == sorted(b) and any("local_experts" in k or "experts" in k for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
