"""The decoupled PPO objective (megatron_dppo/algo/decoupled.py): equal to a written-out transcription of AReaL's
``ppo_actor_loss_fn`` (value and gradient, clamp and mask modes, clip-higher, dual clip); staleness 0 is the
uncorrected objective bit for bit; and, in the Monte-Carlo harness of test_pruning.py (same z thresholds), the
corrected policy gradient from samples of a stale behaviour policy is unbiased for the proximal policy's on-policy
gradient, while the naive objective and a tight truncation are measurably biased (negative controls)."""

import math

import pytest
import test_pruning as TP
import torch

from megatron_dppo.algo.decoupled import behavior_correction, decoupled_objective
from megatron_dppo.algo.losses import LossConfig, per_token_objective

DT = torch.float64


def areal_reference_loss(logp, prox, behav, adv, mask, eps_low, eps_high, c_clip, mode, lower, upper):
    """AReaL's token-level decoupled PPO loss, written out from areal/utils/functional/functional.py
    (ppo_actor_loss_fn + apply_rejection_sampling, metric "ratio", level "token"): a loss to MINIMIZE, the mean
    over the ORIGINAL mask's tokens. mode "clamp": w = clamp(prox/behav, lower, upper); "mask": w = prox/behav on
    tokens with lower <= w <= upper, the others leave the loss mask (the denominator keeps them)."""
    count = mask.sum()
    w = torch.exp(prox - behav)
    if mode == "clamp":
        w = w.clamp(min=lower, max=upper)
        kept = mask
    else:
        kept = mask & (w >= lower) & (w <= upper)
    w = torch.where(kept, w, torch.zeros_like(w))
    ratio = torch.where(kept, torch.exp(logp - prox), torch.zeros_like(logp))
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.max(-adv * ratio, -adv * clipped)
    if c_clip is not None:
        loss = torch.min(loss, torch.sign(adv) * c_clip * adv)
    loss = loss * w
    return torch.where(kept, loss, torch.zeros_like(loss)).sum() / count


def _tokens(seed, t=200):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(t, generator=g, dtype=DT) * 0.5 - 1.5
    prox = logp + torch.randn(t, generator=g, dtype=DT) * 0.3  # the update has moved theta off prox: clipping acts
    behav = prox + torch.randn(t, generator=g, dtype=DT) * 0.6  # stale behaviour policy: u spreads around 1
    adv = torch.randn(t, generator=g, dtype=DT)
    mask = torch.rand(t, generator=g) > 0.2
    return logp, prox, behav, adv, mask


@pytest.mark.parametrize("correction, mode", [("tis", "clamp"), ("mis", "mask")])
@pytest.mark.parametrize("c_clip", [None, 3.0])
def test_equals_areal_written_out(correction, mode, c_clip):
    logp, prox, behav, adv, mask = _tokens(1)
    cfg = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=0.0, aggregation="token_mean",
                     clip_ratio_c=c_clip, rollout_correction=correction, rollout_correction_cap=2.0,
                     rollout_correction_cap_low=0.5).resolved()
    leaf = logp.clone().requires_grad_()
    s, metrics = decoupled_objective(leaf, prox, behav, adv, mask.to(DT), torch.arange(len(logp)), cfg)
    ours = -s.sum() / mask.sum()
    (g_ours,) = torch.autograd.grad(ours, leaf)
    leaf = logp.clone().requires_grad_()
    ref = areal_reference_loss(leaf, prox, behav, adv, mask, 0.2, 0.28, c_clip, mode, 0.5, 2.0)
    (g_ref,) = torch.autograd.grad(ref, leaf)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-14), (float(ours), float(ref))
    assert torch.allclose(g_ours, g_ref, rtol=1e-12, atol=1e-14)
    # the setting is not trivial: the correction, the clip (and the dual clip) all act on some tokens
    assert 0 < float(metrics["behavior_corrected_tokens"]) < float(metrics["tokens"])
    assert 0 < float(metrics["clipped_tokens"]) < float(metrics["tokens"])
    assert float(metrics["behavior_k3_sum"]) > 0


