"""Loss options that follow a peer's form: GSPO's gradient under a per-token rollout-correction factor
(``gspo_gradient``), TRL's bias-corrected KL (``kl_bias_correction``) and verl's GSPO under ``loss.preset=
verl_grpo``. Each peer formula is re-implemented below from the upstream source cited next to it (read from the
PyPI wheels verl==0.9.1 and trl==1.16.0), and each test also shows that the alternative form differs on the same
inputs, so the comparison can fail. GSPO's log-ratio cap (``loss.gspo_log_ratio_cap``) is compared with verl's real
``compute_policy_loss_gspo`` (``make peers``; skipped without it).
"""
from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from megatron_dppo.algo.losses import (
    LOSS_PRESETS,
    LossConfig,
    loss_denominator,
    loss_numerator,
    reference_objective,
    rollout_correction_weights,
    sequence_token_weights,
)

DT = torch.float64
GROUP = 4


def problem(seed=0, n=8, max_len=6, spread=0.3, rollout_spread=0.5, shift=None):
    """n completions (n / GROUP prompts), lengths 2..max_len; ``shift`` [n] adds a per-sequence log-ratio offset."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len + 1, (n,), generator=gen)
    mask = (torch.arange(max_len)[None, :] < lengths[:, None]).to(DT)
    old = torch.randn(n, max_len, generator=gen, dtype=DT) * 0.5 - 1.0
    logp = old + torch.randn(n, max_len, generator=gen, dtype=DT) * spread
    if shift is not None:
        logp = logp + shift[:, None]
    ref = old + torch.randn(n, max_len, generator=gen, dtype=DT) * 0.3
    rollout = old + torch.randn(n, max_len, generator=gen, dtype=DT) * rollout_spread
    adv = torch.randn(n, generator=gen, dtype=DT)
    return dict(lengths=lengths, mask=mask, old=old, logp=logp, ref=ref, rollout=rollout, adv=adv, L=max_len)


def ours(p, leaf, cfg):
    """Our engine path, packed (real tokens only), no pruning: loss_numerator / loss_denominator."""
    real = p["mask"] > 0
    n = p["mask"].shape[0]
    seq = torch.arange(n)[:, None].expand_as(p["mask"])[real]
    tw = sequence_token_weights(cfg.aggregation, torch.ones(n, dtype=DT), p["lengths"])[seq]
    ones = torch.ones_like(tw)
    u = None
    if cfg.rollout_correction != "none":
        u, _ = rollout_correction_weights(p["old"][real], p["rollout"][real], ones, cfg)
    num, _ = loss_numerator(leaf[real], p["old"][real], p["adv"][seq], tw, ones, seq, cfg, p["ref"][real], u)
    den = loss_denominator(cfg.aggregation, n // GROUP, GROUP, p["lengths"].view(-1, GROUP), None, p["L"])
    return num / den


def value_and_grad(fn, p):
    leaf = p["logp"].clone().requires_grad_()
    loss = fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad * p["mask"]


# ------------------------------------------------------------------------------------------------------------
# verl 0.9.1
# ------------------------------------------------------------------------------------------------------------
def verl_agg(loss_mat, mask, mode):
    """verl/trainer/ppo/core_algos.py agg_loss (one DP rank, no global batch info): token-mean = masked sum over
    the tokens; seq-mean-token-mean = per-sequence sum / (|o| + 1e-8), averaged over non-empty sequences. The 1e-8
    is left out (as in test_minibatches.py) so the comparison can be exact; our lengths are >= 2."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    seq_losses = (loss_mat * mask).sum(-1) / mask.sum(-1)
    return seq_losses.sum() / (mask.sum(-1) > 0).sum()


def verl_icepop_weights(p, lo, hi):
    """verl/trainer/ppo/rollout_corr_helper.py compute_rollout_correction_and_rejection_mask (log_ratio = old -
    rollout) -> compute_rollout_correction_weights, rollout_is="token", rollout_is_threshold "lo_hi" (IcePop):
    exp(clamp(log_ratio, -20, 20)) * mask, zero outside [lo, hi], detached."""
    raw = torch.exp(torch.clamp(p["old"] - p["rollout"], -20.0, 20.0)) * p["mask"]
    keep = (raw >= lo) & (raw <= hi)
    return torch.where(keep, raw, torch.zeros_like(raw)).detach()


