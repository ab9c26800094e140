"""DeepSeek-style Mixture-of-Experts decoders: ``deepseek_v3`` (DeepSeek-V3/R1, Kimi-K2, Moonlight) and ``glm4_moe``
(GLM-4.5 / 4.6), read from their transformers 5 configs, and the refusals of what they cannot represent.

Both families share the DeepSeek-V3 sparse block (transformers ``DeepseekV3MoE`` / ``Glm4MoeMoE``):

* router ``r = W_router h`` in fp32, scores ``s = sigmoid(r)``; the experts are chosen by ``s + b`` (``b`` =
  ``e_score_correction_bias``, a fixed buffer: aux-loss-free balancing, which in RL stays frozen), optionally
  group-limited (``n_group`` groups of experts, the ``topk_group`` groups with the largest sum of their top-2
  ``s + b`` kept); the weights are the chosen ``s`` (not ``s + b``), divided by their sum (``norm_topk_prob``) and
  multiplied by ``routed_scaling_factor``;
* ``n_shared_experts`` shared experts, one SwiGLU MLP of width ``n_shared_experts * moe_intermediate_size`` that
  every token passes through, added to the routed output;
* the first ``first_k_dense_replace`` layers are dense (``intermediate_size``).

Megatron-Core 0.16's ``TopKRouter`` computes exactly this with ``moe_router_score_function="sigmoid"``,
``moe_router_enable_expert_bias`` (its ``expert_bias`` buffer holds ``b``; ``moe_router_bias_update_rate=0``
keeps it fixed), ``moe_router_num_groups`` / ``moe_router_group_topk`` (its group score is the sum of the top
``topk / topk_group`` scores, transformers' the top 2: equal when ``topk == 2 * topk_group``, as in DeepSeek-V3's
8 / 4; anything else is refused) and ``moe_router_topk_scaling_factor``; the shared experts are
``moe_shared_expert_intermediate_size`` (no gate). Megatron's sigmoid router always renormalizes the top-k
weights, so ``norm_topk_prob=False`` is refused (every released checkpoint has True).

``deepseek_v3`` attention is multi-latent attention (``MLAArch``, Megatron's ``MLASelfAttention``): queries from
``q_b_proj(norm(q_a_proj h))`` (q-LoRA, ``q_lora_rank``) or ``q_proj h`` (``q_lora_rank: null``, Moonlight /
DeepSeek-V2-Lite); one shared latent ``kv_a_proj_with_mqa h = [c_kv (kv_lora_rank); k_rope (qk_rope_head_dim)]``,
``kv_b_proj(norm(c_kv))`` gives every head's ``[k_nope; v]``; RoPE on the ``qk_rope_head_dim`` part only, the
interleaved pair layout (``rope_interleave: true``: Megatron's MLA de-interleaves exactly so); softmax scale
``mscale(factor, mscale_all_dim)^2 / sqrt(qk_nope + qk_rope)``. Plain RoPE and YaRN (DeepSeek-V3/Kimi-K2's
``rope_type: yarn`` with ``factor``, ``mscale``, ``mscale_all_dim``, ``beta_fast/slow``,
``original_max_position_embeddings``) map to Megatron's ``rope_type`` rope / yarn.

``glm4_moe`` attention is grouped-query attention with the Qwen2 bias layout (``attention_bias``: q, k, v),
optional per-head RMSNorm on q and k (``use_qk_norm``) and partial rotary embedding (``partial_rotary_factor``:
the first half of each head, non-interleaved; Megatron's ``rotary_percent``).

Multi-token-prediction layers (``num_nextn_predict_layers``, the ``model.layers.<num_hidden_layers + i>`` tensors
of the released checkpoints) are ignored on import, as transformers ignores them: the RL policy is the base
decoder, and they are neither trained nor pushed to the rollout engine (a vLLM running MTP speculative decoding
would keep the released MTP weights: refuse that in vLLM's own config).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

DEEPSEEK_MOE_FAMILIES = ("deepseek_v3", "glm4_moe")


@dataclass(frozen=True)
class MLAArch:
    """Multi-latent attention of a ``deepseek_v3`` decoder (HF names in brackets)."""

    q_lora_rank: int | None  # [q_lora_rank]; None: a full-rank q_proj
    kv_lora_rank: int  # [kv_lora_rank]
    qk_nope_head_dim: int  # [qk_nope_head_dim]
    qk_rope_head_dim: int  # [qk_rope_head_dim]
    v_head_dim: int  # [v_head_dim]
    rope_type: str = "rope"  # rope | yarn (Megatron's MLA rope_type)
    yarn_factor: float = 1.0  # [rope_parameters.factor]
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0  # [mscale] (the rotary cos/sin scale numerator)
    yarn_mscale_all_dim: float = 0.0  # [mscale_all_dim] (denominator, and the softmax scale)

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank={self.q_lora_rank} must be a positive integer or null")
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"rope_type={self.rope_type!r}; supported: rope, yarn")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_parameters(self, hidden: int, heads: int) -> int:
        q = (hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
             if self.q_lora_rank is not None else hidden * heads * self.qk_head_dim)
        kv = (hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + heads * self.v_head_dim * hidden


def _get(hf: Any, name: str, default=None):
    return getattr(hf, name, default)


def rope_parameters(hf: Any) -> dict:
    params: dict = {}
    if isinstance(_get(hf, "rope_parameters"), Mapping):
        params.update(hf.rope_parameters)
    if isinstance(_get(hf, "rope_scaling"), Mapping):
        params.update(hf.rope_scaling)
    return params


def mla_from_hf_config(hf: Any) -> MLAArch:
    """The ``MLAArch`` of a transformers ``DeepseekV3Config``; ValueError naming each field Megatron's MLA cannot
    represent."""
    if _get(hf, "rope_interleave", True) is False:
        raise ValueError("rope_interleave=False is not supported: Megatron-Core's multi-latent attention always "
                         "reads the rotary part in DeepSeek's interleaved pair layout (rope_interleave=True, every "
                         "released DeepSeek-V3 / Kimi-K2 / Moonlight config)")
    if _get(hf, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported for deepseek_v3 (Megatron's MLA has bias-free "
                         "q_a_proj / kv_a_proj_with_mqa)")
    heads = int(hf.num_attention_heads)
    kv_heads = _get(hf, "num_key_value_heads") or heads
    if int(kv_heads) != heads:
        raise ValueError(f"num_key_value_heads={kv_heads} != num_attention_heads={heads}: multi-latent attention "
                         "gives every head its own key and value (kv_b_proj)")
    params = rope_parameters(hf)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    kwargs: dict = {}
    if rope_type == "yarn":
        for key in ("attention_factor",):
            if params.get(key) is not None:
                raise ValueError(f"yarn rope_parameters.{key}={params[key]} is not supported (Megatron's YaRN derives "
                                 "the attention factor from mscale / mscale_all_dim)")
        if params.get("truncate", True) is False:
            raise ValueError("yarn rope_parameters.truncate=False is not supported (Megatron rounds the correction "
                             "range to integers)")
        original = params.get("original_max_position_embeddings")
        if original is None:
            raise ValueError("yarn rope_parameters without original_max_position_embeddings is not supported")
        factor = params.get("factor") or int(hf.max_position_embeddings) / int(original)
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if bool(mscale_all_dim) != bool(mscale):
            # transformers: the cos/sin scale is get_mscale(factor) unless both are set, while the softmax scale
            # reads mscale_all_dim alone; Megatron ties both to the pair
            raise ValueError(f"yarn with mscale={mscale} and mscale_all_dim={mscale_all_dim}: Megatron's MLA needs "
                             "both set or neither")
        kwargs = dict(rope_type="yarn", yarn_factor=float(factor), yarn_original_max_position_embeddings=int(original),
                      yarn_beta_fast=float(params.get("beta_fast") or 32), yarn_beta_slow=float(params.get("beta_slow")
                                                                                              or 1),
                      yarn_mscale=float(mscale or 1.0), yarn_mscale_all_dim=float(mscale_all_dim or 0.0))
    elif rope_type != "default":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported for deepseek_v3; supported: default, "
                         "yarn")
    q_lora = _get(hf, "q_lora_rank")
    return MLAArch(q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(hf.kv_lora_rank),
                   qk_nope_head_dim=int(hf.qk_nope_head_dim), qk_rope_head_dim=int(hf.qk_rope_head_dim),
                   v_head_dim=int(hf.v_head_dim), **kwargs)


def check_deepseek_fields(hf: Any, family: str) -> None:
    """The fields both families share that Megatron cannot represent, refused by name."""
    act = _get(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: only 'silu' (SwiGLU MLP) is supported")
    if not _get(hf, "norm_topk_prob", True):
        raise ValueError(f"{family}: norm_topk_prob=False is not supported (Megatron-Core's sigmoid router always "
                         "divides the top-k weights by their sum)")
    # the released DeepSeek-V3 config.json names its router (transformers ignores these and always computes the
    # sigmoid + bias router; vLLM follows them): anything else would make the rollout engine route differently
    scoring, method = _get(hf, "scoring_func", None), _get(hf, "topk_method", None)
    if scoring not in (None, "sigmoid") or method not in (None, "noaux_tc"):
        raise ValueError(f"{family}: scoring_func={scoring!r}, topk_method={method!r} is not supported (the sigmoid "
                         "router with e_score_correction_bias is scoring_func='sigmoid', topk_method='noaux_tc')")
    if _get(hf, "mlp_layer_types") is not None:
        raise ValueError(f"{family}: mlp_layer_types is not supported (dense layers come from first_k_dense_replace)")


def moe_fields(hf: Any, family: str) -> dict:
    """``MoEArch`` keyword arguments of a ``deepseek_v3`` / ``glm4_moe`` config (the sparse block above)."""
    check_deepseek_fields(hf, family)
    layers = int(hf.num_hidden_layers)
    experts = int(hf.n_routed_experts)
    topk = int(hf.num_experts_per_tok)
    first_dense = int(_get(hf, "first_k_dense_replace", 0) or 0)
    groups = int(_get(hf, "n_group", 1) or 1)
    group_topk = int(_get(hf, "topk_group", 1) or 1)
    num_groups = group_limit = None
    if groups > 1:
        if experts % groups:
            raise ValueError(f"n_routed_experts={experts} is not divisible by n_group={groups}")
        if topk != 2 * group_topk:
            raise ValueError(f"n_group={groups}, topk_group={group_topk}, num_experts_per_tok={topk}: transformers "
                             "scores a group by its top-2 experts, Megatron-Core by its top num_experts_per_tok / "
                             "topk_group; they agree only when num_experts_per_tok == 2 * topk_group "
                             "(DeepSeek-V3: 8 and 4)")
        if group_topk < groups:  # every group kept = no group limit
            num_groups, group_limit = groups, group_topk
    shared = int(_get(hf, "n_shared_experts", 0) or 0)
    return dict(num_experts=experts, topk=topk, expert_ffn_hidden_size=int(hf.moe_intermediate_size),
                norm_topk_prob=True, sparse_layers=tuple(i >= first_dense for i in range(layers)),
                router_aux_loss_coef=0.0, score_function="sigmoid", expert_bias=True, num_groups=num_groups,
                group_topk=group_limit, scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0) or 1.0),
                shared_expert_ffn_hidden_size=shared * int(hf.moe_intermediate_size) if shared else None)


def glm4_moe_attention(hf: Any) -> dict:
    """ModelArch keyword arguments of glm4_moe's attention: bias layout, q/k norm, partial rotary."""
    params = rope_parameters(hf)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported for glm4_moe; supported: default")
    partial = float(params.get("partial_rotary_factor", _get(hf, "partial_rotary_factor", 1.0)) or 1.0)
    head_dim = int(_get(hf, "head_dim") or hf.hidden_size // hf.num_attention_heads)
    if not 0 < partial <= 1 or (head_dim * partial) % 2:
        raise ValueError(f"partial_rotary_factor={partial} with head_dim={head_dim}: the rotary part must be an even "
                         "number of dimensions in (0, head_dim]")
    return dict(qkv_bias=bool(_get(hf, "attention_bias", False)), qk_norm=bool(_get(hf, "use_qk_norm", False)),
                rotary_percent=partial, head_dim=head_dim)


def mtp_layers(hf: Any) -> int:
    """Multi-token-prediction layers in the checkpoint (ignored on import; see the module docstring)."""
    return int(_get(hf, "num_nextn_predict_layers", 0) or 0)


def mla_config_kwargs(mla: MLAArch, arch: Any) -> dict:
    """``MLATransformerConfig`` fields of ``mla`` (merged into ``model.build_transformer_config``)."""
    kwargs = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_channels=mla.v_head_dim,
        num_query_groups=arch.num_attention_heads,
        qk_layernorm=True,  # the latent norms q_a_layernorm / kv_a_layernorm (Megatron's q/kv_layernorm)
        rope_type=mla.rope_type,
        rotary_base=arch.rope_theta,
        rotary_scaling_factor=mla.yarn_factor,
        original_max_position_embeddings=mla.yarn_original_max_position_embeddings,
        beta_fast=mla.yarn_beta_fast,
        beta_slow=mla.yarn_beta_slow,
        mscale=mla.yarn_mscale,
        mscale_all_dim=mla.yarn_mscale_all_dim,
    )
    return kwargs


