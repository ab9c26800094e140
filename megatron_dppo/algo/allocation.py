"""Adaptive group sizes: how many completions n_q >= 0 each prompt gets this step, and the weights and baselines
that keep the gradient estimate unbiased with variable n_q (docs/algorithms.md, "Adaptive group sizes").

**The estimator.** Prompt q is skipped (n_q = 0) with probability 1 - pi_q > 0 and otherwise gets n_q >= 2
completions, n_q fixed before generation. Its term is (1/pi_q) (1/n_q) sum_i A_i s_i (s_i the score term of
completion i). With binary rewards and the leave-one-out baseline A_i = r_i - mean_{j != i} r_j (``rloo``),
E[(1/n) sum_i A_i s_i] = grad p_q for EVERY n >= 2 (the baseline is independent of s_i), so the sum over prompts is
unbiased for sum_q grad p_q whatever the allocation, as long as every pi_q > 0. ``expected_gradient_factor`` gives
c_n(p) in E[(1/n) sum_i A_i s_i] = c_n(p) grad p exactly for each estimator:

- ``rloo``: c_n = 1 for every n: unbiased per prompt.
- ``dr_grpo`` (A_i = r_i - mean r): c_n = (n - 1)/n, a known factor: multiplied by n/(n - 1) (``size_correction``)
  it IS rloo. Accepted, corrected.
- ``grpo`` (A_i = (r_i - mean r)/std r): c_n(p) depends on n AND on the unknown p, so the same prompt estimates a
  different multiple of its gradient at each n. With n_q chosen from the prompt's predicted pass rate the step
  estimates sum_q c_{n_q}(p_q) grad p_q, a reweighting that changes with the allocation (not fixed-G GRPO's
  sum_q c_G(p_q) grad p_q); no weight known before generation corrects it. Refused (``check_estimator``).

**The allocation** (``allocate``). From the prompt posterior's Beta(alpha_q, beta_q), the energy curve m_n of the
rloo estimator (``gradient_energy``) and the fitted step cost, per prompt and size n: the noise N_q(n) =
E[m_n(K)], K ~ BetaBinomial(n, alpha_q, beta_q) (= E[p(1-p)]/(n-1) at gamma 1: what the n-sample estimate's
second moment adds), the signal S_q = ``signal`` x N_q(2) (the squared norm of grad p_q, as a multiple of one
sample's noise: a model, fitted offline by ``benchmarks/adaptive_fidelity.py``), and the expected cost
C_q(n) = n (c_gen + c_train P_q(n trained)), where P_q(n trained) is P(the group is mixed) when the zero-variance
filter drops the constant groups (an rloo group with one reward for all has A = 0 exactly: dropping it is exact),
else 1. The step's variance is sum_q [(S_q + N_q(n_q))/pi_q - S_q]; ``allocate`` minimises it at an expected cost
sum_q pi_q C_q(n_q) <= budget by a Lagrange multiplier: for each lambda and prompt, the n in [n_min, n_max] and
pi = clip(sqrt((S + N(n))/(lambda C(n))), 1/max_weight, 1) of least (S + N)/pi + lambda pi C; lambda by bisection.
Every pi_q >= 1/max_weight > 0: the allocation is random wherever it skips, never a deterministic cut.

**Sequential allocation** (``prefix_pair_advantages``): a screen of k, then the rest of G with probability pi_c from
the screen (``screening.continuation_probabilities``: exact, > 0). Plain rloo over the final group is BIASED there
(the group's size depends on its first rewards: optional stopping). The pair form is exact: rloo over G is the
U-statistic (1/(G(G-1))) sum_{i != j} (r_i - r_j) s_i, and pair (i, j) is observed iff the group reached
max(i, j) completions, which given the screen happens with the known probability rho_max(i,j) (1 inside the
screen, pi_c beyond). Weighting each observed pair by 1/rho gives advantages whose estimate is unbiased for the
full-G rloo gradient, and a screen that is not continued still trains its k completions (its pairs have rho = 1).

Plain torch, float64; nothing here imports Megatron. The caller draws on one rank and broadcasts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_choice
from .gradient_energy import beta_binomial_pmf, energy_curve
from .optimal_keep import systematic_sample

ALLOCATION_ESTIMATORS = ("rloo", "dr_grpo")
DRAWS = ("bernoulli", "fixed_size")
BISECTION_STEPS = 100


def check_estimator(estimator: str) -> str:
    """The advantage estimator must be unbiased per prompt at every group size (module docstring)."""
    if estimator == "grpo":
        raise ValueError("adaptive group sizes need an advantage estimator whose expectation does not depend on the "
                         "group size; grpo's std normalisation makes E[(1/n) sum A_i s_i] = c_n(p) grad p with c_n "
                         "depending on n and on the unknown pass rate p, so variable n_q reweights prompts by the "
                         "allocation (refused; valid: rloo, or dr_grpo, corrected by n/(n-1) to rloo)")
    return check_choice("allocation advantage estimator", estimator, ALLOCATION_ESTIMATORS)


def size_correction(estimator: str, sizes: Tensor) -> Tensor:
    """The factor on each group's advantages that makes it rloo: 1 (rloo), n/(n-1) (dr_grpo); float64."""
    n = torch.as_tensor(sizes, dtype=torch.float64)
    if check_estimator(estimator) == "rloo":
        return torch.ones_like(n)
    return n / (n - 1.0)