def verl_gspo_loss(p, logp, agg, eps_low, eps_high, rollout_is_weights=None, kl_coef=0.0):
    """verl/trainer/ppo/core_algos.py compute_policy_loss_gspo: the token ratio s_t = sg[S] * pi_t / sg[pi_t] in log
    space, clamped at max 10, PPO clip with clip_ratio_low/high and NO dual clip (clip_ratio_c is not read), times
    rollout_is_weights, agg_loss; plus verl/workers/utils/losses.py ppo_loss: kl_loss_coef * agg_loss(kl_penalty(
    "low_var_kl")) (core_algos.py kl_penalty_forward: x = clamp(ref - logp, -20, 20), clamp(e^x - x - 1, -10, 10))."""
    mask, adv = p["mask"], p["adv"][:, None]
    negative_approx_kl = logp - p["old"]
    seq_lengths = torch.sum(mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = logp - logp.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -adv * seq_importance_ratio
    pg_losses2 = -adv * torch.clamp(seq_importance_ratio, 1 - eps_low, 1 + eps_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = verl_agg(pg_losses, mask, agg)
    if kl_coef:
        kl = torch.clamp(p["ref"] - logp, min=-20, max=20)
        kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
        loss = loss + kl_coef * verl_agg(kld, mask, agg)
    return loss


@pytest.mark.parametrize("agg, verl_mode", [("token_mean", "token-mean"),
                                            ("seq_mean_token_mean", "seq-mean-token-mean")])
def test_gspo_stop_gradient_equals_verl_gradient_with_icepop(agg, verl_mode):
    p = problem(seed=4)
    lo, hi = 0.7, 1.4
    weights = verl_icepop_weights(p, lo, hi)
    real = p["mask"] > 0
    masked = real & (weights == 0)
    assert 0 < int(masked.sum()) < int(real.sum())  # IcePop zeroes some tokens, not all
    theirs, g_theirs = value_and_grad(lambda leaf: verl_gspo_loss(p, leaf, verl_mode, 0.2, 0.2, weights), p)
    cfg = LossConfig(policy_loss="gspo", eps_low=0.2, eps_high=0.2, kl_coef=0.0, aggregation=agg,
                     rollout_correction="mis", rollout_correction_cap=hi, rollout_correction_cap_low=lo,
                     gspo_gradient="stop_gradient").resolved()
    mine, g_mine = value_and_grad(lambda leaf: ours(p, leaf, cfg), p)
    assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-15)
    assert torch.allclose(g_mine, g_theirs, rtol=1e-10, atol=1e-15)
    assert torch.equal(g_mine[masked], torch.zeros_like(g_mine[masked]))  # a masked token gets no gradient
    # the default (TRL) form: the same value, another gradient; masked tokens still get gradient through S
    auto, g_auto = value_and_grad(lambda leaf: ours(p, leaf, LossConfig(**{**cfg.__dict__,
                                                                              "gspo_gradient": "autograd"})), p)
    assert torch.allclose(auto, theirs, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(g_auto, g_theirs, rtol=1e-3, atol=1e-6)
    assert bool((g_auto[masked] != 0).any())


def test_gspo_forms_agree_without_a_rollout_factor():
    """No per-token factor: stop_gradient and autograd give the same value and gradient (and equal verl's)."""
    p = problem(seed=5)
    for agg, verl_mode in (("token_mean", "token-mean"), ("seq_mean_token_mean", "seq-mean-token-mean")):
        theirs, g_theirs = value_and_grad(lambda leaf: verl_gspo_loss(p, leaf, verl_mode, 0.1, 0.1), p)
        for form in ("autograd", "stop_gradient"):
            cfg = LossConfig(policy_loss="gspo", eps_low=0.1, eps_high=0.1, kl_coef=0.0, aggregation=agg,
                             gspo_gradient=form).resolved()
            mine, g_mine = value_and_grad(lambda leaf: ours(p, leaf, cfg), p)
            assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-15)
            assert torch.allclose(g_mine, g_theirs, rtol=1e-10, atol=1e-15)


def test_verl_grpo_preset_with_gspo_is_verls_gspo():
    """loss.preset=verl_grpo loss.policy_loss=gspo: no dual clip on S, the stop-gradient form, verl's KL loss; the
    case has A < 0 sequences with S > clip_ratio_c = 3, where the dual clip would bound the term."""
    shift = torch.tensor([1.5, 0.0, 1.4, 0.0, 0.0, 1.6, 0.0, 0.0], dtype=DT)
    p = problem(seed=6, shift=shift)
    p["adv"] = torch.tensor([-1.0, 0.5, -0.7, 1.2, -0.3, -1.1, 0.8, 0.2], dtype=DT)
    cfg = LossConfig(preset="verl_grpo", policy_loss="gspo", rollout_correction="mis", rollout_correction_cap=2.0,
                     rollout_correction_cap_low=0.5).resolved()
    assert (cfg.clip_ratio_c, cfg.gspo_gradient, cfg.advantage_estimator) == (None, "stop_gradient", "grpo")
    weights = verl_icepop_weights(p, 0.5, 2.0)
    theirs, g_theirs = value_and_grad(lambda leaf: verl_gspo_loss(p, leaf, "token-mean", 0.2, 0.2, weights,
                                                                   kl_coef=0.001), p)
    mine, g_mine = value_and_grad(lambda leaf: ours(p, leaf, cfg), p)
    assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-15)
    assert torch.allclose(g_mine, g_theirs, rtol=1e-10, atol=1e-15)
    # what the preset gave before: the dual clip bounds those sequences' terms, so the loss differs
    dual = LossConfig(**{**cfg.__dict__, "clip_ratio_c": 3.0})
    assert not torch.allclose(ours(p, p["logp"], dual), theirs, rtol=1e-6)
    # an explicit loss.clip_ratio_c still wins over the preset's rule; ppo_clip keeps verl's dual clip
    assert LossConfig(preset="verl_grpo", policy_loss="gspo", clip_ratio_c=3.0).resolved().clip_ratio_c == 3.0
    assert LossConfig(preset="verl_grpo").resolved().clip_ratio_c == 3.0


