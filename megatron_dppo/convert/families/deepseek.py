"""HF <-> Megatron-Core rules of the DeepSeek-style MoE families (``megatron.deepseek_moe``): ``deepseek_v3``
(multi-latent attention) and ``glm4_moe`` (grouped-query attention), both with the sigmoid router's expert bias and
shared experts.

Multi-latent attention (Megatron ``MLASelfAttention``; HF ``DeepseekV3Attention``), per layer:

==========================================  ============================================  ========================
HF                                          Megatron (local spec)                         split over TP
==========================================  ============================================  ========================
``q_a_proj`` [q_lora, H]                    ``linear_q_down_proj``                        replicated
``q_a_layernorm`` [q_lora]                  ``q_layernorm`` (TE: ``linear_q_up_proj.``    replicated
                                            ``layer_norm_weight``)
``q_b_proj`` [n (nope + rope), q_lora]      ``linear_q_up_proj``                          rows (whole heads)
``q_proj`` [n (nope + rope), H]             ``linear_q_proj`` (``q_lora_rank: null``)     rows (whole heads)
``kv_a_proj_with_mqa`` [kv_lora + rope, H]  ``linear_kv_down_proj``                       replicated
``kv_a_layernorm`` [kv_lora]                ``kv_layernorm`` (TE: ``linear_kv_up_proj.``  replicated
                                            ``layer_norm_weight``)
``kv_b_proj`` [n (nope + v), kv_lora]       ``linear_kv_up_proj``                         rows (whole heads)
``o_proj`` [H, n v]                         ``linear_proj``                               columns
==========================================  ============================================  ========================

The tensors keep their layout: both sides lay heads out contiguously as ``[nope; rope]`` (q) and ``[nope; v]``
(kv_b), and the rotary rows in DeepSeek's interleaved pair order (Megatron's MLA de-interleaves them at run time,
transformers with ``rope_interleave``). The down projections are replicated in both specs: ``TELinear``
(``parallel_mode='duplicated'``) in the TE spec, Megatron's plain ``Linear`` in the local one (``deepseek_moe.
replicate_mla_down_projections``: Megatron's own column-parallel choice gets the shared rotary key's gradient wrong
at TP > 1).

Sparse layers add to the Qwen3-MoE rules: ``mlp.router.expert_bias`` (a float32 buffer) <-> ``mlp.gate.
e_score_correction_bias`` [E], and the shared experts ``mlp.shared_experts.linear_fc1 = [gate; up]`` /
``linear_fc2`` <-> ``mlp.shared_experts.{gate,up,down}_proj`` (split over TP like a dense MLP).
"""
from __future__ import annotations

from typing import Any

from megatron_dppo.convert.mapping import (
    FAMILY_DIMS,
    FAMILY_IGNORED_HF,
    FAMILY_TABLES,
    SPARSE_LAYERS,
    TE_SPEC,
    ColumnParallelMapping,
    GatedMLPMapping,
    ParamMapping,
    QKVMapping,
    ReplicatedMapping,
    RowParallelMapping,
    _dims,
    _moe_decoder_table,
    _w,
)

L = "decoder.layers.*."
H = "model.layers.*."


def _sparse_extras() -> list[ParamMapping]:
    """The expert bias and the shared experts of a DeepSeek-style sparse layer."""
    return [
        ReplicatedMapping(L + "mlp.router.expert_bias", _w(H + "mlp.gate.e_score_correction_bias"), _dims("E"),
                          SPARSE_LAYERS),
        GatedMLPMapping(L + "mlp.shared_experts.linear_fc1.weight",
                        {"gate": H + "mlp.shared_experts.gate_proj.weight",
                         "up": H + "mlp.shared_experts.up_proj.weight"},
                        {"gate": ("FS", "H"), "up": ("FS", "H")}, SPARSE_LAYERS),
        RowParallelMapping(L + "mlp.shared_experts.linear_fc2.weight", _w(H + "mlp.shared_experts.down_proj.weight"),
                           _dims("H", "FS"), SPARSE_LAYERS),
    ]


