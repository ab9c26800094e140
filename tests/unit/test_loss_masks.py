"""Per-token loss masks of multi-turn episodes through the pure layers: THD packing ANDs the mask (observation
tokens are never loss positions, their token weight is 0), the packed loss equals the padded reference objective
whose mask has zeros INSIDE the completion for every loss x aggregation (denominators counting mask-1 tokens:
|o| of seq_mean_token_mean, T of token_mean, the constant of seq_mean_token_sum_norm), KL and rollout correction
see mask-1 tokens only, and log-probs of observation tokens get exactly zero gradient even when their old,
reference and rollout log-probs are garbage. Negative controls: the same batch without the mask, or with the
denominator counting observation tokens, gives another loss."""
from __future__ import annotations

import pytest
import torch

from megatron_dppo.algo.losses import (
    AGGREGATIONS,
    LossConfig,
    loss_denominator,
    loss_numerator,
    reference_objective,
    rollout_correction_weights,
    sequence_token_weights,
)
from megatron_dppo.packing import build_padded_batch, build_plan_micro_batches, build_thd_batch, pack_sequences

DT = torch.float64
B, G = 3, 3


def test_thd_ands_the_loss_mask_by_hand():
    # prompt 11 12 | sampled 13 14 | observation 15 16 | sampled 17
    seq = [11, 12, 13, 14, 15, 16, 17]
    b = build_thd_batch([seq, [21, 22, 23]], [2, 1], [0, 1], [1.0, -1.0], [0.5, 2.0], pad_multiple=4,
                        loss_masks=[[1, 1, 0, 0, 1], [1, 1]])
    # positions 1..5 predict 13..17; the ones predicting 15 and 16 (positions 3, 4) are masked out
    assert b.loss_mask.tolist() == [0, 1, 1, 0, 0, 1, 0, 0, 1, 1, 0, 0]
    assert b.token_weight.tolist() == [0, 0.5, 0.5, 0, 0, 0.5, 0, 0, 2.0, 2.0, 0, 0]
    assert b.labels[b.loss_mask > 0].tolist() == [13, 14, 17, 22, 23]
    assert [v.tolist() for v in b.completion_values(torch.arange(12))] == [[1, 2, 5], [8, 9]]
    padded = build_padded_batch([seq, [21, 22, 23]], [2, 1], [0, 1], [1.0, -1.0], [0.5, 2.0],
                                loss_masks=[[1, 1, 0, 0, 1], [1, 1]])
    assert padded.loss_mask.tolist() == [[0, 1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0, 0]]
    none = build_thd_batch([seq], [2], [0], [1.0], [1.0])
    assert none.loss_mask.sum() == 5  # no masks: every completion token, as before
    with pytest.raises(ValueError, match=r"loss_masks\[0\] has 4 entries for 5 completion tokens"):
        build_thd_batch([seq], [2], [0], [1.0], [1.0], loss_masks=[[1, 1, 0, 1]])
    with pytest.raises(ValueError, match="only 0 and 1"):
        build_thd_batch([seq], [2], [0], [1.0], [1.0], loss_masks=[[1, 1, 2, 0, 1]])
    with pytest.raises(ValueError, match="one per sequence"):
        build_thd_batch([seq], [2], [0], [1.0], [1.0], loss_masks=[])


