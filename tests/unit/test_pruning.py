"""DPPO / CPPO pruning: every invariant of docs/algorithms.md, "Pruning" (numbered as there).

Monte-Carlo tests stack D independent draws in a leading dimension (the pruners treat leading dims as independent
decisions) and judge every statistic with one helper, ``mc_z``: z = |mean - target| / sqrt(SE^2 + atol^2), SE the
measured standard error of the mean and atol a float64 round-off floor. Unbiased cases must have max z < Z_OK;
the biased ones (deterministic mode, CPPO, fixed_size weighted with the naive 1/(1-r)) must have max z > Z_BIASED
in the very same harness, which shows the test can fail. All draws come from fixed seeds, so runs are repeatable.
"""

import json
import logging
import math

import pytest
import torch

import megatron_dppo.algo.pruning as pruning
from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.losses import (
    AGGREGATIONS,
    LossConfig,
    loss_denominator,
    loss_numerator,
    per_token_objective,
    reference_objective,
    sequence_token_weights,
)
from megatron_dppo.algo.prompt_history import PromptHistory
from megatron_dppo.algo.pruning import (
    CPPOPruner,
    DPPOPruner,
    PruneResult,
    combine,
    make_generator,
    pruning_stats,
    zero_variance_filter,
)

DT = torch.float64
Z_OK = 5.0  # unbiased: every statistic within 5 measured standard errors
Z_BIASED = 10.0  # biased: some statistic beyond 10 standard errors
ATOL = 1e-9  # float64 round-off floor of the z denominator
DRAWS = 4000
R_Q, R_O = 0.5, 0.5
B, G, L = 6, 4, 6
NAN = float("nan")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The vectorised Monte Carlo runs many small element-wise ops: on a shared 2-core machine intra-op threads
    only contend (measured 30 s vs 4.5 s for this file). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mc_z(samples: torch.Tensor, target: torch.Tensor, atol: float = ATOL) -> torch.Tensor:
    """Per statistic: |mean over draws - target| in units of the measured standard error of the mean."""
    d = samples.shape[0]
    mean = samples.mean(0)
    se = samples.std(0, correction=1) / math.sqrt(d)
    return (mean - target).abs() / torch.sqrt(se**2 + atol**2)


# ------------------------------------------------------------------------------------------------------------
# A fixed rollout: lengths, log-probs with ratios off 1 (clipping active), reference policy, rewards, history
# ------------------------------------------------------------------------------------------------------------
def make_problem(seed: int = 0, dtype=DT) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B, G), generator=gen)
    lengths[0, 0] = L
    mask = (torch.arange(L)[None, None, :] < lengths[..., None]).to(dtype)
    logp = torch.randn(B, G, L, generator=gen, dtype=dtype) * 0.5 - 1.0
    old = logp + torch.randn(B, G, L, generator=gen, dtype=dtype) * 0.3
    ref = logp + torch.randn(B, G, L, generator=gen, dtype=dtype) * 0.2
    rewards = torch.randn(B, G, generator=gen, dtype=dtype)
    rewards[0] = 1.0  # zero-variance group: A = 0, all candidates (KL term still matters)
    rewards[1] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # 3 small-|A| candidates
    rewards[2] = torch.tensor([1.0, 1.0, 0.0, 0.0])  # all |A| equal: no candidates
    adv = compute_advantages(rewards, "grpo")
    history = torch.tensor([NAN, 0.0, 0.3, 1.2, 0.5, 2.0], dtype=dtype)  # seen mean 0.8: candidates 1, 2, 4
    return dict(lengths=lengths, mask=mask, logp=logp, old=old, ref=ref, adv=adv, history=history)


def config(policy_loss: str, aggregation: str) -> LossConfig:
    eps = (0.2, 0.28) if policy_loss == "ppo_clip" else (0.05, 0.05)
    return LossConfig(policy_loss=policy_loss, eps_low=eps[0], eps_high=eps[1], kl_coef=0.1, kl_estimator="k3",
                      aggregation=aggregation).resolved()


def full_denominator(p: dict, cfg: LossConfig) -> float:
    return loss_denominator(cfg.aggregation, B, G, p["lengths"], None, L)


