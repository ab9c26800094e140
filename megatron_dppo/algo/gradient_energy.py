"""The expected squared gradient norm ("energy") of one prompt's group, as a function of its rewards
(docs/algorithms.md, "Gradient energy of a group").

On policy (ratio 1) and without a KL term, a group's gradient is g = (1/G) sum_i A_i s_i, with s_i the score term
of completion i. If the score terms are uncorrelated and |s_i| grows with how rare the completion's outcome is,
|s_i| ~ |Z_i|^(gamma - 1) with Z_i the group's standardised reward (Bessel std), then

    m(r) = (1/G^2) sum_i A_i^2 |Z_i|^(2 (gamma - 1))        (0 for a group whose rewards are all equal)

is E|g|^2 up to a constant that is the same for every prompt. gamma = 1 is the homoscedastic case; under
std-normalised GRPO (A = Z) the per-completion gradient norm then grows like |A|^gamma, which is what
``benchmarks/gradient_fidelity.py --real`` fits (coefficient of log|A| in log|g_i|; 1-2 on the quickstart).

The advantages come from the estimator's own function (``advantages.compute_advantages``, eps = 0), so the curve
follows whatever the estimator does with the rewards' scale: std-GRPO's m is scale-free, Dr.GRPO's and RLOO's grow
like the square of the rewards' spread.

For binary rewards the energy depends only on k = sum r: ``energy_curve`` enumerates m_G(k), k = 0..G, exactly, and
``expected_energy`` averages it over a beta-binomial predictive distribution of k. Plain torch, float64.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_finite, check_float_tensor
from .advantages import compute_advantages


def check_gamma(gamma: float) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or gamma < 0:
        raise ValueError(f"gamma (the exponent of |A| in a completion's gradient norm) must be a finite number "
                         f">= 0, got {gamma!r}")
    return float(gamma)


def group_energy(rewards: Tensor, estimator: str = "grpo", gamma: float = 1.0) -> Tensor:
    """m(r) for each group of ``rewards`` [..., G] (float64 [...]); 0 for groups whose rewards are all equal."""
    gamma = check_gamma(gamma)
    rewards = check_float_tensor("rewards", rewards, min_dim=1)
    check_finite("rewards", rewards)
    r = rewards.detach().double()
    shape, G = r.shape[:-1], r.shape[-1]
    if G < 2:
        raise ValueError(f"group energy needs group size G >= 2, got G = {G}")
    flat = r.reshape(-1, G)
    A = compute_advantages(flat, estimator, eps=0.0).double()
    constant = (flat == flat[:, :1]).all(dim=1, keepdim=True)
    centred = flat - flat.mean(dim=1, keepdim=True)
    std = flat.std(dim=1, keepdim=True, correction=1)
    Z = torch.where(constant, torch.zeros_like(flat), centred / torch.where(constant, torch.ones_like(std), std))
    rarity = torch.where(Z != 0, Z.abs() ** (2.0 * (gamma - 1.0)), torch.zeros_like(Z))
    m = (A * A * rarity).sum(dim=1) / G**2
    return m.masked_fill(constant.squeeze(1), 0.0).reshape(shape)


def energy_curve(group_size: int, estimator: str = "grpo", gamma: float = 1.0) -> Tensor:
    """m_G(k) for k = 0..G successes among G binary rewards (float64 [G + 1]; m_G(0) = m_G(G) = 0)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an integer >= 2, got {group_size!r}")
    k = torch.arange(group_size + 1)
    rewards = (torch.arange(group_size)[None, :] < k[:, None]).double()  # row k: k ones, then zeros
    return group_energy(rewards, estimator, gamma)


def beta_binomial_pmf(n: int, alpha: Tensor, beta: Tensor) -> Tensor:
    """P(K = k), k = 0..n, for K ~ BetaBinomial(n, alpha, beta); alpha, beta [...] > 0 -> float64 [..., n + 1]."""
    a = torch.as_tensor(alpha, dtype=torch.float64)
    b = torch.as_tensor(beta, dtype=torch.float64)
    if bool(((a <= 0) | (b <= 0) | ~torch.isfinite(a) | ~torch.isfinite(b)).any()):
        raise ValueError("beta_binomial_pmf needs finite alpha, beta > 0")
    a, b = torch.broadcast_tensors(a, b)
    k = torch.arange(n + 1, dtype=torch.float64)
    a, b = a.unsqueeze(-1), b.unsqueeze(-1)
    log_choose = math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    lbeta = lambda x, y: torch.lgamma(x) + torch.lgamma(y) - torch.lgamma(x + y)  # noqa: E731
    return torch.exp(log_choose + lbeta(k + a, n - k + b) - lbeta(a, b))


def expected_energy(alpha: Tensor, beta: Tensor, curve: Tensor) -> Tensor:
    """E[m_G(K)] for K ~ BetaBinomial(G, alpha, beta), with ``curve`` = m_G(0..G) (float64 [...])."""
    G = curve.numel() - 1
    return (beta_binomial_pmf(G, alpha, beta) * curve.double()).sum(-1)
