"""The modelled step cost and the pruning rates it implies (docs/algorithms.md, "Step cost and budgets"): the
coefficients recovered from phase timers, the cost fractions, and the planner's choices in the two regimes (the
completion level first where generation is cheap; the prompt level where generation dominates)."""

import math

import pytest
import torch

from megatron_dppo.algo.step_cost import StepCost, fit_step_cost, plan_rates, variance_curve

B, G = 64, 8


def records(c_gen: float, c_train: float, fixed: float, steps: int = 50, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        kept = int(torch.randint(20, 65, (1,), generator=gen))
        trained = int(torch.randint(50, kept * G + 1, (1,), generator=gen))
        noise = 1 + 0.05 * float(torch.randn(1, generator=gen))
        g = c_gen * kept * G * noise
        t = c_train * trained * noise
        out.append({"prune/prompt_kept": kept, "prune/total_kept": trained, "time/generate": 0.9 * g,
                    "time/reward": 0.1 * g, "time/pack": 0.1 * t, "time/logprob": 0.3 * t, "time/train": 0.6 * t,
                    "time/prune": fixed, "time/step": g + t + fixed})
    return out


def test_the_coefficients_are_recovered_from_phase_timers():
    cost = fit_step_cost(records(0.002, 0.006, 0.05), G)
    assert cost.generate == pytest.approx(0.002, rel=0.03)
    assert cost.train == pytest.approx(0.006, rel=0.03)
    assert cost.fixed == pytest.approx(0.05, rel=1e-6)
    assert cost.generation_share() == pytest.approx(0.25, abs=0.01)
    with pytest.raises(ValueError, match="no record"):
        fit_step_cost([{"time/step": 1.0}], G)


def test_cost_fractions():
    cost = StepCost(generate=1.0, train=3.0)  # rho = 0.25
    assert cost.fraction(B, G, 1.0, 1.0) == pytest.approx(1.0)
    assert cost.fraction(B, G, 0.5, 1.0) == pytest.approx(0.5)  # a pruned prompt saves both
    assert cost.fraction(B, G, 1.0, 0.5) == pytest.approx(0.25 + 0.75 * 0.5)  # a pruned completion: training only
    assert cost.fraction(B, G, 0.7, 0.6) == pytest.approx(0.7 * (0.25 + 0.75 * 0.6))
    # screening: k = 2 for every kept prompt, 6 more for the 40% continued, only those trained
    f = cost.fraction(B, G, 1.0, 1.0, screen=2, continue_fraction=0.4)
    assert f == pytest.approx((1.0 * (2 + 6 * 0.4) + 3.0 * 8 * 0.4) / (4.0 * 8))
    with pytest.raises(ValueError, match="generate"):
        StepCost(generate=-1.0, train=1.0)


def uniform(rate: float) -> float:
    return rate / (1.0 - rate)


def test_the_planner_meets_the_budget_and_keeps_everything_at_budget_one():
    cost = StepCost(generate=1.0, train=2.7)
    plan = plan_rates(cost, B, G, 1.0, uniform, uniform)
    assert (plan.r_q, plan.r_o, plan.predicted_rel_var) == (0.0, 0.0, 0.0)
    for budget in (0.3, 0.5, 0.8):
        plan = plan_rates(cost, B, G, budget, uniform, uniform)
        assert plan.cost_fraction <= budget + 1e-9
        assert cost.fraction(B, G, 1 - plan.r_q, 1 - plan.r_o) == pytest.approx(plan.cost_fraction)
    with pytest.raises(ValueError, match="least modelled cost"):
        plan_rates(cost, B, G, 0.001, uniform, uniform)


def test_cheap_generation_prunes_completions_generation_dominated_prunes_prompts():
    # completions: 40% have A = 0 and are free to drop; the prompt level pays as uniform sampling does
    scores = torch.cat([torch.zeros(205), torch.rand(307, generator=torch.Generator().manual_seed(1)) + 0.2])
    completion = variance_curve(scores, floor=0.05)
    assert completion(0.3) < 1e-12 and completion(0.6) > 0.01
    cpu = StepCost(generate=0.27, train=0.73)  # the CPU quickstart's share
    plan = plan_rates(cpu, B, G, 0.75, uniform, completion)
    assert plan.r_q == 0.0 and plan.r_o > 0.3  # the free completions meet the budget: no prompt is skipped
    assert plan.predicted_rel_var < 1e-12
    cpu_plan = plan_rates(cpu, B, G, 0.6, uniform, completion)
    gpu = StepCost(generate=0.9, train=0.1)  # long reasoning on GPU: generation dominates
    gpu_plan = plan_rates(gpu, B, G, 0.6, uniform, completion)
    assert gpu_plan.r_q > 0.3  # only skipping generation can reach 0.6
    assert cpu_plan.r_q < 0.1 < cpu_plan.r_o
    assert gpu_plan.cost_fraction <= 0.6 + 1e-9


def test_variance_curve_matches_the_water_filled_formula():
    s = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.5], dtype=torch.float64)
    curve = variance_curve(s, floor=0.1)
    assert curve(0.0) == 0.0
    assert curve(0.2) < 1e-12  # one free unit (s = 0) covers a 20% cut
    v = curve(0.5)
    assert 0 < v < math.inf


def test_plan_step_leaves_the_prompt_level_out_where_generation_is_cheap():
    """Generation share 0.25 (the CPU quickstart's regime): r_q = 0 and r_o meets the budget exactly, where
    plan_rates alone would take some prompt rate; share 0.8: the budget below the share needs the prompt level,
    and plan_step is plan_rates."""
    from megatron_dppo.algo.step_cost import plan_step

    gen = torch.Generator().manual_seed(3)
    s_q = torch.rand(B, generator=gen, dtype=torch.float64) + 0.05
    a = torch.randn(B * G, generator=gen, dtype=torch.float64).abs()
    vq, vo = variance_curve(s_q, 0.05), variance_curve(a, 0.3)
    cheap = StepCost(generate=0.001, train=0.003)
    plan = plan_step(cheap, B, G, 0.5, vq, vo)
    assert plan.r_q == 0.0 and plan.cost_fraction == pytest.approx(0.5)
    assert plan.r_o == pytest.approx(1 - (0.5 * 4 - 1) / 3)
    dominated = StepCost(generate=0.004, train=0.001)
    plan = plan_step(dominated, B, G, 0.5, vq, vo)
    assert plan == plan_rates(dominated, B, G, 0.5, vq, vo, max_rate=0.95, grid=48) and plan.r_q > 0.3
    # unreachable by the completion level alone (budget below the generation share): the prompt level is needed
    plan = plan_step(cheap, B, G, 0.2, vq, vo)
    assert plan.r_q > 0 and plan.cost_fraction <= 0.2 + 1e-9