def full_target(p: dict, cfg: LossConfig) -> torch.Tensor:
    """[1 + T]: the full-batch loss and its gradient w.r.t. the log-probs of the T completion tokens, from the
    padded reference implementation."""
    leaf = p["logp"].clone().requires_grad_()
    loss = -reference_objective(leaf, p["old"], p["adv"], p["mask"], cfg, p["ref"])
    (grad,) = torch.autograd.grad(loss, leaf)
    return torch.cat([loss.detach().view(1), grad[p["mask"] > 0]])


def pruned_losses_and_grads(
    p: dict, cfg: LossConfig, weights: torch.Tensor, den: torch.Tensor, with_grad: bool = True
) -> torch.Tensor:
    """[D, 1 + T]: per draw, the pruned loss and its gradient w.r.t. the T completion-token log-probs, through the
    engine's path (sequence_token_weights -> loss_numerator on a packed token layout -> / denominator). The D
    draws are packed side by side as independent sequences, each with its own copy of the log-probs (one leaf),
    so one backward pass of the summed loss yields every draw's gradient. The per-draw loss values come from the
    per-token objective that loss_numerator sums (checked to agree)."""
    d = weights.shape[0]
    real = p["mask"] > 0  # [B, G, L]
    t = int(real.sum())
    seq_of_token = torch.arange(B * G).view(B, G, 1).expand(B, G, L)[real]  # [T]
    seq_index = (torch.arange(d)[:, None] * (B * G) + seq_of_token[None, :]).reshape(-1)
    per_tok = lambda x: x[real].expand(d, t).reshape(-1)  # noqa: E731
    adv_tok = p["adv"][..., None].expand(B, G, L)
    seq_w = sequence_token_weights(cfg.aggregation, weights.reshape(-1), p["lengths"].expand(d, B, G).reshape(-1))
    token_w = seq_w[seq_index]
    logp = p["logp"][real].expand(d, t).reshape(-1).clone().requires_grad_(with_grad)
    # sum over draws of (numerator_k / den_k) = one numerator with each token weight divided by its draw's den
    num, _ = loss_numerator(logp, per_tok(p["old"]), per_tok(adv_tok), token_w / den.repeat_interleave(t),
                            torch.ones_like(token_w), seq_index, cfg, per_tok(p["ref"]))
    s, _ = per_token_objective(logp, per_tok(p["old"]), per_tok(adv_tok), torch.ones_like(token_w), seq_index, cfg,
                               per_tok(p["ref"]))
    losses = -(token_w * s).view(d, t).sum(1) / den
    assert torch.allclose(num, losses.sum(), rtol=1e-9, atol=1e-12)
    if not with_grad:
        return losses.detach()[:, None]
    (grads,) = torch.autograd.grad(num, logp)
    return torch.cat([losses.detach()[:, None], grads.view(d, t)], dim=1)


# ------------------------------------------------------------------------------------------------------------
# Draws of (weights [D, B, G], denominators [D]) for each pruner
# ------------------------------------------------------------------------------------------------------------
def dppo_draws(p, cfg, mode, d=DRAWS, r_q=R_Q, r_o=R_O, seed=0):
    pruner = DPPOPruner(r_q, r_o, mode)
    prompts = pruner.select_prompts(p["history"].expand(d, B), make_generator(seed, 0, "prompts"))
    completions = pruner.select_completions(p["adv"].expand(d, B, G), make_generator(seed, 0, "completions"))
    result = combine(prompts, completions)
    den = torch.full((d,), full_denominator(p, cfg), dtype=DT)
    return result.weight.to(DT), den


def naive_fixed_size_draws(p, cfg, d=DRAWS):
    """fixed_size selection weighted with 1/(1 - r) instead of the exact 1/(1 - n/|C|): biased."""
    result = DPPOPruner(0.0, R_O, "fixed_size").select_completions(p["adv"].expand(d, B, G), make_generator(0, 0, "c"))
    naive = torch.where(result.candidate, 1.0 / (1.0 - R_O), 1.0)
    den = torch.full((d,), full_denominator(p, cfg), dtype=DT)
    return result.keep.to(DT) * naive, den