def make_episodes(seed: int = 0) -> dict:
    """B x G episodes: prompt, then 1-3 assistant turns with observation segments between them."""
    g = torch.Generator().manual_seed(seed)
    seqs, prompt_lengths, masks = [], [], []
    for q in range(B):
        prompt = torch.randint(1, 60, (2 + q,), generator=g).tolist()
        for _ in range(G):
            mask = []
            turns = int(torch.randint(1, 4, (1,), generator=g))
            for t in range(turns):
                mask += [1] * int(torch.randint(1, 5, (1,), generator=g))
                if t < turns - 1:
                    mask += [0] * int(torch.randint(2, 5, (1,), generator=g))
            seqs.append(prompt + torch.randint(1, 60, (len(mask),), generator=g).tolist())
            prompt_lengths.append(len(prompt))
            masks.append(mask)
    L = max(len(m) for m in masks)
    full_mask = torch.zeros(B, G, L, dtype=DT)
    for k, m in enumerate(masks):
        full_mask.view(B * G, L)[k, : len(m)] = torch.tensor(m, dtype=DT)
    logp = torch.randn(B, G, L, generator=g, dtype=DT) * 0.5 - 1.5
    old = logp + torch.randn(B, G, L, generator=g, dtype=DT) * 0.3
    ref = logp + torch.randn(B, G, L, generator=g, dtype=DT) * 0.2
    obs = full_mask == 0
    old[obs], ref[obs] = 0.0, 0.0  # what an episode stores on observation tokens: 0.0, far from logp
    adv = torch.randn(B, G, generator=g, dtype=DT)
    weight = torch.where(torch.rand(B, G, generator=g) < 0.3, 0.0, 1.0 / 0.7).to(DT)
    return dict(seqs=seqs, prompt_lengths=prompt_lengths, masks=masks, mask=full_mask, logp=logp, old=old, ref=ref,
                adv=adv, weight=weight, L=L, trained=full_mask.sum(-1), total=torch.tensor(
                    [len(m) for m in masks], dtype=DT).view(B, G))


def config(policy_loss: str, aggregation: str, **extra) -> LossConfig:
    eps = (0.2, 0.28) if policy_loss == "ppo_clip" else (0.05, 0.05)
    return LossConfig(policy_loss=policy_loss, eps_low=eps[0], eps_high=eps[1], kl_coef=0.1, kl_estimator="k3",
                      aggregation=aggregation, **extra).resolved()


def packed_loss(p: dict, cfg: LossConfig, den: float, lengths: torch.Tensor, use_masks: bool = True,
                rollout: torch.Tensor | None = None):
    """The loss through THD micro-batches (2 bins) and its gradient w.r.t. the packed log-probs."""
    n = B * G
    seq_w = p["weight"].flatten()
    token_w = sequence_token_weights(cfg.aggregation, seq_w, lengths.flatten())
    plan = pack_sequences([len(s) for s in p["seqs"]], 24, 1)
    batches = build_plan_micro_batches(plan, p["seqs"], p["prompt_lengths"], p["adv"].flatten(), token_w,
                                       loss_masks=p["masks"] if use_masks else None)[0]
    total, grads = 0.0, []
    for b in batches:
        def scatter(values):  # [B, G, L] per completion token -> this batch's positions
            out = torch.zeros(b.tokens.shape[0], dtype=DT)
            bounds = b.cu_seqlens_padded.tolist()
            for j, sid in enumerate(b.sample_ids.tolist()):
                start = bounds[j] + p["prompt_lengths"][sid] - 1
                m = len(p["masks"][sid])
                out[start: start + m] = values.view(n, -1)[sid, :m]
            return out

        logp = scatter(p["logp"]).requires_grad_()
        uw = None
        if rollout is not None:
            uw, _ = rollout_correction_weights(scatter(p["old"]), scatter(rollout), b.loss_mask, cfg)
        num, _ = loss_numerator(logp, scatter(p["old"]), b.advantages.to(DT), b.token_weight.to(DT), b.loss_mask,
                                b.seq_index, cfg, scatter(p["ref"]), uw)
        (grad,) = torch.autograd.grad(num / den, logp)
        total += float(num.detach()) / den
        grads.append((b, grad))
    return total, grads


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_packed_masked_loss_equals_the_reference_with_interior_zeros(policy_loss, aggregation):
    p = make_episodes()
    cfg = config(policy_loss, aggregation)
    assert bool((p["trained"] < p["total"]).any())  # observation tokens inside completions
    L_max = int(p["trained"].max())
    den = loss_denominator(aggregation, B, G, p["trained"], None, L_max)  # mask-1 counts
    J = reference_objective(p["logp"], p["old"], p["adv"], p["mask"], cfg, p["ref"], p["weight"], den)
    got, grads = packed_loss(p, cfg, den, p["trained"])
    assert got == pytest.approx(-float(J), rel=1e-6, abs=1e-9)  # THD token weights are float32
    for b, grad in grads:  # observation positions (and prompt / padding): exactly zero gradient
        assert bool((grad[b.loss_mask == 0] == 0).all())
        assert bool((grad[b.loss_mask > 0] != 0).any())
    # negative controls: no mask (observation tokens trained), or D counting observation tokens
    unmasked, _ = packed_loss(p, cfg, den, p["total"], use_masks=False)
    assert unmasked != pytest.approx(got, rel=1e-6)
    if aggregation != "seq_mean_token_sum":  # its D = B*G counts no tokens
        wrong_den = loss_denominator(aggregation, B, G, p["total"], None, int(p["total"].max()))
        wrong, _ = packed_loss(p, cfg, wrong_den, p["total"])
        assert wrong != pytest.approx(got, rel=1e-6)


