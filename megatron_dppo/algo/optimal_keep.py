"""Variance-optimal keep probabilities for Horvitz-Thompson pruning (docs/algorithms.md, "Variance-optimal keep
probabilities").

With independent keep decisions and weights 1/pi, the estimate sum_kept g_i / pi_i of sum_i g_i has variance
sum_i (1 - pi_i)/pi_i * |g_i|^2. At a fixed expected budget sum_i pi_i = K, with bounds lo_i <= pi_i <= 1, the
minimiser is

    pi_i = clip(c * s_i, lo_i, 1),   c >= 0 chosen so that sum_i pi_i = K     ("water-filling")

where s_i = |g_i| (Lagrange: (1 - pi)/pi * s^2 + lambda * pi is minimised at pi = s / sqrt(lambda), then clipped).
Any non-negative proxy s_i for |g_i| keeps the estimate unbiased as long as pi_i > 0 wherever g_i can be
non-zero; a better proxy only lowers the variance. A unit with s_i = 0 and floor lo_i = 0 gets pi_i = 0: that is
exact (not merely unbiased) only when its gradient is exactly zero, which the caller decides (the floor).

Everything here is plain torch, float64, vectorised over leading dimensions (one independent decision per
leading index, units along the last dimension), and draws only from the ``torch.Generator`` passed in.
"""
from __future__ import annotations

import torch
from torch import Tensor

BISECTION_STEPS = 200  # halves [0, c_max] 200 times: c to float64 resolution at any score range


def water_fill(score: Tensor, budget: Tensor | float, floor: Tensor | float = 0.0,
               forced: Tensor | None = None) -> Tensor:
    """Keep probabilities pi [..., N] (float64): ``forced`` units 1; the others clip(c * score, floor, 1) with c
    per leading index such that sum pi = ``budget`` (the expected kept count, forced units included).

    Units with score 0 have no proxy signal. Those with floor 0 are ones the caller declared gradient-free: they
    get pi = 0. Those with a positive floor may carry gradient the proxy cannot see (a prompt whose last group had
    one reward for all; a completion with A = 0 under a KL term): they get their floor, and when the budget is more
    than the positive scores can take (all of them at 1), the rest is spread evenly over them (water-filling with
    equal scores), so the budget is spent. When the budget is below what the forced units and the floors already
    take, every free unit sits at its floor and sum pi > budget; when even all eligible units at 1 take less, sum pi
    < budget. (A zero pruning rate is "keep everything" whatever the scores: the caller's rule, not this one's.)
    """
    s = score.double()
    if bool((s < 0).any()) or not bool(torch.isfinite(s).all()):
        raise ValueError("water_fill needs finite scores >= 0")
    lo = torch.as_tensor(floor, dtype=torch.float64).expand_as(s)
    if bool(((lo < 0) | (lo > 1)).any()):
        raise ValueError("water_fill floors must lie in [0, 1]")
    forced = torch.zeros_like(s, dtype=torch.bool) if forced is None else forced.expand_as(s)
    budget = torch.as_tensor(budget, dtype=torch.float64)
    budget = budget.expand(s.shape[:-1]).unsqueeze(-1) if budget.dim() < s.dim() else budget
    free = ~forced
    remaining = budget - forced.sum(-1, keepdim=True).double()
    pi = _fill(s, lo, free, remaining)
    # budget left over once every positive score is at 1: spread over the zero-score units that may carry gradient
    blind = free & (s == 0) & (lo > 0)
    leftover = remaining - torch.where(free, pi, 0.0).sum(-1, keepdim=True)
    if bool((blind.any(-1, keepdim=True) & (leftover > 1e-12)).any()):
        extra = _fill(blind.double(), lo, blind, leftover + torch.where(blind, lo, 0.0).sum(-1, keepdim=True))
        pi = torch.where(blind, extra, pi)
    return torch.where(free, pi, 1.0)


def _fill(s: Tensor, lo: Tensor, free: Tensor, remaining: Tensor, weight: Tensor | None = None) -> Tensor:
    """clip(c * s, lo, 1) on the ``free`` units with the largest c such that their sum (weighted by ``weight``,
    default 1) stays <= ``remaining`` (bisection; c = 0 when the floors alone exceed it)."""

    def clip(c: Tensor) -> Tensor:  # lo <= 1
        return torch.maximum(torch.clamp(c * s, max=1.0), lo)

    w = torch.ones_like(s) if weight is None else weight
    # c_max: every free unit with a positive score reaches 1
    smallest = torch.where(free & (s > 0), s, torch.full_like(s, torch.inf)).amin(-1, keepdim=True)
    c_max = torch.where(torch.isfinite(smallest), 1.0 / smallest, torch.zeros_like(smallest))
    low, high = torch.zeros_like(c_max), c_max.clone()
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (low + high)
        too_much = torch.where(free, w * clip(mid), 0.0).sum(-1, keepdim=True) > remaining
        high = torch.where(too_much, mid, high)
        low = torch.where(too_much, low, mid)
    return clip(low)


