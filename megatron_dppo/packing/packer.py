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

Baselines with the same output type, for ``benchmarks/packing.py``:
``pack_padded`` (pad-to-longest fixed-size micro-batches), ``pack_ffd`` (first-fit decreasing + steps 2b-3) and
``pack_verl_kk`` (verl's Karmarkar-Karp balancing, faithful, including its possible overfill).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

Plan = list[list[list[int]]]  # [dp_rank][micro_batch] -> indices into lengths

DEFAULT_CLOSE_FRACTION = 0.02
DEFAULT_ALPHA = 2e-5  # ~1/(12*4096): hidden size 4096
# Step 2a budget (keeps it to a fraction of a second even for ~8k sequences and thousands of bins):
KK_WORK_LIMIT = 500_000  # sequences x bins above which step 2a skips Karmarkar-Karp
REBALANCE_ATTEMPTS = 2  # bin counts tried per call
REPAIR_LIMIT = 256  # most overfull bins a repair takes on
SWAP_CANDIDATES = 64  # roomiest bins searched for a swap partner


def attention_cost_alpha(hidden_size: int) -> float:
    """Weight of the ``l**2`` term in the per-sequence cost ``l + alpha * l**2``.

    Per layer and token a dense transformer spends ~``24 h**2`` FLOPs in its linear layers (2 FLOPs x ~12 h^2
    weights) and causal attention spends ~``2 h l`` per token (QK^T and AV over half the sequence on average), so
    a sequence costs ``24 h^2 l + 2 h l^2`` = ``24 h^2 (l + l^2 / (12 h))``.
    """
    if hidden_size < 1:
        raise ValueError(f"hidden_size={hidden_size} must be >= 1")
    return 1.0 / (12.0 * hidden_size)


# --------------------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------------------


def _check_inputs(lengths: Sequence[int], capacity: int, dp_size: int) -> list[int]:
    if capacity is None or int(capacity) != capacity or capacity <= 0:
        raise ValueError(f"capacity={capacity} must be a positive integer number of tokens")
    if int(dp_size) != dp_size or dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be an integer >= 1")
    lengths = [int(x) for x in lengths]
    if len(lengths) == 0:
        raise ValueError("lengths is empty: there is nothing to pack (need at least one sequence)")
    for i, length in enumerate(lengths):
        if length <= 0:
            raise ValueError(f"lengths[{i}]={length} must be a positive token count")
    longest = max(lengths)
    if longest > capacity:
        i = lengths.index(longest)
        raise ValueError(
            f"sequence {i} has {longest} tokens, longer than the micro-batch capacity {capacity}: "
            f"raise the capacity to >= {longest} or cap the prompt + completion length"
        )
    return lengths


def _padded_lengths(lengths: list[int], pad_multiple: int) -> list[int]:
    if int(pad_multiple) != pad_multiple or pad_multiple < 1:
        raise ValueError(f"pad_multiple={pad_multiple} must be an integer >= 1")
    if pad_multiple == 1:
        return lengths
    return [-(-x // pad_multiple) * pad_multiple for x in lengths]


def _seq_cost(length: int, alpha: float) -> float:
    return length + alpha * length * length


# --------------------------------------------------------------------------------------------------------------
# Step 1: bins under the cap
# --------------------------------------------------------------------------------------------------------------


def window_best_fit(
    lengths: Sequence[int], capacity: int, window: int = 64, close_fraction: float = DEFAULT_CLOSE_FRACTION
) -> list[list[int]]:
    """Step 1: window-greedy best fit. Returns bins (lists of indices), each with sum(l) <= capacity.

    ``close_fraction``: a bin whose free space drops below ``close_fraction * capacity`` is closed after the window
    (no later sequence is offered to it). 0 keeps every bin open until the end (pure best fit over the windows).
    """
    if int(window) != window or window < 1:
        raise ValueError(f"window={window} must be an integer >= 1")
    if not 0.0 <= close_fraction < 1.0:
        raise ValueError(f"close_fraction={close_fraction} must be in [0, 1)")
    close_below = close_fraction * capacity
    bins: list[list[int]] = []
    loads: list[int] = []
    # Open bins sorted by (free space, bin id): bisect finds the tightest bin that fits.
    open_free: list[tuple[int, int]] = []
    for start in range(0, len(lengths), window):
        chunk = sorted(range(start, min(start + window, len(lengths))), key=lambda i: (-lengths[i], i))
        for i in chunk:
            need = lengths[i]
            pos = bisect.bisect_left(open_free, (need, -1))
            if pos < len(open_free):
                free, b = open_free.pop(pos)
            else:
                b = len(bins)
                bins.append([])
                loads.append(0)
                free = capacity
            bins[b].append(i)
            loads[b] += need
            bisect.insort(open_free, (free - need, b))
        # Close nearly full bins: keep only those with enough room to be worth offering to later windows.
        cut = bisect.bisect_left(open_free, (close_below, -1))
        del open_free[:cut]
    return bins


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Classic FFD: sort all sequences longest first, put each into the first bin (by opening order) that fits."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, f in enumerate(free):
            if f >= lengths[i]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


# --------------------------------------------------------------------------------------------------------------
# Step 2: bin count multiple of the DP size
# --------------------------------------------------------------------------------------------------------------


def _split_in_two(items: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Split one bin into two halves with balanced tokens (longest first to the lighter half)."""
    halves: tuple[list[int], list[int]] = ([], [])
    load = [0, 0]
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        h = 0 if load[0] <= load[1] else 1
        halves[h].append(i)
        load[h] += lengths[i]
    return sorted(halves[0]), sorted(halves[1])


def make_count_multiple(bins: list[list[int]], lengths: Sequence[int], multiple: int) -> list[list[int]]:
    """Step 2: split the fullest bins until ``len(bins) % multiple == 0``; pad with empty bins if nothing splits.

    A split only removes sequences from a bin, so no bin grows and the cap is kept.
    """
    bins = [list(b) for b in bins]
    while len(bins) % multiple:
        splittable = [b for b in range(len(bins)) if len(bins[b]) >= 2]
        if not splittable:
            bins.append([])  # fewer sequences than bins needed: zero-token dummy micro-batch (see module doc)
            continue
        b = max(splittable, key=lambda b: (sum(lengths[i] for i in bins[b]), -b))
        first, second = _split_in_two(bins[b], lengths)
        bins[b] = first
        bins.append(second)
    return bins


def balanced_bins(lengths: Sequence[int], k: int, capacity: int) -> list[list[int]] | None:
    """Step 2a: ``k`` bins with balanced token sums that all fit under the cap, or None.

    Candidates: LPT (longest sequence to the lightest bin; O(n log k)), then Karmarkar-Karp, whose differencing
    balances many short sequences to within a few tokens (skipped above ``KK_WORK_LIMIT`` = n * k). A candidate
    with a few bins just over the cap is repaired by single moves / pairwise swaps (:func:`repair_overfull`).
    Used only to reach the bin-count bound when the greedy bins round up past it, where the required fill is
    often above 99.8%: only a near-perfect balance fits.
    """
    if k > len(lengths) or sum(2 * x > capacity for x in lengths) > k:  # two sequences > C/2 never share a bin
        return None
    heap = [(0, b) for b in range(k)]
    lpt: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        lpt[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    candidates = [lpt]
    if len(lengths) * k <= KK_WORK_LIMIT:
        candidates.append(karmarkar_karp(lengths, k, equal_size=False))
    for bins in candidates:
        fixed = repair_overfull(bins, lengths, capacity)
        if fixed is not None and all(fixed):
            return fixed
    return None


def repair_overfull(bins: list[list[int]], lengths: Sequence[int], capacity: int) -> list[list[int]] | None:
    """Bring every bin under the cap without changing the bin count, or return None.

    For the most overfull bin ``o`` (excess ``e``): move one of its sequences ``a`` with ``l_a >= e`` into the
    tightest bin with room for it, or else swap ``a`` with a sequence ``b`` of a bin ``u`` (free ``f``) such that
    ``e <= l_a - l_b <= f``. Each step fixes ``o`` without overfilling ``u``, so it ends after at most one step
    per overfull bin; None as soon as a bin cannot be fixed this way, or when more than ``REPAIR_LIMIT`` bins
    are over (swap partners are searched among the ``SWAP_CANDIDATES`` roomiest bins).
    """
    bins = [list(b) for b in bins]
    loads = [sum(lengths[i] for i in b) for b in bins]
    if sum(load > capacity for load in loads) > REPAIR_LIMIT:
        return None
    while True:
        over = [o for o in range(len(bins)) if loads[o] > capacity]
        if not over:
            return bins
        o = max(over, key=lambda o: (loads[o], -o))
        excess = loads[o] - capacity
        step = None
        for a in sorted(bins[o], key=lambda i: (lengths[i], i)):
            if lengths[a] < excess:
                continue
            room = [u for u in range(len(bins)) if u != o and capacity - loads[u] >= lengths[a]]
            if room:
                step = (a, None, min(room, key=lambda u: (capacity - loads[u], u)))
                break
        if step is None:
            for u in heapq.nsmallest(SWAP_CANDIDATES + 1, range(len(bins)), key=lambda u: (loads[u], u)):
                free = capacity - loads[u]
                if u == o or free <= 0:
                    break
                sizes = sorted((lengths[b], b) for b in bins[u])
                for a in bins[o]:
                    lo, hi = lengths[a] - free, lengths[a] - excess  # l_b must lie in [lo, hi]
                    pos = bisect.bisect_left(sizes, (lo, -1))
                    if lo <= hi and pos < len(sizes) and sizes[pos][0] <= hi:
                        step = (a, sizes[pos][1], u)
                        break
                if step is not None:
                    break
        if step is None:
            return None
        a, b, u = step
        bins[o].remove(a)
        bins[u].append(a)
        loads[o] -= lengths[a]
        loads[u] += lengths[a]
        if b is not None:
            bins[u].remove(b)
            bins[o].append(b)
            loads[u] -= lengths[b]
            loads[o] += lengths[b]


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
    cost = [_seq_cost(x, alpha) for x in lengths]
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
# Public packers
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
    lengths = _check_inputs(lengths, capacity, dp_size)
    if int(micro_batch_multiple) != micro_batch_multiple or micro_batch_multiple < 1:
        raise ValueError(f"micro_batch_multiple={micro_batch_multiple} must be an integer >= 1")
    sizes = _check_inputs(_padded_lengths(lengths, pad_multiple), capacity, dp_size)
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


def pack_ffd(
    lengths: Sequence[int], capacity: int, dp_size: int = 1, *, alpha: float = DEFAULT_ALPHA, pad_multiple: int = 1
) -> Plan:
    """Baseline: first-fit decreasing over the whole batch, then the split step (2b) and the dealing (3) of
    ``pack_sequences`` (no step 2a), so it differs from window-greedy only in how the bins are first filled."""
    lengths = _check_inputs(lengths, capacity, dp_size)
    sizes = _check_inputs(_padded_lengths(lengths, pad_multiple), capacity, dp_size)
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
    lengths = _check_inputs(lengths, capacity, dp_size)
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


def karmarkar_karp(values: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """k-way largest differencing method (Karmarkar-Karp), the algorithm of verl's ``karmarkar_karp``.

    Every item starts as a k-way partial partition (``equal_size``: the sorted items are cut into consecutive
    groups of k, one item per set, so every final set gets the same count). Repeatedly pop the partial partition
    with the largest spread (max set sum - min set sum; ties: larger top set) and the next one, and merge them,
    pairing the heaviest set of one with the lightest set of the other. Returns k sorted lists of indices (some
    empty when ``len(values) < k`` without ``equal_size``; verl asserts ``len(values) >= k`` before calling).

    Same merges as verl up to tie-breaking; sums are numpy vectors and item lists are joined lazily (a tree
    flattened at the end), so a merge costs O(k) instead of copying every item list.
    """
    if int(k) != k or k < 1:
        raise ValueError(f"k={k} must be an integer >= 1")
    if equal_size and len(values) % k:
        raise ValueError(f"equal_size needs len(values)={len(values)} to be a multiple of k={k}")
    n = len(values)
    ordered = sorted(range(n), key=lambda i: (values[i], i))
    groups = [ordered[o : o + k] for o in range(0, n, k)] if equal_size else [[i] for i in ordered]

    # Set members are binary trees over a node pool: node i < n is item i, node j >= n joins left[j], right[j];
    # -1 is the empty set. Every join merges two trees, so fewer than n joins ever happen.
    left = np.full(max(n, 1), -1, dtype=np.int64)
    right = np.full(max(n, 1), -1, dtype=np.int64)
    next_node = n

    def push(sums, nodes, counter):
        order = np.argsort(-sums, kind="stable")
        sums, nodes = sums[order], nodes[order]
        heapq.heappush(heap, (-(int(sums[0]) - int(sums[-1])), -int(sums[0]), counter, sums, nodes))

    heap: list = []
    for counter, g in enumerate(groups):
        sums = np.zeros(k, dtype=np.int64)
        nodes = np.full(k, -1, dtype=np.int64)
        sums[: len(g)] = [values[i] for i in g]
        nodes[: len(g)] = g
        push(sums, nodes, counter)
    counter = len(groups)
    while len(heap) > 1:
        _, _, _, sa, na = heapq.heappop(heap)
        _, _, _, sb, nb = heapq.heappop(heap)
        nb = nb[::-1]
        nodes = np.where(na < 0, nb, na)
        both = (na >= 0) & (nb >= 0)
        joins = int(both.sum())
        if joins:
            ids = np.arange(next_node, next_node + joins)
            left[ids - n] = na[both]
            right[ids - n] = nb[both]
            nodes[both] = ids
            next_node += joins
        push(sa + sb[::-1], nodes, counter)
        counter += 1

    def flatten(node: int) -> list[int]:
        out, stack = [], [node]
        while stack:
            x = stack.pop()
            if x < 0:
                continue
            if x < n:
                out.append(x)
            else:
                stack += (int(left[x - n]), int(right[x - n]))
        return sorted(out)

    return [flatten(int(x)) for x in heap[0][4]]


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
    lengths = _check_inputs(lengths, capacity, dp_size)
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


# --------------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------------


@dataclass
class PackingStats:
    """What a plan costs. ``density`` = real tokens / allocated tokens, where a packed (THD) micro-batch allocates
    ``C`` tokens (docs/algorithms.md: sum(l) / (bins * C)) and a padded micro-batch allocates ``n * max(l)``."""

    num_micro_batches: int
    micro_batches_per_rank: list[int]
    equal_counts: bool
    density: float
    real_tokens: int
    allocated_tokens: int
    rank_tokens: list[int]
    rank_costs: list[float]
    max_rank_tokens: int
    min_rank_tokens: int
    max_rank_cost: float
    min_rank_cost: float
    rank_cost_imbalance: float  # max rank cost / mean rank cost (1.0 = perfect)
    max_bin_tokens: int
    max_bin_fill: float  # max_bin_tokens / C
    overfilled_bins: int  # bins with more than C tokens
    empty_bins: int
    missing: list[int] = field(default_factory=list)  # indices never placed
    duplicated: list[int] = field(default_factory=list)  # indices placed more than once

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def packing_stats(
    plan: Plan,
    lengths: Sequence[int],
    capacity: int,
    *,
    alpha: float = DEFAULT_ALPHA,
    layout: str = "thd",
    pad_multiple: int = 1,
) -> PackingStats:
    """Measure a plan. ``layout="thd"``: bins hold ``sum(l)`` (lengths rounded up to ``pad_multiple``) tokens and
    allocate ``C``; ``layout="padded"``: a bin of ``n`` sequences holds ``n * max(l)`` tokens, its allocation."""
    if layout not in ("thd", "padded"):
        raise ValueError(f"layout={layout!r} must be 'thd' or 'padded'")
    if capacity <= 0:
        raise ValueError(f"capacity={capacity} must be > 0")
    lengths = [int(x) for x in lengths]
    sizes = _padded_lengths(lengths, pad_multiple)
    seen = [0] * len(lengths)
    rank_tokens, rank_costs, bin_tokens = [], [], []
    allocated = 0
    empty = 0
    for rank in plan:
        tok, cst = 0, 0.0
        for mb in rank:
            for i in mb:
                if not 0 <= i < len(lengths):
                    raise ValueError(f"plan holds index {i}, outside 0..{len(lengths) - 1}")
                seen[i] += 1
            real = sum(lengths[i] for i in mb)
            if layout == "padded":
                held = len(mb) * max((lengths[i] for i in mb), default=0)
                allocated += held
            else:
                held = sum(sizes[i] for i in mb)
                allocated += capacity
            bin_tokens.append(held)
            empty += len(mb) == 0
            tok += real
            cst += sum(_seq_cost(lengths[i], alpha) for i in mb)
        rank_tokens.append(tok)
        rank_costs.append(cst)
    counts = [len(rank) for rank in plan]
    real_total = sum(rank_tokens)
    mean_cost = sum(rank_costs) / max(1, len(rank_costs))
    return PackingStats(
        num_micro_batches=sum(counts),
        micro_batches_per_rank=counts,
        equal_counts=len(set(counts)) <= 1,
        density=real_total / allocated if allocated else 0.0,
        real_tokens=real_total,
        allocated_tokens=allocated,
        rank_tokens=rank_tokens,
        rank_costs=rank_costs,
        max_rank_tokens=max(rank_tokens, default=0),
        min_rank_tokens=min(rank_tokens, default=0),
        max_rank_cost=max(rank_costs, default=0.0),
        min_rank_cost=min(rank_costs, default=0.0),
        rank_cost_imbalance=(max(rank_costs) / mean_cost) if mean_cost > 0 else 1.0,
        max_bin_tokens=max(bin_tokens, default=0),
        max_bin_fill=max(bin_tokens, default=0) / capacity,
        overfilled_bins=sum(t > capacity for t in bin_tokens),
        empty_bins=empty,
        missing=[i for i, c in enumerate(seen) if c == 0],
        duplicated=[i for i, c in enumerate(seen) if c > 1],
    )


def min_bins(lengths: Sequence[int], capacity: int, dp_size: int = 1) -> int:
    """Lower bound on the bin count of any valid plan: ``ceil(sum(l) / C)`` rounded up to a multiple of ``d``.
    ``sum(l) / (min_bins * C)`` is therefore the best density any packer can reach."""
    bins = max(1, math.ceil(sum(lengths) / capacity))
    return -(-bins // dp_size) * dp_size
