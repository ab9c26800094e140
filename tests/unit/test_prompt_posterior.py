"""The prompt level's discounted posterior and the gradient-energy curve (docs/algorithms.md, "Gradient energy of a
group", "Prompt posterior"): the energy curves against their closed forms and a Monte Carlo of the group gradient,
the posterior's update, prior fit and discount choice, exact resume, independence of the order in which a step's
groups arrive (every rank agrees), the continuous-reward state, and the keep probabilities built on it."""

import json
import math

import pytest
import torch

from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.gradient_energy import (
    beta_binomial_pmf,
    energy_curve,
    expected_energy,
    group_energy,
)
from megatron_dppo.algo.prompt_posterior import (
    INITIAL_PRIOR,
    PromptPosterior,
    fit_beta_prior,
    keep_probabilities,
)

DT = torch.float64


# ------------------------------------------------------------------------------------------------------------
# Energy curves
# ------------------------------------------------------------------------------------------------------------
def test_grpo_energy_is_flat_over_mixed_groups_at_gamma_1_and_skewed_groups_win_above():
    G = 8
    flat = energy_curve(G, "grpo", 1.0)
    assert flat[0] == 0 and flat[G] == 0
    assert torch.allclose(flat[1:G], torch.full((G - 1,), (G - 1) / G**2, dtype=DT))  # sum Z^2 = G - 1
    # m(k)/m(4) at k = 1, 2, 3 (the energy of 1-of-8 groups against balanced ones)
    for gamma, expected in ((1.5, (2.362, 1.443, 1.097)), (2.0, (6.143, 2.333, 1.267))):
        c = energy_curve(G, "grpo", gamma)
        assert torch.allclose(c[1:4] / c[4], torch.tensor(expected, dtype=DT), atol=1e-3)
        assert torch.allclose(c, c.flip(0))  # symmetric in k <-> G - k


def test_dr_grpo_and_rloo_energy_are_proportional_to_k_times_g_minus_k():
    G = 6
    k = torch.arange(G + 1, dtype=DT)
    dr = energy_curve(G, "dr_grpo", 1.0)
    assert torch.allclose(dr, k * (G - k) / G**3)  # sum (r - mean)^2 = k (G - k) / G
    assert torch.allclose(energy_curve(G, "rloo", 1.0), dr * (G / (G - 1)) ** 2)


def test_energy_is_the_expected_squared_gradient_norm_of_the_group():
    """Monte Carlo of |(1/G) sum_i A_i s_i|^2 with independent score vectors whose norm grows like |Z_i|^(gamma-1):
    its mean is m(r) for any reward vector (binary or not) and any estimator."""
    gen = torch.Generator().manual_seed(0)
    dim, draws = 16, 20000
    for estimator, gamma, r in (("grpo", 1.0, [1.0, 0, 0, 0, 0, 0]), ("grpo", 2.0, [1.0, 0, 0, 0, 0, 0]),
                                ("dr_grpo", 1.5, [0.3, 2.0, -1.0, 0.7]), ("rloo", 1.0, [1.0, 1.0, 0, 0, 1.0])):
        rewards = torch.tensor([r], dtype=DT)
        A = compute_advantages(rewards, estimator, eps=0.0)[0]
        Z = (rewards[0] - rewards[0].mean()) / rewards[0].std()
        scale = Z.abs() ** (gamma - 1.0) / math.sqrt(dim)  # E|s_i|^2 = |Z_i|^(2 (gamma - 1))
        s = torch.randn(draws, len(r), dim, generator=gen, dtype=DT) * scale[None, :, None]
        g = (A[None, :, None] * s).sum(1) / len(r)
        energy = (g**2).sum(1)
        expected = float(group_energy(rewards, estimator, gamma)[0])
        assert abs(float(energy.mean()) - expected) < 4 * float(energy.std()) / math.sqrt(draws), estimator


