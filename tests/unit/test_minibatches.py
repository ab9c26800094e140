"""Several updates per rollout (docs/algorithms.md, "Several updates per rollout"): the prompt split into PPO
mini-batches, the unbiasedness of every mini-batch's pruned loss and gradient under DPPO with clipping live, the
rollout-correction weights, and, with nothing pruned, equality of our mini-batch losses with the peers' published
formulas (verl, TRL, slime), each re-implemented here from the upstream source cited next to it.

The Monte-Carlo harness is the one of test_pruning.py (``mc_z``: |mean - target| in measured standard errors).
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.losses import (
    LossConfig,
    loss_denominator,
    loss_numerator,
    per_token_objective,
    reference_objective,
    rollout_correction_weights,
    sequence_token_weights,
)
from megatron_dppo.algo.minibatches import split_prompts
from megatron_dppo.algo.pruning import DPPOPruner, combine, make_generator

DT = torch.float64
Z_OK = 5.0
ATOL = 1e-9
DRAWS = 3000
B, G, L = 6, 4, 6


def mc_z(samples: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    d = samples.shape[0]
    se = samples.std(0, correction=1) / math.sqrt(d)
    return (samples.mean(0) - target).abs() / torch.sqrt(se**2 + ATOL**2)


# ------------------------------------------------------------------------------------------------------------
# The split
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, m", [(6, 1), (6, 2), (7, 3), (8, 8), (5, 2)])
def test_split_is_a_partition_by_prompt_of_near_equal_sizes(n, m):
    groups = split_prompts(n, m, make_generator(3, 5, "mini_batches"))
    assert len(groups) == m
    assert sorted(q for g in groups for q in g) == list(range(n))
    assert all(g == sorted(g) for g in groups)
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_split_depends_only_on_the_generator_and_one_mini_batch_is_the_identity():
    a = split_prompts(12, 3, make_generator(3, 5, "mini_batches"))
    assert a == split_prompts(12, 3, make_generator(3, 5, "mini_batches"))  # same (seed, step): same split
    assert a != split_prompts(12, 3, make_generator(3, 6, "mini_batches"))  # next step: a fresh split
    assert split_prompts(12, 1, make_generator(3, 5, "mini_batches")) == [list(range(12))]
    assert split_prompts(12, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("n, m, match", [(3, 4, "mini_batches=4 is more than the 3 prompts"),
                                         (3, 0, "mini_batches must be an integer >= 1")])
def test_split_errors(n, m, match):
    with pytest.raises(ValueError, match=match):
        split_prompts(n, m)


# ------------------------------------------------------------------------------------------------------------
# A rollout whose policy has moved since it was sampled (ratio != 1, clipping live on later mini-batches)
# ------------------------------------------------------------------------------------------------------------
NAN = float("nan")


def make_problem(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (B, G), generator=gen)
    lengths[0, 0] = L
    mask = (torch.arange(L)[None, None, :] < lengths[..., None]).to(DT)
    old = torch.randn(B, G, L, generator=gen, dtype=DT) * 0.5 - 1.0
    logp = old + torch.randn(B, G, L, generator=gen, dtype=DT) * 0.3  # after earlier updates: ratio != 1
    ref = old + torch.randn(B, G, L, generator=gen, dtype=DT) * 0.2
    rollout = old + torch.randn(B, G, L, generator=gen, dtype=DT) * 0.4  # the rollout engine's numerics
    rewards = torch.randn(B, G, generator=gen, dtype=DT)
    rewards[0] = 1.0
    rewards[1] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = compute_advantages(rewards, "grpo")
    history = torch.tensor([NAN, 0.0, 0.3, 1.2, 0.5, 2.0], dtype=DT)
    return dict(lengths=lengths, mask=mask, logp=logp, old=old, ref=ref, rollout=rollout, adv=adv, history=history)


def rows(p: dict, group: list[int]) -> dict:
    idx = torch.tensor(group)
    return {k: (v[idx] if k != "history" else v) for k, v in p.items()}


def u_weights(p: dict, cfg: LossConfig) -> torch.Tensor:
    """The rollout-correction factor u' [B, G, L] (ones when correction is off)."""
    w, _ = rollout_correction_weights(p["old"].reshape(-1), p["rollout"].reshape(-1), p["mask"].reshape(-1), cfg)
    return w.view(p["old"].shape)


def mini_batch_target(p: dict, cfg: LossConfig, den: float) -> torch.Tensor:
    """[1 + T]: the mini-batch's un-pruned loss with its D_m, and its gradient w.r.t. the completion log-probs."""
    leaf = p["logp"].clone().requires_grad_()
    loss = -reference_objective(leaf, p["old"], p["adv"], p["mask"], cfg, p["ref"], denominator=den,
                                rollout_weight=u_weights(p, cfg))
    (grad,) = torch.autograd.grad(loss, leaf)
    return torch.cat([loss.detach().view(1), grad[p["mask"] > 0]])


