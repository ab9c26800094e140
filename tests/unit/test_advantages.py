"""Advantage estimators: formulas against brute force, the registry, and bad inputs (docs/algorithms.md)."""

import math

import pytest
import torch

from megatron_dppo.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimators,
    compute_advantages,
    register_advantage_estimator,
)


def _rewards(b=5, g=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(b, g, generator=gen, dtype=torch.float64)
    r[0] = 0.7  # a zero-variance group
    r[1] = torch.tensor([1.0, 0, 0, 1, 1, 0], dtype=torch.float64)  # binary rewards
    return r


def test_grpo_uses_sample_std_per_group():
    r = _rewards()
    a = compute_advantages(r, "grpo", eps=1e-6)
    for q in range(r.shape[0]):
        row = r[q].tolist()
        mean = sum(row) / len(row)
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / (len(row) - 1))  # Bessel-corrected
        expect = [(x - mean) / (std + 1e-6) for x in row]
        if len(set(row)) == 1:
            expect = [0.0] * len(row)  # documented: exactly 0 (here the naive formula gives -1.1e-10)
        assert torch.allclose(a[q], torch.tensor(expect, dtype=torch.float64), atol=1e-12)


def test_grpo_is_not_population_std():
    # guards the documented choice: with G=2 the two conventions differ by sqrt(2)
    a = compute_advantages(torch.tensor([[0.0, 2.0]]), "grpo", eps=0.0)
    assert torch.allclose(a, torch.tensor([[-1 / math.sqrt(2), 1 / math.sqrt(2)]]))


def test_dr_grpo_and_rloo_match_brute_force():
    r = _rewards()
    b, g = r.shape
    dr = compute_advantages(r, "dr_grpo")
    rloo = compute_advantages(r, "rloo")
    for q in range(b):
        for i in range(g):
            others = [r[q, j].item() for j in range(g) if j != i]
            assert dr[q, i].item() == pytest.approx(r[q, i].item() - r[q].mean().item(), abs=1e-12)
            assert rloo[q, i].item() == pytest.approx(r[q, i].item() - sum(others) / len(others), abs=1e-12)
    # identity: rloo = G/(G-1) * dr_grpo
    assert torch.allclose(rloo, dr * g / (g - 1), atol=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_constant_groups_get_exactly_zero(estimator):
    # 0.1 * 3 is not exactly representable: mean(r) != r, yet A must be exactly 0 (zero-variance groups)
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 2.0, 3.0]], dtype=torch.float32)
    a = compute_advantages(r, estimator)
    assert torch.equal(a[0], torch.zeros(3))
    assert (a[1] != 0).any()


def test_dtype_and_integer_rewards():
    assert compute_advantages(torch.tensor([[0, 1, 1]]), "grpo").dtype == torch.float32
    assert compute_advantages(torch.zeros(2, 3, dtype=torch.float64), "grpo").dtype == torch.float64


def test_registry_new_estimator_is_one_function():
    @register_advantage_estimator("_test_centered_sign", min_group_size=3)
    def _centered_sign(rewards, eps):
        return torch.sign(rewards - rewards.mean(dim=-1, keepdim=True))

    try:
        assert "_test_centered_sign" in advantage_estimators()
        a = compute_advantages(torch.tensor([[0.0, 1.0, 5.0]]), "_test_centered_sign")
        assert torch.equal(a, torch.tensor([[-1.0, -1.0, 1.0]]))
        with pytest.raises(ValueError, match="G >= 3"):
            compute_advantages(torch.zeros(1, 2), "_test_centered_sign")
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("_test_centered_sign")(_centered_sign)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("_test_centered_sign")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_name_position_and_value(bad):
    r = torch.zeros(3, 4)
    r[2, 1] = bad
    with pytest.raises(ValueError, match=r"\(2, 1\)") as err:
        compute_advantages(r)
    assert str(bad) in str(err.value)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_of_one_rejected_where_needed(estimator):
    with pytest.raises(ValueError, match="G = 1"):
        compute_advantages(torch.zeros(4, 1), estimator)


def test_group_of_one_allowed_for_dr_grpo():
    assert torch.equal(compute_advantages(torch.ones(4, 1), "dr_grpo"), torch.zeros(4, 1))


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_empty_batch_rejected(shape):
    with pytest.raises(ValueError, match="empty"):
        compute_advantages(torch.zeros(shape))


def test_unknown_estimator_lists_valid_ones():
    with pytest.raises(ValueError, match="'ppo'.*dr_grpo, grpo, rloo"):
        compute_advantages(torch.zeros(2, 2), "ppo")


@pytest.mark.parametrize("bad_eps", [-1e-3, float("nan"), float("inf")])
def test_bad_eps(bad_eps):
    with pytest.raises(ValueError, match="eps"):
        compute_advantages(torch.zeros(2, 2), "grpo", eps=bad_eps)


def test_wrong_rank_rejected():
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        compute_advantages(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages(torch.zeros(4))
