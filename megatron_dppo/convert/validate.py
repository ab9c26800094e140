"""Does the Megatron model built from an HF config compute what the HF config describes?

``ModelArch.from_hf_config`` (megatron_dppo.megatron.model) already refuses what the Megatron model cannot
represent (unsupported ``model_type``, activation, biases, sliding window, RoPE scaling). This module checks the
other direction after the model is built: every HF field that shapes the computation equals the corresponding
field of the Megatron ``TransformerConfig`` / ``GPTModel``, so a silent drift in the model builder (a dropped
``kv_channels``, a wrong epsilon, a lost bias flag) stops a conversion with the field and both values named.
"""
from __future__ import annotations

from typing import Any, Mapping


def _hf_config_object(cfg: Mapping[str, Any] | Any) -> Any:
    """A transformers config (family defaults applied, e.g. Qwen3's head_dim=128) from a dict or a config."""
    if isinstance(cfg, Mapping):
        from transformers import AutoConfig

        return AutoConfig.for_model(**dict(cfg))
    return cfg


def _rope(hf: Any) -> tuple[float, str, float]:
    params: dict = {}
    for attr in ("rope_parameters", "rope_scaling"):
        value = getattr(hf, attr, None)
        if isinstance(value, Mapping):
            params.update(value)
    theta = params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    return float(theta), rope_type, float(params.get("factor", 1.0) or 1.0)


def check_megatron_model(cfg: Mapping[str, Any] | Any, arch: Any, model: Any) -> None:
    """ValueError naming the HF field, Megatron's value and the HF value at the first disagreement.

    ``model`` is one unwrapped GPTModel chunk of this rank (its ``config`` is the full TransformerConfig).
    """
    import torch.nn.functional as F

    from megatron_dppo.megatron.arch import QK_NORM_FAMILIES

    hf = _hf_config_object(cfg)
    tc = model.config
    if hf.model_type in ("deepseek_v3", "glm4_moe"):  # their own fields: families/deepseek.py
        from megatron_dppo.convert.families.deepseek import megatron_config_pairs

        _raise_first_mismatch(megatron_config_pairs(hf, model))
        return
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    theta, rope_type, factor = _rope(hf)
    interpolation = getattr(getattr(model, "rotary_pos_emb", None), "seq_len_interpolation_factor", None)
    pairs = [
        ("hidden_size", tc.hidden_size, hf.hidden_size),
        ("num_hidden_layers (num_layers)", tc.num_layers, hf.num_hidden_layers),
        ("num_attention_heads", tc.num_attention_heads, heads),
        ("num_key_value_heads (num_query_groups)", tc.num_query_groups or tc.num_attention_heads, kv),
        ("head_dim (kv_channels)", tc.kv_channels, head_dim),
        ("intermediate_size (ffn_hidden_size)", tc.ffn_hidden_size, hf.intermediate_size),
        ("rms_norm_eps (layernorm_epsilon)", float(tc.layernorm_epsilon), float(getattr(hf, "rms_norm_eps", 1e-6))),
        ("RMSNorm (normalization)", tc.normalization, "RMSNorm"),
        ("hidden_act (gated_linear_unit)", tc.gated_linear_unit, True),
        ("hidden_act (activation_func)", getattr(tc.activation_func, "__name__", None),
         F.silu.__name__ if getattr(hf, "hidden_act", "silu") == "silu" else hf.hidden_act),
        ("mlp/o_proj bias (add_bias_linear)", tc.add_bias_linear, False),
        ("q/k/v bias (add_qkv_bias)", bool(tc.add_qkv_bias), hf.model_type == "qwen2"),
        ("q_norm/k_norm (qk_layernorm)", bool(tc.qk_layernorm), hf.model_type in QK_NORM_FAMILIES),
        ("tie_word_embeddings (share_embeddings_and_output_weights)",
         bool(model.share_embeddings_and_output_weights), bool(getattr(hf, "tie_word_embeddings", False))),
        ("vocab_size", getattr(model, "unpadded_vocab_size", model.vocab_size), hf.vocab_size),
        ("position embedding (position_embedding_type)", model.position_embedding_type, "rope"),
        ("rope_theta (rotary_base)", float(model.rotary_base), theta),
        ("rope_scaling llama3 (rope_scaling)", bool(getattr(model, "rotary_scaling", False)), rope_type == "llama3"),
        ("rope_scaling linear (seq_len_interpolation_factor)", interpolation,
         factor if rope_type == "linear" else None),
    ]
    pairs += _moe_pairs(hf, tc)
    _raise_first_mismatch(pairs)


def _raise_first_mismatch(pairs) -> None:
    for field, megatron_value, hf_value in pairs:
        if megatron_value != hf_value:
            raise ValueError(f"HF config field {field}: the Megatron model has {megatron_value!r}, "
                             f"the HF config needs {hf_value!r}")


def _moe_pairs(hf: Any, tc: Any) -> list[tuple[str, Any, Any]]:
    """The sparse blocks (Qwen3-MoE / Mixtral): experts, top-k, expert size, which layers are sparse, router."""
    from megatron_dppo.megatron.moe import MOE_FAMILIES, moe_from_hf_config

    if hf.model_type not in MOE_FAMILIES:
        return [("num_experts (num_moe_experts)", getattr(tc, "num_moe_experts", None), None)]
    experts = hf.num_experts if hf.model_type == "qwen3_moe" else hf.num_local_experts
    ffn = hf.moe_intermediate_size if hf.model_type == "qwen3_moe" else hf.intermediate_size
    norm_topk = bool(getattr(hf, "norm_topk_prob", False)) if hf.model_type == "qwen3_moe" else True
    freq = tc.moe_layer_freq  # a list (1 = MoE layer), or an int N: every N-th layer from the first
    if isinstance(freq, int):
        freq = [1 if i % freq == 0 else 0 for i in range(tc.num_layers)]
    return [
        ("num_experts (num_moe_experts)", tc.num_moe_experts, experts),
        ("num_experts_per_tok (moe_router_topk)", tc.moe_router_topk, hf.num_experts_per_tok),
        ("moe_intermediate_size (moe_ffn_hidden_size)", tc.moe_ffn_hidden_size, ffn),
        ("mlp_only_layers / decoder_sparse_step (moe_layer_freq)", list(freq),
         moe_from_hf_config(hf, hf.model_type).layer_pattern()),
        # top-k of softmax without renormalization (Qwen3-MoE norm_topk_prob=false) is Megatron's pre-softmax router
        ("norm_topk_prob (moe_router_pre_softmax)", bool(tc.moe_router_pre_softmax), not norm_topk),
        ("router scores (moe_router_score_function)", tc.moe_router_score_function, "softmax"),
    ]