def cppo_draws(p, cfg, scope, d=DRAWS):
    """CPPO as its authors train it: top-|A|, weight 1, loss = mean over the kept units."""
    result = CPPOPruner(0.5, scope).select_completions(p["adv"].expand(d, B, G))
    keep = result.keep
    den = torch.tensor(
        [loss_denominator(cfg.aggregation, 1, int(k.sum()), p["lengths"][k].view(1, -1), None, L) for k in keep[:2]],
        dtype=DT,
    )
    den = den[:1].expand(d).clone()  # the kept set is the same in every draw (deterministic)
    return result.weight.to(DT), den


LOSS_GRID = [(pl, agg) for pl in ("ppo_clip", "gspo") for agg in AGGREGATIONS]
GRID_IDS = [f"{pl}-{agg}" for pl, agg in LOSS_GRID]


def monte_carlo_z(p, cfg, weights, den) -> torch.Tensor:
    samples = pruned_losses_and_grads(p, cfg, weights, den)
    return mc_z(samples, full_target(p, cfg))


# ------------------------------------------------------------------------------------------------------------
# Invariant (3): mean pruned loss and gradient = full-batch ones, every loss x aggregation, clipping + KL on
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["bernoulli", "fixed_size"])
@pytest.mark.parametrize("policy_loss, aggregation", LOSS_GRID, ids=GRID_IDS)
def test_pruned_loss_and_gradient_are_unbiased(policy_loss, aggregation, mode):
    p = make_problem()
    cfg = config(policy_loss, aggregation)
    # the setting is not trivial: clipping is active on some tokens and not others, KL contributes
    f = p["mask"].reshape(-1)
    _, metrics = per_token_objective(p["logp"].reshape(-1), p["old"].reshape(-1),
                                     p["adv"][..., None].expand(B, G, L).reshape(-1), f,
                                     torch.arange(B * G).repeat_interleave(L), cfg, p["ref"].reshape(-1))
    assert 0 < float(metrics["clipped_tokens"]) < float(metrics["tokens"])
    assert float(metrics["kl_sum"]) > 0
    weights, den = dppo_draws(p, cfg, mode)
    kept = (weights > 0).to(DT).mean()
    assert 0.4 < kept < 0.9, kept  # prompt and completion pruning both happen
    z = monte_carlo_z(p, cfg, weights, den)
    assert z.max() < Z_OK, f"max z {z.max():.2f} at statistic {int(z.argmax())} (0 = loss, then gradient entries)"
    assert z.numel() == 1 + int(p["lengths"].sum())


# ------------------------------------------------------------------------------------------------------------
# Invariant (6): the same Monte-Carlo test detects the bias of deterministic mode and CPPO (and of naive weights)
# ------------------------------------------------------------------------------------------------------------
BIASED_CASES = [(pr, pl, agg) for pr in ("dppo-deterministic", "cppo-group", "cppo-batch") for pl, agg in LOSS_GRID]
BIASED_CASES += [("fixed_size-naive-weight", "ppo_clip", "token_mean"),
                 ("fixed_size-naive-weight", "gspo", "seq_mean_token_mean")]


@pytest.mark.parametrize("pruner, policy_loss, aggregation", BIASED_CASES, ids=["-".join(c) for c in BIASED_CASES])
def test_biased_pruners_fail_the_same_test(pruner, policy_loss, aggregation):
    # deterministic mode and CPPO decide the same way in every draw (SE = 0): z = bias / round-off floor, so fewer
    # draws suffice; the naive-weight fixed_size case is random and uses the full DRAWS of the unbiased test
    p = make_problem()
    cfg = config(policy_loss, aggregation)
    if pruner == "dppo-deterministic":
        weights, den = dppo_draws(p, cfg, "deterministic", d=200)
    elif pruner.startswith("cppo"):
        weights, den = cppo_draws(p, cfg, pruner.split("-")[1], d=200)
    else:
        weights, den = naive_fixed_size_draws(p, cfg)
    z = monte_carlo_z(p, cfg, weights, den)
    assert z.max() > Z_BIASED, f"bias not detected: max z {z.max():.2f}"


# ------------------------------------------------------------------------------------------------------------
# Invariant (2): E[keep * w] = 1 for every unit
# ------------------------------------------------------------------------------------------------------------
def _keep_times_weight(level: str, mode: str, d: int = 20000):
    p = make_problem()
    pruner = DPPOPruner(0.3, 0.6, mode)
    if level == "prompt":
        history = torch.tensor([NAN, 0.0, 0.3, 1.2, 0.5, 2.0, 0.1, 0.05, NAN, 0.7], dtype=DT)
        result = pruner.select_prompts(history.expand(d, -1), make_generator(1, 2, "prompts"))
    else:
        result = pruner.select_completions(p["adv"].expand(d, B, G), make_generator(1, 2, "completions"))
    return result, result.keep.to(DT) * result.weight.to(DT)


