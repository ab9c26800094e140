"""Variance-optimal keep probabilities (``algo.dppo_keep=optimal``; docs/algorithms.md, "Variance-optimal keep
probabilities"): the water-filling solution, the systematic sample's inclusion probabilities, and unbiasedness of
the full pruned loss gradient at both levels, with and without KL, with PPO mini-batches and under DP2 (gloo),
in the Monte-Carlo harness of test_pruning.py (same z thresholds), plus negative controls that fail it."""

import math
import os
import tempfile

import pytest
import test_minibatches as TM
import test_pruning as TP
import torch

from megatron_dppo.algo.losses import LossConfig, loss_denominator, per_token_objective
from megatron_dppo.algo.minibatches import split_prompts
from megatron_dppo.algo.optimal_keep import predicted_relative_variance, systematic_sample, water_fill
from megatron_dppo.algo.pruning import DPPOPruner, PruneResult, combine, make_generator, pruning_stats

DT = torch.float64
B, G = TP.B, TP.G
DRAWS = TP.DRAWS


def variance(pi: torch.Tensor, s: torch.Tensor) -> float:
    """sum (1 - pi)/pi s^2 over s > 0 (inf if such a unit has pi = 0)."""
    s2 = s.double() ** 2
    pos = s2 > 0
    if bool((pi[pos] <= 0).any()):
        return math.inf
    return float(((1 - pi[pos]) / pi[pos] * s2[pos]).sum())


# ------------------------------------------------------------------------------------------------------------
# Water-filling: the budget is met, the form is clip(c s, lo, 1), and no feasible allocation has less variance
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [2.0, 2.5, 4.0, 6.5, 8.0])
def test_water_fill_meets_the_budget_in_the_clipped_linear_form(budget):
    s = torch.tensor([0.0, 0.05, 0.3, 0.3, 1.0, 2.0, 4.0, 9.0, 0.0, 0.7], dtype=DT)
    lo = torch.full_like(s, 0.05)
    forced = torch.zeros_like(s, dtype=torch.bool)
    forced[8] = True
    pi = water_fill(s, budget, floor=lo, forced=forced)
    assert pi[8] == 1.0
    assert abs(float(pi.sum()) - budget) < 1e-9
    assert bool(((pi >= lo - 1e-15) & (pi <= 1.0)).all())
    inside = (pi > lo + 1e-12) & (pi < 1.0 - 1e-12) & ~forced
    assert bool(inside.any())
    c = pi[inside] / s[inside]
    assert torch.allclose(c, c[0].expand_as(c), rtol=1e-9)  # pi = c s wherever no bound binds
    # a unit at 1 has c s >= 1, a unit at its floor has c s <= lo
    assert bool((c[0] * s[(pi >= 1.0) & ~forced] >= 1.0 - 1e-9).all())
    assert bool((c[0] * s[(pi <= lo + 1e-12) & ~forced] <= lo[0] + 1e-9).all())


def test_water_fill_minimises_the_variance_among_feasible_allocations():
    gen = torch.Generator().manual_seed(3)
    s = torch.rand(12, generator=gen, dtype=DT) ** 2 * 5
    lo, budget = 0.05, 5.0
    best = variance(water_fill(s, budget, floor=lo), s)
    for _ in range(2000):  # random feasible allocations: Dirichlet-like split of the budget, clipped to bounds
        x = torch.rand(12, generator=gen, dtype=DT) + 1e-3
        pi = water_fill(x, budget, floor=lo)  # any positive scores give a feasible point with sum = budget
        assert abs(float(pi.sum()) - budget) < 1e-9
        assert variance(pi, s) >= best - 1e-9
    uniform = torch.full_like(s, budget / 12)
    assert variance(uniform, s) > best