def real_verl():
    """verl 0.9.1's own core_algos and ActorConfig, imported from ``.peers/verl`` (tests/_peers.py)."""
    from tests._peers import verl_path

    with verl_path():
        core = importlib.import_module("verl.trainer.ppo.core_algos")
        actor_config = importlib.import_module("verl.workers.config").ActorConfig
    return core, actor_config(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=GROUP,
                              rollout_n=GROUP, clip_ratio=0.2)


def test_verl_grpo_gspo_caps_the_log_ratio_as_verls_real_function():
    """loss.preset=verl_grpo loss.policy_loss=gspo against verl's real compute_policy_loss_gspo + kl_penalty
    (low_var_kl) + agg_loss (token-mean), on sequences whose mean log-ratio exceeds verl's cap of 10 with a negative
    advantage (the unclipped branch: verl's term is e^10 |A| with no gradient). Without the cap the same inputs give
    e^11-scale terms with gradient, so the comparison can fail."""
    core, actor = real_verl()
    shift = torch.tensor([11.0, 0.0, 10.5, 0.0, 0.0, 12.0, 0.0, 0.0], dtype=DT)
    p = problem(seed=7, shift=shift)
    p["adv"] = torch.tensor([-1.0, 0.5, -0.7, 1.2, -0.3, 0.9, 0.8, 0.2], dtype=DT)  # seq 5: A > 0, clipped anyway
    seq_log_ratio = ((p["logp"] - p["old"]) * p["mask"]).sum(-1) / p["mask"].sum(-1)
    binds = (seq_log_ratio > 10) & (p["adv"] < 0)
    assert binds.tolist() == [True, False, True, False, False, False, False, False]
    cfg = LossConfig(preset="verl_grpo", policy_loss="gspo").resolved()
    assert cfg.gspo_log_ratio_cap == 10.0

    def policy_loss(leaf):
        adv = p["adv"][:, None].expand_as(leaf)
        return core.compute_policy_loss_gspo(p["old"], leaf, adv, p["mask"], "token-mean", actor)[0]

    def theirs(leaf):
        kl = core.kl_penalty(leaf, p["ref"], "low_var_kl")
        return policy_loss(leaf) + cfg.kl_coef * core.agg_loss(kl, p["mask"], "token-mean")

    value, grad = value_and_grad(theirs, p)
    mine, g_mine = value_and_grad(lambda leaf: ours(p, leaf, cfg), p)
    assert value > 1e3  # the capped terms dominate: e^10 |A| per token
    assert torch.allclose(mine, value, rtol=1e-12, atol=0)
    assert torch.allclose(g_mine, grad, rtol=1e-10, atol=1e-15)
    _, g_policy = value_and_grad(policy_loss, p)  # where the cap binds, only the KL term has a gradient
    assert torch.equal(g_policy[binds], torch.zeros_like(g_policy[binds])) and bool((g_policy[~binds] != 0).any())
    uncapped = replace(cfg, gspo_log_ratio_cap=None)  # what the preset gave before
    loose, g_loose = value_and_grad(lambda leaf: ours(p, leaf, uncapped), p)
    assert loose > 1.5 * value and bool((g_loose[binds][p["mask"][binds] > 0] != 0).all())
    # the padded reference objective applies the same cap
    view = lambda t: t.view(-1, GROUP, t.shape[-1])  # noqa: E731
    ref = -reference_objective(view(p["logp"]), view(p["old"]), p["adv"].view(-1, GROUP), view(p["mask"]), cfg,
                               view(p["ref"]))
    assert torch.allclose(ref, value, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------------------------
# TRL 1.16.0
# ------------------------------------------------------------------------------------------------------------
def trl_loss(p, logp, loss_type, beta, level="token", bias_correction=True, is_mode=None, clip=(0.0, 2.0)):
    """trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss, epsilon 0.2: log_importance_weights per token or the
    masked sequence mean ("sequence", shape (B, 1)); coef_1 = exp(.); per_token_kl = exp(ref - logp) - (ref - logp)
    - 1, times coef_1 when use_bias_correction_kl (the GRPOConfig default); -min(coef_1 A, clamp(coef_1) A) times
    the vLLM IS ratio (_generate_and_score_completions: exp((old - sampling) * mask), token_mask: 0 outside
    [clip_min, clip_max]); + beta * per_token_kl; loss_type "dapo": sum / num_items_in_batch (one process, one
    accumulation step), "grpo": per-sequence mean, then the mean over sequences."""
    mask, adv = p["mask"], p["adv"][:, None]
    log_ratio = logp - p["old"]
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = torch.exp(p["ref"] - logp) - (p["ref"] - logp) - 1
    if bias_correction:
        per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if is_mode == "token_mask":
        ratio = torch.exp((p["old"] - p["rollout"]) * mask)
        ratio = ratio.masked_fill((ratio < clip[0]) | (ratio > clip[1]), value=0.0)
        per_token_loss = per_token_loss * ratio
    per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


TRL_KL_CASES = [("dapo", "token_mean", "token", "ppo_clip"), ("grpo", "seq_mean_token_mean", "token", "ppo_clip"),
                ("dapo", "token_mean", "sequence", "gspo"), ("grpo", "seq_mean_token_mean", "sequence", "gspo")]


@pytest.mark.parametrize("loss_type, agg, level, policy", TRL_KL_CASES, ids=[f"{c[0]}-{c[2]}" for c in TRL_KL_CASES])
def test_kl_bias_correction_equals_trl(loss_type, agg, level, policy):
    p = problem(seed=7, spread=0.25)
    eps = 0.2
    cfg = LossConfig(policy_loss=policy, eps_low=eps, eps_high=eps, kl_coef=0.04, kl_estimator="k3", aggregation=agg,
                     kl_bias_correction=True).resolved()
    theirs, g_theirs = value_and_grad(lambda leaf: trl_loss(p, leaf, loss_type, 0.04, level), p)
    mine, g_mine = value_and_grad(lambda leaf: ours(p, leaf, cfg), p)
    assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-15)
    assert torch.allclose(g_mine, g_theirs, rtol=1e-10, atol=1e-15)
    # without the correction TRL's loss (use_bias_correction_kl=False) is our plain k3 one, and they differ
    plain_theirs, g_plain = value_and_grad(lambda leaf: trl_loss(p, leaf, loss_type, 0.04, level, False), p)
    plain = LossConfig(**{**cfg.__dict__, "kl_bias_correction": False})
    plain_mine, g_plain_mine = value_and_grad(lambda leaf: ours(p, leaf, plain), p)
    assert torch.allclose(plain_mine, plain_theirs, rtol=1e-12, atol=1e-15)
    assert torch.allclose(g_plain_mine, g_plain, rtol=1e-10, atol=1e-15)
    assert not torch.allclose(g_plain, g_theirs, rtol=1e-4, atol=1e-8)