def pruned_samples(p: dict, cfg: LossConfig, weights: torch.Tensor, den: float | torch.Tensor) -> torch.Tensor:
    """[D, 1 + T]: per draw, the engine-path loss (sequence_token_weights -> loss_numerator with the
    rollout-correction factor, on a packed token layout, / D_m) of the mini-batch and its gradient. The draws are
    packed side by side, each with its own copy of the log-probs, so one backward gives every draw's gradient."""
    d, b, g = weights.shape
    real = p["mask"] > 0
    t = int(real.sum())
    seq_of_token = torch.arange(b * g).view(b, g, 1).expand(b, g, L)[real]
    seq_index = (torch.arange(d)[:, None] * (b * g) + seq_of_token[None, :]).reshape(-1)
    per_tok = lambda x: x[real].expand(d, t).reshape(-1)  # noqa: E731
    seq_w = sequence_token_weights(cfg.aggregation, weights.reshape(-1), p["lengths"].expand(d, b, g).reshape(-1))
    token_w = seq_w[seq_index]
    logp = p["logp"][real].expand(d, t).reshape(-1).clone().requires_grad_()
    old, ref, adv = per_tok(p["old"]), per_tok(p["ref"]), per_tok(p["adv"][..., None].expand(b, g, L))
    u, _ = rollout_correction_weights(old, per_tok(p["rollout"]), torch.ones_like(token_w), cfg)
    den = torch.as_tensor(den, dtype=DT).expand(d)  # one D per draw (a constant D_m, or a biased count)
    num, _ = loss_numerator(logp, old, adv, token_w / den.repeat_interleave(t), torch.ones_like(token_w), seq_index,
                            cfg, ref, u)
    s, _ = per_token_objective(logp, old, adv, torch.ones_like(token_w), seq_index, cfg, ref, u)
    losses = -(token_w * s).view(d, t).sum(1) / den
    (grads,) = torch.autograd.grad(num, logp)
    return torch.cat([losses.detach()[:, None], grads.view(d, t)], dim=1)


CASES = [
    # (policy loss, aggregation, rollout correction, dual clip, r_q). token_mean with prompt pruning divides by the
    # Horvitz-Thompson token count (consistent, not exactly unbiased: docs/algorithms.md), so it runs with r_q = 0.
    ("ppo_clip", "seq_mean_token_mean", "none", None, 0.5),
    ("ppo_clip", "seq_mean_token_sum", "tis", 3.0, 0.5),
    ("ppo_clip", "seq_mean_token_sum_norm", "mis", 3.0, 0.5),
    ("ppo_clip", "token_mean", "tis", 3.0, 0.0),
    ("gspo", "seq_mean_token_mean", "tis", None, 0.5),
]


@pytest.mark.parametrize("mini_batches", [2, 3])
@pytest.mark.parametrize("policy_loss, aggregation, correction, dual_clip, r_q", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_every_mini_batch_is_unbiased_under_dppo(mini_batches, policy_loss, aggregation, correction, dual_clip, r_q):
    """Each mini-batch's pruned loss and gradient, with its own D_m from its un-pruned units, is an unbiased
    estimate of the same mini-batch un-pruned: prompt + completion pruning drawn over the WHOLE batch, the split
    fixed beforehand from the seed, the ratio live (clipping acts), KL and rollout correction on."""
    p = make_problem()
    eps = (0.2, 0.28) if policy_loss == "ppo_clip" else (0.05, 0.05)
    cfg = LossConfig(policy_loss=policy_loss, eps_low=eps[0], eps_high=eps[1], kl_coef=0.1, kl_estimator="k3",
                     aggregation=aggregation, clip_ratio_c=dual_clip, rollout_correction=correction,
                     rollout_correction_cap=1.5).resolved()
    pruner = DPPOPruner(r_q, 0.5, "bernoulli")
    prompts = pruner.select_prompts(p["history"].expand(DRAWS, B), make_generator(0, 0, "prompts"))
    completions = pruner.select_completions(p["adv"].expand(DRAWS, B, G), make_generator(0, 0, "completions"))
    weights = combine(prompts, completions).weight.to(DT)  # [D, B, G], 0 where pruned
    assert 0.4 < float((weights > 0).to(DT).mean()) < 0.95
    groups = split_prompts(B, mini_batches, make_generator(0, 0, "mini_batches"))
    for group in groups:
        sub = rows(p, group)
        den = loss_denominator(aggregation, len(group), G, sub["lengths"], None, L)  # D_m, un-pruned units
        mask = sub["mask"].reshape(-1)
        _, m = per_token_objective(sub["logp"].reshape(-1), sub["old"].reshape(-1),
                                   sub["adv"][..., None].expand(-1, G, L).reshape(-1), mask,
                                   torch.arange(len(group) * G).repeat_interleave(L), cfg, sub["ref"].reshape(-1))
        assert float(m["ratio_sum"]) != float(m["tokens"])  # ratio live on this mini-batch
        if policy_loss == "ppo_clip":
            assert float(m["clipped_tokens"]) > 0
        if correction != "none":
            u = u_weights(sub, cfg)[sub["mask"] > 0]
            assert bool(((u - torch.exp(sub["old"] - sub["rollout"])[sub["mask"] > 0]).abs() > 1e-12).any())
        z = mc_z(pruned_samples(sub, cfg, weights[:, group], den), mini_batch_target(sub, cfg, den))
        assert z.max() < Z_OK, f"mini-batch {group}: max z {z.max():.2f} at statistic {int(z.argmax())}"


def test_the_same_harness_detects_a_per_mini_batch_denominator_of_kept_units():
    """Dividing each mini-batch by its kept count (instead of the fixed D_m) is biased, and this test sees it."""
    p = make_problem()
    cfg = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=0.1, kl_estimator="k3",
                     aggregation="seq_mean_token_mean").resolved()
    pruner = DPPOPruner(0.5, 0.5, "bernoulli")
    d = DRAWS
    prompts = pruner.select_prompts(p["history"].expand(d, B), make_generator(0, 0, "prompts"))
    completions = pruner.select_completions(p["adv"].expand(d, B, G), make_generator(0, 0, "completions"))
    weights = combine(prompts, completions).weight.to(DT)
    group = split_prompts(B, 2, make_generator(0, 0, "mini_batches"))[0]
    sub, w = rows(p, group), weights[:, group]
    kept = (w > 0).to(DT).sum((1, 2)).clamp(min=1)
    samples = pruned_samples(sub, cfg, w, kept)
    den = loss_denominator("seq_mean_token_mean", len(group), G, None, None, L)
    assert mc_z(samples, mini_batch_target(sub, cfg, den)).max() > 10.0


