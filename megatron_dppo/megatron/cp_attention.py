"""Context-parallel causal attention of packed (THD) sequences for any attention kernel: all-gather K/V.

Each CP rank holds its zigzag part of every sequence (``packing.context_parallel``): for sequence ``i`` of padded
length ``L_i = 2 * cp * c_i``, chunks ``r`` and ``2cp - 1 - r`` (``c_i`` positions each), queries, keys and values
alike, already rotated by their global positions (Megatron's THD RoPE does that from the global ``cu_seqlens``).
``context_parallel_attention``:

1. all-gathers K and V over the CP group (one collective for both) and puts them in the full packed order;
   backward: a reduce-scatter of dK / dV (``cp_comm.gather_cp_sum_grad``), because every rank's queries read
   every rank's keys;
2. runs this rank's query chunks against their causal key prefixes: chunk ``j`` of sequence ``i`` (global
   positions ``[j*c_i, (j+1)*c_i)``) against keys ``[0, (j+1)*c_i)`` of the same sequence, with the causal mask
   aligned to the bottom right (the last query sees every key). Two query segments per sequence and rank; the key
   prefixes are gathered into a packed key tensor of their own (the early chunk's prefix is short: about one
   sequence of K/V per rank in all).

The kernel is a parameter, ``attend(q, k, v, cu_q, cu_k, max_q, max_k, scale)`` -> ``[t_q, np, hn]``, causal
bottom-right per segment (FlashAttention's varlen convention). ``sdpa_causal_segments`` is the reference kernel on
``scaled_dot_product_attention`` (any device, fp32 on CPU), used by the SDPA backend and by the tests.

Memory per rank: the gathered K/V of the micro-batch (``T * 2 * ng * hn`` values, the price of this scheme; ring
attention, as TE's ``cp_comm_type=p2p``, avoids it) plus this rank's ``T / cp`` queries' activations, which is
what CP divides. Compute: ``~T^2 / (2 cp)`` per rank, balanced by the zigzag.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_dppo.packing.context_parallel import check_cp_layout

from .cp_comm import cp_size_rank, gather_cp_sum_grad

Attend = Callable[..., Tensor]


def sdpa_causal_segments(query: Tensor, key: Tensor, value: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                         max_k: int, scale: float) -> Tensor:
    """Reference varlen kernel: query segment ``i`` (``[cu_q[i], cu_q[i+1])`` of ``query [t_q, np, hn]``)
    attends to key segment ``i`` of ``key/value [t_k, ng, hn]`` with the causal mask aligned to the bottom right
    (query ``a`` of ``n_q`` sees keys ``b <= a + n_k - n_q``); needs ``n_k >= n_q``. GQA when ``ng < np``.
    One SDPA call per bucket of key lengths (within a factor 2), never a ``[t_q, t_k]`` mask. A bucket whose
    segments are all square (``n_k == n_q``) is plain top-left causal; the others need a ``[n, Q, K]`` mask,
    which SDPA would keep (as floats) until the backward: ``_MaskedSDPA`` rebuilds it there instead, so only
    q, k and v stay alive between forward and backward."""
    heads, kv_heads = query.size(1), key.size(1)
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of key/value heads {kv_heads}")
    bq, bk = cu_q.tolist(), cu_k.tolist()
    if len(bq) != len(bk):
        raise ValueError(f"cu_q has {len(bq) - 1} segments, cu_k {len(bk) - 1}")
    out = query.new_zeros(query.shape[0], heads, query.shape[2])
    buckets: dict[int, list[tuple[int, int, int, int]]] = {}
    for i in range(len(bq) - 1):
        nq, nk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        if nq == 0:
            continue
        if nk < nq:
            raise ValueError(f"segment {i}: {nq} queries but {nk} keys; bottom-right causal needs keys >= queries")
        buckets.setdefault((nk - 1).bit_length(), []).append((bq[i], nq, bk[i], nk))
    device = query.device
    for bucket in buckets.values():
        col = lambda values: torch.tensor(values, device=device).unsqueeze(1)  # noqa: E731
        q_start, q_len = col([s[0] for s in bucket]), col([s[1] for s in bucket])
        k_start, k_len = col([s[2] for s in bucket]), col([s[3] for s in bucket])
        q_off = torch.arange(max(s[1] for s in bucket), device=device).unsqueeze(0)
        k_off = torch.arange(max(s[3] for s in bucket), device=device).unsqueeze(0)
        q_valid, k_valid = q_off < q_len, k_off < k_len  # [n, Q], [n, K]
        q_index = torch.where(q_valid, q_start + q_off, torch.zeros_like(q_off))
        k_index = torch.where(k_valid, k_start + k_off, torch.zeros_like(k_off))
        q = query[q_index].permute(0, 2, 1, 3)  # [n, np, Q, hn]
        k = key[k_index].permute(0, 2, 1, 3)
        v = value[k_index].permute(0, 2, 1, 3)
        if kv_heads != heads:
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        if all(s[1] == s[3] for s in bucket):  # square segments, left-aligned: top-left causal is exact
            seg = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            seg = _MaskedSDPA.apply(q, k, v, q_len, k_len, scale)
        out = out.index_put((q_index[q_valid],), seg.permute(0, 2, 1, 3)[q_valid])
    return out


def _bottom_right_mask(q_len: Tensor, k_len: Tensor, queries: int, keys: int) -> Tensor:
    """``[n, 1, Q, K]`` True where query ``a`` of a segment may see key ``b``: ``b <= a + n_k - n_q`` and ``b < n_k``;
    padded query rows (beyond ``n_q``) still see key 0, so no row is empty."""
    q_off = torch.arange(queries, device=q_len.device).unsqueeze(0)
    k_off = torch.arange(keys, device=q_len.device).unsqueeze(0)
    mask = (k_off.unsqueeze(1) <= (q_off + k_len - q_len).unsqueeze(2)) & (k_off < k_len).unsqueeze(1)
    return mask.unsqueeze(1)


class _MaskedSDPA(torch.autograd.Function):
    """SDPA with the bottom-right causal mask, the mask rebuilt in the backward (an attention recompute) instead of
    being held, as a float copy, from forward to backward: ``(2cp+1) L^2 / (4 cp^2)`` floats per layer and rank,
    more than the activations CP saves once ``L`` is long."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, q_len: Tensor, k_len: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(q, k, v, q_len, k_len)
        ctx.scale = scale
        mask = _bottom_right_mask(q_len, k_len, q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, q_len, k_len = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
            mask = _bottom_right_mask(q_len, k_len, q.shape[2], k.shape[2])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=ctx.scale)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
        return (*grads, None, None, None)


