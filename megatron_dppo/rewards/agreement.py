"""How far a reward model agrees with the rule reward: Kendall's tau-b within each group (the reward-hacking alarm).

GRPO and DPPO only use the order of the rewards within a group (the advantages are group-relative), so agreement
is measured there: for each group whose rule rewards and model scores both vary, tau-b over its G completions,

    tau_b = (C - D) / sqrt((n0 - T_x) (n0 - T_y)),   n0 = G (G - 1) / 2,

with C / D the concordant / discordant pairs and T_x / T_y the pairs tied in x / y (ties are the rule: binary
rewards tie a lot, which tau-b, unlike tau-a, accounts for). The metric is the mean over those groups: 1 when the
model orders every group as the rule does, about 0 for a model unrelated to the rule, negative when it prefers
what the rule rejects (a length-biased model on a task whose correct answers are short). A group where either
side is flat has no order to agree with and is left out. ``scipy.stats.kendalltau`` (variant "b") computes the
same number for one group (tested).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def kendall_tau_b(x: Tensor, y: Tensor) -> float:
    """Kendall's tau-b of two 1-D samples; NaN when either is constant (or has fewer than 2 values)."""
    x, y = x.double().flatten(), y.double().flatten()
    if x.numel() != y.numel():
        raise ValueError(f"kendall_tau_b needs samples of one length, got {x.numel()} and {y.numel()}")
    if x.numel() < 2:
        return math.nan
    upper = torch.triu(torch.ones(x.numel(), x.numel(), dtype=torch.bool), diagonal=1)
    dx = torch.sign(x[:, None] - x[None, :])[upper]
    dy = torch.sign(y[:, None] - y[None, :])[upper]
    untied_x, untied_y = float((dx != 0).sum()), float((dy != 0).sum())
    if untied_x == 0 or untied_y == 0:
        return math.nan
    return float((dx * dy).sum()) / math.sqrt(untied_x * untied_y)


def group_agreement(rule: Tensor, model: Tensor) -> tuple[float, int]:
    """(mean within-group tau-b, number of groups it averages) of [B, G] rule rewards and model scores; NaN and 0
    when no group has both varying."""
    if rule.shape != model.shape or rule.dim() != 2:
        raise ValueError(f"rule and model rewards must both be [B, G], got {tuple(rule.shape)} and "
                         f"{tuple(model.shape)}")
    taus = [t for t in (kendall_tau_b(r, m) for r, m in zip(rule, model)) if not math.isnan(t)]
    return (sum(taus) / len(taus) if taus else math.nan), len(taus)