# ------------------------------------------------------------------------------------------------------------
# Rollout correction weights
# ------------------------------------------------------------------------------------------------------------
def test_rollout_correction_weights_tis_mis_and_metrics():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5], dtype=DT))
    rollout = torch.log(torch.tensor([0.5, 0.1, 0.4, 0.9, 0.3], dtype=DT))  # u = 1, 5, 1.25, 0.556, 1.667
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=DT)
    u = torch.tensor([1.0, 5.0, 1.25, 0.5 / 0.9, 0.0], dtype=DT)
    tis, m = rollout_correction_weights(old, rollout, mask, LossConfig(rollout_correction="tis",
                                                                       rollout_correction_cap=2.0,
                                                                       rollout_correction_cap_low=0.6).resolved())
    assert torch.allclose(tis, torch.tensor([1.0, 2.0, 1.25, 0.6, 0.0], dtype=DT))
    assert float(m["corrected_tokens"]) == 2 and float(m["tokens"]) == 4
    assert math.isclose(float(m["ratio_sum"]), float(u[:4].sum()))
    log_u = torch.log(u[:4])
    assert math.isclose(float(m["k1_sum"]), float(-log_u.sum()))
    assert math.isclose(float(m["k3_sum"]), float((u[:4] - log_u - 1).sum()))
    mis, m = rollout_correction_weights(old, rollout, mask, LossConfig(rollout_correction="mis",
                                                                       rollout_correction_cap=2.0,
                                                                       rollout_correction_cap_low=0.6).resolved())
    assert torch.allclose(mis, torch.tensor([1.0, 0.0, 1.25, 0.0, 0.0], dtype=DT))
    none, _ = rollout_correction_weights(old, rollout, mask, LossConfig(kl_coef=0.0).resolved())
    assert torch.equal(none, mask)


def test_defaults_leave_the_objective_bit_identical():
    """The new options at their defaults (no dual clip, no KL clamp, no rollout factor) change nothing, bit for
    bit: the loss a one-update run trains on is today's."""
    p = make_problem()
    f = lambda t: t.reshape(-1)  # noqa: E731
    adv = f(p["adv"][..., None].expand(B, G, L))
    seq = torch.arange(B * G).repeat_interleave(L)
    for pl in ("ppo_clip", "gspo"):
        base = LossConfig(policy_loss=pl, eps_low=0.2, eps_high=0.28, kl_coef=0.1, kl_estimator="k3",
                          aggregation="seq_mean_token_mean").resolved()
        s0, _ = per_token_objective(f(p["logp"]), f(p["old"]), adv, f(p["mask"]), seq, base, f(p["ref"]))
        s1, _ = per_token_objective(f(p["logp"]), f(p["old"]), adv, f(p["mask"]), seq, base, f(p["ref"]), None)
        ones = torch.ones_like(s0)
        s2, _ = per_token_objective(f(p["logp"]), f(p["old"]), adv, f(p["mask"]), seq, base, f(p["ref"]), ones)
        assert torch.equal(s0, s1) and torch.equal(s0, s2)


def test_dual_clip_bounds_negative_advantage_terms():
    cfg = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.2, kl_coef=0.0, clip_ratio_c=3.0).resolved()
    logp = torch.log(torch.tensor([5.0, 5.0, 2.0, 0.5], dtype=DT))
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0], dtype=DT)
    s, _ = per_token_objective(logp, torch.zeros(4, dtype=DT), adv, torch.ones(4, dtype=DT), None, cfg)
    # A<0, rho=5: min(-5, -1.2) = -5, bounded at 3*A = -3; A>0 untouched (1.2); rho=2: -2 > -3 stays; rho=.5: -0.8
    assert torch.allclose(s, torch.tensor([-3.0, 1.2, -2.0, -0.8], dtype=DT))
    with pytest.raises(ValueError, match="clip_ratio_c must be None"):
        LossConfig(clip_ratio_c=1.0).resolved()