@pytest.mark.parametrize("level", ["prompt", "completion"])
@pytest.mark.parametrize("mode", ["bernoulli", "fixed_size"])
def test_keep_times_weight_has_mean_one(level, mode):
    result, kw = _keep_times_weight(level, mode)
    z = mc_z(kw, torch.ones_like(kw[0]))
    assert z.max() < Z_OK, z
    cand = result.candidate[0]
    assert cand.any() and (~cand).any()
    assert (kw.std(0)[cand] > 0).all()  # candidates are actually pruned at random
    assert torch.equal(kw[:, ~cand], torch.ones_like(kw[:, ~cand]))  # non-candidates: always kept, weight 1


@pytest.mark.parametrize("level", ["prompt", "completion"])
def test_keep_times_weight_is_biased_in_deterministic_mode(level):
    _, kw = _keep_times_weight(level, "deterministic")
    assert mc_z(kw, torch.ones_like(kw[0])).max() > Z_BIASED


# ------------------------------------------------------------------------------------------------------------
# Variance formula of section 2.1 (bernoulli) vs the Monte-Carlo variance of J_hat
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy_loss, aggregation", [("ppo_clip", "seq_mean_token_mean"), ("gspo", "token_mean")])
def test_variance_formula_matches_monte_carlo(policy_loss, aggregation):
    p = make_problem()
    cfg = config(policy_loss, aggregation)
    # per-unit terms g_qi (already divided by D): the full loss with one unit's weight set to 1, others 0
    unit = torch.eye(B * G, dtype=DT).view(B * G, B, G)
    g = pruned_losses_and_grads(p, cfg, unit, torch.full((B * G,), full_denominator(p, cfg), dtype=DT), False)[:, 0]
    g = g.view(B, G)
    pruner = DPPOPruner(R_Q, R_O, "bernoulli")
    pi_q = pruner.select_prompts(p["history"], make_generator(0, 0, "p")).keep_prob
    pi_iq = pruner.select_completions(p["adv"], make_generator(0, 0, "c")).keep_prob
    var_q = ((1 / pi_iq - 1) * g**2).sum(1)
    var_formula = ((1 / pi_q - 1) * g.sum(1) ** 2 + var_q / pi_q).sum()
    weights, den = dppo_draws(p, cfg, "bernoulli", d=10000)
    losses = pruned_losses_and_grads(p, cfg, weights, den, with_grad=False)[:, 0]
    target = full_target(p, cfg)[0]
    assert torch.allclose(g.sum(), target, rtol=1e-10)  # the units add up to the full loss
    # E[(J_hat - J)^2] = Var(J_hat) since E[J_hat] = J: judge the squared deviations with the same helper
    z = mc_z(((losses - target) ** 2)[:, None], var_formula.view(1))
    assert var_formula > 0 and z.max() < Z_OK, (float(var_formula), float(((losses - target) ** 2).mean()))
    # ... and the test can fail: the variance of a different rate is rejected
    pi_wrong = torch.where(pi_iq < 1, torch.full_like(pi_iq, 0.6), pi_iq)
    var_wrong = ((1 / pi_q - 1) * g.sum(1) ** 2 + ((1 / pi_wrong - 1) * g**2).sum(1) / pi_q).sum()
    z_wrong = mc_z(((losses - target) ** 2)[:, None], var_wrong.view(1)).max()
    assert z_wrong > Z_OK, (float(z), float(z_wrong))