MLA_ARCH_CONFIG_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                          "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_base", "rotary_scaling_factor",
                          "mscale", "mscale_all_dim")


def softmax_scale(mla: MLAArch) -> float:
    """transformers' attention scale of a deepseek_v3 layer (for checks)."""
    scale = 1.0 / math.sqrt(mla.qk_head_dim)
    if mla.rope_type == "yarn" and mla.yarn_mscale_all_dim and mla.yarn_factor > 1:
        m = 0.1 * mla.yarn_mscale_all_dim * math.log(mla.yarn_factor) + 1.0
        scale *= m * m
    return scale


def arch_fields(hf: Any, family: str) -> dict:
    """Every ``ModelArch`` keyword argument of a ``deepseek_v3`` / ``glm4_moe`` transformers config (``moe``: the
    ``MoEArch`` keyword arguments)."""
    heads = int(hf.num_attention_heads)
    classifier = any(str(a).endswith("ForSequenceClassification") for a in _get(hf, "architectures", None) or [])
    if classifier:
        raise ValueError(f"{family}: a sequence classifier (reward model) is not supported for this family")
    if _get(hf, "use_sliding_window", False) or (_get(hf, "layer_types") and any(
            t != "full_attention" for t in hf.layer_types)):
        raise ValueError(f"{family}: sliding-window layers are not supported")
    fields: dict = dict(family=family, vocab_size=int(hf.vocab_size), hidden_size=int(hf.hidden_size),
                        ffn_hidden_size=int(hf.intermediate_size), num_layers=int(hf.num_hidden_layers),
                        num_attention_heads=heads, norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
                        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
                        max_position_embeddings=int(_get(hf, "max_position_embeddings", 4096) or 4096),
                        init_std=float(_get(hf, "initializer_range", 0.02) or 0.02),
                        rope_theta=float(rope_parameters(hf).get("rope_theta") or _get(hf, "rope_theta", None)
                                         or 10000.0),
                        moe=moe_fields(hf, family), mtp_layers=mtp_layers(hf))
    if family == "deepseek_v3":
        mla = mla_from_hf_config(hf)
        fields.update(num_kv_heads=heads, head_dim=mla.qk_head_dim, qkv_bias=False, qk_norm=False, mla=mla)
    else:
        attn = glm4_moe_attention(hf)
        kv = _get(hf, "num_key_value_heads") or heads
        fields.update(num_kv_heads=int(kv), **attn)
    return fields


