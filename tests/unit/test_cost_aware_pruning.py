"""Cost-aware DPPO with multi-turn episodes as units (``keep="optimal", keep_cost="tokens"``): the water-filling
solution pi = clip(t s / sqrt(c), lo, 1) at a fixed expected cost, and unbiasedness of the pruned loss and
gradient with EPISODES as the pruning and advantage units at both levels (a pruned prompt skips its G episodes),
through masked THD packing (observation tokens mask 0), in the Monte-Carlo harness of test_pruning.py (same z
thresholds). Negative controls fail the same test: dropping the most expensive episodes (the "fast-episode bias"
of discard-and-requeue schedulers) and weighting a cost-aware draw by the cost-blind probabilities."""
from __future__ import annotations

import math

import pytest
import test_pruning as TP
import torch

from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.losses import (
    LossConfig,
    loss_denominator,
    loss_numerator,
    reference_objective,
    sequence_token_weights,
)
from megatron_dppo.algo.optimal_keep import cost_water_fill, water_fill
from megatron_dppo.algo.pruning import DPPOPruner, PruneResult, combine, make_generator
from megatron_dppo.packing import build_thd_batch

DT = torch.float64
B, G = 6, 4
DRAWS = 4000
NAN = float("nan")


# ------------------------------------------------------------------------------------------------------------
# Water-filling with costs
# ------------------------------------------------------------------------------------------------------------
def variance(pi, s):
    pos = s > 0
    return float(((1 - pi[pos]) / pi[pos] * s[pos] ** 2).sum())


def test_cost_water_fill_meets_the_cost_budget_in_the_signal_over_root_cost_form():
    s = torch.tensor([0.0, 0.2, 0.5, 0.5, 1.0, 2.0, 3.0, 0.7, 1.5, 0.0], dtype=DT)
    c = torch.tensor([10.0, 40, 10, 90, 20, 300, 15, 60, 30, 25], dtype=DT)
    lo = torch.full_like(s, 0.05)
    forced = torch.zeros_like(s, dtype=torch.bool)
    forced[9] = True
    budget = 0.45 * float(c.sum())
    pi = cost_water_fill(s, c, budget, floor=lo, forced=forced)
    assert pi[9] == 1.0 and float((pi * c).sum()) == pytest.approx(budget, rel=1e-9)
    inside = (pi > lo + 1e-12) & (pi < 1 - 1e-12) & ~forced
    t = pi[inside] * c[inside].sqrt() / s[inside]
    assert inside.sum() >= 3 and torch.allclose(t, t[0].expand_as(t), rtol=1e-9)  # pi = t s / sqrt(c)
    # equal costs: exactly the cost-blind water-filling with the budget in units
    same = cost_water_fill(s, torch.full_like(s, 7.0), 7.0 * 4.5, floor=lo)
    torch.testing.assert_close(same, water_fill(s, 4.5, floor=lo), rtol=1e-12, atol=1e-12)


def test_cost_water_fill_minimises_the_variance_at_its_expected_cost():
    gen = torch.Generator().manual_seed(4)
    s = torch.rand(12, generator=gen, dtype=DT) ** 2 * 3
    c = 5 + 95 * torch.rand(12, generator=gen, dtype=DT)
    budget = 0.4 * float(c.sum())
    best = variance(cost_water_fill(s, c, budget, floor=0.05), s)
    x = torch.rand(300, 12, generator=gen, dtype=DT) + 1e-3  # other feasible allocations, same expected cost
    for pi in cost_water_fill(x, c.expand(300, 12), budget, floor=0.05):
        assert float((pi * c).sum()) == pytest.approx(budget, rel=1e-9)
        assert variance(pi, s) >= best - 1e-9
    blind = water_fill(s, budget / float(c.mean()), floor=0.05)  # cost-blind pi, rescaled to the same cost
    scale = budget / float((blind * c).sum())
    assert variance((blind * scale).clamp(max=1.0), s) > best


