"""Group-relative advantages, computed on the FULL group before any pruning (docs/algorithms.md, "Objective").

rewards has shape [B, G]: B prompts, G completions each. Estimators (registry ``ADVANTAGE_ESTIMATORS``):

- ``grpo``:    A_i = (r_i - mean(r)) / (std(r) + eps), with the SAMPLE standard deviation
               std(r) = sqrt(sum_j (r_j - mean(r))^2 / (G - 1))  (Bessel-corrected; torch.std's default, as in
               verl and TRL). Needs G >= 2.
- ``dr_grpo``: A_i = r_i - mean(r)  (Dr. GRPO: no std scaling). Any G >= 1.
- ``rloo``:    A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean(r))  (leave-one-out baseline). Needs G >= 2.

For every built-in estimator a group whose rewards are all exactly equal gets A = 0 exactly (not a rounding
residue divided by eps), so zero-variance groups are recognisable by ``A == 0``.

A new estimator is one function ``fn(rewards: Tensor[B, G], eps: float) -> Tensor[B, G]``:

    @register_advantage_estimator("my_estimator", min_group_size=2)
    def my_estimator(rewards, eps): ...

Inputs are validated before the estimator runs: a 2-D non-empty tensor, finite values (the error names the
position and value), and G >= the estimator's ``min_group_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ._checks import check_finite, check_float_tensor
from .registry import Registry

EstimatorFn = Callable[[Tensor, float], Tensor]


@dataclass(frozen=True)
class AdvantageEstimator:
    fn: EstimatorFn
    min_group_size: int


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def register_advantage_estimator(name: str, min_group_size: int = 1, overwrite: bool = False):
    """Decorator: register ``fn(rewards[B, G], eps) -> advantages[B, G]`` under ``name``."""
    if min_group_size < 1:
        raise ValueError(f"min_group_size must be >= 1, got {min_group_size}")

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        ADVANTAGE_ESTIMATORS.register(name, overwrite=overwrite)(AdvantageEstimator(fn, min_group_size))
        return fn

    return decorator


def _zero_constant_groups(rewards: Tensor, advantages: Tensor) -> Tensor:
    """A = 0 exactly for groups whose rewards are all equal. In floating point mean(r) need not equal r even then
    (0.1 + 0.1 + 0.1 = 0.30000000000000004), and dividing that rounding error by std + eps would leave spurious
    non-zero advantages; the built-in estimators are all exactly 0 on such groups in exact arithmetic."""
    constant = (rewards == rewards[..., :1]).all(dim=-1, keepdim=True)
    return advantages.masked_fill(constant, 0.0)


@register_advantage_estimator("grpo", min_group_size=2)
def _grpo(rewards: Tensor, eps: float) -> Tensor:
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, correction=1)  # sample std (Bessel), see module docstring
    return _zero_constant_groups(rewards, (rewards - mean) / (std + eps))


@register_advantage_estimator("dr_grpo", min_group_size=1)
def _dr_grpo(rewards: Tensor, eps: float) -> Tensor:
    return _zero_constant_groups(rewards, rewards - rewards.mean(dim=-1, keepdim=True))


@register_advantage_estimator("rloo", min_group_size=2)
def _rloo(rewards: Tensor, eps: float) -> Tensor:
    g = rewards.shape[-1]
    total = rewards.sum(dim=-1, keepdim=True)
    return _zero_constant_groups(rewards, rewards - (total - rewards) / (g - 1))


def compute_advantages(rewards: Tensor, estimator: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Advantages [B, G] of ``rewards`` [B, G] with the named estimator (see module docstring for formulas).

    Integer/bool rewards are converted to float32; floating rewards keep their dtype.
    Raises ValueError for: a non-2-D or empty input, NaN/inf rewards (naming position and value), G smaller than
    the estimator needs, an unknown estimator (listing the valid ones), a negative or non-finite eps.
    """
    entry = ADVANTAGE_ESTIMATORS.get(estimator)
    rewards = check_float_tensor("rewards", rewards, min_dim=2)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [B, G], got {tuple(rewards.shape)}")
    check_finite("rewards", rewards)
    group_size = rewards.shape[1]
    if group_size < entry.min_group_size:
        raise ValueError(
            f"advantage estimator {estimator!r} needs group size G >= {entry.min_group_size}, got G = {group_size}"
        )
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    advantages = entry.fn(rewards, float(eps))
    if advantages.shape != rewards.shape:
        raise ValueError(
            f"advantage estimator {estimator!r} returned shape {tuple(advantages.shape)}, "
            f"expected {tuple(rewards.shape)}"
        )
    return advantages


def group_advantages(rewards: Tensor, counted: Tensor | None, estimator: str = "grpo", eps: float = 1e-6) -> Tensor:
    """Advantages [B, G] with each group's statistics over its ``counted`` [B, G] members only (the others, e.g.
    episodes whose environment failed, get 0 and take no part in their group's mean or std). A group with fewer
    than max(2, the estimator's minimum) counted members has nothing to compare: all its advantages are 0.
    ``counted`` None or all True: exactly ``compute_advantages``."""
    if counted is None or bool(counted.all()):
        return compute_advantages(rewards, estimator, eps)
    counted = torch.as_tensor(counted, dtype=torch.bool)
    if counted.shape != rewards.shape:
        raise ValueError(f"counted must have the shape of rewards {tuple(rewards.shape)}, got {tuple(counted.shape)}")
    smallest = max(2, ADVANTAGE_ESTIMATORS.get(estimator).min_group_size)
    sizes = counted.sum(dim=1)
    out = torch.zeros(rewards.shape, dtype=rewards.dtype if rewards.is_floating_point() else torch.float32)
    for n in sorted(set(sizes.tolist())):
        if n < smallest:
            continue
        rows = (sizes == n).nonzero().flatten()
        adv = compute_advantages(rewards[rows][counted[rows]].view(len(rows), n), estimator, eps)
        block = out[rows]
        block[counted[rows]] = adv.flatten().to(out.dtype)
        out[rows] = block
    return out


def advantage_estimators() -> list[str]:
    """Names of the registered estimators."""
    return ADVANTAGE_ESTIMATORS.names()
