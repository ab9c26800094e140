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


# DeepSeek-style MoE families (deepseek_moe.py): every distinctive feature on, one process
TINY_DEEPSEEK_STYLE = {
    "deepseek_v3": {  # MLA with q-LoRA, sigmoid router + expert bias, 2 groups, shared expert, dense first layer
        "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5, "max_position_embeddings": 32, "tie_word_embeddings": True,
        "rope_theta": 10000.0},
    "glm4_moe": {  # q/k norm, q/k/v bias, partial rotary, sigmoid router + expert bias, shared expert, dense first
        "model_type": "glm4_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
        "max_position_embeddings": 32, "tie_word_embeddings": False, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("family", sorted(TINY_DEEPSEEK_STYLE))
def test_deepseek_style_rl_step_and_resume(family, tmp_path):
    """Two RL steps of a from-scratch deepseek_v3 / glm4_moe policy (routing replay on): they train (finite,
    non-zero gradients), the HF rollout engine receives the pushed weights, and a resume from the first step's
    checkpoint reproduces the second step's metrics and final checkpoint bit for bit."""
    def config(out):
        return tiny_config(out, model={"hf_config": dict(TINY_DEEPSEEK_STYLE[family]),
                                       "tokenizer": "train-sentencepiece", "moe_routing_replay": True},
                           train={"steps": 2, "sft_steps": 0}, eval={"every": 100}, checkpoint={"every": 1})

    straight = tmp_path / "straight"
    proc = run_cli(write_config(tmp_path / "run.yaml", config(straight)))
    assert family in proc.stdout
    records = read_metrics(straight)
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    assert all(r["train/grad_norm"] > 0 and r["train/update_ok"] == 1.0 for r in rl)
    steps = sorted(p.name for p in (straight / "checkpoints").glob("step_*"))
    assert len(steps) >= 2

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / steps[-1])
    (resumed / "checkpoints" / "latest").write_text(steps[-2] + "\n")
    proc = run_cli(write_config(tmp_path / "resumed.yaml", config(resumed)))
    assert "resumed from" in proc.stdout
    assert stable_metrics(read_metrics(resumed)) == stable_metrics(records)
    a, b = checkpoint_tensors(latest_checkpoint(straight)), checkpoint_tensors(latest_checkpoint(resumed))
    assert sorted(a) == sorted(b) and any("expert_bias" in k for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
