"""Baseline packers with the output type of ``pack_sequences`` (``plan[dp_rank][micro_batch]``), for
``benchmarks/packing.py`` and the packing tests: ``pack_padded`` (pad-to-longest fixed-size micro-batches),
``pack_ffd`` (first-fit decreasing + steps 2b-3 of ``packer.py``) and ``pack_verl_kk`` (verl's Karmarkar-Karp
balancing, faithful, including its possible overfill)."""

from __future__ import annotations

import math
from typing import Sequence

from megatron_dppo.packing.bins import first_fit_decreasing, karmarkar_karp, make_count_multiple
from megatron_dppo.packing.packer import deal_bins
from megatron_dppo.packing.plan import DEFAULT_ALPHA, Plan, check_inputs, padded_lengths


def pack_ffd(
    lengths: Sequence[int], capacity: int, dp_size: int = 1, *, alpha: float = DEFAULT_ALPHA, pad_multiple: int = 1
) -> Plan:
    """Baseline: first-fit decreasing over the whole batch, then the split step (2b) and the dealing (3) of
    ``pack_sequences`` (no step 2a), so it differs from window-greedy only in how the bins are first filled."""
    lengths = check_inputs(lengths, capacity, dp_size)
    sizes = check_inputs(padded_lengths(lengths, pad_multiple), capacity, dp_size)
    bins = make_count_multiple(first_fit_decreasing(sizes, capacity), sizes, dp_size)
    return deal_bins(bins, sizes, dp_size, capacity, alpha=alpha)


def pack_padded(
    lengths: Sequence[int], capacity: int, dp_size: int = 1, micro_batch_size: int | None = None
) -> Plan:
    """Baseline: the classic padded layout. Rank ``r`` takes a contiguous slice of the batch in the given order
    (sizes differ by at most one), cut into micro-batches of ``micro_batch_size`` sequences, each padded to its
    longest sequence. Default ``micro_batch_size = C // max(l)`` (>= 1) so that ``n * L_max <= C`` always holds.

    Ranks can end up with different micro-batch counts (when ``len(lengths)`` is not a multiple of
    ``dp_size * micro_batch_size``); ``packing_stats`` reports it as ``equal_counts=False``.
    """
    lengths = check_inputs(lengths, capacity, dp_size)
    if micro_batch_size is None:
        micro_batch_size = max(1, capacity // max(lengths))
    if int(micro_batch_size) != micro_batch_size or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be an integer >= 1")
    n = len(lengths)
    plan: Plan = []
    start = 0
    for r in range(dp_size):
        stop = start + n // dp_size + (1 if r < n % dp_size else 0)
        idx = list(range(start, stop))
        plan.append([idx[k : k + micro_batch_size] for k in range(0, len(idx), micro_batch_size)])
        start = stop
    return plan


# --------------------------------------------------------------------------------------------------------------
# verl baseline (faithful to verl/utils/seqlen_balancing.py before the strict-cap fix, verl PR 7553)
# --------------------------------------------------------------------------------------------------------------


def pack_verl_kk(lengths: Sequence[int], capacity: int, dp_size: int = 1) -> Plan:
    """Baseline: verl's dynamic batching with sequence balancing, reproduced faithfully.

    1. ``RayPPOTrainer._balance_batch``: KK with ``equal_size=True`` splits the batch over the ``dp_size`` ranks
       (equal sequence counts, balanced token sums). When ``len(lengths)`` is not a multiple of ``dp_size`` (verl
       pads or asserts) we fall back to ``equal_size=False``.
    2. ``rearrange_micro_batches`` on each rank: ``num_micro_batches = ceil(rank tokens / C)``, all-reduced with
       MAX over the DP group, then KK with ``equal_size=False`` into that many micro-batches by token sum.

    ``ceil(total / C)`` is only a lower bound on the number of bins, so a micro-batch CAN exceed ``C``
    (verl PR 7553); we keep that behaviour and ``packing_stats`` counts the overfilled bins.
    """
    lengths = check_inputs(lengths, capacity, dp_size)
    n = len(lengths)
    if dp_size == 1:
        rank_parts = [list(range(n))]
    else:
        rank_parts = karmarkar_karp(lengths, dp_size, equal_size=(n % dp_size == 0))
    num_mb = max(max(1, math.ceil(sum(lengths[i] for i in part) / capacity)) for part in rank_parts)
    plan: Plan = []
    for part in rank_parts:
        local = karmarkar_karp([lengths[i] for i in part], num_mb, equal_size=False)
        plan.append([[part[j] for j in mb] for mb in local])
    return plan