# ------------------------------------------------------------------------------------------------------------
# Invariant (1): r_q = r_o = 0 reproduces GRPO bit for bit
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["bernoulli", "fixed_size", "deterministic"])
@pytest.mark.parametrize("policy_loss, aggregation", LOSS_GRID, ids=GRID_IDS)
def test_zero_rates_reproduce_grpo_bit_for_bit(policy_loss, aggregation, mode):
    p = make_problem(dtype=torch.float32)
    cfg = config(policy_loss, aggregation)
    pruner = DPPOPruner(0.0, 0.0, mode)
    prompts = pruner.select_prompts(p["history"], make_generator(3, 7, "prompts"))
    completions = pruner.select_completions(p["adv"], make_generator(3, 7, "completions"))
    result = combine(prompts, completions)
    assert result.keep.all() and torch.equal(result.weight, torch.ones(B, G))
    lengths = p["lengths"].reshape(-1)
    flat = dict(old=p["old"].reshape(-1), adv=p["adv"][..., None].expand(B, G, L).reshape(-1),
                mask=p["mask"].reshape(-1), seq=torch.arange(B * G).repeat_interleave(L), ref=p["ref"].reshape(-1))

    def loss_and_grad(seq_weight, prompt_keep_prob):
        leaf = p["logp"].reshape(-1).clone().requires_grad_()
        tw = sequence_token_weights(cfg.aggregation, seq_weight, lengths).repeat_interleave(L)
        num, _ = loss_numerator(leaf, flat["old"], flat["adv"], tw, flat["mask"], flat["seq"], cfg, flat["ref"])
        loss = num / loss_denominator(cfg.aggregation, B, G, p["lengths"], prompt_keep_prob, L)
        return loss, torch.autograd.grad(loss, leaf)[0]

    grpo_loss, grpo_grad = loss_and_grad(torch.ones(B * G), None)  # plain GRPO: no pruner at all
    dppo_loss, dppo_grad = loss_and_grad(result.weight.reshape(-1), prompts.keep_prob[prompts.keep])
    assert torch.equal(dppo_loss, grpo_loss)
    assert torch.equal(dppo_grad, grpo_grad)
    # and the GRPO path is the formula of section 1
    ref = -reference_objective(p["logp"], p["old"], p["adv"], p["mask"], cfg, p["ref"])
    assert torch.allclose(grpo_loss, ref, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# Token-mean denominator under prompt pruning: Horvitz-Thompson T_hat is unbiased for T_full
# ------------------------------------------------------------------------------------------------------------
def test_horvitz_thompson_token_count_is_unbiased():
    p = make_problem()
    d = 3000
    prompts = DPPOPruner(R_Q, 0.0).select_prompts(p["history"].expand(d, B), make_generator(5, 0, "prompts"))
    t_hat = torch.tensor([
        loss_denominator("token_mean", B, G, p["lengths"][k], prompts.keep_prob[i][k], None)
        for i, k in enumerate(prompts.keep)
    ], dtype=DT)
    t_full = float(p["lengths"].sum())
    assert t_hat.std() > 0
    assert mc_z(t_hat[:, None], torch.tensor([t_full], dtype=DT)).max() < Z_OK


# ------------------------------------------------------------------------------------------------------------
# Candidate rules, fixed_size counts, weights (section 2.1)
# ------------------------------------------------------------------------------------------------------------
def test_prompt_candidate_rule():
    history = torch.tensor([NAN, 0.0, 0.3, 1.2, 0.5, 2.0])  # mean of seen = 0.8
    result = DPPOPruner(0.5, 0.5, "deterministic").select_prompts(history)
    assert result.candidate.tolist() == [False, True, True, False, True, False]
    # never-seen prompts are never candidates; a batch of unseen prompts is kept whole with weight 1
    fresh = DPPOPruner(0.9, 0.9).select_prompts(torch.full((5,), NAN), make_generator(0, 0))
    assert not fresh.candidate.any() and fresh.keep.all() and torch.equal(fresh.weight, torch.ones(5))
    # h == 0 is a candidate even when it equals the mean (every seen prompt had a constant group)
    zeros = DPPOPruner(0.5, 0.5, "deterministic").select_prompts(torch.tensor([0.0, 0.0, NAN]))
    assert zeros.candidate.tolist() == [True, True, False]


def test_completion_candidate_rule():
    adv = torch.tensor([[0.0, 0.1, -2.0, 2.0], [0.0, 0.0, 0.0, 0.0], [0.8660254, -0.8660254, -0.8660254, 0.8660254]])
    result = DPPOPruner(0.5, 0.5, "deterministic").select_completions(adv)
    assert result.candidate.tolist() == [[True, True, False, False], [True] * 4, [False] * 4]


@pytest.mark.parametrize("rate", [0.3, 0.5, 0.9])
def test_fixed_size_prunes_exact_count_with_exact_weight(rate):
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(200, 10, generator=gen)
    adv[:, :3] *= 0.01  # at least 3 candidates per group
    result = DPPOPruner(0.0, rate, "fixed_size").select_completions(adv, make_generator(0, 1))
    n_cand = result.candidate.sum(1)
    n_prune = (rate * n_cand.double() + 1e-9).floor().long()
    assert torch.equal((result.candidate & ~result.keep).sum(1), n_prune)
    assert not (~result.candidate & ~result.keep).any()
    exact = (1 - n_prune.double() / n_cand.double())[:, None].expand_as(result.keep_prob)
    assert torch.equal(result.keep_prob[result.candidate], exact[result.candidate])
    assert torch.allclose(result.weight[result.keep & result.candidate].double(),
                          1 / exact[result.keep & result.candidate], rtol=1e-7)


def test_deterministic_prunes_lowest_scores_and_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(pruning, "_warned_deterministic", False)
    with caplog.at_level(logging.WARNING, logger="megatron_dppo.algo.pruning"):
        DPPOPruner(0.5, 0.5, "deterministic")
        DPPOPruner(0.5, 0.5, "deterministic")
    assert sum("BIASED" in r.message for r in caplog.records) == 1
    adv = torch.tensor([[0.3, -0.1, 3.0, 0.2, -0.0]])  # candidates (|A| < 0.72): 0.3, 0.1, 0.2, 0.0
    result = DPPOPruner(0.0, 0.5, "deterministic").select_completions(adv)
    assert result.keep.tolist() == [[True, False, True, True, False]]  # the 2 smallest |A| pruned


def test_same_generator_seed_same_decision():
    # invariant (5) support: a decision is a pure function of (inputs, generator seed), so broadcasting the
    # decision from one rank or re-drawing with the same seed agree
    p = make_problem()
    pruner = DPPOPruner(0.5, 0.5)
    a = pruner.select_completions(p["adv"], make_generator(11, 3, "completions"))
    b = pruner.select_completions(p["adv"], make_generator(11, 3, "completions"))
    assert torch.equal(a.keep, b.keep) and torch.equal(a.weight, b.weight)
    draws = [make_generator(11, s, "completions").initial_seed() for s in range(50)]
    assert len(set(draws)) == 50 and make_generator(11, 3, "prompts").initial_seed() != draws[3]
    steps = [pruner.select_completions(p["adv"], make_generator(11, s, "completions")).keep for s in range(10)]
    assert any(not torch.equal(k, steps[0]) for k in steps[1:])  # other steps draw differently


def test_random_modes_require_a_generator():
    with pytest.raises(ValueError, match="Generator"):
        DPPOPruner(0.5, 0.5).select_completions(torch.randn(2, 4))
    with pytest.raises(ValueError, match="Generator"):
        DPPOPruner(0.5, 0.5, "fixed_size").select_prompts(torch.rand(4), generator=123)


def test_combine_compacted_rows_and_weights():
    prompts = DPPOPruner(0.5, 0.0, "deterministic").select_prompts(torch.tensor([0.0, 1.0, 0.1, 2.0, NAN]))
    # candidates 0 and 2 (h < 0.775); n = 1 pruned: prompt 0 (lowest); prompt 2 kept with pi = 1/2
    assert prompts.keep.tolist() == [False, True, True, True, True]
    adv = torch.tensor([[0.0, 0.0, 1.0, -1.0]] * 4)  # one row per KEPT prompt
    completions = DPPOPruner(0.0, 0.5, "deterministic").select_completions(adv)
    result = combine(prompts, completions)
    assert result.keep.shape == (5, 4) and not result.keep[0].any()
    # kept candidate prompt (pi_q = 1/2): 1/(0.5 * 0.5) for its kept candidate completion, 1/0.5 for the others
    assert torch.equal(result.weight[2], torch.tensor([0.0, 4.0, 2.0, 2.0]))
    assert torch.equal(result.weight[1], torch.tensor([0.0, 2.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="rows"):
        combine(prompts, DPPOPruner(0.0, 0.5, "deterministic").select_completions(torch.randn(3, 4)))


def test_prune_result_properties_and_stats():
    r = PruneResult(keep=torch.tensor([True, True, False, True]), weight=torch.tensor([2.0, 2.0, 0.0, 1.0]),
                    candidate=torch.tensor([True, True, True, False]))
    assert r.kept_fraction == 0.75
    assert r.ess == pytest.approx(25 / 9)
    none = PruneResult(keep=torch.zeros(3, dtype=torch.bool), weight=torch.zeros(3))
    assert none.ess == 0.0 and none.kept_fraction == 0.0
    stats = pruning_stats(prompt=r, completion=r, combined=r)
    assert stats["prune/prompt_kept_fraction"] == 0.75 and stats["prune/completion_candidates"] == 3
    assert stats["prune/total_ess"] == pytest.approx(25 / 9) and stats["prune/total_units"] == 4
    with pytest.raises(ValueError, match="bool"):
        PruneResult(keep=torch.ones(2), weight=torch.ones(2))


# ------------------------------------------------------------------------------------------------------------
# Invariant (4): CPPO scopes keep exactly the counts; allocation arithmetic
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate, group", [(0.5, 4), (0.3, 8), (0.9, 10), (0.0, 6), (0.75, 16)])
def test_cppo_group_scope_keeps_top_k_per_prompt(rate, group):
    adv = torch.randn(7, group, generator=torch.Generator().manual_seed(group))
    result = CPPOPruner(rate, "group").select_completions(adv)
    k = math.floor(group * (1 - rate) + 1e-9)
    assert torch.equal(result.keep.sum(1), torch.full((7,), k))
    kept_min = torch.where(result.keep, adv.abs(), torch.inf).min(1).values
    pruned_max = torch.where(result.keep, -torch.inf, adv.abs()).max(1).values
    assert (kept_min >= pruned_max).all()
    assert torch.equal(result.weight, result.keep.float())


@pytest.mark.parametrize("rate", [0.5, 0.3, 0.9])
def test_cppo_batch_scope_keeps_top_k_overall(rate):
    adv = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    result = CPPOPruner(rate, "batch").select_completions(adv)
    k = math.floor(40 * (1 - rate) + 1e-9)
    assert int(result.keep.sum()) == k
    assert adv.abs()[result.keep].min() >= adv.abs()[~result.keep].max()
    assert result.keep.sum(1).unique().numel() > 1  # not per group


def test_cppo_ties_random_with_generator_else_by_index():
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    assert CPPOPruner(0.5).select_completions(adv).keep.tolist() == [[True, True, False, False]]
    picks = {tuple(CPPOPruner(0.5).select_completions(adv, make_generator(0, s)).keep[0].tolist()) for s in range(40)}
    assert len(picks) > 1 and all(sum(pk) == 2 for pk in picks)


@pytest.mark.parametrize(
    "rate, b, g, expect", [(0.5, 32, 16, 64), (0.0, 32, 16, 32), (0.3, 10, 8, 16), (0.75, 8, 16, 32)]
)
def test_cppo_allocation_prunes_back_to_update_batch(rate, b, g, expect):
    pruner = CPPOPruner(rate, "group", allocation=True)
    assert pruner.prompts_to_draw(b, g) == expect
    assert CPPOPruner(rate, "batch").prompts_to_draw(b) == math.ceil(b / (1 - rate) - 1e-9)
    for scope in ("group", "batch"):
        p = CPPOPruner(rate, scope, allocation=True)
        n = p.prompts_to_draw(b, g)
        adv = torch.randn(n, g, generator=torch.Generator().manual_seed(n))
        result = p.select_allocated(adv, b)
        assert int(result.keep.sum()) == b * g
        if scope == "group":
            assert (result.keep.sum(1) <= math.floor(g * (1 - rate) + 1e-9)).all()
    with pytest.raises(ValueError, match="needs"):
        CPPOPruner(0.5, "batch").select_allocated(torch.randn(b, g), b)


def test_cppo_rejects_rates_that_keep_nothing():
    with pytest.raises(ValueError, match="0 of 4"):
        CPPOPruner(0.9, "group").select_completions(torch.randn(3, 4))


# ------------------------------------------------------------------------------------------------------------
# Zero-variance filter, prompt history
# ------------------------------------------------------------------------------------------------------------
def test_zero_variance_filter_exact_equality():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0 + 1.2e-7], [0.0, 0.0, 0.0], [0.0, 1.0, 0.5]])
    result = zero_variance_filter(rewards)
    assert result.keep.tolist() == [[False] * 3, [True] * 3, [False] * 3, [True] * 3]
    assert torch.equal(result.weight, result.keep.float())
    with pytest.raises(ValueError, match="G = 1"):
        zero_variance_filter(torch.ones(3, 1))