def test_staleness_zero_is_the_uncorrected_objective_bit_for_bit():
    logp, prox, _, adv, mask = _tokens(2)
    for correction in ("none", "tis", "mis"):
        cfg = LossConfig(policy_loss="ppo_clip", aggregation="token_mean", kl_coef=0.1, kl_estimator="k3",
                         rollout_correction=correction).resolved()
        ref = logp - 0.1
        s, m = decoupled_objective(logp, prox, prox, adv, mask.to(DT), None, cfg, ref_logp=ref)
        plain, _ = per_token_objective(logp, prox, adv, mask.to(DT), None, cfg, ref_logp=ref)
        assert torch.equal(s, plain), correction
        assert float(m["behavior_corrected_tokens"]) == 0.0 and float(m["behavior_k1_sum"]) == 0.0


def test_behavior_correction_is_zero_off_the_mask_and_carries_no_gradient():
    _, prox, behav, _, mask = _tokens(3)
    prox = prox.clone().requires_grad_()
    w, _ = behavior_correction(prox, behav, mask.to(DT), LossConfig(rollout_correction="tis").resolved())
    assert not w.requires_grad
    assert bool((w[~mask] == 0).all()) and bool((w[mask] > 0).all())


# ------------------------------------------------------------------------------------------------------------
# Monte Carlo: samples of a stale pi_behav, gradient at theta = prox, against the on-policy gradient of pi_prox
# ------------------------------------------------------------------------------------------------------------
K = 6  # a one-token "completion" from a categorical policy over K tokens
DRAWS = 20000


def _policies():
    g = torch.Generator().manual_seed(5)
    theta = torch.randn(K, generator=g, dtype=DT)  # pi_prox = softmax(theta); training starts there
    behav = theta + torch.randn(K, generator=g, dtype=DT) * 0.8  # k versions old
    adv = torch.randn(K, generator=g, dtype=DT)  # A(x), fixed
    return theta, behav, adv


def _gradient_samples(cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """[DRAWS, K] per-sample gradients d s / d theta of the decoupled objective at theta = prox, x ~ pi_behav;
    and the exact on-policy target E_{x ~ pi_prox}[A(x) d log pi(x) / d theta]."""
    theta, behav_logits, adv = _policies()
    log_prox, log_behav = torch.log_softmax(theta, 0), torch.log_softmax(behav_logits, 0)
    x = torch.multinomial(log_behav.exp(), DRAWS, replacement=True, generator=torch.Generator().manual_seed(6))
    leaf = log_prox[x].clone().requires_grad_()  # logp of each sampled token under pi_theta (= prox here)
    s, _ = decoupled_objective(leaf, log_prox[x], log_behav[x], adv[x], torch.ones(DRAWS, dtype=DT), None, cfg)
    (ds_dlogp,) = torch.autograd.grad(s.sum(), leaf)
    score = torch.nn.functional.one_hot(x, K).to(DT) - log_prox.exp()  # d log pi(x) / d theta for a softmax
    samples = ds_dlogp[:, None] * score
    pi = log_prox.exp()
    target = (pi[:, None] * adv[:, None] * (torch.eye(K, dtype=DT) - pi[None, :])).sum(0)
    return samples, target


def test_corrected_gradient_is_unbiased_for_the_proximal_policy():
    u = torch.exp(torch.log_softmax(_policies()[0], 0) - torch.log_softmax(_policies()[1], 0))
    cfg = LossConfig(policy_loss="ppo_clip", kl_coef=0.0, rollout_correction="tis",
                     rollout_correction_cap=float(u.max()) + 1.0).resolved()
    samples, target = _gradient_samples(cfg)
    z = TP.mc_z(samples, target)
    assert z.max() < TP.Z_OK, z


@pytest.mark.parametrize("correction, cap", [("none", 2.0), ("tis", 1.05)])
def test_naive_and_tightly_truncated_gradients_are_biased(correction, cap):
    cfg = LossConfig(policy_loss="ppo_clip", kl_coef=0.0, rollout_correction=correction,
                     rollout_correction_cap=cap).resolved()
    samples, target = _gradient_samples(cfg)
    z = TP.mc_z(samples, target)
    assert z.max() > TP.Z_BIASED, z


def test_truncation_bounds_the_variance():
    """What truncation buys: the per-sample gradient's second moment shrinks with the cap (the price is the bias
    measured above)."""
    def tis(cap):
        return LossConfig(kl_coef=0.0, rollout_correction="tis", rollout_correction_cap=cap).resolved()

    loose = _gradient_samples(tis(1e6))[0]
    tight = _gradient_samples(tis(1.5))[0]
    assert float((tight ** 2).sum(1).mean()) < float((loose ** 2).sum(1).mean())
    assert math.isfinite(float((loose ** 2).sum(1).mean()))
