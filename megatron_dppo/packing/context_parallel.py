"""Context-parallel (CP) layout of a packed THD micro-batch: which positions each CP rank holds, and back.

Context parallelism splits every packed sequence over the ``cp`` ranks of a CP group. Causal attention costs
more for late positions than for early ones, so a plain split into ``cp`` contiguous pieces would leave the last
rank with most of the work. Megatron-LM and Transformer Engine use the load-balanced ("zigzag") split, and so
does this module, position for position:

* every sequence ``i`` (its PADDED segment ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])``, length ``L_i``)
  is cut into ``2 * cp`` equal chunks of ``c_i = L_i / (2 * cp)`` positions;
* CP rank ``r`` holds chunks ``r`` and ``2*cp - 1 - r`` of every sequence, in that order, sequence after sequence:
  its local tensor has ``T / cp`` positions and the same sequence order as the full one.

This is TE's ``thd_get_partitioned_indices`` (used by Megatron-LM's ``get_batch_on_this_cp_rank`` for THD) and
the layout Megatron's THD RoPE assumes (``rope_utils._get_thd_freqs_on_this_cp_rank``: with the GLOBAL
``cu_seqlens``, rank ``r`` rotates its two chunks by their global positions). Rank ``r``'s causal work is
``(r + 1/2) + (2cp - r - 1/2) = 2cp`` chunk pairs for every ``r``: balanced.

Every padded length must be a multiple of ``2 * cp``; ``thd.thd_pad_multiple(tp, cp, sp)`` (``2 * tp * cp`` when
``cp > 1``) is what the packer and ``build_thd_batch`` pad to, so packed batches always qualify.

Functions (pure torch, no process group): ``cp_partition_indices`` (full -> this rank), ``cp_positions``
(the global position inside its sequence of each local position, for RoPE), ``cp_gather_order`` (ranks'
locals concatenated in rank order -> full order), ``split_for_cp`` / ``merge_from_cp`` (tensors).
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

Tensor = torch.Tensor


def _bounds(cu_seqlens_padded: Tensor | Sequence[int]) -> tuple[int, ...]:
    values = cu_seqlens_padded.tolist() if isinstance(cu_seqlens_padded, Tensor) else list(cu_seqlens_padded)
    return tuple(int(v) for v in values)


def check_cp_layout(cu_seqlens_padded: Tensor | Sequence[int], cp_size: int) -> None:
    """Raise ``ValueError`` unless every padded sequence length is a multiple of ``2 * cp_size``."""
    _check(_bounds(cu_seqlens_padded), cp_size)


def _check(bounds: tuple[int, ...], cp_size: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be an integer >= 1")
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens_padded={list(bounds)} must start at 0 and hold at least one sequence")
    multiple = 2 * cp_size
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        length = end - start
        if length < 0 or (cp_size > 1 and length % multiple):
            raise ValueError(f"sequence {i} has padded length {length}: context parallelism over cp={cp_size} ranks "
                             f"needs every padded length to be a multiple of 2*cp={multiple} (build the batch with "
                             "pad_multiple=packing.thd_pad_multiple(tp, cp, sp))")


@functools.lru_cache(maxsize=64)
def _partition(bounds: tuple[int, ...], cp_size: int, cp_rank: int) -> tuple[Tensor, Tensor]:
    """(indices into the full tensor, global position in its sequence) of rank ``cp_rank``'s positions."""
    _check(bounds, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, {cp_size})")
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    chunk = (torch.tensor(bounds[1:], dtype=torch.long) - starts) // (2 * cp_size)  # c_i per sequence
    pieces, positions = [], []
    for start, c in zip(starts.tolist(), chunk.tolist()):
        if c == 0:
            continue
        local = torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                           torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)])
        positions.append(local)
        pieces.append(local + start)
    if not pieces:
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty
    return torch.cat(pieces), torch.cat(positions)


def cp_partition_indices(cu_seqlens_padded: Tensor | Sequence[int], cp_size: int, cp_rank: int) -> Tensor:
    """Indices (long ``[T / cp]``, CPU) of the full THD tensor's positions that CP rank ``cp_rank`` holds, in its
    local order (module docstring). ``cp_size == 1`` gives ``arange(T)``."""
    return _partition(_bounds(cu_seqlens_padded), cp_size, cp_rank)[0]


def cp_positions(cu_seqlens_padded: Tensor | Sequence[int], cp_size: int, cp_rank: int) -> Tensor:
    """Global position inside its own sequence (long ``[T / cp]``, CPU) of each of rank ``cp_rank``'s local
    positions: the position ids RoPE must see."""
    return _partition(_bounds(cu_seqlens_padded), cp_size, cp_rank)[1]


@functools.lru_cache(maxsize=64)
def _gather_order(bounds: tuple[int, ...], cp_size: int) -> Tensor:
    concatenated = torch.cat([_partition(bounds, cp_size, r)[0] for r in range(cp_size)])
    return torch.argsort(concatenated)


def cp_gather_order(cu_seqlens_padded: Tensor | Sequence[int], cp_size: int) -> Tensor:
    """The permutation (long ``[T]``, CPU) that puts the ranks' local tensors, concatenated in rank order (what an
    all-gather over the CP group returns), back in the full order: ``full = torch.cat(locals)[order]``."""
    return _gather_order(_bounds(cu_seqlens_padded), cp_size)


def split_for_cp(tensor: Tensor, cu_seqlens_padded: Tensor | Sequence[int], cp_size: int, cp_rank: int,
                 dim: int = 0) -> Tensor:
    """Rank ``cp_rank``'s part of ``tensor`` (its ``dim`` runs over the ``T`` packed positions)."""
    index = cp_partition_indices(cu_seqlens_padded, cp_size, cp_rank)
    bounds = _bounds(cu_seqlens_padded)
    if tensor.shape[dim] != bounds[-1]:
        raise ValueError(f"tensor has {tensor.shape[dim]} positions along dim {dim}, cu_seqlens_padded ends at "
                         f"{bounds[-1]}")
    return tensor.index_select(dim, index.to(tensor.device))


def merge_from_cp(parts: Sequence[Tensor], cu_seqlens_padded: Tensor | Sequence[int], dim: int = 0) -> Tensor:
    """The full tensor from every rank's part (``parts[r]`` = ``split_for_cp(full, ..., r)``), the inverse of
    ``split_for_cp``."""
    cp_size = len(parts)
    order = cp_gather_order(cu_seqlens_padded, cp_size)
    joined = torch.cat(list(parts), dim=dim)
    if joined.shape[dim] != order.numel():
        raise ValueError(f"the parts hold {joined.shape[dim]} positions along dim {dim}, cu_seqlens_padded ends "
                         f"at {order.numel()}")
    return joined.index_select(dim, order.to(joined.device))