def ensure_mla_without_te() -> None:
    """Megatron-Core 0.16's ``multi_latent_attention`` sets ``HAVE_TE = True`` when its TE extension module
    imports, which it does without Transformer Engine too (``TELinear`` is then a ``MagicMock`` placeholder), and
    ``MultiLatentAttention.__init__`` runs ``isinstance(self.linear_proj, TELinear)``: a TypeError on any machine
    without TE. When ``TELinear`` is not a class, TE is absent: ``HAVE_TE = False`` selects the branch written for
    that case."""
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.HAVE_TE and not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def replicate_mla_down_projections(block) -> None:
    """Megatron-Core 0.16's local MLA spec makes ``linear_q_down_proj`` / ``linear_kv_down_proj``
    column-parallel and all-gathers their outputs (``gather_from_tensor_model_parallel_region``). That gather's
    backward only splits the gradient, so the shared rotary key ``k_pos_emb`` (used by every head, the heads split
    over TP) keeps the gradient of this rank's heads only: at TP > 1 the forward is right and the gradients are
    not (measured: one Adam step at TP2 x SP moved log-probs 3.7e-3 away from one process). The replicated
    layout of the TE spec (``TELinear``, ``parallel_mode='duplicated'``) has the right backward (``k_pos_emb`` is
    gathered over the sequence-parallel region, whose backward sums over TP); its local twin is Megatron's plain
    ``Linear`` (``post_training.modelopt.layers``: weights marked ``sequence_parallel``, so their gradients are
    summed over TP). The local spec gets that, in place, for every layer of ``block``."""
    from megatron.core.post_training.modelopt.layers import Linear

    for layer in block.layer_specs:
        submodules = layer.submodules.self_attention.submodules
        submodules.linear_q_down_proj = Linear
        submodules.linear_kv_down_proj = Linear
