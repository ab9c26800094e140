"""Checkpoint tensor names -> the parameters of a live transformers model.

The weight stream (``convert.export_hf_weights``) speaks the *checkpoint* layout: the names and shapes of a
model's safetensors files, which is what vLLM's ``load_weights`` and ``save_pretrained`` readers expect. A live
transformers model mostly has the same parameters, with one exception: transformers 5 keeps the experts of a
Mixture-of-Experts layer fused in memory, while checkpoints store one tensor per expert:

=============================================================  ==============================================
checkpoint (Qwen3-MoE / Mixtral)                               transformers 5 in memory
=============================================================  ==============================================
``...mlp.experts.<e>.gate_proj.weight``  / ``...block_sparse_moe.experts.<e>.w1.weight``  [F, H]
                                                               ``...mlp.experts.gate_up_proj[e, :F]``
``...mlp.experts.<e>.up_proj.weight``    / ``...w3.weight``    ``...mlp.experts.gate_up_proj[e, F:]``
``...mlp.experts.<e>.down_proj.weight``  / ``...w2.weight``    ``...mlp.experts.down_proj[e]``  [H, F]
``...block_sparse_moe.gate.weight`` (Mixtral router)           ``...mlp.gate.weight``
=============================================================  ==============================================

(transformers' own loader applies the same conversion when it reads a checkpoint; transformers 4 keeps one module
per expert, whose names are the checkpoint's.) ``ParameterLayout.target(name)`` returns the tensor (a view into
the fused parameter where needed) that a checkpoint tensor fills, and the parameter it belongs to, so the engine
can check that a stream covered every parameter exactly.
"""
from __future__ import annotations

import re

import torch
from torch import Tensor

_EXPERT = re.compile(r"^(?P<layer>.+)\.(?P<block>mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                     r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(?P<layer>.+)\.block_sparse_moe\.gate\.weight$")
_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")


class ParameterLayout:
    """Where each checkpoint tensor goes in ``model`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params: dict[str, Tensor] = dict(model.state_dict(keep_vars=True))

    def target(self, name: str) -> tuple[Tensor, Tensor] | None:
        """(the tensor to copy ``name`` into, the parameter it is part of), or None for an unknown name."""
        if name in self.params:
            return self.params[name], self.params[name]
        router = _MIXTRAL_ROUTER.match(name)
        if router:
            fused = self.params.get(f"{router['layer']}.mlp.gate.weight")
            return (fused, fused) if fused is not None else None
        expert = _EXPERT.match(name)
        if expert is None:
            return None
        base = f"{expert['layer']}.mlp.experts."
        e, proj = int(expert["e"]), expert["proj"]
        if proj in _DOWN:
            fused = self.params.get(base + "down_proj")
            if fused is None or e >= fused.shape[0]:
                return None
            return fused[e], fused
        fused = self.params.get(base + "gate_up_proj")
        if fused is None or e >= fused.shape[0]:
            return None
        half = fused.shape[1] // 2
        rows = slice(0, half) if proj in _GATE else slice(half, 2 * half)
        return fused[e, rows], fused

    def example_names(self, k: int = 3) -> list[str]:
        return list(self.params)[:k]
