"""``ModelArch``: the numbers that define a supported decoder, read from a Hugging Face config.

Its own module so that the model builder (``model.py``) and the layout checks (``parallel.py``) can both use it
without importing each other (imports flow arch <- parallel <- model). The families, their two switches and what
``from_hf_config`` rejects are described in ``model.py``'s docstring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .deepseek_moe import DEEPSEEK_MOE_FAMILIES, MLAArch, arch_fields
from .dense_families import WINDOW_FAMILIES, partial_rotary_from_hf_config, sliding_window_from_hf_config
from .moe import MOE_FAMILIES, MoEArch, moe_from_hf_config

# HF model_type -> family
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}
FAMILIES.update(WINDOW_FAMILIES)  # mistral, ministral, phi3 (dense_families.py)
FAMILIES.update({f: f for f in DEEPSEEK_MOE_FAMILIES})  # deepseek_v3, glm4_moe (deepseek_moe.py)
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
# HF model types people train that this release refuses by name, and why (convert and train both read
# ModelArch.from_hf_config: a named refusal, never a silently wrong model). docs/models.md has the list.
_GEMMA3 = ("Gemma 3 mixes sliding and global layers with a different RoPE base per layer type (rope_local_base_freq), "
           "which Megatron-Core 0.16's GPTModel cannot express (one rotary embedding per model), plus extra pre/post "
           "norms and (1 + w) RMSNorm weights")
REFUSED_MODEL_TYPES = {
    "gpt_oss": "gpt-oss needs attention sinks (softmax_type='learnable') and alternating sliding windows in the "
               "packed (THD) attention, a clamped SwiGLU with biases and MoE with a router bias; this release "
               "implements none of the sinks or the clamped-SwiGLU expert mapping",
    "gemma3": _GEMMA3,
    "gemma3_text": _GEMMA3,
    "gemma2": "Gemma 2 needs logit soft-capping in attention and on the output, extra pre/post norms and "
              "(1 + w) RMSNorm weights; not implemented",
    "qwen3_next": "hybrid linear attention (Gated DeltaNet layers between gated full-attention layers)",
    "qwen3_5": "hybrid linear attention (Gated DeltaNet layers) and a vision tower",
    "qwen3_5_moe": "hybrid linear attention (Gated DeltaNet layers) and a vision tower",
    "qwen3_5_text": "hybrid linear attention (Gated DeltaNet layers)",
    "qwen3_5_moe_text": "hybrid linear attention (Gated DeltaNet layers)",
    "kimi_linear": "hybrid linear attention (Kimi Delta Attention layers)",
    "minimax": "hybrid linear attention (lightning attention layers)",
    "minimax_m2": "no mapping yet (MiniMax-M2: sigmoid router, per-layer qk-norm over all heads)",
    "deepseek_v32": "DeepSeek Sparse Attention (a lightning indexer picks the keys each query attends)",
    "deepseek_v4": "no mapping yet (DeepSeek-V4 attention and routing differ from V3)",
    "deepseek_v2": "no mapping yet (DeepSeek-V2: softmax group-limited routing; use a deepseek_v3 config)",
    "glm4_moe_lite": "no mapping yet (GLM-4.7-Flash: multi-latent attention in a glm4 config)",
    "longcat_flash": "zero-computation experts and two attention blocks per layer",
}
# RoPE variants Megatron's RotaryEmbedding can represent; llama3 with Megatron's fixed constants only.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelArch:
    """The numbers that define a decoder of one of ``FAMILIES`` (dense, MoE, multi-latent attention; HF names in
    brackets)."""

    family: str  # llama | qwen2 | qwen3 | qwen3_moe | mixtral | mistral | ministral | phi3 | deepseek_v3 | glm4_moe
    vocab_size: int  # [vocab_size] rows of the embedding (already padded by the model authors)
    hidden_size: int  # [hidden_size]
    ffn_hidden_size: int  # [intermediate_size] (the dense MLP; MoE experts: moe.expert_ffn_hidden_size)
    num_layers: int  # [num_hidden_layers]
    num_attention_heads: int  # [num_attention_heads]
    num_kv_heads: int  # [num_key_value_heads] (GQA); == num_attention_heads for MHA
    head_dim: int  # [head_dim] or hidden_size // num_attention_heads
    rope_theta: float  # [rope_theta] / rope_parameters["rope_theta"]
    norm_eps: float  # [rms_norm_eps]
    tie_embeddings: bool  # [tie_word_embeddings]
    qkv_bias: bool  # qwen2: True
    qk_norm: bool  # qwen3: True
    max_position_embeddings: int  # [max_position_embeddings]
    rope_scaling_type: str = "default"  # default | linear | llama3
    rope_scaling_factor: float = 1.0
    init_std: float = 0.02  # [initializer_range]
    moe: MoEArch | None = None  # the sparse blocks of qwen3_moe / mixtral; None for dense families
    # deepseek_v3 (``deepseek_moe``): multi-latent attention (then head_dim = qk_nope + qk_rope and
    # num_kv_heads = num_attention_heads); the checkpoint's multi-token-prediction layers (ignored on import)
    mla: MLAArch | None = None
    mtp_layers: int = 0
    # [partial_rotary_factor] (phi3, glm4_moe): the fraction of each head's channels RoPE rotates (Megatron's
    # rotary_percent)
    rotary_percent: float = 1.0
    # [num_labels] of a *ForSequenceClassification (a reward model): its output layer is the score head [labels, H]
    # at every position (``score_head.ScoreHead``) instead of the vocabulary; None for a causal LM
    num_labels: int | None = None
    # [sliding_window] (mistral / ministral): keys each query attends to, itself included; None = full attention
    sliding_window: int | None = None
    # [layer_types] when only some layers use the window: one bool per layer (True = sliding); None = every layer
    window_layers: tuple[bool, ...] | None = None

    def __post_init__(self):
        if self.window_layers is not None:  # (a list after a JSON round trip)
            object.__setattr__(self, "window_layers", tuple(bool(w) for w in self.window_layers))
        if self.family not in FAMILIES.values():
            raise ValueError(f"family={self.family!r}; supported: {sorted(set(FAMILIES.values()))}")
        if (self.moe is not None) != self.is_moe_family:
            raise ValueError(f"family={self.family!r} {'needs' if self.is_moe_family else 'cannot have'} "
                             f"MoE blocks (moe={self.moe})")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError(f"moe.sparse_layers has {len(self.moe.sparse_layers)} entries for "
                             f"num_layers={self.num_layers}")
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs it)")
        if self.num_labels is not None and (self.num_labels < 1 or self.tie_embeddings):
            raise ValueError(f"num_labels={self.num_labels} (a sequence classifier) needs num_labels >= 1 and "
                             "untied embeddings (its score head is not the embedding matrix)")
        if self.rope_scaling_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling_type={self.rope_scaling_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        if self.sliding_window is not None and (self.family not in WINDOW_FAMILIES or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window}: a positive window, and only for the families "
                             f"{sorted(WINDOW_FAMILIES)} (family={self.family!r})")
        if not 0.0 < self.rotary_percent <= 1.0 or (self.rotary_percent * self.head_dim) % 2:
            raise ValueError(f"rotary_percent={self.rotary_percent} must be in (0, 1] and rotate an even number of "
                             f"channels of head_dim={self.head_dim}")
        if self.window_layers is not None and (self.sliding_window is None
                                               or len(self.window_layers) != self.num_layers):
            raise ValueError(f"window_layers has {len(self.window_layers)} entries for num_layers={self.num_layers} "
                             f"(and needs a sliding_window, got {self.sliding_window})")

    @property
    def is_moe_family(self) -> bool:
        return self.family in MOE_FAMILIES

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any] | Any) -> "ModelArch":
        """From a ``config.json`` dict or a ``transformers.PretrainedConfig`` (transformers 4.x or 5.x).

        A dict is first turned into its transformers config class so that family defaults apply exactly as
        when Hugging Face loads the model (e.g. Qwen3's default ``head_dim=128``).
        """
        hf = _as_transformers_config(cfg)
        model_type = getattr(hf, "model_type", None)
        _check_model_type(model_type)
        family = FAMILIES[model_type]
        if family in DEEPSEEK_MOE_FAMILIES:
            fields = arch_fields(hf, family)
            return cls(**dict(fields, moe=MoEArch(**fields["moe"])))

        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r}: only 'silu' (SwiGLU MLP) is supported")
        if getattr(hf, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported (the Megatron model has bias-free MLP layers)")
        attention_bias = bool(getattr(hf, "attention_bias", False) or False)
        if family in ("qwen3", "qwen3_moe") and attention_bias:
            # transformers' Qwen3 puts the bias on q, k, v AND o_proj: a bias-free Megatron model would silently
            # drop all four
            raise ValueError(f"attention_bias=True ({family}: bias on q, k, v and o_proj) is not supported; the "
                             "released Qwen3 configs have false")
        if family == "llama" and attention_bias:
            raise ValueError("attention_bias=True (Llama: bias on q, k, v and o) is not supported; only the "
                             "Qwen2 layout (bias on q, k, v) is")
        if getattr(hf, "use_sliding_window", False) or (family == "mixtral" and getattr(hf, "sliding_window", None)):
            raise ValueError(f"use_sliding_window=True (sliding_window={getattr(hf, 'sliding_window', None)}) "
                             "is not supported")
        layer_types = getattr(hf, "layer_types", None)
        window, window_layers = (sliding_window_from_hf_config(hf, family, int(hf.num_hidden_layers))
                                 if family in WINDOW_FAMILIES else (None, None))
        if family not in WINDOW_FAMILIES and layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"layer_types={sorted(set(layer_types))}: only full_attention layers are supported")

        heads = int(hf.num_attention_heads)
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None)
        if head_dim is None:
            if hf.hidden_size % heads:
                raise ValueError(f"hidden_size={hf.hidden_size} is not divisible by num_attention_heads={heads} "
                                 "and the config has no head_dim")
            head_dim = hf.hidden_size // heads

        theta, rope_type, factor = _rope_from_config(hf)
        classifier = any(str(a).endswith("ForSequenceClassification") for a in getattr(hf, "architectures", None) or [])
        num_labels = int(getattr(hf, "num_labels", 1)) if classifier else None
        tie = getattr(hf, "tie_word_embeddings", False) and not classifier  # (a classifier has no LM head to tie)
        moe = moe_from_hf_config(hf, family) if family in MOE_FAMILIES else None
        return cls(
            family=family,
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            ffn_hidden_size=int(hf.intermediate_size),
            num_layers=int(hf.num_hidden_layers),
            num_attention_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rope_theta=float(theta),
            norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
            tie_embeddings=bool(tie),
            qkv_bias=family == "qwen2",
            qk_norm=family in QK_NORM_FAMILIES,
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096) or 4096),
            rope_scaling_type=rope_type,
            rope_scaling_factor=float(factor),
            init_std=float(getattr(hf, "initializer_range", 0.02) or 0.02),
            moe=moe,
            num_labels=num_labels,
            sliding_window=window,
            window_layers=window_layers,
            rotary_percent=partial_rotary_from_hf_config(hf, family),
        )

    @property
    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, f, hd = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_kv_heads * hd
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * hd if self.qk_norm else 0)
        if self.mla is not None:
            attn = self.mla.attention_parameters(h, self.num_attention_heads)
        emb = self.vocab_size * h
        if self.moe is None:
            layers = self.num_layers * (attn + 3 * h * f + 2 * h)
        else:
            sparse = self.moe.num_sparse_layers
            experts = self.moe.num_experts * 3 * h * self.moe.expert_ffn_hidden_size + self.moe.num_experts * h
            experts += 3 * h * (self.moe.shared_expert_ffn_hidden_size or 0)
            layers = self.num_layers * (attn + 2 * h) + sparse * experts + (self.num_layers - sparse) * 3 * h * f
        head = emb if self.num_labels is None else self.num_labels * h
        return layers + h + emb + (0 if self.tie_embeddings else head)

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token passes through: top-k experts instead of all (== num_parameters when dense)."""
        if self.moe is None:
            return self.num_parameters
        idle = self.moe.num_experts - self.moe.topk
        return self.num_parameters - self.moe.num_sparse_layers * idle * 3 * self.hidden_size * (
            self.moe.expert_ffn_hidden_size)


def _check_model_type(model_type) -> None:
    """ValueError for a model type we do not build; the refused ones (``REFUSED_MODEL_TYPES``) by name, with what
    they have that the Megatron model cannot represent."""
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is refused: {REFUSED_MODEL_TYPES[model_type]}; supported: "
                         f"{sorted(FAMILIES)}")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}")


