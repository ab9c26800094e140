"""The dense families beyond Llama/Qwen: Mistral and Ministral (sliding-window attention), Phi-3 (fused
projections, partial rotary, a window). The families refused by name are in ``arch.REFUSED_MODEL_TYPES``.
docs/models.md has the table of what is tested.

Sliding window (HF ``sliding_window = W``): query ``i`` attends to the keys ``j`` with ``i - W < j <= i`` of its
own sequence, i.e. ``W`` keys itself included (transformers 5, ``masking_utils.sliding_window_overlay``:
``kv_idx > q_idx - W``; its FlashAttention path passes ``window_size = (W - 1, ...)``). Megatron-Core's
``window_size = (left, right)`` counts the keys *besides* the query (FlashAttention / Transformer Engine
convention), so the model is built with ``window_size = (W - 1, 0)``. Ministral's ``layer_types`` mix sliding and
full layers; Megatron-Core takes the per-layer choice as ``window_attn_skip_freq = [1 if windowed else 0, ...]``
(``megatron.core.transformer.utils.is_layer_window_attention``, 1-based global layer numbers).

Phi-3 / Phi-4-mini (``phi3``): the Llama decoder with q, k, v fused in one ``qkv_proj`` (rows ``[q; k; v]``) and
gate / up in one ``gate_up_proj`` (rows ``[gate; up]``, Megatron's own ``linear_fc1`` layout), an optional window on
every layer (``sliding_window``), and partial rotary (``partial_rotary_factor``: RoPE on the first
``factor * head_dim`` channels of each head, the rest passed through; Megatron-Core's ``rotary_percent``, the same
split and frequencies). LongRoPE (``rope_scaling`` type ``longrope``, the 128k models) is refused.

Mistral models without a window (``sliding_window: null``, Mistral-7B-v0.2 and later, Mistral-Nemo with an explicit
``head_dim``) are the Llama decoder under another name.
"""
from __future__ import annotations

from typing import Any

# HF model_type -> family (the Llama decoder, plus a sliding window)
WINDOW_FAMILIES = {"mistral": "mistral", "ministral": "ministral", "phi3": "phi3"}
FUSED_PROJECTION_FAMILIES = ("phi3",)  # qkv_proj and gate_up_proj fused in the checkpoint
PARTIAL_ROTARY_FAMILIES = ("phi3",)  # partial_rotary_factor read (any other family: refused when != 1)

SLIDING_LAYER, FULL_LAYER = "sliding_attention", "full_attention"


def sliding_window_from_hf_config(hf: Any, family: str, num_layers: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(sliding_window, window_layers)`` of a Mistral / Ministral config: the window ``W`` (None: full attention
    everywhere) and, when only some layers use it, one bool per layer (None: every layer)."""
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if family in ("mistral", "phi3"):  # transformers applies their window to every layer (no layer_types)
        layer_types = None
    if window is None:
        if layer_types and any(t != FULL_LAYER for t in layer_types):
            raise ValueError(f"layer_types={sorted(set(layer_types))} with sliding_window=None: the sliding layers "
                             "have no window size")
        return None, None
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window={window} must be a positive number of keys")
    if not layer_types:
        return window, None
    unknown = set(layer_types) - {SLIDING_LAYER, FULL_LAYER}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported; expected {SLIDING_LAYER!r} or "
                         f"{FULL_LAYER!r}")
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
    layers = tuple(t == SLIDING_LAYER for t in layer_types)
    if not any(layers):
        return None, None
    return window, None if all(layers) else layers


def window_config_kwargs(sliding_window: int | None, window_layers: tuple[bool, ...] | None) -> dict:
    """The Megatron ``TransformerConfig`` fields of a sliding window (see the module docstring); {} without one."""
    if sliding_window is None:
        return {}
    kwargs: dict = {"window_size": (sliding_window - 1, 0)}
    if window_layers is not None:
        kwargs["window_attn_skip_freq"] = [1 if w else 0 for w in window_layers]
    return kwargs


def partial_rotary_from_hf_config(hf: Any, family: str) -> float:
    """The fraction of each head's channels that RoPE rotates (``partial_rotary_factor``; 1.0 = all)."""
    params = getattr(hf, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = float(factor if factor is not None else getattr(hf, "partial_rotary_factor", 1.0) or 1.0)
    if factor != 1.0 and family not in PARTIAL_ROTARY_FAMILIES:
        raise ValueError(f"partial_rotary_factor={factor} is not supported for {family!r} (only "
                         f"{list(PARTIAL_ROTARY_FAMILIES)})")
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor={factor} must be in (0, 1]")
    return factor