def test_water_fill_edges():
    s = torch.tensor([0.0, 1.0, 2.0], dtype=DT)
    # below what the floors take: every free unit at its floor
    assert torch.equal(water_fill(s, 0.1, floor=0.2), torch.full((3,), 0.2, dtype=DT))
    # more than can be spent: positive scores at 1, the zero score at its floor (0 here)
    assert torch.equal(water_fill(s, 2.9, floor=0.0), torch.tensor([0.0, 1.0, 1.0], dtype=DT))
    # budget beyond the positive scores goes evenly to the zero-score units with a positive floor (they may carry
    # gradient the proxy cannot see); zero-score units with floor 0 are declared gradient-free and stay at 0
    assert torch.allclose(water_fill(torch.tensor([0.0, 0.0, 1.0], dtype=DT), 2.5, floor=0.1),
                          torch.tensor([0.75, 0.75, 1.0], dtype=DT))
    assert torch.allclose(water_fill(torch.tensor([0.0, 0.0, 1.0], dtype=DT), 2.5,
                                     floor=torch.tensor([0.0, 0.1, 0.1], dtype=DT)),
                          torch.tensor([0.0, 1.0, 1.0], dtype=DT))
    # leading dims are independent decisions with their own budgets
    pi = water_fill(s.expand(2, 3), torch.tensor([1.0, 2.0], dtype=DT), floor=0.0)
    assert torch.allclose(pi.sum(-1), torch.tensor([1.0, 2.0], dtype=DT))
    with pytest.raises(ValueError, match="scores >= 0"):
        water_fill(torch.tensor([-1.0, 1.0]), 1.0)
    with pytest.raises(ValueError, match="floors"):
        water_fill(s, 1.0, floor=1.5)


# ------------------------------------------------------------------------------------------------------------
# Systematic sampling: inclusion probabilities exactly pi, a fixed size
# ------------------------------------------------------------------------------------------------------------
def test_systematic_sample_has_the_inclusion_probabilities_and_a_fixed_size():
    pi = torch.tensor([0.0, 0.1, 0.25, 0.5, 0.65, 0.9, 1.0, 0.6], dtype=DT)  # sum 4.0
    keep = systematic_sample(pi.expand(20000, 8), make_generator(0, 0, "sys"))
    assert set(keep.sum(-1).tolist()) == {4}
    z = TP.mc_z(keep.to(DT), pi)
    assert z.max() < TP.Z_OK, z
    assert not bool(keep[:, 0].any()) and bool(keep[:, 6].all())
    odd = torch.tensor([0.3, 0.3, 0.3, 0.35], dtype=DT)  # sum 1.25: floor or ceil
    assert set(systematic_sample(odd.expand(2000, 4), make_generator(0, 1, "sys")).sum(-1).tolist()) <= {1, 2}


# ------------------------------------------------------------------------------------------------------------
# The pruner: budgets, zero-advantage units, rate 0, bad options
# ------------------------------------------------------------------------------------------------------------
def optimal(r_q=0.5, r_o=0.5, mode="bernoulli", floor=0.1, alpha=0.5, zero_grad=True) -> DPPOPruner:
    return DPPOPruner(r_q, r_o, mode, keep="optimal", length_exponent=alpha, keep_floor=floor,
                      zero_advantage_gradient=zero_grad)


def optimal_draws(p, pruner: DPPOPruner, d=DRAWS, seed=0) -> tuple[PruneResult, PruneResult]:
    """d independent decisions of both levels exactly as a step makes them: the completion level sees only the
    generated rows of its draw, their lengths and their prompts' pi_q."""
    prompts = pruner.select_prompts(p["history"].expand(d, B), make_generator(seed, 0, "prompts"))
    completions = pruner.select_completions(p["adv"].expand(d, B, G), make_generator(seed, 0, "completions"),
                                            lengths=p["lengths"].expand(d, B, G).double(),
                                            prompt_prob=prompts.probabilities(), generated=prompts.keep)
    return prompts, completions