# ------------------------------------------------------------------------------------------------------------
# r = 0: our mini-batch losses == the peers' published formulas on identical inputs
# ------------------------------------------------------------------------------------------------------------
# Upstream sources read (commits of the snapshots):
#   verl  volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7
#         verl/trainer/ppo/core_algos.py:325          GRPO advantage (score - mean) / (std + epsilon), epsilon 1e-6
#         verl/trainer/ppo/core_algos.py:1209-1235    compute_policy_loss_vanilla: ratio, clip, dual clip (c = 3)
#         verl/trainer/ppo/core_algos.py:1237-1239    pg_losses * rollout_is_weights
#         verl/trainer/ppo/core_algos.py:1055-1076    agg_loss: token-mean, seq-mean-token-sum, seq-mean-token-mean
#         verl/trainer/ppo/core_algos.py:1890-1896    low_var_kl: clamp x to [-20, 20], kld to [-10, 10]
#         verl/trainer/ppo/rollout_corr_helper.py:531-562  token TIS: exp(log ratio) truncated at the threshold
#   TRL   huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8
#         trl/trainer/grpo_trainer.py:2685-2707       advantages (r - group mean) / (group std + 1e-4) (Bessel std)
#         trl/trainer/grpo_trainer.py:2590-2620       vLLM IS ratio: token_truncate clamp / token_mask zero
#         trl/trainer/grpo_trainer.py:3066-3121       coef_1, coef_2, -min(...), * IS ratio, + beta * k3
#         trl/trainer/grpo_trainer.py:3125-3142       loss_type grpo / dr_grpo / dapo aggregation
#   slime THUDM/slime 624b824a898ab0ec1fcb4d373004c7f3852bf515
#         slime/backends/megatron_utils/loss.py:884-905   vanilla TIS clamp(exp(old - rollout), tis_clip_low, tis_clip)
#         slime/backends/megatron_utils/loss.py:908-930   icepop: ratio inside [low, high] else 0
# The verl ratio clamp exp(clamp(logp - old, -20, 20)) (core_algos.py:1211-1213) is inactive on these inputs.
def peer_problem(seed=1, n_prompts=4, group=4, max_len=5):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n_prompts * group,), generator=gen)
    mask = (torch.arange(max_len)[None, :] < lengths[:, None]).to(DT)
    old = torch.randn(n_prompts * group, max_len, generator=gen, dtype=DT) * 0.5 - 1.0
    logp = old + torch.randn(n_prompts * group, max_len, generator=gen, dtype=DT) * 0.6
    ref = old + torch.randn(n_prompts * group, max_len, generator=gen, dtype=DT) * 0.3
    rollout = old + torch.randn(n_prompts * group, max_len, generator=gen, dtype=DT) * 0.5
    rewards = (torch.rand(n_prompts, group, generator=gen) > 0.5).to(DT)
    rewards[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    return dict(lengths=lengths, mask=mask, old=old, logp=logp, ref=ref, rollout=rollout, rewards=rewards,
                G=group, L=max_len)


def verl_grpo_advantage(rewards: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """verl core_algos.py:310-325 (per group: torch.mean, torch.std (Bessel), (s - mean) / (std + epsilon))."""
    out = torch.empty_like(rewards)
    for q in range(rewards.shape[0]):
        s = rewards[q]
        out[q] = (s - torch.mean(s)) / (torch.std(s) + epsilon)
    return out.reshape(-1)


def trl_grpo_advantage(rewards: torch.Tensor) -> torch.Tensor:
    """TRL grpo_trainer.py:2685-2707, scale_rewards="group": nanmean / nanstd (Bessel) per group, std + 1e-4."""
    g = rewards.shape[1]
    flat = rewards.reshape(-1)
    mean = torch.nanmean(rewards, dim=1).repeat_interleave(g)
    var = torch.nanmean((rewards - rewards.mean(1, keepdim=True)) ** 2, dim=1) * g / (g - 1)
    std = torch.sqrt(var).repeat_interleave(g)
    return (flat - mean) / (std + 1e-4)


def verl_mini_batch_loss(mb: dict, adv_seq: torch.Tensor, logp: torch.Tensor, loss_agg_mode: str,
                         rollout_is: str | None = None, kl_coef: float = 0.001, length_eps: float = 1e-8
                         ) -> torch.Tensor:
    """verl's actor loss of one mini-batch, one DP rank holding it all (dp_size = 1): policy loss
    (compute_policy_loss_vanilla, dual clip c = 3, eps 0.2) + kl_coef * agg_loss(low_var_kl clamped).
    ``length_eps``: the + 1e-8 of seq-mean-token-mean's |o| (core_algos.py:1067)."""
    adv = adv_seq[:, None].expand_as(logp)
    mask = mb["mask"]
    negative_approx_kl = torch.clamp(logp - mb["old"], min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.2)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * 3.0
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is is not None:  # rollout_corr_helper.py:531-562 (token level, threshold 2.0, no batch norm)
        log_ratio = mb["old"] - mb["rollout"]
        w = torch.exp(torch.clamp(log_ratio, -20.0, 20.0)) * mask
        pg_losses = pg_losses * w.clamp(max=2.0)

    def agg(loss_mat):
        if loss_agg_mode == "token-mean":
            return (loss_mat * mask).sum() / mask.sum()
        seq_losses = torch.sum(loss_mat * mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (torch.sum(mask, dim=-1) + length_eps)
        seq_mask = (torch.sum(mask, dim=-1) > 0).to(DT)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()

    kl = torch.clamp(mb["ref"] - logp, min=-20, max=20)
    kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    return agg(pg_losses) + kl_coef * agg(kld)


def trl_mini_batch_loss(mb: dict, adv_seq: torch.Tensor, logp: torch.Tensor, loss_type: str, beta: float,
                        is_mode: str | None = None) -> torch.Tensor:
    """TRL GRPOTrainer._compute_loss on one mini-batch (importance_sampling_level "token", epsilon 0.2)."""
    adv = adv_seq[:, None]
    mask = mb["mask"]
    coef_1 = torch.exp(logp - mb["old"])
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if is_mode is not None:  # grpo_trainer.py:2580-2620 with clip_min 0, clip_max 2
        ratio = torch.exp((mb["old"] - mb["rollout"]) * mask)
        if is_mode == "token_truncate":
            ratio = torch.clamp(ratio, min=0.0, max=2.0)
        else:
            ratio = ratio.masked_fill((ratio < 0.0) | (ratio > 2.0), 0.0)
        per_token_loss = per_token_loss * ratio
    if beta != 0.0:
        per_token_kl = torch.exp(mb["ref"] - logp) - (mb["ref"] - logp) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * mb["L"])
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)  # "dapo": num_items_in_batch, 1 process


def our_mini_batch_loss(mb: dict, adv_seq: torch.Tensor, logp: torch.Tensor, cfg: LossConfig,
                        n_prompts: int) -> torch.Tensor:
    """Our engine path on the same mini-batch, packed (real tokens only), no pruning: loss_numerator / D_m."""
    real = mb["mask"] > 0
    n = mb["mask"].shape[0]
    seq = torch.arange(n)[:, None].expand_as(mb["mask"])[real]
    tw = sequence_token_weights(cfg.aggregation, torch.ones(n, dtype=DT), mb["lengths"])[seq]
    u = None
    if cfg.rollout_correction != "none":
        u, _ = rollout_correction_weights(mb["old"][real], mb["rollout"][real], torch.ones_like(tw), cfg)
    num, _ = loss_numerator(logp[real], mb["old"][real], adv_seq[seq], tw, torch.ones_like(tw), seq, cfg,
                            mb["ref"][real], u)
    den = loss_denominator(cfg.aggregation, n_prompts, mb["G"], mb["lengths"].view(n_prompts, mb["G"]), None,
                           mb["L"])
    return num / den


def mini_batches_of(p: dict, mini_batches: int) -> list[tuple[list[int], dict]]:
    g = p["G"]
    out = []
    for group in split_prompts(p["rewards"].shape[0], mini_batches, make_generator(0, 0, "mini_batches")):
        seqs = torch.tensor([q * g + i for q in group for i in range(g)])
        out.append((group, {k: (v[seqs] if isinstance(v, torch.Tensor) and k != "rewards" else v)
                            for k, v in p.items()}))
    return out


VERL_CASES = [("token-mean", "token_mean", None, "none"), ("seq-mean-token-sum", "seq_mean_token_sum", None, "none"),
              ("seq-mean-token-mean", "seq_mean_token_mean", None, "none"),
              ("token-mean", "token_mean", "token", "tis")]


@pytest.mark.parametrize("verl_mode, ours, rollout_is, correction", VERL_CASES, ids=[c[0] + (c[2] or "")
                                                                                      for c in VERL_CASES])
def test_mini_batch_losses_equal_verl(verl_mode, ours, rollout_is, correction):
    p = peer_problem()
    adv = verl_grpo_advantage(p["rewards"])
    assert torch.equal(adv, compute_advantages(p["rewards"], "grpo", 1e-6).reshape(-1))
    cfg = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.2, kl_coef=0.001, kl_estimator="k3",
                     aggregation=ours, clip_ratio_c=3.0, kl_clamp=10.0, rollout_correction=correction,
                     rollout_correction_cap=2.0).resolved()
    for group, mb in mini_batches_of(p, 2):
        adv_mb = torch.cat([adv[q * p["G"]:(q + 1) * p["G"]] for q in group])
        theirs_leaf = mb["logp"].clone().requires_grad_()
        ours_leaf = mb["logp"].clone().requires_grad_()
        # seq-mean-token-mean: verl divides by |o| + 1e-8 (core_algos.py:1067); we compare with that 1e-8 at 0
        # and check separately that it moves verl's own loss by under 1e-6 relative
        theirs = verl_mini_batch_loss(mb, adv_mb, theirs_leaf, verl_mode, rollout_is, length_eps=0.0)
        published = verl_mini_batch_loss(mb, adv_mb, mb["logp"], verl_mode, rollout_is)
        assert torch.allclose(published, theirs.detach(), rtol=1e-6, atol=0)
        mine = our_mini_batch_loss(mb, adv_mb, ours_leaf, cfg, len(group))
        (g_theirs,), (g_mine,) = torch.autograd.grad(theirs, theirs_leaf), torch.autograd.grad(mine, ours_leaf)
        assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-15), (float(mine.detach()), float(theirs.detach()))
        assert torch.allclose(g_mine * mb["mask"], g_theirs * mb["mask"], rtol=1e-12, atol=1e-15)