def test_trl_grpo_preset_with_kl_is_trls_default_loss():
    """loss.preset=trl_grpo with loss.kl_coef=0.04 is TRL's GRPOConfig defaults (loss_type dapo, epsilon 0.2,
    use_bias_correction_kl True) with beta 0.04, including its GSPO form (importance_sampling_level sequence) under
    vLLM token_mask IS correction: the autograd gspo_gradient."""
    p = problem(seed=8, spread=0.25)
    cfg = LossConfig(preset="trl_grpo", kl_coef=0.04).resolved()
    assert cfg.kl_bias_correction and cfg.aggregation == "token_mean"
    assert torch.allclose(ours(p, p["logp"], cfg), trl_loss(p, p["logp"], "dapo", 0.04), rtol=1e-12, atol=1e-15)
    gspo = LossConfig(preset="trl_grpo", kl_coef=0.04, policy_loss="gspo", rollout_correction="mis",
                      rollout_correction_cap=1.4, rollout_correction_cap_low=0.7).resolved()
    assert gspo.gspo_gradient == "autograd"
    theirs, g_theirs = value_and_grad(lambda leaf: trl_loss(p, leaf, "dapo", 0.04, "sequence", True, "token_mask",
                                                            (0.7, 1.4)), p)
    mine, g_mine = value_and_grad(lambda leaf: ours(p, leaf, gspo), p)
    assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-15)
    assert torch.allclose(g_mine, g_theirs, rtol=1e-10, atol=1e-15)


