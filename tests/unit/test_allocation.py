"""Adaptive group sizes (``algo.allocation``): the estimate is unbiased under the allocation, and the same check
fails for the estimators and allocations that are not.

The exact problem: each prompt q is a categorical policy over V outcomes (logits theta_q), the reward is 1 for
outcome 0, so J = sum_q p_q with p_q = softmax(theta_q)_0 and grad J (w.r.t. every theta_q) is known exactly:
grad_q p_q = p_q (e_0 - softmax(theta_q)). A completion's score term is s = e_o - softmax(theta_q). Every draw
samples the allocation's coins AND the completions, so the Monte Carlo mean tests E over both.
"""
import math

import pytest
import torch

from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.allocation import (
    allocate,
    check_estimator,
    completion_weights,
    draw_allocation,
    expected_gradient_factor,
    prefix_pair_advantages,
    size_correction,
)
from megatron_dppo.algo.screening import continuation_probabilities

DT = torch.float64
V = 3
DRAWS = 12000
Z_OK, Z_BIASED = 4.5, 8.0
THETA = torch.tensor([[2.2, 0.0, 0.0], [0.4, 0.1, -0.3], [-0.2, 0.3, 0.0], [-1.6, 0.5, 0.2],
                      [-3.0, 0.0, 0.5], [0.9, -0.5, 0.0]], dtype=DT)
B = THETA.shape[0]


def policy():
    return THETA.softmax(-1)


def true_gradient() -> torch.Tensor:
    pi = policy()
    e0 = torch.zeros(V, dtype=DT)
    e0[0] = 1.0
    return pi[:, :1] * (e0 - pi)  # [B, V]


def beta_of(p: torch.Tensor, strength: float = 6.0):
    """A posterior centred on each prompt's true pass rate (what the allocation reads)."""
    return 1.0 + strength * p, 1.0 + strength * (1 - p)


def sample(gen: torch.Generator, q: int, n: int, draws: int = DRAWS):
    """(rewards [draws, n], scores [draws, n, V]) of n completions of prompt q."""
    pi = policy()[q]
    o = torch.multinomial(pi.expand(draws, V), n, replacement=True, generator=gen)
    s = torch.nn.functional.one_hot(o, V).to(DT) - pi
    return (o == 0).to(DT), s