def test_cost_water_fill_edges_and_errors():
    s = torch.tensor([0.0, 1.0, 2.0], dtype=DT)
    c = torch.tensor([1.0, 2.0, 4.0], dtype=DT)
    torch.testing.assert_close(cost_water_fill(s, c, 100.0, floor=0.0), torch.tensor([0.0, 1.0, 1.0], dtype=DT))
    spread = cost_water_fill(s, c, 6.5, floor=0.1)  # budget beyond what positive scores take: to the blind unit
    torch.testing.assert_close(spread, torch.tensor([0.5, 1.0, 1.0], dtype=DT))  # 0.5*1 + 2 + 4 = 6.5
    for bad in (torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, float("inf"), 1.0])):
        with pytest.raises(ValueError, match="costs > 0"):
            cost_water_fill(s, bad.double(), 1.0)
    with pytest.raises(ValueError, match="needs keep='optimal'"):
        DPPOPruner(0.5, 0.5, keep="uniform", keep_cost="tokens")
    with pytest.raises(ValueError, match="needs costs"):
        DPPOPruner(0.5, 0.5, keep="optimal", keep_cost="tokens").select_prompts(
            torch.tensor([0.1, 0.2], dtype=DT), make_generator(0, 0, "p"))
    with pytest.raises(ValueError, match="DPPO keep cost"):
        DPPOPruner(0.5, 0.5, keep="optimal", keep_cost="flops")