def cost_water_fill(score: Tensor, cost: Tensor, budget: Tensor | float, floor: Tensor | float = 0.0,
                    forced: Tensor | None = None) -> Tensor:
    """Cost-aware keep probabilities pi [..., N] (float64): with units of unequal cost c_i (an episode of 8 turns
    costs more than one of 1), minimise sum (1 - pi_i)/pi_i * s_i^2 at a fixed EXPECTED COST sum pi_i c_i =
    ``budget``. Lagrange gives pi_i = s_i / sqrt(lambda c_i), so

        pi_i = clip(t * s_i / sqrt(c_i), lo_i, 1),   t >= 0 chosen so that sum pi_i c_i = budget

    (keep probability proportional to signal over the square root of cost). ``forced`` units are kept (pi = 1)
    and their cost counts in the budget. Zero-score units behave as in ``water_fill``: pi = 0 with floor 0, their
    floor otherwise, plus their share (proportional to 1 / sqrt(c)) of any budget the positive scores cannot take.
    With equal costs this is ``water_fill`` with the budget divided by that cost. Any pi > 0 wherever the gradient
    can be non-zero keeps the Horvitz-Thompson estimate unbiased; the costs only move the variance."""
    c = cost.double()
    if bool((c <= 0).any()) or not bool(torch.isfinite(c).all()):
        raise ValueError("cost_water_fill needs finite costs > 0")
    s = score.double()
    if bool((s < 0).any()) or not bool(torch.isfinite(s).all()):
        raise ValueError("cost_water_fill needs finite scores >= 0")
    lo = torch.as_tensor(floor, dtype=torch.float64).expand_as(s)
    if bool(((lo < 0) | (lo > 1)).any()):
        raise ValueError("cost_water_fill floors must lie in [0, 1]")
    forced = torch.zeros_like(s, dtype=torch.bool) if forced is None else forced.expand_as(s)
    budget = torch.as_tensor(budget, dtype=torch.float64)
    budget = budget.expand(s.shape[:-1]).unsqueeze(-1) if budget.dim() < s.dim() else budget
    free = ~forced
    remaining = budget - torch.where(forced, c, 0.0).sum(-1, keepdim=True)
    root = c.sqrt()
    pi = _fill(s / root, lo, free, remaining, weight=c)
    blind = free & (s == 0) & (lo > 0)
    leftover = remaining - torch.where(free, pi * c, 0.0).sum(-1, keepdim=True)
    if bool((blind.any(-1, keepdim=True) & (leftover > 1e-12)).any()):
        extra = _fill(torch.where(blind, 1.0 / root, 0.0), lo, blind,
                      leftover + torch.where(blind, lo * c, 0.0).sum(-1, keepdim=True), weight=c)
        pi = torch.where(blind, extra, pi)
    return torch.where(free, pi, 1.0)


def systematic_sample(pi: Tensor, generator: torch.Generator) -> Tensor:
    """A fixed-size sample with inclusion probabilities exactly ``pi`` [..., N]: the units in a uniformly random
    order, each owning an interval of length pi_i on [0, sum pi), and the points u, u + 1, u + 2, ... with one
    u ~ U[0, 1) per leading index. An interval of length pi_i <= 1 holds a point with probability exactly pi_i,
    and the sample holds floor(sum pi) or ceil(sum pi) units (exactly K when sum pi = K is an integer)."""
    p = pi.double()
    order = torch.argsort(torch.rand(p.shape, generator=generator, dtype=torch.float64), dim=-1)
    u = torch.rand((*p.shape[:-1], 1), generator=generator, dtype=torch.float64)
    p_sorted = p.gather(-1, order)
    end = torch.cumsum(p_sorted, dim=-1)
    start = end - p_sorted
    hit_sorted = torch.floor(end - u) > torch.floor(start - u)
    keep = torch.zeros_like(hit_sorted).scatter(-1, order, hit_sorted)
    return (keep | (p >= 1.0)) & (p > 0.0)  # exact ends: round-off in the cumulative sum never flips them


def predicted_relative_variance(pi: Tensor, score: Tensor) -> float:
    """sum (1 - pi)/pi * s^2 / sum s^2 over the units with s > 0 (the variance the estimate would have, relative to
    the squared norm of the full sum, if the unit gradients were orthogonal with norms s). NaN if every s is 0."""
    s2 = score.double() ** 2
    p = pi.double()
    positive = s2 > 0
    if not bool(positive.any()):
        return float("nan")
    ratio = torch.where(positive, (1.0 - p) / p.clamp(min=1e-300), torch.zeros_like(p))
    return float((ratio * s2).sum() / s2.sum())


def completion_scores(advantages: Tensor, lengths: Tensor | None, exponent: float,
                      prompt_prob: Tensor | None = None) -> Tensor:
    """The completion-level proxy for a unit's gradient norm: |A| * L^exponent / pi_q (float64, [..., B, G]).

    Dividing by the prompt's keep probability pi_q [..., B] makes the allocation optimal for the estimate as it is
    trained, where a completion of a prompt kept with pi_q carries the weight 1/pi_q too."""
    s = advantages.double().abs()
    if lengths is not None and exponent != 0.0:
        s = s * lengths.double().clamp(min=1.0) ** exponent
    if prompt_prob is not None:
        s = s / prompt_prob.double().clamp(min=1e-300).unsqueeze(-1)
    return s