def test_expected_kept_counts_are_the_budgets():
    p = TP.make_problem()
    pruner = optimal(r_q=0.4, r_o=0.3)
    prompts, completions = optimal_draws(p, pruner, d=8000)
    # prompt level: E[kept] = (1 - r_q) B exactly (sum pi; feasible here)
    assert abs(float(prompts.probabilities()[0].sum()) - 0.6 * B) < 1e-9
    assert TP.mc_z(prompts.keep.sum(-1, keepdim=True).to(DT), torch.tensor([0.6 * B], dtype=DT)).max() < TP.Z_OK
    # completion level: sum of pi over the generated completions = (1 - r_o) x their number, in every draw (with
    # a KL term every completion may carry gradient: the budget is always spent)
    generated = prompts.keep.unsqueeze(-1).expand(-1, B, G)
    spent = (completions.probabilities() * generated).sum((1, 2))
    assert torch.allclose(spent, 0.7 * generated.sum((1, 2)).to(DT), atol=1e-9)
    # without KL the zero-advantage completions take nothing: the budget, or every A != 0 completion at 1
    no_kl = optimal(r_q=0.4, r_o=0.3, zero_grad=False)
    prompts, completions = optimal_draws(p, no_kl, d=500)
    generated = prompts.keep.unsqueeze(-1).expand(-1, B, G)
    nonzero = generated & (p["adv"] != 0)
    spent = (completions.probabilities() * generated).sum((1, 2))
    expect = torch.minimum(0.7 * generated.sum((1, 2)).to(DT), nonzero.sum((1, 2)).to(DT))
    assert torch.allclose(spent, expect, atol=1e-9)
    assert not bool((completions.keep & ~generated).any())  # nothing kept in a row that was never generated


def test_zero_advantage_completions_are_free_without_kl_and_floored_with_it():
    p = TP.make_problem()  # prompt 0 has one reward for all: A = 0 for its whole group
    no_kl = optimal(r_q=0.0, zero_grad=False).select_completions(p["adv"], make_generator(0, 0, "c"),
                                                                  lengths=p["lengths"].double())
    assert torch.equal(no_kl.probabilities()[0], torch.zeros(G, dtype=DT))
    assert not bool(no_kl.keep[0].any())
    kl = optimal(r_q=0.0, zero_grad=True).select_completions(p["adv"], make_generator(0, 0, "c"),
                                                             lengths=p["lengths"].double())
    assert torch.allclose(kl.probabilities()[0], torch.full((G,), 0.1, dtype=DT))
    # every unit that can carry gradient has pi >= the floor
    assert bool((kl.probabilities() >= 0.1 - 1e-12).all())


@pytest.mark.parametrize("mode", ["bernoulli", "fixed_size"])
def test_zero_rates_keep_everything_with_weight_exactly_one(mode):
    p = TP.make_problem()
    prompts, completions = optimal_draws(p, optimal(0.0, 0.0, mode, zero_grad=False), d=3)
    total = combine(prompts, completions)
    assert bool(total.keep.all()) and torch.equal(total.weight, torch.ones_like(total.weight))


def test_optimal_refuses_deterministic_and_bad_options():
    with pytest.raises(ValueError, match="deterministic"):
        DPPOPruner(0.5, 0.5, "deterministic", keep="optimal")
    with pytest.raises(ValueError, match="keep rule"):
        DPPOPruner(0.5, 0.5, keep="best")
    with pytest.raises(ValueError, match="keep_floor"):
        DPPOPruner(0.5, 0.5, keep="optimal", keep_floor=-0.1)
    with pytest.raises(ValueError, match="length_exponent"):
        DPPOPruner(0.5, 0.5, keep="optimal", length_exponent=float("nan"))
    with pytest.raises(ValueError, match="lengths must have shape"):
        optimal().select_completions(torch.ones(2, 3), make_generator(0, 0, "c"), lengths=torch.ones(3, 2))