def test_energy_under_continuous_rewards_follows_the_estimators_scale():
    r = torch.tensor([[0.31, -1.2, 0.05, 2.4, 0.9, -0.4]], dtype=DT)
    for gamma in (1.0, 2.0):
        grpo = [float(group_energy(r * c, "grpo", gamma)) for c in (0.01, 1.0, 10.0)]
        assert max(grpo) - min(grpo) < 1e-9 * max(grpo)  # std-GRPO removes the scale, and so does its energy
        dr = [float(group_energy(r * c, "dr_grpo", gamma)) for c in (0.01, 1.0, 10.0)]
        assert dr[1] / dr[0] == pytest.approx(1e4) and dr[2] / dr[1] == pytest.approx(100.0)
    assert float(group_energy(torch.full((1, 6), 0.7, dtype=DT), "grpo", 1.5)) == 0.0
    with pytest.raises(ValueError, match="gamma"):
        group_energy(r, "grpo", -1.0)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        energy_curve(8, "ppo")


def test_expected_energy_is_the_beta_binomial_average():
    alpha, beta = torch.tensor([0.4, 3.0, 9.0], dtype=DT), torch.tensor([0.4, 1.5, 1.0], dtype=DT)
    pmf = beta_binomial_pmf(8, alpha, beta)
    assert torch.allclose(pmf.sum(-1), torch.ones(3, dtype=DT))
    # Beta(1, 1): uniform over k
    assert torch.allclose(beta_binomial_pmf(8, torch.tensor(1.0), torch.tensor(1.0)), torch.full((9,), 1 / 9, dtype=DT))
    gen = torch.Generator().manual_seed(1)
    curve = energy_curve(8, "grpo", 2.0)
    draws = 200000
    for a, b, e in zip(alpha, beta, expected_energy(alpha, beta, curve)):
        p = torch.distributions.Beta(a, b).sample((draws,))
        k = (torch.rand(draws, 8, generator=gen, dtype=DT) < p[:, None]).sum(1)
        mc = curve[k]
        assert abs(float(mc.mean()) - float(e)) < 4 * float(mc.std()) / math.sqrt(draws)


# ------------------------------------------------------------------------------------------------------------
# Posterior: update, prior, discount
# ------------------------------------------------------------------------------------------------------------
def _binary_groups(p: torch.Tensor, ids: list, G: int, gen) -> torch.Tensor:
    return (torch.rand(len(ids), G, generator=gen, dtype=DT) < p[ids, None]).double()


def test_a_visit_adds_its_counts_and_the_discount_acts_per_optimizer_step():
    post = PromptPosterior(4, discounts=(0.9,))
    post.update([7], torch.tensor([[1.0, 1.0, 1.0, 0.0]]), step=3)
    a0, b0 = post.prior()
    assert (a0, b0) == INITIAL_PRIOR  # fewer groups than the prior fit needs
    alpha, beta = post.beta_parameters([7], step=3)
    assert (float(alpha), float(beta)) == (a0 + 3, b0 + 1)
    alpha, beta = post.beta_parameters([7], step=8)  # five steps later: counts x 0.9^5
    assert float(alpha) == pytest.approx(a0 + 3 * 0.9**5) and float(beta) == pytest.approx(b0 + 0.9**5)
    post.update([7], torch.tensor([[0.0, 0.0]]), step=8)  # a screen of 2 counts as 2 more failures
    alpha, beta = post.beta_parameters([7], step=8)
    assert float(alpha) == pytest.approx(a0 + 3 * 0.9**5) and float(beta) == pytest.approx(b0 + 0.9**5 + 2)
    # unseen: the prior
    alpha, beta = post.beta_parameters([8], step=8)
    assert (float(alpha), float(beta)) == INITIAL_PRIOR


def test_the_prior_is_a_method_of_moments_fit_to_recent_pass_rates():
    gen = torch.Generator().manual_seed(2)
    p = torch.distributions.Beta(torch.tensor(0.6, dtype=DT), torch.tensor(1.4, dtype=DT)).sample((4000,))
    k = (torch.rand(4000, 8, generator=gen, dtype=DT) < p[:, None]).sum(1)
    a0, b0 = fit_beta_prior(k.tolist(), [8] * 4000)
    assert a0 / (a0 + b0) == pytest.approx(0.3, abs=0.02)
    assert a0 + b0 == pytest.approx(2.0, rel=0.2)
    assert fit_beta_prior([1, 2], [8, 8]) == INITIAL_PRIOR
    # every group constant: the most extreme (U-shaped) prior allowed, not a failure
    a0, b0 = fit_beta_prior([0, 8] * 20, [8] * 40)
    assert a0 + b0 == pytest.approx(0.2)


