"""Collectives over the context-parallel (CP) group, with the backward each use needs.

A CP rank holds its zigzag part of every packed sequence (``packing.context_parallel``). Two things need the
positions of the other ranks too, and they differ in what the gradient of the gathered tensor means:

* ``gather_cp_sum_grad`` (attention keys / values): every rank uses the gathered K/V with its OWN queries, so the
  gradient of rank ``s``'s K/V is the SUM over ranks of their gradients of its slice: all-gather forward,
  reduce-scatter backward (``reduce_scatter_tensor`` with NCCL; gloo has none, so all-reduce and keep the slice:
  the same sum).
* ``gather_cp_same_grad`` (per-token log-probs): every rank computes the SAME function of the gathered tensor (the
  micro-batch's loss over all its tokens, so every denominator stays the full-batch one); the gradient is
  identical on all ranks and each keeps its own slice: all-gather forward, slice backward. The parameter
  gradients of the CP ranks are then summed over the data-parallel x context-parallel group, as Megatron's DDP
  does for every model parameter (``dp_cp_group``).

Both return the tensor in the FULL packed order (``cp_gather_order``), on the input's device. ``group`` of
size 1 (or None) returns the input unchanged.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_dppo.packing.context_parallel import cp_gather_order, split_for_cp


def cp_size_rank(group) -> tuple[int, int]:
    """(size, rank) of a CP process group; (1, 0) for None."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def split_to_cp_rank(tensor: Tensor, cu_seqlens_padded: Tensor | Sequence[int], group, dim: int = 0) -> Tensor:
    """This CP rank's part of a full packed tensor (``split_for_cp`` with the group's size and rank)."""
    size, rank = cp_size_rank(group)
    return tensor if size == 1 else split_for_cp(tensor, cu_seqlens_padded, size, rank, dim=dim)


def _all_gather_rank_major(local: Tensor, group) -> Tensor:
    size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=0)


class _GatherSumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, order: Tensor, group) -> Tensor:
        ctx.group, ctx.order, ctx.local_rows = group, order, local.shape[0]
        return _all_gather_rank_major(local, group).index_select(0, order)

    @staticmethod
    def backward(ctx, grad_full: Tensor):
        group, rows = ctx.group, ctx.local_rows
        rank = dist.get_rank(group)
        rank_major = torch.empty_like(grad_full)
        rank_major.index_copy_(0, ctx.order, grad_full)  # full order -> ranks' parts concatenated
        rank_major = rank_major.contiguous()
        if dist.get_backend(group) == "nccl":
            out = torch.empty((rows,) + tuple(grad_full.shape[1:]), dtype=grad_full.dtype, device=grad_full.device)
            dist.reduce_scatter_tensor(out, rank_major, group=group)
            return out, None, None
        dist.all_reduce(rank_major, group=group)  # gloo has no reduce-scatter: the same sum, then our slice
        return rank_major[rank * rows:(rank + 1) * rows].clone(), None, None


class _GatherSameGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, order: Tensor, group) -> Tensor:
        ctx.order, ctx.rank, ctx.local_rows = order, dist.get_rank(group), local.shape[0]
        return _all_gather_rank_major(local, group).index_select(0, order)

    @staticmethod
    def backward(ctx, grad_full: Tensor):
        rank_major = torch.empty_like(grad_full)
        rank_major.index_copy_(0, ctx.order, grad_full)
        rows = ctx.local_rows
        return rank_major[ctx.rank * rows:(ctx.rank + 1) * rows].clone(), None, None


def _order(cu_seqlens_padded, group, device) -> Tensor:
    return cp_gather_order(cu_seqlens_padded, dist.get_world_size(group)).to(device)


def gather_cp_sum_grad(local: Tensor, cu_seqlens_padded: Tensor | Sequence[int], group) -> Tensor:
    """All ranks' parts of a packed tensor (dim 0) in full order; backward: reduce-scatter (module docstring)."""
    if cp_size_rank(group)[0] == 1:
        return local
    return _GatherSumGrad.apply(local, _order(cu_seqlens_padded, group, local.device), group)


def gather_cp_same_grad(local: Tensor, cu_seqlens_padded: Tensor | Sequence[int], group) -> Tensor:
    """All ranks' parts of a packed tensor (dim 0) in full order, for a use that is identical on every CP rank;
    backward: this rank's slice of the (identical) gradient (module docstring)."""
    if cp_size_rank(group)[0] == 1:
        return local
    return _GatherSameGrad.apply(local, _order(cu_seqlens_padded, group, local.device), group)