def test_prompt_history_scores_ema_and_checkpoint_roundtrip(tmp_path):
    hist = PromptHistory()
    hist.update([3, "abc"], torch.tensor([[1.0, -1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]]))
    s = hist.scores(torch.tensor([3, 7]))
    assert s[0] == 1.0 and math.isnan(s[1])
    assert hist.scores(["abc"]).tolist() == [0.0]
    hist.update([3], torch.tensor([[3.0, 3.0, 3.0, 3.0]]))
    assert hist.scores([3]).tolist() == [3.0]  # no EMA: the last group
    ema = PromptHistory(ema_alpha=0.25)
    ema.update([1], torch.tensor([[4.0, 4.0]]))
    ema.update([1], torch.tensor([[0.0, 0.0]]))
    assert ema.scores([1]).tolist() == [3.0]  # 0.25 * 0 + 0.75 * 4
    # plain Python types: survives JSON and torch.save (weights_only)
    state = json.loads(json.dumps(ema.state_dict()))
    restored = PromptHistory(ema_alpha=0.25)
    restored.load_state_dict(state)
    assert restored.state_dict() == ema.state_dict()
    torch.save(hist.state_dict(), tmp_path / "h.pt")
    again = PromptHistory()
    again.load_state_dict(torch.load(tmp_path / "h.pt", weights_only=True))
    assert again.scores([3, "abc", 99])[:2].tolist() == [3.0, 0.0] and len(again) == 2
    with pytest.raises(ValueError, match="format"):
        again.load_state_dict({"ids": [], "scores": []})