def test_predicted_relative_variance_and_stats():
    s = torch.tensor([0.0, 1.0, 2.0], dtype=DT)
    pi = torch.tensor([0.0, 0.5, 1.0], dtype=DT)
    assert predicted_relative_variance(pi, s) == pytest.approx((0.5 / 0.5 * 1.0) / 5.0)
    p = TP.make_problem()
    prompts, completions = optimal_draws(p, optimal(), d=1)
    stats = pruning_stats(prompts, completions)
    assert stats["prune/completion_predicted_rel_var"] >= 0 and "prune/prompt_predicted_rel_var" in stats
    # at the uniform rule's expected kept count the optimal rule predicts less variance (same proxy)
    uniform = DPPOPruner(0.0, 0.5, "bernoulli", length_exponent=0.5)
    u = uniform.select_completions(p["adv"], make_generator(0, 0, "c"), lengths=p["lengths"].double())
    r_o = 1.0 - float(u.probabilities().sum()) / (B * G)
    o = optimal(0.0, r_o, zero_grad=False).select_completions(p["adv"], make_generator(0, 0, "c"),
                                                              lengths=p["lengths"].double())
    assert float(o.probabilities().sum()) <= float(u.probabilities().sum()) + 1e-9
    assert o.predicted_rel_variance < u.predicted_rel_variance


# ------------------------------------------------------------------------------------------------------------
# Unbiasedness of the full pruned loss and gradient (both levels; clipping live; with and without KL)
# ------------------------------------------------------------------------------------------------------------
def weights_and_denominator(p, cfg, pruner, d=DRAWS, seed=0):
    prompts, completions = optimal_draws(p, pruner, d, seed)
    weights = combine(prompts, completions).weight.to(DT)
    den = torch.full((d,), TP.full_denominator(p, cfg), dtype=DT)
    return weights, den


def kl_config(policy_loss, aggregation, kl: bool) -> LossConfig:
    cfg = TP.config(policy_loss, aggregation)
    return cfg if kl else LossConfig(policy_loss=cfg.policy_loss, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                     kl_coef=0.0, aggregation=aggregation).resolved()


GRID = [(pl, agg, kl) for pl, agg in TP.LOSS_GRID if agg != "token_mean" for kl in (True, False)]
GRID += [("ppo_clip", "token_mean", True)]


@pytest.mark.parametrize("mode", ["bernoulli", "fixed_size"])
@pytest.mark.parametrize("policy_loss, aggregation, kl", GRID, ids=[f"{a}-{b}-kl{int(c)}" for a, b, c in GRID])
def test_optimal_pruned_loss_and_gradient_are_unbiased(policy_loss, aggregation, kl, mode):
    p = TP.make_problem()
    cfg = kl_config(policy_loss, aggregation, kl)
    weights, den = weights_and_denominator(p, cfg, optimal(mode=mode, zero_grad=kl))
    kept = float((weights > 0).to(DT).mean())
    assert 0.2 < kept < 0.75, kept  # both levels prune
    distinct = torch.unique(weights[weights > 0])
    assert distinct.numel() > 5  # per-unit probabilities, not one rate
    z = TP.monte_carlo_z(p, cfg, weights, den)
    assert z.max() < TP.Z_OK, f"max z {z.max():.2f} at statistic {int(z.argmax())} (0 = loss, then gradient)"


NEGATIVE = ["prompt-floor-0", "no-zero-advantage-floor-under-kl"]


@pytest.mark.parametrize("case", NEGATIVE)
def test_negative_controls_fail_the_same_test(case):
    """pi_min = 0 at the prompt level never revisits prompt 1, whose last group had one reward for all (h = 0) but
    whose group now has a non-zero advantage; pruning A = 0 completions outright while a KL term is on loses their
    KL gradient. Both are biased, and the harness sees it."""
    p = TP.make_problem()
    assert p["history"][1] == 0 and bool((p["adv"][1] != 0).any())
    cfg = TP.config("ppo_clip", "seq_mean_token_mean")  # KL on
    pruner = optimal(floor=0.0, zero_grad=True) if case == "prompt-floor-0" else optimal(r_q=0.0, zero_grad=False)
    weights, den = weights_and_denominator(p, cfg, pruner)
    z = TP.monte_carlo_z(p, cfg, weights, den)
    assert z.max() > TP.Z_BIASED, f"bias not detected: max z {z.max():.2f}"


