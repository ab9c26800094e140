"""Per-expert checkpoint names -> transformers' fused in-memory expert parameters (Qwen3-MoE, Mixtral).

A Hugging Face checkpoint (and ``export_hf_weights``) holds one tensor per expert and projection
(``mlp.experts.<e>.gate_proj.weight`` / Mixtral ``block_sparse_moe.experts.<e>.w1.weight``), which is what vLLM's
``load_weights`` takes. transformers 5 holds the experts of a layer fused instead: ``mlp.experts.gate_up_proj``
``[E, 2F, H]`` (row block ``[gate_e; up_e]`` per expert) and ``mlp.experts.down_proj`` ``[E, H, F]``, and renames
Mixtral's ``block_sparse_moe`` to ``mlp``; ``from_pretrained`` converts on load. ``fused_target`` gives the slice
of the in-memory parameter that one checkpoint tensor fills, so a weight stream can be copied into a live
transformers model (the CPU rollout engine) without materializing a layer's experts. transformers 4.x keeps the
checkpoint names in memory; there the names are found directly and this module is not consulted.
"""
from __future__ import annotations

import re
from typing import Mapping

from torch import Tensor

_EXPERT = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                     r"(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
# checkpoint projection -> (fused parameter, which half of its rows: 0 gate, 1 up, None all)
_PARTS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


def fused_target(params: Mapping[str, Tensor], name: str) -> tuple[str, Tensor] | None:
    """(name of the in-memory parameter, the view of it that checkpoint tensor ``name`` fills), or None when
    ``name`` is not a per-expert / Mixtral-router name or the model does not hold that fused parameter."""
    router = _MIXTRAL_ROUTER.match(name)
    if router:
        target = f"{router['layer']}.mlp.gate.weight"
        return (target, params[target]) if target in params else None
    match = _EXPERT.match(name)
    if not match:
        return None
    fused, half = _PARTS[match["part"]]
    target = f"{match['layer']}.mlp.experts.{fused}"
    if target not in params:
        return None
    param = params[target]
    expert = int(match["expert"])
    if expert >= param.shape[0]:
        return None
    view = param[expert]
    if half is not None:
        rows = view.shape[0] // 2
        view = view[half * rows:(half + 1) * rows]
    return target, view