def expected_gradient_factor(estimator: str, n: int, p: float) -> float:
    """c_n(p) with E[(1/n) sum_i A_i s_i] = c_n(p) grad p for n binary rewards of pass rate p (exact; any
    registered estimator, grpo included): c = E[A_1 | r_1 = 1] - E[A_1 | r_1 = 0], since E[s 1{r=1}] = grad p =
    -E[s 1{r=0}] and s_1 is independent of the other rewards."""
    from .advantages import compute_advantages

    if n < 2 or not 0.0 < p < 1.0:
        raise ValueError(f"expected_gradient_factor needs n >= 2 and 0 < p < 1, got n={n}, p={p}")
    out = 0.0
    for first in (1.0, 0.0):
        for k in range(n):  # successes among the other n - 1
            prob = math.comb(n - 1, k) * p**k * (1 - p) ** (n - 1 - k)
            rewards = torch.tensor([[first] + [1.0] * k + [0.0] * (n - 1 - k)], dtype=torch.float64)
            a1 = float(compute_advantages(rewards, estimator, eps=0.0)[0, 0])
            out += (1.0 if first else -1.0) * prob * a1
    return out


def noise_curves(alpha: Tensor, beta: Tensor, sizes: range, gamma: float = 1.0) -> Tensor:
    """N_q(n) = E[m_n(K)] [B, len(sizes)], K ~ BetaBinomial(n, alpha_q, beta_q), m_n the rloo energy curve."""
    cols = [(beta_binomial_pmf(n, alpha, beta) * energy_curve(n, "rloo", gamma)).sum(-1) for n in sizes]
    return torch.stack(cols, dim=-1)


def mixed_probabilities(alpha: Tensor, beta: Tensor, sizes: range) -> Tensor:
    """P_q(a group of n is not all equal) [B, len(sizes)]."""
    cols = []
    for n in sizes:
        pmf = beta_binomial_pmf(n, alpha, beta)
        cols.append(1.0 - pmf[..., 0] - pmf[..., -1])
    return torch.stack(cols, dim=-1)


@dataclass(frozen=True)
class Allocation:
    """Per prompt [B]: the group size n_q if generated (``sizes``), the probability pi_q it is generated
    (``prob``), its expected cost pi_q C_q(n_q) (``cost``, the caller's units), and the objective's predicted
    variance sum (S + N)/pi - S (``predicted_variance``)."""

    sizes: Tensor
    prob: Tensor
    cost: Tensor
    predicted_variance: float

    @property
    def expected_samples(self) -> float:
        return float((self.sizes.double() * self.prob).sum())