# ------------------------------------------------------------------------------------------------------------
# Episodes as units: B prompts x G episodes, each prompt + assistant turns + observations (mask 0)
# ------------------------------------------------------------------------------------------------------------
def make_episodes(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    seqs, prompt_lengths, masks = [], [], []
    for q in range(B):
        prompt = torch.randint(1, 60, (2 + q % 3,), generator=gen).tolist()
        for i in range(G):
            turns = 1 + (q + i) % 3
            mask = []
            for t in range(turns):
                mask += [1] * int(torch.randint(1, 4, (1,), generator=gen))
                if t < turns - 1:
                    mask += [0] * int(torch.randint(3, 7, (1,), generator=gen))
            seqs.append(prompt + torch.randint(1, 60, (len(mask),), generator=gen).tolist())
            prompt_lengths.append(len(prompt))
            masks.append(mask)
    L = max(len(m) for m in masks)
    mask = torch.zeros(B * G, L, dtype=DT)
    for k, m in enumerate(masks):
        mask[k, : len(m)] = torch.tensor(m, dtype=DT)
    mask = mask.view(B, G, L)
    logp = torch.randn(B, G, L, generator=gen, dtype=DT) * 0.5 - 1.0
    old = logp + torch.randn(B, G, L, generator=gen, dtype=DT) * 0.3
    ref = logp + torch.randn(B, G, L, generator=gen, dtype=DT) * 0.2
    old[mask == 0], ref[mask == 0] = 0.0, 0.0
    rewards = torch.randn(B, G, generator=gen, dtype=DT)
    rewards[0] = 1.0  # zero-variance group: A = 0 (its KL term still matters)
    rewards[1] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    cost = torch.tensor([len(s) for s in seqs], dtype=DT).view(B, G)  # prompt + sampled + observation tokens
    return dict(seqs=seqs, prompt_lengths=prompt_lengths, masks=masks, mask=mask, logp=logp, old=old, ref=ref,
                adv=compute_advantages(rewards, "grpo"), trained=mask.sum(-1), cost=cost, L=L,
                history=torch.tensor([NAN, 0.0, 0.3, 1.2, 0.5, 2.0], dtype=DT))


def config(aggregation: str, policy_loss: str = "ppo_clip") -> LossConfig:
    eps = (0.2, 0.28) if policy_loss == "ppo_clip" else (0.05, 0.05)
    return LossConfig(policy_loss=policy_loss, eps_low=eps[0], eps_high=eps[1], kl_coef=0.1, kl_estimator="k3",
                      aggregation=aggregation).resolved()


def unit_values(p: dict, cfg: LossConfig, den: float) -> torch.Tensor:
    """[B*G, 1 + T]: each episode's term of the loss and of its gradient w.r.t. the T trained-token log-probs,
    through masked THD packing with weight 1. The pruned loss is linear in the per-episode weights w (D fixed),
    so a draw's loss and gradient are sum_k w_k * values[k]."""
    n = B * G
    flat_mask = p["mask"].view(n, -1)
    positions = flat_mask.nonzero()  # (episode, completion index) of every trained token, in order
    values = torch.zeros(n, 1 + positions.shape[0], dtype=DT)
    ones = torch.ones(n, dtype=DT)
    token_w = sequence_token_weights(cfg.aggregation, ones, p["trained"].flatten())
    for k in range(n):
        b = build_thd_batch([p["seqs"][k]], [p["prompt_lengths"][k]], [k], [float(p["adv"].flatten()[k])],
                            [float(token_w[k])], loss_masks=[p["masks"][k]])
        start, m = p["prompt_lengths"][k] - 1, len(p["masks"][k])

        def at(x):
            out = torch.zeros(b.tokens.shape[0], dtype=DT)
            out[start: start + m] = x.view(n, -1)[k, :m]
            return out

        logp = at(p["logp"]).requires_grad_()
        num, _ = loss_numerator(logp, at(p["old"]), b.advantages.to(DT), b.token_weight.to(DT), b.loss_mask,
                                b.seq_index, cfg, at(p["ref"]))
        (grad,) = torch.autograd.grad(num / den, logp)
        assert bool((grad[b.loss_mask == 0] == 0).all())  # observation tokens: no gradient
        values[k, 0] = num.detach() / den
        mine = positions[:, 0] == k
        values[k, 1:][mine] = grad[start: start + m][b.loss_mask[start: start + m] > 0]
    return values


def target(p: dict, cfg: LossConfig, den: float) -> torch.Tensor:
    leaf = p["logp"].clone().requires_grad_()
    loss = -reference_objective(leaf, p["old"], p["adv"], p["mask"], cfg, p["ref"], denominator=den)
    (grad,) = torch.autograd.grad(loss, leaf)
    return torch.cat([loss.detach().view(1), grad[p["mask"] > 0]])


def pruner(mode="bernoulli", keep_cost="tokens", floor=0.1) -> DPPOPruner:
    return DPPOPruner(0.4, 0.5, mode, keep="optimal", keep_floor=floor, zero_advantage_gradient=True,
                      keep_cost=keep_cost)


def draws(p, prune: DPPOPruner, d=DRAWS, seed=0) -> tuple[PruneResult, PruneResult]:
    """d independent decisions of both levels as a step makes them: prompt costs = the expected cost of G
    episodes (the mean of the prompt's last group; unknown for the never-seen prompt), completion costs = each
    episode's tokens."""
    prompt_costs = (G * p["cost"].mean(-1)).clone()
    prompt_costs[torch.isnan(p["history"])] = NAN
    costs = prompt_costs.expand(d, B) if prune.keep_cost == "tokens" else None
    prompts = prune.select_prompts(p["history"].expand(d, B), make_generator(seed, 0, "prompts"), costs=costs)
    completions = prune.select_completions(
        p["adv"].expand(d, B, G), make_generator(seed, 0, "completions"), lengths=p["trained"].expand(d, B, G),
        prompt_prob=prompts.probabilities(), generated=prompts.keep,
        costs=p["cost"].expand(d, B, G) if prune.keep_cost == "tokens" else None)
    return prompts, completions


AGGREGATIONS = ["seq_mean_token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum"]


@pytest.mark.parametrize("mode", ["bernoulli", "fixed_size"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_cost_aware_pruning_of_episodes_is_unbiased(aggregation, mode):
    p = make_episodes()
    cfg = config(aggregation, "gspo" if aggregation == "seq_mean_token_sum" else "ppo_clip")
    den = loss_denominator(aggregation, B, G, p["trained"], None, int(p["trained"].max()))
    values = unit_values(p, cfg, den)
    full = target(p, cfg, den)
    torch.testing.assert_close(values.sum(0), full, rtol=1e-5, atol=1e-9)  # the packed masked path = reference
    prompts, completions = draws(p, pruner(mode))
    weights = combine(prompts, completions).weight.to(DT).view(DRAWS, B * G)
    # both levels prune, per-episode probabilities, cheaper episodes kept more often at equal signal
    kept = float((weights > 0).to(DT).mean())
    assert 0.2 < kept < 0.8 and torch.unique(weights[weights > 0]).numel() > 5
    z = TP.mc_z(weights @ values, full)
    assert z.max() < TP.Z_OK, f"max z {z.max():.2f} at statistic {int(z.argmax())} (0 = loss, then gradient)"


def test_the_rule_spends_less_compute_per_unit_of_variance():
    """At the same expected compute (tokens), cost-aware probabilities predict less added variance than the
    cost-blind optimal rule, and keep the expected cost at its budget."""
    p = make_episodes()
    s = p["adv"].abs() + 0.0
    c = p["cost"]
    budget = 0.5 * float(c.sum())
    aware = cost_water_fill(s.flatten(), c.flatten(), budget, floor=0.1)
    blind = water_fill(s.flatten(), 0.5 * B * G, floor=0.1)
    t = torch.tensor(1.0, dtype=DT)  # scale the blind rule to the same expected cost
    lo, hi = torch.tensor(0.0, dtype=DT), torch.tensor(10.0, dtype=DT)
    for _ in range(100):
        t = (lo + hi) / 2
        if float(((blind * t).clamp(0.1, 1.0) * c.flatten()).sum()) > budget:
            hi = t
        else:
            lo = t
    blind = (blind * lo).clamp(0.1, 1.0)
    assert float((aware * c.flatten()).sum()) == pytest.approx(budget, rel=1e-9)
    assert variance(aware, s.flatten()) < variance(blind, s.flatten())


NEGATIVE = ["drop-expensive-episodes", "cost-blind-weights"]


@pytest.mark.parametrize("case", NEGATIVE)
def test_negative_controls_fail_the_same_test(case):
    """Dropping the costliest quarter of the episodes with weight 1 (what a scheduler that discards slow episodes
    trains on), or drawing with cost-aware probabilities but weighting by the cost-blind ones: both biased, and
    the harness sees it."""
    p = make_episodes()
    cfg = config("seq_mean_token_mean")
    den = loss_denominator(cfg.aggregation, B, G, p["trained"])
    values, full = unit_values(p, cfg, den), target(p, cfg, den)
    if case == "drop-expensive-episodes":
        cheap = (p["cost"] <= p["cost"].flatten().quantile(0.75)).flatten().to(DT)
        weights = cheap.expand(DRAWS, B * G)
    else:
        prompts, completions = draws(p, pruner())
        drawn = combine(prompts, completions)
        blind = pruner(keep_cost="none")  # the cost-blind rule's probabilities for the same batch
        pi_q = blind.select_prompts(p["history"], make_generator(1, 0, "p")).probabilities()
        pi_c = blind.select_completions(p["adv"], make_generator(1, 0, "c"), lengths=p["trained"],
                                        prompt_prob=pi_q).probabilities()
        blind_pi = (pi_q[:, None] * pi_c).expand(DRAWS, B, G)
        assert bool((blind_pi > 0).all())
        weights = torch.where(drawn.keep, 1.0 / blind_pi, 0.0).to(DT).view(DRAWS, B * G)
    z = TP.mc_z(weights @ values, full)
    assert z.max() > TP.Z_BIASED, f"bias not detected: max z {z.max():.2f}"
    assert math.isfinite(float(z.max()))