# ------------------------------------------------------------------------------------------------------------
# PPO mini-batches: every mini-batch with its own D_m stays unbiased (the ratio live, KL and correction on)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mini_batches", [2, 3])
@pytest.mark.parametrize("policy_loss, aggregation, correction, dual_clip, r_q",
                         [c for c in TM.CASES if c[1] != "token_mean"], ids=lambda c: str(c))
def test_every_mini_batch_is_unbiased_under_optimal(mini_batches, policy_loss, aggregation, correction, dual_clip,
                                                    r_q):
    p = TM.make_problem()
    eps = (0.2, 0.28) if policy_loss == "ppo_clip" else (0.05, 0.05)
    cfg = LossConfig(policy_loss=policy_loss, eps_low=eps[0], eps_high=eps[1], kl_coef=0.1, kl_estimator="k3",
                     aggregation=aggregation, clip_ratio_c=dual_clip, rollout_correction=correction,
                     rollout_correction_cap=1.5).resolved()
    prompts, completions = optimal_draws(p, optimal(r_q=r_q))
    weights = combine(prompts, completions).weight.to(DT)
    for group in split_prompts(B, mini_batches, make_generator(0, 0, "mini_batches")):
        sub = TM.rows(p, group)
        den = loss_denominator(aggregation, len(group), G, sub["lengths"], None, TM.L)
        z = TP.mc_z(TM.pruned_samples(sub, cfg, weights[:, group], den), TM.mini_batch_target(sub, cfg, den))
        assert z.max() < TP.Z_OK, f"mini-batch {group}: max z {z.max():.2f} at statistic {int(z.argmax())}"


# ------------------------------------------------------------------------------------------------------------
# DP2 (gloo): rank 0 decides and broadcasts, each rank trains its dealt half, the gradients are all-reduced
# ------------------------------------------------------------------------------------------------------------
def _dp_worker(rank: int, world: int, store_path: str, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        p = TP.make_problem()
        cfg = TP.config("ppo_clip", "seq_mean_token_mean")
        pruner = optimal(mode="bernoulli", zero_grad=True)
        d = 2000
        local = combine(*optimal_draws(p, pruner, d)).weight.to(DT)  # every rank could draw; rank 0's is used
        box = [local if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        weights = box[0]
        same = torch.tensor([float(torch.equal(weights, local))], dtype=DT)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        # the data-parallel deal: sequence k of the batch trains on rank k % world
        mine = (torch.arange(B * G) % world == rank).view(B, G).to(DT)
        den = torch.full((d,), TP.full_denominator(p, cfg), dtype=DT)
        samples = TP.pruned_losses_and_grads(p, cfg, weights * mine, den)  # this rank's part of loss and gradient
        dist.all_reduce(samples)  # the DP gradient all-reduce (sum of the ranks' parts, global D)
        if rank == 0:
            z = TP.mc_z(samples, TP.full_target(p, cfg))
            torch.save({"z": z, "same": float(same)}, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_optimal_is_unbiased_under_dp2_with_the_decision_broadcast_from_rank_0():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.pt")
        mp.start_processes(_dp_worker, args=(2, store, out), nprocs=2, join=True, start_method="spawn")
        result = torch.load(out)
    assert result["same"] == 1.0  # the same seeded decision on every rank
    assert result["z"].max() < TP.Z_OK, f"max z {result['z'].max():.2f}"


def test_the_clipping_and_kl_are_live_in_the_unbiasedness_problem():
    p = TP.make_problem()
    cfg = TP.config("ppo_clip", "seq_mean_token_mean")
    mask = p["mask"].reshape(-1)
    _, m = per_token_objective(p["logp"].reshape(-1), p["old"].reshape(-1),
                               p["adv"][..., None].expand(B, G, TP.L).reshape(-1), mask,
                               torch.arange(B * G).repeat_interleave(TP.L), cfg, p["ref"].reshape(-1))
    assert 0 < float(m["clipped_tokens"]) < float(m["tokens"]) and float(m["kl_sum"]) > 0