TRL_CASES = [("grpo", "seq_mean_token_mean", 0.04, None, "none"), ("dapo", "token_mean", 0.0, None, "none"),
             ("dr_grpo", "seq_mean_token_sum_norm", 0.0, None, "none"),
             ("dapo", "token_mean", 0.0, "token_truncate", "tis"), ("dapo", "token_mean", 0.0, "token_mask", "mis")]


@pytest.mark.parametrize("loss_type, ours, beta, is_mode, correction", TRL_CASES,
                         ids=[c[0] + "-" + str(c[3]) for c in TRL_CASES])
def test_mini_batch_losses_equal_trl(loss_type, ours, beta, is_mode, correction):
    p = peer_problem(seed=2)
    adv = trl_grpo_advantage(p["rewards"])
    assert torch.allclose(adv, compute_advantages(p["rewards"], "grpo", 1e-4).reshape(-1), rtol=1e-14, atol=1e-15)
    cfg = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.2, kl_coef=beta, kl_estimator="k3",
                     aggregation=ours, advantage_eps=1e-4, rollout_correction=correction,
                     rollout_correction_cap=2.0).resolved()
    for group, mb in mini_batches_of(p, 2):
        adv_mb = torch.cat([adv[q * p["G"]:(q + 1) * p["G"]] for q in group])
        theirs_leaf = mb["logp"].clone().requires_grad_()
        ours_leaf = mb["logp"].clone().requires_grad_()
        theirs = trl_mini_batch_loss(mb, adv_mb, theirs_leaf, loss_type, beta, is_mode)
        mine = our_mini_batch_loss(mb, adv_mb, ours_leaf, cfg, len(group))
        (g_theirs,), (g_mine,) = torch.autograd.grad(theirs, theirs_leaf), torch.autograd.grad(mine, ours_leaf)
        assert torch.allclose(mine, theirs, rtol=1e-12, atol=1e-15), (float(mine), float(theirs.detach()))
        assert torch.allclose(g_mine * mb["mask"], g_theirs * mb["mask"], rtol=1e-12, atol=1e-15)


