"""Steps 1 and 2 of Dense Prompt Packing (``packer.py``): sequences into bins under the token cap ``C``, and the
bin count made a multiple of the DP size. Window-greedy best fit (step 1) and classic first-fit decreasing (the
``pack_ffd`` baseline); splitting the fullest bins (2b); balanced bins at the lower bound with an over-cap repair
(2a), and the k-way Karmarkar-Karp partition it tries (also verl's balancing in ``baselines.pack_verl_kk``).
Bins are lists of indices into ``lengths``; every function is deterministic (ties broken by index)."""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence

import numpy as np

DEFAULT_CLOSE_FRACTION = 0.02
# Step 2a budget (keeps it to a fraction of a second even for ~8k sequences and thousands of bins):
KK_WORK_LIMIT = 500_000  # sequences x bins above which step 2a skips Karmarkar-Karp
REPAIR_LIMIT = 256  # most overfull bins a repair takes on
SWAP_CANDIDATES = 64  # roomiest bins searched for a swap partner


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
# k-way partition (step 2a; verl's balancing, faithful to verl/utils/seqlen_balancing.py)
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