# ------------------------------------------------------------------------------------------------------------
# The padded reference knows the new options (it is what the pruning tests average against)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, form, bias", [("ppo_clip", "autograd", True), ("gspo", "stop_gradient", False),
                                                ("gspo", "stop_gradient", True), ("gspo", "autograd", True)])
def test_reference_objective_knows_the_new_options(policy, form, bias):
    p = problem(seed=9)
    cfg = LossConfig(policy_loss=policy, eps_low=0.2, eps_high=0.2, kl_coef=0.05, kl_estimator="k3",
                     aggregation="seq_mean_token_mean", clip_ratio_c=3.0, rollout_correction="mis",
                     rollout_correction_cap=1.4, rollout_correction_cap_low=0.7, gspo_gradient=form,
                     kl_bias_correction=bias).resolved()
    u, _ = rollout_correction_weights(p["old"], p["rollout"], p["mask"], cfg)
    n = p["mask"].shape[0]

    def padded(leaf):
        view = lambda t: t.view(n // GROUP, GROUP, -1)  # noqa: E731
        return -reference_objective(view(leaf), view(p["old"]), p["adv"].view(-1, GROUP), view(p["mask"]), cfg,
                                    view(p["ref"]), rollout_weight=view(u))

    ref, g_ref = value_and_grad(padded, p)
    mine, g_mine = value_and_grad(lambda leaf: ours(p, leaf, cfg), p)
    assert torch.allclose(mine, ref, rtol=1e-12, atol=1e-15)
    assert torch.allclose(g_mine, g_ref, rtol=1e-10, atol=1e-15)


def test_presets_carry_the_peer_forms():
    assert LOSS_PRESETS["trl_grpo"].kl_bias_correction is True
    assert LOSS_PRESETS["verl_grpo"].gspo_gradient == "stop_gradient"
    for name in ("grpo", "dapo", "gspo", "dr_grpo"):
        cfg = LOSS_PRESETS[name]
        assert (cfg.gspo_gradient, cfg.kl_bias_correction, cfg.gspo_log_ratio_cap) == ("autograd", False, None)


def test_config_options_reach_the_loss():
    from megatron_dppo.config import load_config
    from megatron_dppo.run.build import build_loss

    verl, _ = build_loss(load_config(None, ["loss.preset=verl_grpo", "loss.policy_loss=gspo"], validate=False))
    assert (verl.policy_loss, verl.clip_ratio_c, verl.gspo_gradient) == ("gspo", None, "stop_gradient")
    trl, _ = build_loss(load_config(None, ["loss.preset=trl_grpo", "loss.kl_bias_correction=false",
                                           "loss.gspo_gradient=stop_gradient"], validate=False))
    assert (trl.kl_bias_correction, trl.gspo_gradient) == (False, "stop_gradient")
    assert verl.gspo_log_ratio_cap == 10.0 and trl.gspo_log_ratio_cap is None
    uncapped, _ = build_loss(load_config(None, ["loss.preset=verl_grpo", "loss.gspo_log_ratio_cap=20"],
                                         validate=False))
    assert uncapped.gspo_log_ratio_cap == 20.0
    with pytest.raises(ValueError,
                       match=r"loss.gspo_log_ratio_cap=-1.0 is invalid: expected preset, null \(off\) or > 0"):
        load_config(None, ["loss.gspo_log_ratio_cap=-1"], validate=False).loss.validate()
    with pytest.raises(ValueError, match="loss.gspo_gradient='sg' is invalid"):
        load_config(None, ["loss.gspo_gradient=sg"], validate=False)
    with pytest.raises(ValueError, match="unknown loss preset 'verl'; valid: grpo, dapo"):
        LossConfig(preset="verl").resolved()