def test_slime_tis_and_icepop_weights():
    """slime loss.py:884-930 on the same tokens: TIS = clamp(exp(old - rollout), low, clip); icepop keeps the
    ratio inside [low, clip], else 0. Ours, with cap_low = low and cap = clip."""
    p = peer_problem(seed=3)
    real = p["mask"] > 0
    old, rollout = p["old"][real], p["rollout"][real]
    tis_ratio = torch.exp(old - rollout)
    slime_tis = torch.clamp(tis_ratio, min=0.1, max=2.0)
    slime_ice = torch.where((tis_ratio >= 0.1) & (tis_ratio <= 2.0), tis_ratio, torch.zeros_like(tis_ratio))
    ones = torch.ones_like(old)
    for mode, expected in (("tis", slime_tis), ("mis", slime_ice)):
        cfg = LossConfig(rollout_correction=mode, rollout_correction_cap=2.0, rollout_correction_cap_low=0.1).resolved()
        ours, _ = rollout_correction_weights(old, rollout, ones, cfg)
        assert torch.allclose(ours, expected, rtol=1e-14, atol=0)
    assert bool((tis_ratio > 2.0).any()) and bool((tis_ratio < 2.0).any())  # the caps act


# ------------------------------------------------------------------------------------------------------------
# Configuration: the new options, their errors, and the peers' presets by name
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, match", [
    ("train.mini_batches=5", r"train.mini_batches=5 is invalid: expected an integer in \[1, train.prompts_per_step=4"),
    ("train.epochs=0", "train.epochs=0 is invalid"),
    ("loss.clip_ratio_c=1.0", r"loss.clip_ratio_c=1.0 is invalid: expected preset, null \(off\) or > 1"),
    ("loss.gspo_log_ratio_cap=big", "loss.gspo_log_ratio_cap='big' is invalid: expected float or one of 'preset' or "
                                    "null"),
    ("loss.rollout_correction=foo", "loss.rollout_correction='foo' is invalid"),
    ("loss.kl_clamp=0", "loss.kl_clamp=0.0 is invalid"),
])
def test_config_errors_name_the_value(override, match):
    from megatron_dppo.config import load_config

    with pytest.raises(ValueError, match=match):
        cfg = load_config(None, ["data.task=arithmetic", "train.prompts_per_step=4", override], validate=False)
        cfg.train.validate()
        cfg.loss.validate()