def _moe_rules(arch: Any, spec: str, qk_norm: bool) -> list[ParamMapping]:
    table = _moe_decoder_table(arch, spec, qk_norm=qk_norm, block="mlp", router="gate.weight",
                               gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight")
    extras = _sparse_extras()
    if arch.moe.shared_expert_ffn_hidden_size is None:
        extras = [m for m in extras if "shared_experts" not in m.megatron]
    return table + extras


def glm4_moe_table(arch: Any, spec: str) -> list[ParamMapping]:
    """GLM-4.5: the Qwen3-MoE rules with the q/k norm only when ``use_qk_norm``, the Qwen2 q/k/v bias when
    ``attention_bias``, the expert bias and the shared experts."""
    table = _moe_rules(arch, spec, qk_norm=arch.qk_norm)
    if arch.qkv_bias:
        table.append(QKVMapping(L + "self_attention.linear_qkv.bias",
                                {"q": H + "self_attn.q_proj.bias", "k": H + "self_attn.k_proj.bias",
                                 "v": H + "self_attn.v_proj.bias"},
                                {"q": ("Q",), "k": ("KV",), "v": ("KV",)}))
    return table


def deepseek_v3_table(arch: Any, spec: str) -> list[ParamMapping]:
    """DeepSeek-V3 / Kimi-K2 / Moonlight: the MoE rules with multi-latent attention instead of q/k/v."""
    mla = arch.mla
    te = spec == TE_SPEC
    # the MoE table without its grouped-query attention rows (and TE's norm fused into linear_qkv)
    table = [m for m in _moe_rules(arch, spec, qk_norm=False) if ".self_attention." not in m.megatron]
    down = ReplicatedMapping  # both specs (module docstring)
    attn = "self_attention."
    rules: list[ParamMapping] = [
        ReplicatedMapping(L + "input_layernorm.weight", _w(H + "input_layernorm.weight"), _dims("H")),
        down(L + attn + "linear_kv_down_proj.weight", _w(H + "self_attn.kv_a_proj_with_mqa.weight"),
             _dims("KVA", "H")),
        ReplicatedMapping(L + attn + ("linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight"),
                          _w(H + "self_attn.kv_a_layernorm.weight"), _dims("KVL")),
        ColumnParallelMapping(L + attn + "linear_kv_up_proj.weight", _w(H + "self_attn.kv_b_proj.weight"),
                              _dims("KVB", "KVL")),
        RowParallelMapping(L + attn + "linear_proj.weight", _w(H + "self_attn.o_proj.weight"), _dims("H", "O")),
    ]
    if mla.q_lora_rank is None:
        rules.append(ColumnParallelMapping(L + attn + "linear_q_proj.weight", _w(H + "self_attn.q_proj.weight"),
                                           _dims("QB", "H")))
    else:
        rules += [
            down(L + attn + "linear_q_down_proj.weight", _w(H + "self_attn.q_a_proj.weight"), _dims("QA", "H")),
            ReplicatedMapping(L + attn + ("linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight"),
                              _w(H + "self_attn.q_a_layernorm.weight"), _dims("QA")),
            ColumnParallelMapping(L + attn + "linear_q_up_proj.weight", _w(H + "self_attn.q_b_proj.weight"),
                                  _dims("QB", "QA")),
        ]
    # the local spec's input_layernorm is already in the MoE table (ReplicatedMapping above replaces it: same rule)
    table = [m for m in table if m.megatron != L + "input_layernorm.weight"]
    return table[:1] + rules + table[1:]


def mla_dims(arch: Any) -> dict[str, int]:
    """The symbolic dimensions of the MLA and shared-expert rules (``mapping.resolve_dims``)."""
    dims: dict[str, int] = {}
    mla = getattr(arch, "mla", None)
    if mla is not None:
        n = arch.num_attention_heads
        dims.update(QA=mla.q_lora_rank or 0, QB=n * mla.qk_head_dim, KVA=mla.kv_lora_rank + mla.qk_rope_head_dim,
                    KVL=mla.kv_lora_rank, KVB=n * (mla.qk_nope_head_dim + mla.v_head_dim), O=n * mla.v_head_dim)
    moe = getattr(arch, "moe", None)
    if moe is not None and getattr(moe, "shared_expert_ffn_hidden_size", None):
        dims["FS"] = moe.shared_expert_ffn_hidden_size
    return dims


def ignored_hf_tensor(name: str, arch: Any) -> bool:
    """A checkpoint tensor of a multi-token-prediction layer (``model.layers.<num_layers + i>.*``), ignored."""
    if not getattr(arch, "mtp_layers", 0) or not name.startswith("model.layers."):
        return False
    layer = name.split(".")[2]
    return layer.isdigit() and arch.num_layers <= int(layer) < arch.num_layers + arch.mtp_layers


def megatron_config_pairs(hf: Any, model: Any) -> list[tuple[str, Any, Any]]:
    """(HF field, the built Megatron model's value, the value the HF config needs) for ``validate.
    check_megatron_model``: the numbers ``ModelArch.from_hf_config`` reads from a deepseek_v3 / glm4_moe config."""
    from megatron_dppo.megatron.arch import ModelArch

    arch = ModelArch.from_hf_config(hf)
    tc, moe = model.config, arch.moe
    freq = tc.moe_layer_freq
    if isinstance(freq, int):
        freq = [1 if i % freq == 0 else 0 for i in range(tc.num_layers)]
    pairs = [
        ("hidden_size", tc.hidden_size, arch.hidden_size),
        ("num_hidden_layers (num_layers)", tc.num_layers, arch.num_layers),
        ("num_attention_heads", tc.num_attention_heads, arch.num_attention_heads),
        ("intermediate_size (ffn_hidden_size)", tc.ffn_hidden_size, arch.ffn_hidden_size),
        ("rms_norm_eps (layernorm_epsilon)", float(tc.layernorm_epsilon), arch.norm_eps),
        ("tie_word_embeddings (share_embeddings_and_output_weights)",
         bool(model.share_embeddings_and_output_weights), arch.tie_embeddings),
        ("vocab_size", getattr(model, "unpadded_vocab_size", model.vocab_size), arch.vocab_size),
        ("rope_theta (rotary_base)", float(model.rotary_base), arch.rope_theta),
        ("n_routed_experts (num_moe_experts)", tc.num_moe_experts, moe.num_experts),
        ("num_experts_per_tok (moe_router_topk)", tc.moe_router_topk, moe.topk),
        ("moe_intermediate_size (moe_ffn_hidden_size)", tc.moe_ffn_hidden_size, moe.expert_ffn_hidden_size),
        ("first_k_dense_replace (moe_layer_freq)", list(freq), moe.layer_pattern()),
        ("sigmoid router (moe_router_score_function)", tc.moe_router_score_function, "sigmoid"),
        ("e_score_correction_bias (moe_router_enable_expert_bias)", tc.moe_router_enable_expert_bias, True),
        ("n_group (moe_router_num_groups)", tc.moe_router_num_groups, moe.num_groups),
        ("topk_group (moe_router_group_topk)", tc.moe_router_group_topk, moe.group_topk),
        ("routed_scaling_factor (moe_router_topk_scaling_factor)", tc.moe_router_topk_scaling_factor or 1.0,
         moe.scaling_factor),
        ("n_shared_experts (moe_shared_expert_intermediate_size)", tc.moe_shared_expert_intermediate_size,
         moe.shared_expert_ffn_hidden_size),
    ]
    if arch.mla is not None:
        mla = arch.mla
        pairs += [(f"{hf_name} ({name})", getattr(tc, name, None), value) for hf_name, name, value in (
            ("q_lora_rank", "q_lora_rank", mla.q_lora_rank), ("kv_lora_rank", "kv_lora_rank", mla.kv_lora_rank),
            ("qk_nope_head_dim", "qk_head_dim", mla.qk_nope_head_dim),
            ("qk_rope_head_dim", "qk_pos_emb_head_dim", mla.qk_rope_head_dim),
            ("v_head_dim", "v_head_dim", mla.v_head_dim), ("rope_type", "rope_type", mla.rope_type),
            ("rope factor", "rotary_scaling_factor", mla.yarn_factor), ("mscale", "mscale", mla.yarn_mscale),
            ("mscale_all_dim", "mscale_all_dim", mla.yarn_mscale_all_dim))]
    else:
        pairs += [
            ("num_key_value_heads (num_query_groups)", tc.num_query_groups, arch.num_kv_heads),
            ("head_dim (kv_channels)", tc.kv_channels, arch.head_dim),
            ("attention_bias (add_qkv_bias)", bool(tc.add_qkv_bias), arch.qkv_bias),
            ("use_qk_norm (qk_layernorm)", bool(tc.qk_layernorm), arch.qk_norm),
            ("partial_rotary_factor (rotary_percent)", float(model.rotary_percent), arch.rotary_percent),
        ]
    return pairs


FAMILY_TABLES.update(deepseek_v3=deepseek_v3_table, glm4_moe=glm4_moe_table)
FAMILY_DIMS.update(deepseek_v3=mla_dims, glm4_moe=mla_dims)
FAMILY_IGNORED_HF.update(deepseek_v3=ignored_hf_tensor, glm4_moe=ignored_hf_tensor)
