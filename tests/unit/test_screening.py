"""Prompt keep from the posterior and screen-then-continue (docs/algorithms.md, "Prompt posterior", "Screening"):
exactly unbiased for the full-G gradient. The potential full groups (binary rewards, G completions each) and their
per-token log-probs are fixed; only the coins are drawn: the prompt-level keep from the posterior, the
continuation after a k-screen (pi_c water-filled over the batch, so it depends on the other prompts' screens), and
the completion level's optimal keep on the full-group advantages. The pruned loss and its gradient, through the
engine's loss path of test_pruning.py, must match the unpruned full-G step within |z| < 4 for the grpo, dr_grpo and
gspo presets (PPO clipping active; grpo's KL term on). Two negative controls fail the same test: SPEED's rule (never
continue after a screen with one reward for all) and a prompt that can carry gradient kept with pi = 0."""

import math

import pytest
import test_pruning as TP
import torch

from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.gradient_energy import energy_curve
from megatron_dppo.algo.losses import LOSS_PRESETS
from megatron_dppo.algo.prompt_posterior import PromptPosterior, keep_probabilities
from megatron_dppo.algo.pruning import DPPOPruner, make_generator
from megatron_dppo.algo.screening import (
    ScreenDecision,
    continuation_probabilities,
    continuation_scores,
    decide_continuation,
    screening_denominator,
)

DT = torch.float64
B, G, L = TP.B, TP.G, TP.L  # 6 prompts x 4 completions of up to 6 tokens
K = 2  # screen size
Z_MAX = 4.0
DRAWS = 6000
R_Q, CONTINUE, R_O, MAX_WEIGHT = 0.3, 0.6, 0.3, 10.0
PRESETS = ["grpo", "dr_grpo", "gspo"]

# the potential full groups: the first K of each row are its screen
REWARDS = torch.tensor([[1, 1, 0, 1],   # constant screen, mixed group: SPEED never trains it
                        [0, 0, 0, 1],   # constant screen, mixed group
                        [1, 0, 1, 1],   # mixed screen
                        [0, 0, 0, 0],   # constant group: only the KL term (grpo preset)
                        [0, 1, 0, 0],   # mixed screen
                        [1, 1, 1, 1]], dtype=DT)


def problem(preset: str) -> tuple[dict, object]:
    p = TP.make_problem(seed=3)
    cfg = LOSS_PRESETS[preset]
    p["rewards"] = REWARDS
    p["adv"] = compute_advantages(REWARDS, cfg.advantage_estimator)
    return p, cfg


def posterior() -> PromptPosterior:
    """A posterior with some history, so the prompts' keep probabilities differ."""
    post = PromptPosterior(G, gamma=1.5)
    gen = torch.Generator().manual_seed(11)
    for step in range(4):
        post.update(list(range(B)), (torch.rand(B, G, generator=gen, dtype=DT) < 0.5).double(), step)
    post.update([0, 5], torch.ones(2, G, dtype=DT), 4)
    post.update([3], torch.zeros(1, G, dtype=DT), 4)
    return post