def test_presets_by_name_with_overrides():
    from megatron_dppo.config import load_config
    from megatron_dppo.run.build import build_loss

    cfg = load_config(None, ["data.task=arithmetic", "loss.preset=verl_grpo", "loss.rollout_correction=tis",
                             "loss.rollout_correction_cap=3.0", "train.mini_batches=4", "train.epochs=2"],
                      validate=False)
    cfg.train.validate()
    loss, estimator = build_loss(cfg)
    assert (loss.clip_ratio_c, loss.kl_clamp, loss.kl_coef, loss.aggregation, estimator) == \
        (3.0, 10.0, 0.001, "token_mean", "grpo")
    assert (loss.rollout_correction, loss.rollout_correction_cap) == ("tis", 3.0)
    assert (cfg.train.mini_batches, cfg.train.epochs) == (4, 2)
    trl, _ = build_loss(load_config(None, ["loss.preset=trl_grpo"], validate=False))
    assert trl.advantage_eps == 1e-4 and trl.kl_coef == 0.0
    default, _ = build_loss(load_config(None, [], validate=False))
    assert (default.clip_ratio_c, default.kl_clamp, default.advantage_eps, default.rollout_correction) == \
        (None, None, 1e-6, "none")
    assert default.temperature == 1.0
    # the rollout's sampling temperature reaches the loss: every log-prob of the update is tempered by it
    tempered, _ = build_loss(load_config(None, ["rollout.temperature=0.7", "loss.preset=verl_grpo"], validate=False))
    assert tempered.temperature == 0.7 and tempered.kl_clamp == 10.0


def test_a_preset_value_can_be_overridden_to_null_where_null_is_off(tmp_path):
    """verl_grpo's gspo_log_ratio_cap 10, dual clip 3 and KL clamp 10: null on the command line or in the file turns
    each off (it used to be dropped as 'not set', leaving the preset's value); the default and "preset" keep it."""
    from megatron_dppo.config import load_config
    from megatron_dppo.run.build import build_loss

    base = ["loss.preset=verl_grpo", "loss.policy_loss=gspo"]
    kept, _ = build_loss(load_config(None, base, validate=False))
    assert kept.gspo_log_ratio_cap == 10.0 and kept.kl_clamp == 10.0
    off, _ = build_loss(load_config(None, base + ["loss.gspo_log_ratio_cap=null", "loss.kl_clamp=null"],
                                    validate=False))
    assert off.gspo_log_ratio_cap is None and off.kl_clamp is None and off.policy_loss == "gspo"
    path = tmp_path / "run.yaml"
    path.write_text("loss:\n  preset: verl_grpo\n  clip_ratio_c: null\n  kl_clamp: preset\n  gspo_log_ratio_cap: 5\n")
    cfg = load_config(path, [], validate=False)
    cfg.loss.validate()
    from_file, _ = build_loss(cfg)
    assert (from_file.clip_ratio_c, from_file.kl_clamp, from_file.gspo_log_ratio_cap) == (None, 10.0, 5.0)
    assert load_config(None, [], validate=False).loss.clip_ratio_c == "preset"


