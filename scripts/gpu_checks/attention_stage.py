"""Stage 3: torch's varlen FlashAttention (through ``attention.varlen_attention``) against per-sequence SDPA,
forward and backward, GQA, bf16 and fp16 against an fp32 reference; ``VarlenCoreAttention`` against the SDPA twin
on a padded THD batch. ``--cpu-smoke`` puts a CPU reference with the kernel's signature in its place."""
from __future__ import annotations

import math

from .harness import Check, require
from .shapes import small_arch

ROUNDING_STEPS = 4  # VarlenCoreAttention vs its SDPA twin: a few rounding steps of each tensor's largest value


def module_limit(scale: float, eps: float, floor: float, steps: int = ROUNDING_STEPS) -> float:
    """Tolerance of the module-level comparison for a tensor whose largest magnitude is ``scale``, in a dtype of
    machine epsilon ``eps``: ``steps`` rounding steps at that magnitude (a step is at most eps * |x|), never below
    ``floor``. Two kernels that add in another order round differently: in bf16 (eps 2^-7) a gradient of
    magnitude ~18 moves in steps of 0.125, which an absolute 5e-2 cannot hold."""
    return max(floor, steps * eps * scale)


def per_sequence_attention(q, k, v, cu, scale):
    """Reference: one causal SDPA call per sequence (GQA by repeating key/value heads)."""
    import torch
    import torch.nn.functional as F

    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out, bounds = [], cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out)


def cpu_reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False):
    """--cpu-smoke stand-in for torch's varlen_attn (its 2.12+ signature; the kernel itself is CUDA only)."""
    assert tuple(window_size) == (-1, 0)
    return per_sequence_attention(query, key, value, cu_seq_q, scale)


def stage_varlen(c: Check) -> dict:
    import torch

    from megatron_dppo.megatron.attention import varlen_attention

    kernel = cpu_reference_kernel if c.cpu_smoke else None
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, hd = (4, 2, 16) if c.cpu_smoke else (32, 8, 128)
    lengths = [1, 7, 33, 64, 5] if c.cpu_smoke else [1, 17, 128, 1000, 333, 2048, 7, 640]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(c.device)
    t = sum(lengths)
    base = [torch.randn(t, h, hd, generator=g).to(c.device) for h in (heads, kv_heads, kv_heads)]
    w = torch.randn(t, heads, hd, generator=g).to(c.device)
    scale = 1.0 / math.sqrt(hd)

    def run(fn, dtype):
        q, k, v = (x.to(dtype).requires_grad_(True) for x in base)
        out = fn(q, k, v)
        grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
        return [out.float()] + [gr.float() for gr in grads]

    ref = run(lambda q, k, v: per_sequence_attention(q, k, v, cu, scale), torch.float32)
    figures = {"sequences": len(lengths), "tokens": t, "heads": f"{heads}:{kv_heads}", "head_dim": hd}
    for dtype in ([torch.float32] if c.cpu_smoke else [torch.bfloat16, torch.float16]):
        name = str(dtype).replace("torch.", "")
        fused = run(lambda q, k, v: varlen_attention(q, k, v, cu, max(lengths), causal=True, scale=scale,
                                                     kernel=kernel), dtype)
        sdpa = run(lambda q, k, v: per_sequence_attention(q, k, v, cu, scale), dtype)
        for i, part in enumerate(("out", "dq", "dk", "dv")):
            err = (fused[i] - ref[i]).abs().max().item()
            base_err = (sdpa[i] - ref[i]).abs().max().item()
            figures[f"{name}_{part}_max_diff"] = err
            figures[f"{name}_{part}_sdpa_max_diff"] = base_err
            limit = 1e-4 if dtype == torch.float32 else 2 * base_err + 1e-3
            require(math.isfinite(err) and err <= limit,
                    f"varlen {name} {part}: max |diff| {err:.3e} vs fp32 reference exceeds {limit:.3e}")
    figures.update(_module_level_varlen(c, kernel))
    return figures


def _module_level_varlen(c: Check, kernel) -> dict:
    """VarlenCoreAttention == SDPACoreAttention (the CPU-verified twin) on a padded THD batch with tail padding."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dppo.megatron.attention import SDPACoreAttention, VarlenCoreAttention
    from megatron_dppo.megatron.model import build_transformer_config
    from megatron_dppo.megatron.parallel import ParallelConfig

    c.need_parallel()
    arch = small_arch(c)
    config = build_transformer_config(arch, ParallelConfig(), c.dtype, attention_backend="sdpa")
    padded = [8, 24, 16, 64] if c.cpu_smoke else [128, 512, 2048, 384]
    cu = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(c.device)
    total = int(cu[-1]) + 16  # tail padding after the last segment
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    g = torch.Generator().manual_seed(1)
    hq, hkv, hd = arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    q, k, v = (torch.randn(total, h, hd, generator=g).to(c.device, c.dtype) for h in (hq, hkv, hkv))
    class Varlen(VarlenCoreAttention):  # the kernel decides the dtype rule when the layer is built
        pass

    Varlen.kernel = None if kernel is None else staticmethod(kernel)
    outs = []
    for cls in (SDPACoreAttention, Varlen):
        module = cls(config, 1, AttnMaskType.causal, "self")
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = module(qq, kk, vv, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        grads = torch.autograd.grad(out.float().sum(), (qq, kk, vv))
        outs.append([out.float()] + [gr.float() for gr in grads])
    diffs = [(a - b).abs().max().item() for a, b in zip(outs[0], outs[1])]
    scales = [a.abs().max().item() for a in outs[0]]
    eps = torch.finfo(c.dtype).eps
    limits = [module_limit(s, eps, floor=1e-5 if c.cpu_smoke else 5e-2) for s in scales]
    tail = outs[1][0][int(cu[-1]):].abs().max().item()
    require(tail == 0.0, f"tail positions after the last segment are not zero ({tail})")
    for part, diff, scale, limit in zip(("out", "dq", "dk", "dv"), diffs, scales, limits):
        require(diff <= limit, f"VarlenCoreAttention vs SDPA twin, {part}: max |diff| {diff:.3e} > {limit:.3e} "
                               f"({ROUNDING_STEPS} rounding steps at its largest magnitude {scale:.3g})")
    return {"module_out_max_diff": diffs[0], "module_grad_max_diff": max(diffs[1:]), "module_tail_zero": True,
            "module_max_abs": [round(s, 4) for s in scales], "module_limits": [round(x, 6) for x in limits]}