def draws(p: dict, cfg, estimator: str, rule: str = "exact", d: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """Weights [d, B, G] of posterior keep -> k-screen -> continuation -> completion-level optimal keep."""
    post = posterior()
    ids, step = list(range(B)), 5
    pi_q = keep_probabilities(post.scores(ids, step), R_Q, MAX_WEIGHT)
    if rule == "prompt-zero":
        pi_q = pi_q.clone()
        pi_q[1] = 0.0  # prompt 1's group is mixed: it carries gradient
    kept = torch.rand(d, B, generator=make_generator(seed, 0, "prompts"), dtype=DT) < pi_q
    alpha, beta = post.beta_parameters(ids, step)
    s_c = continuation_scores(p["rewards"][:, :K], alpha, beta, energy_curve(G, estimator, 1.5))
    pi_c = continuation_probabilities(s_c.expand(d, B), kept, CONTINUE, MAX_WEIGHT)
    if rule == "speed":  # SPEED: continue iff the screen has both rewards, never after a constant screen
        mixed = p["rewards"][:, :K].min(1).values != p["rewards"][:, :K].max(1).values
        pi_c = torch.where(kept & mixed, 1.0, 0.0).double()
    decision = decide_continuation(pi_c, kept, version=step, generator=make_generator(seed, 0, "continue"))
    group_w = decision.weights(pi_q.expand(d, B), version=step)  # 1/(pi_q pi_c) or 0
    if rule == "speed":
        group_w = torch.where(decision.keep, 1.0 / pi_q.expand(d, B), 0.0)  # SPEED reweights nothing
    prob = torch.where(decision.keep, pi_q * decision.prob, torch.ones_like(group_w))
    # (with a KL term a completion with A = 0 still has a gradient: it keeps the floor, not pi = 0)
    pruner = DPPOPruner(0.0, R_O, keep="optimal", zero_advantage_gradient=cfg.kl_coef > 0)
    completions = pruner.select_completions(
        p["adv"].expand(d, B, G), make_generator(seed, 0, "completions"), prompt_prob=prob,
        generated=decision.keep)
    return group_w.unsqueeze(-1) * completions.keep.to(DT) / completions.keep_prob.clamp(min=1e-300)


def z_of(preset: str, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    p, cfg = problem(preset)
    estimator = cfg.advantage_estimator
    w = draws(p, cfg, estimator, rule)
    den = torch.full((w.shape[0],), screening_denominator(cfg.aggregation, B, G, L), dtype=DT)
    samples = TP.pruned_losses_and_grads(p, cfg, w, den)
    return TP.mc_z(samples, TP.full_target(p, cfg)), w


@pytest.mark.parametrize("preset", PRESETS)
def test_screening_is_exactly_unbiased_for_the_full_group_gradient(preset):
    z, w = z_of(preset, "exact")
    assert float(z.max()) < Z_MAX, f"max z {z.max():.2f} at statistic {int(z.argmax())}"
    # the test is not trivial: prompts are pruned, screens stop groups, completions are dropped
    groups = (w > 0).any(-1).double().mean(0)
    assert 0.2 < float(groups.mean()) < 0.8
    assert bool((groups[[0, 1]] > 0.05).all())  # constant screens are continued sometimes, not never
    assert 0.2 < float((w > 0).double().mean()) < 0.7


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("rule", ["speed", "prompt-zero"])
def test_negative_controls_fail_the_same_test(preset, rule):
    z, _ = z_of(preset, rule)
    assert float(z.max()) > 10.0, f"bias not detected: max z {z.max():.2f}"


def test_posterior_keep_alone_is_unbiased_and_zero_keep_is_not():
    """No screen: the prompt level from the posterior, completions kept as they are (the grpo preset)."""
    p, cfg = problem("grpo")
    post = posterior()
    pi_q = keep_probabilities(post.scores(list(range(B)), 5), 0.4, MAX_WEIGHT)
    den = torch.full((DRAWS,), screening_denominator(cfg.aggregation, B, G, L), dtype=DT)
    target = TP.full_target(p, cfg)
    for pi, unbiased in ((pi_q, True), (torch.where(torch.arange(B) == 2, 0.0, pi_q), False)):
        keep = torch.rand(DRAWS, B, generator=make_generator(1, 0, "prompts"), dtype=DT) < pi
        w = torch.where(keep, 1.0 / pi.clamp(min=1e-300), 0.0).unsqueeze(-1).expand(DRAWS, B, G)
        z = TP.mc_z(TP.pruned_losses_and_grads(p, cfg, w, den), target)
        assert (float(z.max()) < Z_MAX) if unbiased else (float(z.max()) > 10.0), (unbiased, float(z.max()))


# ------------------------------------------------------------------------------------------------------------
# The pieces
# ------------------------------------------------------------------------------------------------------------
def test_continuation_scores_follow_the_energy_of_the_full_group():
    curve = energy_curve(8, "grpo", 1.0)
    a, b = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])
    screens = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    s = continuation_scores(screens, a, b, curve)
    # a mixed screen makes the full group mixed for sure: the energy of any mixed group (flat at gamma = 1)
    assert float(s[0]) ** 2 == pytest.approx(7 / 64)
    # after 2 successes the rest is BetaBinomial(6, 3, 1): P(all 6 succeed) = 3/9 = 1/3
    assert float(s[1]) ** 2 == pytest.approx(7 / 64 * (1 - 1 / 3))
    assert float(s[1]) == pytest.approx(float(s[2]))  # symmetric prior
    with pytest.raises(ValueError, match="binary"):
        continuation_scores(torch.tensor([[0.5, 1.0]]), a[:1], b[:1], curve)
    with pytest.raises(ValueError, match="screen size"):
        continuation_scores(torch.ones(1, 8), a[:1], b[:1], curve)


def test_continuation_probabilities_are_never_zero_and_meet_the_budget():
    s = torch.tensor([[0.0, 0.1, 0.5, 2.0, 0.3, 0.0]], dtype=DT)
    screened = torch.tensor([[True, True, True, True, True, False]])
    pi = continuation_probabilities(s, screened, 0.5, 20.0)
    assert float(pi[0, :5].sum()) == pytest.approx(2.5)
    assert bool((pi[0, :5] >= 1 / 20 - 1e-12).all()) and float(pi[0, 5]) == 0.0
    assert torch.equal(continuation_probabilities(s, screened, 1.0, 20.0), screened.double())


def test_a_continuation_from_another_weight_version_is_refused():
    decision = ScreenDecision(keep=torch.tensor([True, False]), prob=torch.tensor([0.5, 0.5], dtype=DT), version=7)
    assert torch.equal(decision.weights(torch.tensor([0.5, 1.0], dtype=DT), 7), torch.tensor([4.0, 0.0], dtype=DT))
    with pytest.raises(ValueError, match="same weights"):
        decision.weights(torch.ones(2, dtype=DT), 8)


def test_the_denominator_is_fixed_and_token_mean_is_refused():
    assert screening_denominator("seq_mean_token_mean", 6, 4) == 24.0
    assert screening_denominator("seq_mean_token_sum_norm", 6, 4, 10) == 240.0
    with pytest.raises(ValueError, match="token_mean"):
        screening_denominator("token_mean", 6, 4)


def test_fixed_size_continuation_has_the_inclusion_probabilities():
    pi = torch.tensor([0.2, 0.9, 0.5, 0.4, 1.0], dtype=DT)
    screened = torch.ones(5, dtype=torch.bool)
    d = 20000
    decision = decide_continuation(pi.expand(d, 5), screened, 0, make_generator(2, 0, "c"), mode="fixed_size")
    freq = decision.keep.double().mean(0)
    assert torch.allclose(freq, pi, atol=4 * math.sqrt(0.25 / d))
    sizes = decision.keep.sum(1)
    assert set(sizes.tolist()) <= {3, 4}