def _check_positive(name: str, value: float, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < minimum:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def allocate(alpha: Tensor, beta: Tensor, *, budget: float, gen_cost: float, train_cost: float, n_min: int = 2,
             n_max: int = 16, max_weight: float = 20.0, signal: float = 1.0, gamma: float = 1.0,
             filtered: bool = True) -> Allocation:
    """The allocation of least predicted variance at expected cost <= ``budget`` (module docstring). Costs are
    per completion (``gen_cost`` generated, ``train_cost`` trained; ``algo.step_cost.StepCost``'s units);
    ``filtered``: constant groups are dropped before training (they cost no training)."""
    a = torch.as_tensor(alpha, dtype=torch.float64).flatten()
    b = torch.as_tensor(beta, dtype=torch.float64).flatten()
    if a.shape != b.shape or not a.numel():
        raise ValueError(f"alpha and beta must be non-empty and of one shape, got {tuple(a.shape)}, {tuple(b.shape)}")
    if isinstance(n_min, bool) or not isinstance(n_min, int) or n_min < 2:
        raise ValueError(f"n_min must be an integer >= 2 (the leave-one-out baseline needs 2), got {n_min!r}")
    if isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < n_min:
        raise ValueError(f"n_max must be an integer >= n_min = {n_min}, got {n_max!r}")
    max_weight = _check_positive("max_weight", max_weight, 1.0)
    signal = _check_positive("signal", signal)
    gen_cost, train_cost = _check_positive("gen_cost", gen_cost), _check_positive("train_cost", train_cost)
    if gen_cost + train_cost <= 0:
        raise ValueError("gen_cost + train_cost must be > 0")
    budget = _check_positive("budget", budget)
    sizes = range(n_min, n_max + 1)
    n = torch.tensor(list(sizes), dtype=torch.float64)
    noise = noise_curves(a, b, sizes, gamma)  # [B, S]
    sig = signal * noise_curves(a, b, range(2, 3), gamma).squeeze(-1)  # S_q
    total = sig.unsqueeze(-1) + noise  # S_q + N_q(n)
    trained = mixed_probabilities(a, b, sizes) if filtered else torch.ones_like(noise)
    C = n * (gen_cost + train_cost * trained)  # [B, S]
    floor = 1.0 / max_weight
    least = (floor * C).min(-1).values.sum()
    if budget < float(least) * (1 - 1e-12):
        raise ValueError(f"budget {budget:.6g} is below the least expected cost {float(least):.6g} (every prompt at "
                         f"pi = 1/max_weight = {floor:.3g} with its cheapest size); raise the budget or max_weight")

    def solve(lam: float):
        pi = (total / (lam * C).clamp(min=1e-300)).sqrt().clamp(floor, 1.0)
        obj = total / pi + lam * pi * C
        j = obj.argmin(-1, keepdim=True)  # ties: the smaller n
        return j.squeeze(-1), pi.gather(-1, j).squeeze(-1), C.gather(-1, j).squeeze(-1)

    j, pi, c = solve(1e-300)
    if float((pi * c).sum()) > budget:
        lo, hi = -300.0, 300.0  # log10 lambda
        for _ in range(BISECTION_STEPS):
            mid = 0.5 * (lo + hi)
            _, p_, c_ = solve(10.0**mid)
            lo, hi = (mid, hi) if float((p_ * c_).sum()) > budget else (lo, mid)
        j, pi, c = solve(10.0**hi)
    t = total.gather(-1, j.unsqueeze(-1)).squeeze(-1)
    return Allocation(sizes=n[j].long(), prob=pi, cost=pi * c, predicted_variance=float((t / pi - sig).sum()))


def uniform_variance(alpha: Tensor, beta: Tensor, n: int, signal: float = 1.0, gamma: float = 1.0) -> float:
    """The objective's predicted variance of every prompt at n completions, pi = 1 (the uniform-G baseline)."""
    return float(noise_curves(alpha, beta, range(n, n + 1), gamma).sum())


def draw_allocation(prob: Tensor, generator: torch.Generator, mode: str = "bernoulli") -> Tensor:
    """Which prompts are generated [B] bool: independent coins, or a systematic sample (fixed_size: exactly
    round(sum pi) or one off, inclusion probabilities exactly pi)."""
    check_choice("allocation draw", mode, DRAWS)
    p = prob.double()
    if mode == "bernoulli":
        return torch.rand(p.shape, generator=generator, dtype=torch.float64) < p
    return systematic_sample(p, generator)


def completion_weights(sizes: Tensor, prob: Tensor, group_size: int) -> Tensor:
    """The per-completion weight G/(n_q pi_q) [B] of a generated prompt: with the loss's fixed denominator of B x G
    sequences (seq_mean aggregations) a prompt's term is then (1/pi_q)(1/n_q) sum_i A_i s_i / B."""
    return group_size / (sizes.double() * prob.double())


def prefix_pair_advantages(rewards: Tensor, sizes: Tensor, reach: Tensor) -> Tensor:
    """Pair-weighted leave-one-out advantages [S, G] of groups observed up to ``sizes`` [S] completions of a
    potential G, where completion m (1-based) was reached with probability ``reach`` [S, G] given what decided the
    size (1 inside the screen). Entry i: (1/(G-1)) sum_{j != i, j < n} (r_i - r_j) / reach[max(i, j)]; 0 beyond n.
    (1/G) sum_i A_i s_i is then unbiased for the full-G rloo term (module docstring)."""
    r = rewards.double()
    S, G = r.shape
    if reach.shape != r.shape or sizes.shape != (S,):
        raise ValueError(f"rewards {tuple(r.shape)}, sizes {tuple(sizes.shape)} and reach {tuple(reach.shape)} "
                         f"must be [S, G], [S], [S, G]")
    idx = torch.arange(G)
    observed = idx[None, :] < sizes[:, None]  # [S, G]
    if bool((reach[observed] <= 0).any()):
        raise ValueError("every observed completion needs a reach probability > 0")
    later = torch.maximum(idx[:, None], idx[None, :])  # [G, G]: max(i, j)
    rho = reach.double()[:, later]  # [S, G, G]
    pair = observed[:, :, None] & observed[:, None, :] & (idx[:, None] != idx[None, :])
    diff = r[:, :, None] - r[:, None, :]
    term = torch.where(pair, diff / rho.clamp(min=1e-300), torch.zeros_like(diff))
    return term.sum(-1) / (G - 1)
