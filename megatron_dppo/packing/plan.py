"""What every packer shares: the plan type ``plan[dp_rank][micro_batch] -> [sequence indices]``, the input checks,
the lengths rounded up to the THD padding multiple, the per-sequence cost model ``l + alpha * l**2``, the bin-count
lower bound ``min_bins`` and the measures of a plan (``packing_stats``). docs/algorithms.md (packing)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

Plan = list[list[list[int]]]  # [dp_rank][micro_batch] -> indices into lengths

DEFAULT_ALPHA = 2e-5  # ~1/(12*4096): hidden size 4096


def attention_cost_alpha(hidden_size: int) -> float:
    """Weight of the ``l**2`` term in the per-sequence cost ``l + alpha * l**2``.

    Per layer and token a dense transformer spends ~``24 h**2`` FLOPs in its linear layers (2 FLOPs x ~12 h^2
    weights) and causal attention spends ~``2 h l`` per token (QK^T and AV over half the sequence on average), so
    a sequence costs ``24 h^2 l + 2 h l^2`` = ``24 h^2 (l + l^2 / (12 h))``.
    """
    if hidden_size < 1:
        raise ValueError(f"hidden_size={hidden_size} must be >= 1")
    return 1.0 / (12.0 * hidden_size)


def seq_cost(length: int, alpha: float) -> float:
    """Estimated compute of one sequence, ``l + alpha * l**2`` (what step 3 balances over the ranks)."""
    return length + alpha * length * length


def min_bins(lengths: Sequence[int], capacity: int, dp_size: int = 1) -> int:
    """Lower bound on the bin count of any valid plan: ``ceil(sum(l) / C)`` rounded up to a multiple of ``d``.
    ``sum(l) / (min_bins * C)`` is therefore the best density any packer can reach."""
    bins = max(1, math.ceil(sum(lengths) / capacity))
    return -(-bins // dp_size) * dp_size


# --------------------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------------------


def check_inputs(lengths: Sequence[int], capacity: int, dp_size: int) -> list[int]:
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


def padded_lengths(lengths: list[int], pad_multiple: int) -> list[int]:
    if int(pad_multiple) != pad_multiple or pad_multiple < 1:
        raise ValueError(f"pad_multiple={pad_multiple} must be an integer >= 1")
    if pad_multiple == 1:
        return lengths
    return [-(-x // pad_multiple) * pad_multiple for x in lengths]


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
    sizes = padded_lengths(lengths, pad_multiple)
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
            cst += sum(seq_cost(lengths[i], alpha) for i in mb)
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

