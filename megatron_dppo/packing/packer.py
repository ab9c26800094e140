"""Dense Prompt Packing: put whole sequences into token-capped micro-batches and deal them to DP ranks.

docs/algorithms.md (packing). Input: per-sequence token counts ``l_s`` (prompt + completion), a token capacity ``C`` per
micro-batch and the data-parallel size ``d``. Output: a *plan* ``plan[dp_rank][micro_batch] -> [sequence indices]``.

``pack_sequences`` (the default packer) runs three steps:

1. **Window-greedy best fit.** Walk the sequences in windows of ``W``. Inside a window place each sequence,
   longest first, into the open bin with the least free space that still fits it (best fit); open a new bin when
   none fits. After each window, close bins whose free space is below ``close_fraction * C``; the other bins stay
   open and the next window keeps filling them. Windows keep the plan local in the input order (a prompt's group
   stays in few bins) and keep the work near-linear (sorting within windows, bisect over the open bins).
2. **Equal micro-batch count per rank.** Megatron's pipeline schedule runs the same number of micro-batches on
   every DP rank, so the bin count must be a multiple of ``d``. No plan can use fewer than
   ``min_bins = ceil(sum(l) / C)`` rounded up to that multiple. (2a) When the greedy count rounds up PAST that
   bound (one bin too many at d = 8 costs seven more), try the bound directly: ``min_bins`` bins with balanced
   token sums (LPT, then Karmarkar-Karp), a few over-cap bins repaired by moves / pairwise swaps, kept only if
   every bin then fits under ``C``. With many short sequences this succeeds even at 99.9% fill, where best fit
   cannot. (2b) Otherwise raise the count to the multiple by splitting the fullest bins in two (a split never
   grows a bin, so the cap still holds). With fewer sequences than needed bins, the remaining bins are EMPTY lists:
   the engine must turn an empty micro-batch into a zero-token dummy micro-batch (``build_thd_batch([], ...)``),
   which runs the same collectives with zero loss weight, so no rank can hang. This only happens when
   ``len(lengths) < d`` or when every bin already holds a single sequence.
3. **Cost-balanced dealing.** Estimated compute of a sequence is ``l + alpha * l**2`` (linear layers plus the
   causal attention term; for a dense transformer with hidden size ``h`` the FLOP ratio gives
   ``alpha ~= 1 / (12 h)``, see :func:`attention_cost_alpha`). Bins are dealt longest-processing-time first to the
   cheapest rank that still has room for a bin, then single sequences move from the most to the least loaded rank
   while that lowers the larger of the two loads and the receiving bin stays within ``C``.

Every step is deterministic (ties broken by index), so all ranks compute the same plan from the same lengths.

Invariants (tests/unit/test_packing.py): no bin exceeds ``C``; every index appears exactly once; every rank has the
same number of micro-batches. Density = sum(l) / (bins * C).

Where the steps live: ``bins.py`` (steps 1 and 2), this module (step 3 and ``pack_sequences``), ``plan.py``
(the plan type, input checks, cost model, ``min_bins``, ``packing_stats``); the baselines with the same output type
for ``benchmarks/packing.py`` (``pack_padded``, ``pack_ffd``, ``pack_verl_kk``) are in ``baselines.py``.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from megatron_dppo.packing.bins import DEFAULT_CLOSE_FRACTION, balanced_bins, make_count_multiple, window_best_fit
from megatron_dppo.packing.plan import DEFAULT_ALPHA, Plan, check_inputs, min_bins, padded_lengths, seq_cost

REBALANCE_ATTEMPTS = 2  # step 2a: bin counts below the greedy count tried per call


# --------------------------------------------------------------------------------------------------------------
# Step 3: deal bins to ranks
# --------------------------------------------------------------------------------------------------------------


def deal_bins(
    bins: list[list[int]],
    lengths: Sequence[int],
    dp_size: int,
    capacity: int,
    alpha: float = DEFAULT_ALPHA,
    refine: bool = True,
) -> Plan:
    """Step 3: give each rank ``len(bins) / dp_size`` bins, balancing the cost ``sum(l + alpha l^2)`` per rank.

    LPT dealing (most expensive bin first, to the cheapest rank that still has a free slot), then, if ``refine``,
    move single sequences from the most to the least expensive rank while that strictly lowers the larger of the
    two costs, the receiving bin stays within ``capacity`` and the giving bin keeps at least one sequence.
    """
    if len(bins) % dp_size:
        raise ValueError(f"{len(bins)} bins cannot be dealt evenly to dp_size={dp_size}")
    per_rank = len(bins) // dp_size
    cost = [seq_cost(x, alpha) for x in lengths]
    bin_cost = [sum(cost[i] for i in b) for b in bins]
    order = sorted(range(len(bins)), key=lambda b: (-bin_cost[b], b))
    plan: Plan = [[] for _ in range(dp_size)]
    rank_cost = [0.0] * dp_size
    heap = [(0.0, r) for r in range(dp_size)]  # (cost, rank) of ranks with a free slot
    for b in order:
        c, r = heapq.heappop(heap)
        plan[r].append(list(bins[b]))
        rank_cost[r] = c + bin_cost[b]
        if len(plan[r]) < per_rank:
            heapq.heappush(heap, (rank_cost[r], r))
    if refine and dp_size > 1:
        _refine_by_moves(plan, lengths, cost, rank_cost, capacity)
    for rank in plan:
        for mb in rank:
            mb.sort()
    return plan


def _refine_by_moves(plan: Plan, lengths: Sequence[int], cost: list[float], rank_cost: list[float], capacity: int):
    """Local search: move one sequence from the max-cost rank to the min-cost rank while it helps."""
    n = sum(len(mb) for rank in plan for mb in rank)
    for _ in range(4 * n):
        hi = max(range(len(plan)), key=lambda r: (rank_cost[r], -r))
        lo = min(range(len(plan)), key=lambda r: (rank_cost[r], r))
        gap = rank_cost[hi] - rank_cost[lo]
        if gap <= 0:
            return
        lo_free = [capacity - sum(lengths[i] for i in mb) for mb in plan[lo]]
        tb = max(range(len(lo_free)), key=lambda b: (lo_free[b], -b))  # the roomiest bin: keeps bins even
        best = None  # (new max of the pair, sequence, source bin, target bin)
        for sb, mb in enumerate(plan[hi]):
            if len(mb) < 2:
                continue
            for i in mb:
                if cost[i] >= gap or lengths[i] > lo_free[tb]:  # would not lower max(hi, lo), or fits nowhere
                    continue
                new_max = max(rank_cost[hi] - cost[i], rank_cost[lo] + cost[i])
                if best is None or (new_max, i) < (best[0], best[1]):
                    best = (new_max, i, sb, tb)
        if best is None:
            return
        _, i, sb, tb = best
        plan[hi][sb].remove(i)
        plan[lo][tb].append(i)
        rank_cost[hi] -= cost[i]
        rank_cost[lo] += cost[i]


# --------------------------------------------------------------------------------------------------------------
# The default packer: steps 1-3
# --------------------------------------------------------------------------------------------------------------


def pack_sequences(
    lengths: Sequence[int],
    capacity: int,
    dp_size: int = 1,
    window: int = 64,
    *,
    close_fraction: float = DEFAULT_CLOSE_FRACTION,
    alpha: float = DEFAULT_ALPHA,
    pad_multiple: int = 1,
    micro_batch_multiple: int = 1,
    rebalance: bool = True,
) -> Plan:
    """Dense Prompt Packing: window-greedy best fit, equal micro-batch count per rank, cost-balanced dealing.

    Args:
        lengths: tokens per sequence (prompt + completion).
        capacity: hard token cap ``C`` per micro-batch.
        dp_size: data-parallel size ``d``; every rank gets the same number of micro-batches.
        window: window size ``W`` of the greedy pass.
        close_fraction: close a bin once its free space is below ``close_fraction * C`` (default 0.02).
        alpha: weight of the attention term in the cost ``l + alpha * l**2`` (see :func:`attention_cost_alpha`).
        pad_multiple: pack the lengths rounded up to this multiple (THD per-sequence padding, see
            ``thd_pad_multiple``), so the padded micro-batch ``cu_seqlens_padded[-1]`` also stays <= C.
        micro_batch_multiple: make the per-rank micro-batch count a multiple of this too (e.g. the pipeline size
            for an interleaved schedule). 1 = no constraint.
        rebalance: step 2a (module docstring): when the greedy bins round up past the bound, try balanced bins
            nearer the bound (LPT, then Karmarkar-Karp, plus a swap repair), kept only if every bin fits under C.

    Returns:
        ``plan[dp_rank][micro_batch]`` -> sorted indices into ``lengths``. A micro-batch is an empty list only when
        there are fewer sequences than micro-batches needed (see the module docstring: zero-token dummy).

    Raises:
        ValueError: empty ``lengths``, a non-positive length, ``capacity <= 0``, ``dp_size < 1``, or a sequence
            (after padding) longer than ``capacity`` (the message names both numbers).
    """
    lengths = check_inputs(lengths, capacity, dp_size)
    if int(micro_batch_multiple) != micro_batch_multiple or micro_batch_multiple < 1:
        raise ValueError(f"micro_batch_multiple={micro_batch_multiple} must be an integer >= 1")
    sizes = check_inputs(padded_lengths(lengths, pad_multiple), capacity, dp_size)
    multiple = dp_size * micro_batch_multiple
    bins = window_best_fit(sizes, capacity, window=window, close_fraction=close_fraction)
    if rebalance:
        # Step 2a: the greedy count rounded up to the multiple can exceed the bound min_bins (one extra bin at
        # dp=8 costs 7 more). Try balanced bins at the counts below it, from the roomiest down, at most
        # REBALANCE_ATTEMPTS of them; stop at the first failure (fewer bins only get harder).
        rounded = -(-len(bins) // multiple) * multiple
        counts = range(rounded - multiple, min_bins(sizes, capacity, multiple) - 1, -multiple)
        for k in list(counts)[:REBALANCE_ATTEMPTS]:
            balanced = balanced_bins(sizes, k, capacity)
            if balanced is None:
                break
            bins = balanced
    bins = make_count_multiple(bins, sizes, multiple)
    return deal_bins(bins, sizes, dp_size, capacity, alpha=alpha)

