"""Context-parallel attention (megatron/cp_attention.py) on CPU with gloo: output and input gradients at cp=2
equal plain per-sequence causal attention (cp=1) on packed THD batches of several sequences, GQA included."""
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


def _reference(q, k, v):
    """Causal attention within each sequence, one SDPA call per sequence."""
    outs = []
    group = HEADS // KV_HEADS
    for a, b in zip(CU[:-1], CU[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE).transpose(0, 1))
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