def _as_transformers_config(cfg):
    if isinstance(cfg, Mapping):
        cfg = dict(cfg)
        model_type = cfg.get("model_type")
        _check_model_type(model_type)
        from transformers import AutoConfig

        return AutoConfig.for_model(**cfg)
    return cfg


def _rope_from_config(hf) -> tuple[float, str, float]:
    """(theta, scaling type, factor) from transformers 5 ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``."""
    params: dict = {}
    if isinstance(getattr(hf, "rope_parameters", None), Mapping):
        params.update(hf.rope_parameters)
    if isinstance(getattr(hf, "rope_scaling", None), Mapping):
        params.update(hf.rope_scaling)
    theta = params.get("rope_theta") or getattr(hf, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    factor = float(params.get("factor", 1.0) or 1.0)
    if rope_type == "llama3":
        for key, expected in _MEGATRON_LLAMA3_ROPE.items():
            value = params.get(key, expected)
            if not math.isclose(float(value), expected):
                raise ValueError(f"llama3 rope scaling with {key}={value} is not supported; Megatron-Core's "
                                 f"RotaryEmbedding fixes {key}={expected}")
    if rope_type == "linear" and factor <= 0:
        raise ValueError(f"linear rope scaling factor={factor} must be positive")
    return theta, rope_type, factor