@functools.lru_cache(maxsize=64)
def _segments(bounds: tuple[int, ...], cp_size: int, cp_rank: int) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """(cu_q, cu_k, key index into the full order, max_q, max_k) of rank ``cp_rank``'s query chunks (cached: every
    layer of a micro-batch asks for the same)."""
    check_cp_layout(bounds, cp_size)
    q_lens, k_lens, key_index = [], [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        c = (end - start) // (2 * cp_size)
        if c == 0:
            continue
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            q_lens.append(c)
            k_lens.append((chunk + 1) * c)
            key_index.append(torch.arange(start, start + (chunk + 1) * c))
    zero = torch.zeros(1, dtype=torch.int32)
    cu_q = torch.cat([zero, torch.tensor(q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, torch.tensor(k_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)])
    index = torch.cat(key_index) if key_index else torch.zeros(0, dtype=torch.long)
    return cu_q, cu_k, index, max(q_lens, default=0), max(k_lens, default=0)


def context_parallel_attention(query: Tensor, key: Tensor, value: Tensor,
                               cu_seqlens_padded: Tensor | Sequence[int], group, *, scale: float,
                               attend: Attend = sdpa_causal_segments) -> Tensor:
    """Causal self-attention of this CP rank's queries ``[t/cp, np, hn]`` over the whole packed sequences
    (module docstring). ``key/value``: this rank's ``[t/cp, ng, hn]``; ``cu_seqlens_padded``: the GLOBAL offsets
    (every length a multiple of ``2 * cp``); ``group``: the CP process group (None or size 1: plain causal
    attention per sequence). Returns ``[t/cp, np, hn]`` in this rank's local order."""
    bounds = tuple(int(b) for b in (cu_seqlens_padded.tolist() if isinstance(cu_seqlens_padded, Tensor)
                                    else cu_seqlens_padded))
    size, rank = cp_size_rank(group)
    cu_q, cu_k, index, max_q, max_k = _segments(bounds, size, rank)
    if query.size(0) * size != bounds[-1]:
        raise ValueError(f"this CP rank holds {query.size(0)} positions, the packed batch {bounds[-1]}: under "
                         f"cp={size} every rank must hold exactly 1/{size} of it")
    kv_heads = key.size(1)
    kv = gather_cp_sum_grad(torch.cat([key, value], dim=1), bounds, group)  # [t, 2 ng, hn], full order
    index = index.to(kv.device)
    kv = kv.index_select(0, index)
    device = query.device
    return attend(query, kv[:, :kv_heads], kv[:, kv_heads:], cu_q.to(device), cu_k.to(device), max_q, max_k,
                  scale)