def z_scores(estimates: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    mean, se = estimates.mean(0), estimates.std(0) / math.sqrt(estimates.shape[0])
    return ((mean - target).abs() / se.clamp(min=1e-12)).flatten()


def allocation_estimates(sizes, prob, keep, estimator="rloo", seed=0) -> torch.Tensor:
    """[draws, B, V]: keep_q / pi_q * (1/n_q) sum_i A_i s_i, advantages of ``estimator`` with its size correction."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(keep.shape[0], B, V, dtype=DT)
    for q in range(B):
        n = int(sizes[q])
        r, s = sample(gen, q, n, keep.shape[0])
        A = compute_advantages(r, estimator, eps=0.0)
        if estimator != "grpo":
            A = A * size_correction(estimator, torch.tensor(n))
        out[:, q] = keep[:, q, None].to(DT) / prob[q] * (A[..., None] * s).mean(1)
    return out


def the_allocation(budget=20.0):
    p = policy()[:, 0]
    alpha, beta = beta_of(p)
    return allocate(alpha, beta, budget=budget, gen_cost=1.0, train_cost=1.0, n_min=2, n_max=8, max_weight=10.0,
                    signal=0.3)


def coins(prob, mode="bernoulli"):
    gen = torch.Generator().manual_seed(7)
    return torch.stack([draw_allocation(prob, gen, mode) for _ in range(DRAWS)])


@pytest.mark.parametrize("mode", ["bernoulli", "fixed_size"])
def test_the_allocation_estimate_is_unbiased(mode):
    alloc = the_allocation()
    assert bool((alloc.prob < 1).any()) and len(set(alloc.sizes.tolist())) > 1, "not a variable allocation"
    z = z_scores(allocation_estimates(alloc.sizes, alloc.prob, coins(alloc.prob, mode)), true_gradient())
    assert z.max() < Z_OK, f"max z {z.max():.2f}"


def test_a_deterministic_allocation_with_some_pi_zero_is_biased():
    """The control: the same sizes and expected prompt count, but a deterministic cut: the round(sum pi) prompts of
    largest pi always generated (weight 1), the others never (pi = 0)."""
    alloc = the_allocation()
    top = alloc.prob.argsort(descending=True)[:round(float(alloc.prob.sum()))]
    keep = torch.zeros(B, dtype=torch.bool).index_fill(0, top, True).expand(DRAWS, B)
    assert 0 < int(keep[0].sum()) < B
    z = z_scores(allocation_estimates(alloc.sizes, torch.ones(B, dtype=DT), keep), true_gradient())
    assert z.max() > Z_BIASED


def test_dr_grpo_corrected_by_n_over_n_minus_1_is_unbiased():
    alloc = the_allocation()
    z = z_scores(allocation_estimates(alloc.sizes, alloc.prob, coins(alloc.prob), "dr_grpo"), true_gradient())
    assert z.max() < Z_OK


def test_grpo_std_normalisation_changes_its_target_with_the_group_size():
    """E[(1/n) sum A s] = c_n(p) grad p: 1 for rloo and corrected dr_grpo at every n; for grpo c_n(p) moves with n,
    so variable n_q estimates a different, allocation-dependent objective; refused by name."""
    for n in (2, 4, 8):
        for p in (0.1, 0.5, 0.8):
            assert expected_gradient_factor("rloo", n, p) == pytest.approx(1.0, abs=1e-12)
            assert expected_gradient_factor("dr_grpo", n, p) * n / (n - 1) == pytest.approx(1.0, abs=1e-12)
    grpo = {n: expected_gradient_factor("grpo", n, 0.2) for n in (2, 4, 8)}
    assert max(grpo.values()) / min(grpo.values()) > 1.3, grpo
    # and it shows in the estimate: the allocation's grpo estimate misses fixed-G grpo's expected gradient
    alloc = the_allocation()
    p = policy()[:, 0]
    target = torch.stack([torch.tensor(expected_gradient_factor("grpo", 8, float(x))) for x in p])[:, None] \
        * true_gradient()
    est = allocation_estimates(alloc.sizes, alloc.prob, coins(alloc.prob), "grpo")
    assert z_scores(est, target).max() > Z_BIASED
    with pytest.raises(ValueError, match="grpo's std normalisation"):
        check_estimator("grpo")


def test_the_budget_is_respected_and_spent_where_the_signal_is():
    p = policy()[:, 0]
    alpha, beta = beta_of(p)
    for budget in (14.0, 30.0, 60.0):
        alloc = allocate(alpha, beta, budget=budget, gen_cost=1.0, train_cost=0.5, n_min=2, n_max=8,
                         max_weight=10.0, filtered=False)
        assert float(alloc.cost.sum()) <= budget * (1 + 1e-9)
        assert bool((alloc.prob >= 0.1 - 1e-12).all()) and bool((alloc.sizes >= 2).all())
        if budget < B * 8 * 1.5:
            assert float(alloc.cost.sum()) > 0.97 * budget  # the budget is used, not left over
        # the realised cost of the draws averages the expected cost
        keep = coins(alloc.prob).to(DT)
        realised = (keep * alloc.sizes.to(DT) * 1.5).sum(1)
        assert float(realised.mean()) == pytest.approx(float(alloc.cost.sum()), rel=0.03)
    # the prompt nearest p = 1/2 gets more expected samples than the ones near 0 or 1
    alloc = allocate(alpha, beta, budget=30.0, gen_cost=1.0, train_cost=0.5, filtered=False)
    x = alloc.sizes.double() * alloc.prob
    mid, edge = int((p - 0.5).abs().argmin()), int((p - 0.5).abs().argmax())
    assert float(x[mid]) > float(x[edge])
    with pytest.raises(ValueError, match="below the least expected cost"):
        allocate(alpha, beta, budget=0.5, gen_cost=1.0, train_cost=0.5, max_weight=10.0)
    # the least variance: never worse than the uniform allocation of the same expected cost (n=4 for all: 6*4*1.5)
    from megatron_dppo.algo.allocation import uniform_variance
    alloc = allocate(alpha, beta, budget=36.0, gen_cost=1.0, train_cost=0.5, filtered=False, signal=1.0)
    assert alloc.predicted_variance <= uniform_variance(alpha, beta, 4) + 1e-12


def sequential_estimates(pair_weighted: bool, G=6, k=2, seed=3) -> torch.Tensor:
    """Screen k of each prompt, continue to G with pi_c water-filled over the step's screens by the screening
    module (scores: mostly the screens with mixed rewards), rloo terms: pair-weighted (``prefix_pair_advantages``)
    or plain over whatever was generated (Reinforce-Ada's way)."""
    gen = torch.Generator().manual_seed(seed)
    coin = torch.Generator().manual_seed(seed + 1)
    drawn = [sample(gen, q, G) for q in range(B)]
    r = torch.stack([d[0] for d in drawn], 1)  # [draws, B, G]
    mixed = (r[..., :k] != r[..., :1]).any(-1).to(DT)
    pi_c = continuation_probabilities(0.05 + mixed, torch.ones(B, dtype=torch.bool), 0.5, 10.0)  # [draws, B]
    cont = torch.rand(DRAWS, B, generator=coin, dtype=DT) < pi_c
    out = torch.zeros(DRAWS, B, V, dtype=DT)
    for q in range(B):
        rq, s = r[:, q], drawn[q][1]
        sizes = torch.where(cont[:, q], G, k)
        if pair_weighted:
            reach = torch.ones(DRAWS, G, dtype=DT)
            reach[:, k:] = pi_c[:, q, None]
            A = prefix_pair_advantages(rq, sizes, reach)
            out[:, q] = (A[..., None] * s).sum(1) / G
        else:
            full = compute_advantages(rq, "rloo", eps=0.0)
            short = torch.zeros_like(rq)
            short[:, :k] = compute_advantages(rq[:, :k], "rloo", eps=0.0)
            A = torch.where(cont[:, q, None], full, short)
            out[:, q] = (A[..., None] * s).sum(1) / sizes[:, None].to(DT)
    return out


def test_sequential_pair_weighted_advantages_are_unbiased_and_plain_rloo_is_not():
    assert z_scores(sequential_estimates(True), true_gradient()).max() < Z_OK
    assert z_scores(sequential_estimates(False), true_gradient()).max() > Z_BIASED


def test_prefix_pair_advantages_reduce_to_rloo_on_a_full_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0, 0.0]], dtype=DT)
    A = prefix_pair_advantages(r, torch.tensor([5, 5]), torch.ones(2, 5, dtype=DT))
    assert torch.allclose(A, compute_advantages(r, "rloo", eps=0.0))
    short = prefix_pair_advantages(r, torch.tensor([3, 2]), torch.ones(2, 5, dtype=DT))
    assert bool((short[0, 3:] == 0).all()) and bool((short[1, 2:] == 0).all())


def test_completion_weights_make_each_prompt_a_mean_over_its_group():
    w = completion_weights(torch.tensor([2, 4, 8]), torch.tensor([0.5, 1.0, 0.25], dtype=DT), 8)
    assert torch.allclose(w, torch.tensor([8.0, 2.0, 4.0], dtype=DT))