def test_rollout_correction_and_kl_see_mask_one_tokens_only():
    """Observation tokens carry rollout log-prob 0.0 (and old/ref 0.0): u = exp(old - rollout) would be anything
    there. The factor is 0 off the mask, the mismatch metrics count trained tokens only, and the loss and
    gradient are those of the reference with the per-token factor on mask-1 tokens."""
    p = make_episodes(1)
    rollout = p["old"] + torch.randn(p["old"].shape, generator=torch.Generator().manual_seed(2), dtype=DT) * 0.4
    rollout[p["mask"] == 0] = 0.0
    for correction in ("tis", "mis"):
        cfg = config("ppo_clip", "seq_mean_token_mean", rollout_correction=correction, rollout_correction_cap=1.5)
        flat_mask = p["mask"].flatten()
        weight, metrics = rollout_correction_weights(p["old"].flatten(), rollout.flatten(), flat_mask, cfg)
        assert bool((weight[flat_mask == 0] == 0).all())
        assert float(metrics["tokens"]) == float(p["trained"].sum())
        u = torch.exp(p["old"] - rollout)[p["mask"] > 0]
        assert float(metrics["ratio_sum"]) == pytest.approx(float(u.sum()), rel=1e-12)
        den = loss_denominator("seq_mean_token_mean", B, G)
        J = reference_objective(p["logp"], p["old"], p["adv"], p["mask"], cfg, p["ref"], p["weight"], den,
                                rollout_weight=weight.view(p["mask"].shape))
        got, grads = packed_loss(p, cfg, den, p["trained"], rollout=rollout)
        assert got == pytest.approx(-float(J), rel=1e-6, abs=1e-9)  # THD token weights are float32
        for b, grad in grads:
            assert bool((grad[b.loss_mask == 0] == 0).all())


def test_garbage_on_observation_tokens_changes_nothing():
    """NaN and huge values in the observation tokens' log-probs leave loss and gradient bit for bit unchanged."""
    p = make_episodes(3)
    cfg = config("gspo", "token_mean", rollout_correction="tis")
    den = loss_denominator("token_mean", B, G, p["trained"])
    clean, clean_grads = packed_loss(p, cfg, den, p["trained"], rollout=p["old"])
    obs = p["mask"] == 0
    dirty = dict(p, logp=p["logp"].clone(), old=p["old"].clone(), ref=p["ref"].clone())
    dirty["logp"][obs], dirty["old"][obs], dirty["ref"][obs] = float("nan"), 1e6, -1e6
    rollout = dirty["old"].clone()
    rollout[obs] = float("inf")
    got, grads = packed_loss(dirty, cfg, den, p["trained"], rollout=rollout)
    assert got == clean
    for (_, a), (_, b) in zip(clean_grads, grads):
        assert torch.equal(a, b)