def test_rollout_correction_stage_places_engine_logprobs_at_the_completion_tokens():
    """stages.correct_rollout_mismatch on packed micro-batches (padding between sequences, two sequences in one
    bin, their order swapped): each completion token gets u' of ITS OWN rollout-engine log-prob; prompt and padding
    positions get 0. A sequence the engine gave no log-probs for (or the wrong number) is an error naming it, not
    u' = 1 (the old fallback, which made a stale or truncated sample look on-policy there)."""
    import dataclasses
    from types import SimpleNamespace

    from megatron_dppo.packing import build_rank_micro_batches
    from megatron_dppo.train.rollouts import Rollout
    from megatron_dppo.train.stages import TrainBatch, correct_rollout_mismatch
    from megatron_dppo.train.step_metrics import logprob_mismatch

    prompts = [[5, 6], [7, 8, 9]]
    completions = [[[11, 12, 13]], [[21, 22]]]
    token_ids = [prompts[0] + completions[0][0], prompts[1] + completions[1][0]]
    batch = TrainBatch(token_ids=token_ids, prompt_lengths=[2, 3], advantages=torch.tensor([1.0, -1.0]),
                       token_weights=torch.ones(2), seq_weights=torch.ones(2), rewards=torch.zeros(2),
                       origin=[(0, 0), (1, 0)], denominator=2.0)
    engine_logp = [[-0.5, -1.0, -3.0], [-1.25, -0.75]]  # u = exp(old - engine) with old = -1 everywhere
    rollout = Rollout(prompts=[SimpleNamespace(id=f"q{q}", token_ids=p) for q, p in enumerate(prompts)],
                      completions=completions, texts=[[""], [""]],
                      behaviour_logprobs=[[engine_logp[0]], [engine_logp[1]]], truncated=[[False], [False]])

    def packed():
        micro_batches = build_rank_micro_batches([[1, 0]], token_ids, [2, 3], batch.advantages, batch.token_weights,
                                                 pad_multiple=4)
        for mb in micro_batches:
            mb.old_logprobs = torch.full(mb.tokens.shape, -1.0)
        return micro_batches

    micro_batches = packed()
    loss_cfg = LossConfig(rollout_correction="tis", rollout_correction_cap=2.0).resolved()
    metrics = correct_rollout_mismatch(loss_cfg, rollout, [batch], [micro_batches])
    (mb,) = micro_batches
    per_seq = dict(zip(mb.sample_ids.tolist(), mb.completion_values(mb.rollout_weight)))
    u = [torch.exp(-1.0 - torch.tensor(lp)) for lp in engine_logp]
    for sid in (0, 1):
        assert torch.allclose(per_seq[sid], u[sid].clamp(max=2.0).float())
    assert float(mb.rollout_weight[mb.loss_mask == 0].abs().sum()) == 0.0
    all_u = torch.cat(u)
    assert metrics["rollout/is_corrected_fraction"] == pytest.approx(1 / 5)  # u = e^2 > 2, of 5 tokens
    assert metrics["rollout/is_ratio"] == pytest.approx(float(all_u.sum()) / 5)
    all_lp = torch.tensor(engine_logp[0] + engine_logp[1])
    assert metrics["rollout/kl_k1"] == pytest.approx(float(all_lp.sum() + 5) / 5)
    assert logprob_mismatch(rollout, [batch], [micro_batches])["rollout/logprob_abs_diff"] == \
        pytest.approx(float((all_lp + 1).abs().sum()) / 5)

    for missing, said in ((None, "no behaviour log-probs"), ([-1.0], "returned 1 behaviour log-probs")):
        broken = dataclasses.replace(rollout, behaviour_logprobs=[[engine_logp[0]], [missing]])
        for stage in (lambda mbs: correct_rollout_mismatch(loss_cfg, broken, [batch], [mbs]),
                      lambda mbs: logprob_mismatch(broken, [batch], [mbs])):
            with pytest.raises(ValueError, match=f"completion 0 of prompt 'q1'.*{said} for its 2 tokens"):
                stage(packed())


def test_one_mini_batch_one_epoch_is_todays_step():
    """mini_batches = epochs = 1: the step trains the surviving batch itself (same object, same D), no old-log-prob
    pass is added (the engine is not even touched when neither recompute_old_logprobs nor KL asks for one), and
    the 'several updates' condition the old-log-prob decision reads is off. The whole-run check (metrics and
    checkpoint tensors bit-identical to the commit before this feature) is in the branch's report."""
    from megatron_dppo.config import load_config
    from megatron_dppo.run.state import TrainSide
    from megatron_dppo.train.stages import (
        fill_old_and_reference_logprobs,
        several_updates_per_rollout,
        split_mini_batches,
    )

    cfg = load_config(None, ["train.recompute_old_logprobs=false"], validate=False)
    side = TrainSide(cfg=cfg, engine=None, loss_cfg=LossConfig(kl_coef=0.0).resolved(), estimator="grpo",
                     pruner=None)
    batch = object()
    assert split_mini_batches(side, [], None, None, None, batch, step=0) == [batch]
    assert split_mini_batches(side, [], None, None, None, batch, step=0)[0] is batch
    assert not several_updates_per_rollout(cfg)
    fill_old_and_reference_logprobs(side, [[]])  # engine None: would raise if a pass were added
    for key, value in (("train.mini_batches", 2), ("train.epochs", 2)):
        several = load_config(None, [f"{key}={value}"], validate=False)
        assert several_updates_per_rollout(several)
        with pytest.raises(AttributeError):  # several updates: the old-log-prob pass runs (here: no engine)
            no_kl = LossConfig(kl_coef=0.0).resolved()
            fill_old_and_reference_logprobs(TrainSide(cfg=several, engine=None, loss_cfg=no_kl, estimator="grpo",
                                                      pruner=None), [[]])


def test_update_metrics_of_several_updates():
    from megatron_dppo.train.stages import merge_update_metrics

    one = {"loss": 0.5, "grad_norm": 2.0, "tokens": 10.0, "sequences": 3.0, "micro_batches": 2.0, "update_ok": 1.0}
    assert merge_update_metrics([one]) is one  # one update per rollout: its metrics as they are
    two = dict(one, loss=1.5, grad_norm=4.0, tokens=6.0, update_ok=0.0)
    assert merge_update_metrics([one, two]) == {"loss": 1.0, "grad_norm": 3.0, "tokens": 16.0, "sequences": 6.0,
                                                "micro_batches": 4.0, "update_ok": 0.0, "updates": 2.0}
