"""MoE architectures from HF configs: the published sizes of real models, the router semantics, the checks of
the expert layout (no process group needed: milliseconds)."""
from __future__ import annotations

import pytest

from megatron_dppo.megatron.model import ModelArch
from megatron_dppo.megatron.moe import global_expert_index, moe_config_kwargs
from megatron_dppo.megatron.parallel import ParallelConfig, validate_parallel

# config.json of the released checkpoints (the fields that matter)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, max_position_embeddings=40960, router_aux_loss_coef=0.001)
MIXTRAL_8X7B = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                    num_experts_per_tok=2, rope_theta=1_000_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    max_position_embeddings=32768, sliding_window=None)


def test_published_sizes():
    """30.5B total / 3.3B active (Qwen3-30B-A3B), 46.7B / 12.9B (Mixtral-8x7B): the model cards' numbers."""
    q = ModelArch.from_hf_config(QWEN3_30B_A3B)
    assert q.family == "qwen3_moe" and q.qk_norm and q.moe.num_sparse_layers == 48
    assert q.num_parameters / 1e9 == pytest.approx(30.53, abs=0.01)
    assert q.num_active_parameters / 1e9 == pytest.approx(3.35, abs=0.01)
    m = ModelArch.from_hf_config(MIXTRAL_8X7B)
    assert m.family == "mixtral" and not m.qk_norm and m.moe.norm_topk_prob
    assert m.num_parameters / 1e9 == pytest.approx(46.70, abs=0.01)
    assert m.num_active_parameters / 1e9 == pytest.approx(12.88, abs=0.01)


def test_dense_layers_and_router_variant():
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2, norm_topk_prob=False)
    moe = ModelArch.from_hf_config(cfg).moe
    # layer i is sparse when it is not mlp-only and (i + 1) % decoder_sparse_step == 0 (transformers' rule)
    assert moe.sparse_layers == (False, True, False, True, False, True)
    kwargs = moe_config_kwargs(moe, ep=1, etp=1)
    assert kwargs["moe_layer_freq"] == [0, 1, 0, 1, 0, 1]
    assert kwargs["moe_router_pre_softmax"] is True  # softmax over all experts, top-k, no renormalization
    assert kwargs["moe_router_load_balancing_type"] == "none" and kwargs["moe_aux_loss_coeff"] == 0.0
    assert moe_config_kwargs(moe, ep=1, etp=1, aux_loss_coeff=1e-3)["moe_router_load_balancing_type"] == "aux_loss"
    # renormalized top-k == top-k of the logits, softmax over the k
    renormed = ModelArch.from_hf_config(QWEN3_30B_A3B).moe
    assert moe_config_kwargs(renormed, ep=1, etp=1)["moe_router_pre_softmax"] is False


def test_unsupported_router_is_refused():
    with pytest.raises(ValueError, match="router_jitter_noise"):
        ModelArch.from_hf_config(dict(MIXTRAL_8X7B, router_jitter_noise=0.1))
    with pytest.raises(ValueError, match="sliding_window"):
        ModelArch.from_hf_config(dict(MIXTRAL_8X7B, sliding_window=4096))
    with pytest.raises(ValueError, match="no MoE layer"):
        ModelArch.from_hf_config(dict(QWEN3_30B_A3B, num_hidden_layers=2, mlp_only_layers=[0, 1]))


def test_recipe_layout_is_valid_and_bad_layouts_name_the_numbers():
    arch = ModelArch.from_hf_config(QWEN3_30B_A3B)
    # the recipe: 16 GPUs, TP2 + SP, EP8, ETP1 -> DP8
    assert validate_parallel(arch, ParallelConfig(tp=2, sp=True, ep=8, etp=1), 16) == 8
    with pytest.raises(ValueError, match="num_experts=128 is not divisible by ep=3"):
        validate_parallel(arch, ParallelConfig(ep=3), 3)
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        validate_parallel(arch, ParallelConfig(tp=2, ep=8), 16)
    with pytest.raises(ValueError, match="etp\\*ep\\*pp"):
        validate_parallel(arch, ParallelConfig(tp=2, sp=True, ep=16, pp=2), 16)
    with pytest.raises(ValueError, match="not divisible by etp=5"):
        validate_parallel(arch, ParallelConfig(tp=1, ep=1, etp=5), 5)
    dense = ModelArch.from_hf_config(dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        validate_parallel(dense, ParallelConfig(ep=2), 2)


def test_global_expert_index_blocks():
    assert [global_expert_index(i, 8, r, 4) for r in range(4) for i in range(2)] == list(range(8))
    with pytest.raises(ValueError):
        global_expert_index(2, 8, 0, 4)