def _drive(post: PromptPosterior, p_of_step, steps: int, n_prompts: int = 40, batch: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = torch.randperm(n_prompts, generator=gen)[:batch].tolist()
        post.update(ids, _binary_groups(p_of_step(step), ids, post.group_size, gen), step)


def test_the_discount_is_chosen_by_one_step_ahead_likelihood():
    base = torch.distributions.Beta(torch.tensor(0.5, dtype=DT), torch.tensor(0.5, dtype=DT)).sample((40,))
    steady = PromptPosterior(8)
    _drive(steady, lambda t: base, 60)
    assert steady.discount() >= 0.98  # nothing changes: keep the whole history
    # each prompt's pass rate flips every 5 steps: old visits mislead, a short memory predicts better
    drifting = PromptPosterior(8)
    _drive(drifting, lambda t: base if (t // 5) % 2 == 0 else 1 - base, 60)
    assert drifting.discount() <= 0.8
    stats = drifting.stats()
    assert stats["posterior/discount"] == drifting.discount()
    chosen = stats["posterior/loglik_per_revisit"]
    assert chosen == max(v for k, v in stats.items() if k.startswith("posterior/loglik_per_revisit/"))
    assert stats["posterior/revisits"] > 0


def test_the_posterior_predicts_the_mixed_share_of_next_visits():
    """Calibration: the mean predicted P(mixed) of revisits equals their observed mixed share."""
    gen = torch.Generator().manual_seed(4)
    base = torch.distributions.Beta(torch.tensor(0.4, dtype=DT), torch.tensor(0.4, dtype=DT)).sample((200,))
    post = PromptPosterior(8)
    predicted, observed = [], []
    for step in range(80):
        ids = torch.randperm(200, generator=gen)[:32].tolist()
        r = _binary_groups(base, ids, 8, gen)
        if step >= 20:
            seen = [i in post for i in ids]
            pm = post.mixed_probability(ids, step)
            predicted += [float(x) for x, s in zip(pm, seen) if s]
            observed += [float(0 < row.sum() < 8) for row, s in zip(r, seen) if s]
        post.update(ids, r, step)
    n = len(observed)
    assert n > 500
    assert abs(sum(predicted) / n - sum(observed) / n) < 0.04
    # and better than the constant rate: the posterior separates prompts
    pbar = sum(observed) / n
    brier = sum((p - o) ** 2 for p, o in zip(predicted, observed)) / n
    assert brier < 0.8 * pbar * (1 - pbar)


def test_unseen_and_constant_history_prompts_keep_a_positive_score():
    post = PromptPosterior(8)
    gen = torch.Generator().manual_seed(5)
    ids = list(range(30))
    post.update(ids, _binary_groups(torch.rand(30, generator=gen, dtype=DT), ids, 8, gen), 0)
    post.update([100], torch.ones(1, 8, dtype=DT), 1)  # all correct last time
    s = post.scores([100, 101] + ids, 2)  # 101: never seen
    assert bool((s > 0).all())
    assert float(s[0]) < float(s[1])  # an all-correct visit lowers the score, it does not zero it


# ------------------------------------------------------------------------------------------------------------
# Determinism: order within a step, exact resume
# ------------------------------------------------------------------------------------------------------------
def test_the_state_does_not_depend_on_the_order_of_a_steps_groups():
    gen = torch.Generator().manual_seed(6)
    p = torch.rand(50, generator=gen, dtype=DT)
    calls = []
    for step in range(12):
        ids = torch.randint(0, 50, (20,), generator=gen).tolist()  # repeats within a step too
        calls.append((ids, _binary_groups(p, ids, 8, gen), step))
    a, b = PromptPosterior(8, length_exponent=0.5), PromptPosterior(8, length_exponent=0.5)
    for ids, r, step in calls:
        lengths = torch.arange(r.numel(), dtype=DT).view_as(r) % 5 + 1
        a.update(ids, r, step, lengths)
        perm = torch.randperm(len(ids), generator=gen)
        b.update([ids[i] for i in perm], r[perm], step, lengths[perm])
    sa, sb = a.state_dict(), b.state_dict()
    order_a, order_b = {i: j for j, i in enumerate(sa["ids"])}, {i: j for j, i in enumerate(sb["ids"])}
    for pid in order_a:  # the rows may be allocated in another order; each prompt's state is identical
        assert sa["state"][order_a[pid]] == sb["state"][order_b[pid]]
        assert sa["t"][order_a[pid]] == sb["t"][order_b[pid]]
    assert sa["score_binary"] == sb["score_binary"]
    assert sorted(map(tuple, sa["window"])) == sorted(map(tuple, sb["window"]))
    assert torch.equal(a.scores(list(range(60)), 12), b.scores(list(range(60)), 12))


@pytest.mark.parametrize("rewards", ["binary", "continuous"])
def test_checkpoint_and_resume_are_exact(rewards):
    gen = torch.Generator().manual_seed(7)
    p = torch.rand(40, generator=gen, dtype=DT)

    def groups(step):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randperm(40, generator=g)[:16].tolist()
        r = _binary_groups(p, ids, 8, g)
        if rewards == "continuous":
            r = r + 0.1 * torch.randn(r.shape, generator=g, dtype=DT)
        return ids, r, torch.randint(1, 9, r.shape, generator=g).double()

    straight = PromptPosterior(8, gamma=1.7, length_exponent=0.3)
    for step in range(20):
        straight.update(*groups(step)[:2], step, groups(step)[2])
    first = PromptPosterior(8, gamma=1.7, length_exponent=0.3)
    for step in range(11):
        first.update(*groups(step)[:2], step, groups(step)[2])
    saved = json.loads(json.dumps(first.state_dict()))  # plain Python types only
    resumed = PromptPosterior(8, gamma=1.7, length_exponent=0.3)
    resumed.load_state_dict(saved)
    for step in range(11, 20):
        resumed.update(*groups(step)[:2], step, groups(step)[2])
    assert resumed.state_dict() == straight.state_dict()
    ids = list(range(45))
    assert torch.equal(resumed.scores(ids, 21), straight.scores(ids, 21))
    assert resumed.binary == (rewards == "binary")


def test_load_refuses_a_state_made_with_another_configuration():
    post = PromptPosterior(8)
    post.update([1], torch.ones(1, 8), 0)
    with pytest.raises(ValueError, match="configured with"):
        PromptPosterior(8, discounts=(0.9, 0.5)).load_state_dict(post.state_dict())
    with pytest.raises(ValueError, match="configured with"):
        PromptPosterior(4).load_state_dict(post.state_dict())
    with pytest.raises(ValueError, match="not a PromptPosterior state"):
        post.load_state_dict({"format": "megatron_dppo.PromptHistory/1"})


def test_bad_inputs_are_named():
    post = PromptPosterior(8)
    with pytest.raises(ValueError, match="shape"):
        post.update([1, 2], torch.ones(3, 8), 0)
    with pytest.raises(ValueError, match="step"):
        post.update([1], torch.ones(1, 8), -1)
    with pytest.raises(ValueError, match="prompt ids"):
        post.update([1.5], torch.ones(1, 8), 0)
    with pytest.raises(ValueError, match="rewards='binary'"):
        PromptPosterior(8, rewards="binary").update([1], torch.full((1, 8), 0.5), 0)
    with pytest.raises(ValueError, match="discounts"):
        PromptPosterior(8, discounts=(1.2,))
    with pytest.raises(ValueError, match="reward kind"):
        PromptPosterior(8, rewards="graded")


# ------------------------------------------------------------------------------------------------------------
# Continuous rewards
# ------------------------------------------------------------------------------------------------------------
def test_continuous_rewards_switch_the_state_and_keep_the_estimators_scale():
    gen = torch.Generator().manual_seed(8)
    spread = torch.linspace(0.0, 2.0, 30, dtype=DT)  # prompt q's rewards vary by spread[q] (0: a constant group)
    noise = [torch.randn(30, 8, generator=gen, dtype=DT) for _ in range(6)]
    scores = {}
    for estimator in ("grpo", "dr_grpo"):
        for scale in (0.01, 1.0, 10.0):
            post = PromptPosterior(8, estimator=estimator)
            post.update([0], torch.ones(1, 8), 0)
            assert post.binary
            for step in range(6):
                r = scale * (0.5 + spread[:, None] * noise[step])
                post.update(list(range(30)), r, step + 1)
            assert not post.binary  # the first non-binary reward switched it for good
            scores[estimator, scale] = post.scores(list(range(30)), 7)
    for scale in (0.01, 10.0):  # std-GRPO: the same scores whatever the reward scale (issue: RM scores)
        assert torch.allclose(scores["grpo", scale], scores["grpo", 1.0], rtol=1e-9)
        assert torch.allclose(scores["dr_grpo", scale], scale * scores["dr_grpo", 1.0], rtol=1e-9)
    # Dr.GRPO ranks prompts by their spread; the constant prompt has the least signal
    s = scores["dr_grpo", 1.0]
    assert int(s.argmin()) == 0 and int(s.argmax()) > 20


# ------------------------------------------------------------------------------------------------------------
# Keep probabilities
# ------------------------------------------------------------------------------------------------------------
def test_posterior_keep_probabilities_meet_the_budget_cap_the_weight_and_are_unbiased():
    post = PromptPosterior(8, gamma=2.0)
    gen = torch.Generator().manual_seed(9)
    base = torch.distributions.Beta(torch.tensor(0.4, dtype=DT), torch.tensor(0.4, dtype=DT)).sample((64,))
    for step in range(10):
        ids = torch.randperm(64, generator=gen)[:32].tolist()
        post.update(ids, _binary_groups(base, ids, 8, gen), step)
    s = post.scores(list(range(70)), 10)
    pi = keep_probabilities(s, 0.4, max_weight=8.0)
    assert float(pi.sum()) == pytest.approx(0.6 * 70)
    assert bool((pi >= 1 / 8 - 1e-12).all()) and bool((pi <= 1).all())
    assert torch.equal(keep_probabilities(s, 0.0, 8.0), torch.ones(70, dtype=DT))
    # E[keep / pi] = 1 for every prompt
    draws = 40000
    keep = torch.rand(draws, 70, generator=gen, dtype=DT) < pi
    kw = keep.double() / pi
    z = (kw.mean(0) - 1).abs() / (kw.std(0) / math.sqrt(draws)).clamp(min=1e-12)
    assert float(z.max()) < 4.5
    with pytest.raises(ValueError, match="max_weight"):
        keep_probabilities(s, 0.4, 0.5)


def test_the_pruner_draws_the_posterior_keep_probabilities_unbiased_in_both_modes():
    """DPPOPruner(keep="posterior"): pi are keep_probabilities of the scores, kept units weighted 1/pi with
    E[keep * w] = 1 (bernoulli and fixed_size), score recorded; NaN scores (a history's unseen prompts) refused."""
    from megatron_dppo.algo.pruning import DPPOPruner

    post = PromptPosterior(8)
    gen = torch.Generator().manual_seed(4)
    base = torch.distributions.Beta(torch.tensor(0.5, dtype=DT), torch.tensor(0.5, dtype=DT)).sample((48,))
    for step in range(6):
        ids = torch.randperm(48, generator=gen)[:24].tolist()
        post.update(ids, _binary_groups(base, ids, 8, gen), step)
    s = post.scores(list(range(40)), 6)
    draws = 20000
    for mode in ("bernoulli", "fixed_size"):
        pruner = DPPOPruner(0.5, 0.5, mode=mode, keep="posterior", max_weight=5.0)
        res = pruner.select_prompts(s.expand(draws, -1), gen)
        assert torch.allclose(res.keep_prob[0], keep_probabilities(s, 0.5, 5.0))
        assert torch.equal(res.score[0], s)
        kw = res.weight.double()
        assert torch.equal(kw > 0, res.keep) and bool((kw <= 5.0 + 1e-5).all())
        z = (kw.mean(0) - 1).abs() / (kw.std(0) / math.sqrt(draws)).clamp(min=1e-12)
        assert float(z.max()) < 4.5, mode
    assert torch.equal(DPPOPruner(0.0, 0.5, keep="posterior").select_prompts(s, gen).keep_prob,
                       torch.ones(40, dtype=DT))
    with pytest.raises(ValueError, match="needs a score for every prompt"):
        DPPOPruner(0.5, 0.5, keep="posterior").select_prompts(torch.tensor([0.2, math.nan]), gen)
    with pytest.raises(ValueError, match="deterministic"):
        DPPOPruner(0.5, 0.5, mode="deterministic", keep="posterior")
