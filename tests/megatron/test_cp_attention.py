"""Context-parallel attention (megatron/cp_attention.py) on CPU with gloo: output and input gradients at cp=2
equal plain per-sequence causal attention (cp=1) on packed THD batches of several sequences, GQA included; the
same through the SDPA and varlen core-attention modules (varlen with CPU reference kernels of torch 2.10's and
2.13's ``varlen_attn`` signatures, bottom-right causal as FlashAttention)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from _dist import run_distributed

CU = [0, 8, 12, 28, 32]  # four sequences, padded lengths multiples of 2*cp = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
SCALE = 0.3


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = CU[-1]
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    upstream = torch.randn(t, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    return q, k, v, upstream


def _reference(q, k, v, scale=SCALE):
    """Causal attention within each sequence, one SDPA call per sequence."""
    outs = []
    group = HEADS // KV_HEADS
    for a, b in zip(CU[:-1], CU[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def _grads(fn, q, k, v, upstream):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    (out * upstream).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_worker():
    import torch.distributed as dist

    from megatron_dppo.megatron.cp_attention import context_parallel_attention
    from megatron_dppo.packing.context_parallel import split_for_cp

    dist.init_process_group("gloo", init_method="env://")
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, upstream = (split_for_cp(x, CU, cp, rank) for x in _inputs())
    return _grads(lambda q_, k_, v_: context_parallel_attention(q_, k_, v_, CU, dist.group.WORLD, scale=SCALE),
                  q, k, v, upstream)


def test_cp2_equals_cp1_outputs_and_input_grads():
    from megatron_dppo.packing.context_parallel import merge_from_cp

    q, k, v, upstream = _inputs()
    expected = _grads(_reference, q, k, v, upstream)
    ranks = run_distributed(_cp_worker, world_size=2, timeout=120)
    for name, want, parts in zip(("out", "dq", "dk", "dv"), expected, zip(*ranks)):
        got = merge_from_cp(list(parts), CU)
        diff = (got - want).abs().max().item()
        print(f"{name}: max abs diff cp2 vs cp1 {diff:.2e}")
        assert diff < 1e-12, f"{name}: max abs diff {diff}"


def test_single_rank_is_plain_causal_attention():
    from megatron_dppo.megatron.cp_attention import context_parallel_attention

    q, k, v, upstream = _inputs(1)
    expected = _grads(_reference, q, k, v, upstream)
    got = _grads(lambda *x: context_parallel_attention(*x, CU, None, scale=SCALE), q, k, v, upstream)
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=0, atol=1e-12)


def test_bad_layouts_are_named():
    import pytest

    from megatron_dppo.megatron.cp_attention import sdpa_causal_segments

    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="keys >= queries"):
        sdpa_causal_segments(q[:8], k[:4], v[:4], torch.tensor([0, 8]), torch.tensor([0, 4]), 8, 4, SCALE)


def kernel_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's varlen_attn signature; FlashAttention's bottom-right causal on unequal q / k segments."""
    from megatron_dppo.megatron.cp_attention import sdpa_causal_segments

    assert tuple(window_size) == (-1, 0) and (enable_gqa or query.size(1) == key.size(1))
    return sdpa_causal_segments(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)


def kernel_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature: no scale (1/sqrt(hn)), no GQA."""
    from megatron_dppo.megatron.cp_attention import sdpa_causal_segments

    assert is_causal and query.size(1) == key.size(1)
    return sdpa_causal_segments(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, query.size(2) ** -0.5)


def _module_worker():
    import dataclasses
    from types import SimpleNamespace

    import torch.distributed as dist
    from _engine_fixtures import tiny_arch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dppo.megatron.attention import SDPACoreAttention, VarlenCoreAttention
    from megatron_dppo.megatron.model import build_transformer_config
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.packing.context_parallel import split_for_cp

    dist.init_process_group("gloo", init_method="env://")
    cp, rank = dist.get_world_size(), dist.get_rank()
    arch = dataclasses.replace(tiny_arch(), hidden_size=32, head_dim=HEAD_DIM)
    config = build_transformer_config(arch, ParallelConfig(cp=cp), torch.float32, attention_backend="sdpa")
    groups = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1), cp=dist.group.WORLD)
    cu = torch.tensor(CU, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=16, max_seqlen_kv=16)
    q, k, v, upstream = (split_for_cp(x.float(), CU, cp, rank) for x in _inputs())
    out = {}
    for name, kernel in (("sdpa", None), ("varlen_2_13", kernel_2_13), ("varlen_2_10", kernel_2_10)):
        if kernel is None:
            cls = SDPACoreAttention
        else:
            cls = type("Varlen", (VarlenCoreAttention,), {"kernel": staticmethod(kernel)})
        scale = HEAD_DIM ** -0.5 if name == "varlen_2_10" else SCALE
        module = cls(config, 1, AttnMaskType.causal, "self", softmax_scale=scale, pg_collection=groups)

        def run(q_, k_, v_, module=module):
            result = module(q_, k_, v_, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
            return result.view(-1, HEADS, HEAD_DIM)

        out[name] = _grads(run, q, k, v, upstream.float())
    return out


def test_core_attention_modules_at_cp2_equal_cp1():
    from megatron_dppo.packing.context_parallel import merge_from_cp

    ranks = run_distributed(_module_worker, world_size=2, timeout=180)
    q, k, v, upstream = _inputs()
    for name in ("sdpa", "varlen_2_13", "varlen_2_10"):
        scale = HEAD_DIM ** -0.5 if name == "varlen_2_10" else SCALE  # 2.10's kernel has no scale argument
        expected = _grads(lambda *x: _reference(*x, scale=scale), q, k, v, upstream)
        for what, want, parts in zip(("out", "dq", "dk", "dv"), expected, zip(*[r[name] for r in ranks])):
            diff = (merge_from_cp(list(parts), CU).double() - want).abs().max().item()
            assert diff < 1e-5, f"{name} {what}: max abs diff {diff}"