@pytest.mark.parametrize("alpha", [0.0, 1.5, -0.1, float("nan")])
def test_prompt_history_bad_alpha(alpha):
    with pytest.raises(ValueError, match="ema_alpha"):
        PromptHistory(ema_alpha=alpha)


def test_prompt_history_bad_ids_and_shapes():
    with pytest.raises(ValueError, match="ids"):
        PromptHistory().update([1.5], torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"\[2, G\]"):
        PromptHistory().update([1, 2], torch.zeros(3, 2))


# ------------------------------------------------------------------------------------------------------------
# Bad input -> ValueError naming the value
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, float("nan"), float("inf")])
def test_rates_outside_unit_interval_rejected(rate):
    with pytest.raises(ValueError, match=f"r_q.*{rate}"):
        DPPOPruner(rate, 0.0)
    with pytest.raises(ValueError, match=f"r_o.*{rate}"):
        DPPOPruner(0.0, rate)
    with pytest.raises(ValueError, match=f"rate.*{rate}"):
        CPPOPruner(rate)


def test_unknown_mode_and_scope_rejected():
    with pytest.raises(ValueError, match="'greedy'.*bernoulli, fixed_size, deterministic"):
        DPPOPruner(0.1, 0.1, "greedy")
    with pytest.raises(ValueError, match="'global'.*group, batch"):
        CPPOPruner(0.5, "global")


def test_bad_advantages_and_history_rejected():
    pruner = DPPOPruner(0.5, 0.5)
    gen = make_generator(0, 0)
    adv = torch.zeros(2, 3)
    adv[1, 2] = NAN
    with pytest.raises(ValueError, match=r"nan at position \(1, 2\)"):
        pruner.select_completions(adv, gen)
    with pytest.raises(ValueError, match="inf"):
        pruner.select_prompts(torch.tensor([0.1, float("inf"), NAN]), gen)
    with pytest.raises(ValueError, match="-0.5"):
        pruner.select_prompts(torch.tensor([0.1, -0.5]), gen)
    with pytest.raises(ValueError, match="empty"):
        pruner.select_prompts(torch.zeros(0), gen)
    with pytest.raises(ValueError, match="empty"):
        pruner.select_completions(torch.zeros(0, 4), gen)
    with pytest.raises(ValueError, match="empty"):
        CPPOPruner(0.5).select_completions(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="at least 2"):
        pruner.select_completions(torch.zeros(4), gen)
