"""Policy losses, KL estimators, aggregation weights and denominators (docs/algorithms.md).

The flat implementation (loss_numerator / loss_denominator / sequence_token_weights, as the engine calls it) is
checked against ``reference_objective``, written straight from the formulas on padded tensors, for every loss x
aggregation x KL estimator, in the padded-flattened AND the packed (no padding, shuffled) layouts.
"""

import itertools
import math

import pytest
import torch

from megatron_dppo.algo.advantages import ADVANTAGE_ESTIMATORS
from megatron_dppo.algo.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOSS_PRESETS,
    POLICY_LOSSES,
    LossConfig,
    loss_denominator,
    loss_numerator,
    per_token_objective,
    reference_objective,
    register_policy_loss,
    sequence_token_weights,
)

DT = torch.float64


def make_batch(b=3, g=4, max_len=7, seed=0, spread=0.3):
    """Padded batch with ratios off 1 (clipping active), a reference policy, per-sequence weights and lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (b, g), generator=gen)
    lengths[0, 0] = max_len
    mask = (torch.arange(max_len)[None, None, :] < lengths[..., None]).to(DT)
    logp = (torch.randn(b, g, max_len, generator=gen, dtype=DT) * 0.5 - 1.0)
    old = logp + torch.randn(b, g, max_len, generator=gen, dtype=DT) * spread
    ref = logp + torch.randn(b, g, max_len, generator=gen, dtype=DT) * 0.2
    adv = torch.randn(b, g, generator=gen, dtype=DT)
    adv[1, 1] = 0.0
    weight = torch.tensor([1.0, 2.0, 0.0, 4.0 / 3.0], dtype=DT).repeat(b * g)[: b * g].view(b, g)
    return dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask, lengths=lengths, weight=weight)


def flat_padded(batch):
    """Padded layout flattened: seq_index = row of [N, L]."""
    b, g, max_len = batch["logp"].shape
    n = b * g
    seq_index = torch.arange(n).repeat_interleave(max_len)
    return dict(
        logp=batch["logp"].reshape(-1),
        old=batch["old"].reshape(-1),
        ref=batch["ref"].reshape(-1),
        adv=batch["adv"].reshape(n, 1).expand(n, max_len).reshape(-1),
        mask=batch["mask"].reshape(-1),
        seq_index=seq_index,
        token_of_seq=lambda per_seq: per_seq.reshape(n, 1).expand(n, max_len).reshape(-1),
    )


def flat_loss(batch, cfg, logp_leaf, layout="padded"):
    """loss = loss_numerator / loss_denominator with sequence_token_weights, as the engine composes them."""
    b, g, max_len = batch["logp"].shape
    n = b * g
    lengths = batch["lengths"].reshape(-1)
    seq_w = sequence_token_weights(cfg.aggregation, batch["weight"].reshape(-1), lengths)
    den = loss_denominator(cfg.aggregation, b, g, batch["lengths"], None, max_len)
    if layout == "padded":
        f = flat_padded(batch)
        tw = f["token_of_seq"](seq_w)
        num, metrics = loss_numerator(
            logp_leaf.reshape(-1), f["old"], f["adv"], tw, f["mask"], f["seq_index"], cfg, f["ref"]
        )
        return num / den, metrics
    # packed: only real tokens, sequences in a shuffled order, seq_index = position in the pack
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    parts = {k: [] for k in ("logp", "old", "ref", "adv", "tw", "seq")}
    for slot, s in enumerate(order.tolist()):
        q, i = divmod(s, g)
        length = int(batch["lengths"][q, i])
        parts["logp"].append(logp_leaf[q, i, :length])
        parts["old"].append(batch["old"][q, i, :length])
        parts["ref"].append(batch["ref"][q, i, :length])
        parts["adv"].append(batch["adv"][q, i].expand(length))
        parts["tw"].append(seq_w[s].expand(length))
        parts["seq"].append(torch.full((length,), slot))
    cat = {k: torch.cat(v) for k, v in parts.items()}
    mask = torch.ones_like(cat["old"])
    num, metrics = loss_numerator(cat["logp"], cat["old"], cat["adv"], cat["tw"], mask, cat["seq"], cfg, cat["ref"])
    return num / den, metrics


ALL_CONFIGS = [
    LossConfig(policy_loss=pl, eps_low=0.2, eps_high=0.28, kl_coef=0.1, kl_estimator=kl, aggregation=agg).resolved()
    for pl, agg, kl in itertools.product(("ppo_clip", "gspo"), AGGREGATIONS, ("k1", "k2", "k3"))
]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.aggregation}-{c.kl_estimator}")
def test_flat_loss_equals_reference_objective(cfg, layout):
    batch = make_batch(spread=0.3 if cfg.policy_loss == "ppo_clip" else 1.0)
    if cfg.policy_loss == "gspo":
        cfg = LossConfig(policy_loss="gspo", eps_low=0.05, eps_high=0.05, kl_coef=cfg.kl_coef,
                         kl_estimator=cfg.kl_estimator, aggregation=cfg.aggregation).resolved()
    leaf_a = batch["logp"].clone().requires_grad_()
    leaf_b = batch["logp"].clone().requires_grad_()
    loss, metrics = flat_loss(batch, cfg, leaf_a, layout)
    ref_loss = -reference_objective(
        leaf_b, batch["old"], batch["adv"], batch["mask"], cfg, batch["ref"], batch["weight"]
    )
    (grad_a,) = torch.autograd.grad(loss, leaf_a)
    (grad_b,) = torch.autograd.grad(ref_loss, leaf_b)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=1e-14)
    assert torch.allclose(grad_a, grad_b, rtol=1e-10, atol=1e-14)
    # the comparison is not vacuous: clipping is active on some but not all tokens, and KL contributes
    tokens = float(metrics["tokens"])
    assert 0 < float(metrics["clipped_tokens"]) < tokens
    assert float(metrics["kl_sum"]) != 0


def test_padding_garbage_never_leaks():
    batch = make_batch()
    cfg = LossConfig(policy_loss="ppo_clip", kl_coef=0.1, kl_estimator="k3", aggregation="token_mean").resolved()
    dirty = {k: v.clone() for k, v in batch.items()}
    pad = batch["mask"] == 0
    for key in ("logp", "old", "ref"):
        dirty[key][pad] = float("nan")
    clean_leaf = batch["logp"].clone().requires_grad_()
    dirty_leaf = dirty["logp"].clone().requires_grad_()
    loss_clean, _ = flat_loss(batch, cfg, clean_leaf)
    loss_dirty, _ = flat_loss(dirty, cfg, dirty_leaf)
    (g_clean,) = torch.autograd.grad(loss_clean, clean_leaf)
    (g_dirty,) = torch.autograd.grad(loss_dirty, dirty_leaf)
    assert torch.equal(loss_clean, loss_dirty)
    assert torch.equal(g_clean, g_dirty)


def test_ppo_clip_hand_values_and_clip_higher():
    # A > 0: rho = 1.25 is clipped at 1.2 with eps_high 0.2 but not with eps_high 0.28 (DAPO clip-higher)
    logp = torch.log(torch.tensor([1.25, 0.7, 1.25, 0.7], dtype=DT)).requires_grad_()
    old = torch.zeros(4, dtype=DT)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=DT)
    mask = torch.ones(4, dtype=DT)
    seq = torch.arange(4)
    sym = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.2, kl_coef=0.0).resolved()
    s, m = per_token_objective(logp, old, adv, mask, seq, sym)
    # min(rho A, clip(rho) A): [1.2 (clipped high), -0.8 (clipped low), -1.25, 0.7]
    assert torch.allclose(s, torch.tensor([1.2, -0.8, -1.25, 0.7], dtype=DT))
    assert (m["clip_high_tokens"], m["clip_low_tokens"], m["clipped_tokens"]) == (1, 1, 2)
    (grad,) = torch.autograd.grad(s.sum(), logp)
    assert torch.allclose(grad, torch.tensor([0.0, 0.0, -1.25, 0.7], dtype=DT))  # no gradient through the clip
    high = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=0.0).resolved()
    s_high, m_high = per_token_objective(logp, old, adv, mask, seq, high)
    assert torch.allclose(s_high[0], torch.tensor(1.25, dtype=DT))
    assert m_high["clip_high_tokens"] == 0


def test_gspo_is_one_term_per_sequence_with_exact_gradient():
    batch = make_batch(spread=0.15, seed=3)
    cfg = LossConfig(policy_loss="gspo", eps_low=0.05, eps_high=0.05, kl_coef=0.0,
                     aggregation="seq_mean_token_mean").resolved()
    b, g, max_len = batch["logp"].shape
    leaf = batch["logp"].clone().requires_grad_()
    loss, _ = flat_loss(batch, cfg, leaf)
    # independent per-sequence formula: -1/(B G) sum w min(S A, clip(S) A)
    leaf2 = batch["logp"].clone().requires_grad_()
    m, length = batch["mask"], batch["lengths"].to(DT)
    seq_ratio = torch.exp(((leaf2 - batch["old"]) * m).sum(-1) / length)
    a = batch["adv"]
    per_seq = torch.minimum(seq_ratio * a, seq_ratio.clamp(0.95, 1.05) * a)
    direct = -(batch["weight"] * per_seq).sum() / (b * g)
    assert torch.allclose(loss, direct, rtol=1e-12)
    (g1,) = torch.autograd.grad(loss, leaf)
    (g2,) = torch.autograd.grad(direct, leaf2)
    assert torch.allclose(g1, g2, rtol=1e-10, atol=1e-15)
    # within a sequence every token gets the same gradient dmin/dS * S / |o| (the ratio is per sequence)
    q, i = 0, 0
    toks = g1[q, i, : int(batch["lengths"][q, i])]
    assert torch.allclose(toks, toks[0].expand_as(toks))
    clipped = (seq_ratio - seq_ratio.clamp(0.95, 1.05)).abs() > 0
    assert clipped.any() and (~clipped).any()


def test_gspo_needs_seq_index_on_completion_tokens():
    t = torch.zeros(4, dtype=DT)
    cfg = LossConfig(policy_loss="gspo", kl_coef=0.0).resolved()
    with pytest.raises(ValueError, match="seq_index"):
        per_token_objective(t, t, t, torch.ones(4), None, cfg)
    with pytest.raises(ValueError, match="seq_index"):
        per_token_objective(t, t, t, torch.ones(4), torch.tensor([0, 0, -1, 1]), cfg)


def test_kl_estimators_exact_expectation_under_policy():
    # tokens x ~ pi: E_pi[k1] = E_pi[k3] = KL(pi || ref) exactly; k2 is biased; k3 >= 0; all are 0 at pi = ref
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(50, generator=gen, dtype=DT), 0)
    ref = torch.log_softmax(torch.randn(50, generator=gen, dtype=DT), 0)
    p = logp.exp()
    kl = (p * (logp - ref)).sum()
    est = {name: (p * KL_ESTIMATORS.get(name)(logp, ref)).sum() for name in ("k1", "k2", "k3")}
    assert torch.allclose(est["k1"], kl, rtol=1e-12)
    assert torch.allclose(est["k3"], kl, rtol=1e-12)
    assert not torch.allclose(est["k2"], kl, rtol=1e-3)
    assert (KL_ESTIMATORS.get("k3")(logp, ref) >= 0).all()
    for name in ("k1", "k2", "k3"):
        assert torch.equal(KL_ESTIMATORS.get(name)(logp, logp), torch.zeros_like(logp))
    x = ref - logp
    assert torch.allclose(KL_ESTIMATORS.get("k3")(logp, ref), torch.exp(x) - x - 1)


def test_kl_needs_reference():
    t = torch.zeros(3, dtype=DT)
    with pytest.raises(ValueError, match="ref_logp"):
        loss_numerator(t, t, t, t, torch.ones(3), torch.arange(3), LossConfig(kl_coef=0.1).resolved())


def test_bf16_inputs_are_upcast():
    batch = make_batch()
    f = flat_padded(batch)
    cfg = LossConfig(kl_coef=0.0).resolved()
    tw = torch.ones_like(f["old"])
    num32, _ = loss_numerator(f["logp"].float(), f["old"].float(), f["adv"].float(), tw, f["mask"], f["seq_index"], cfg)
    num16, _ = loss_numerator(
        f["logp"].bfloat16(), f["old"].float(), f["adv"].float(), tw, f["mask"], f["seq_index"], cfg
    )
    assert num16.dtype == torch.float32
    assert torch.allclose(num16, num32, rtol=2e-2)


def test_sequence_token_weights():
    w = torch.tensor([1.0, 2.0, 4.0])
    lengths = torch.tensor([4, 5, 0])
    assert torch.equal(sequence_token_weights("seq_mean_token_mean", w, lengths), torch.tensor([0.25, 0.4, 0.0]))
    for agg in ("token_mean", "seq_mean_token_sum_norm"):
        assert torch.equal(sequence_token_weights(agg, w, lengths), w)
    with pytest.raises(ValueError, match="'mean'.*seq_mean_token_mean"):
        sequence_token_weights("mean", w, lengths)
    with pytest.raises(ValueError, match="-1"):
        sequence_token_weights("token_mean", w, torch.tensor([1, -1, 2]))


def test_loss_denominator_values():
    lengths = torch.tensor([[3, 5], [2, 0], [7, 1]])
    assert loss_denominator("seq_mean_token_mean", 3, 2) == 6.0
    assert loss_denominator("seq_mean_token_sum_norm", 3, 2, max_completion_len=10) == 60.0
    assert loss_denominator("token_mean", 3, 2, lengths) == 18.0
    # Horvitz-Thompson with prompt pruning: rows = kept prompts, T_hat = sum (1/pi_q) sum_i |o|
    kept = lengths[[0, 2]]
    assert loss_denominator("token_mean", 3, 2, kept, torch.tensor([0.5, 1.0])) == 8 / 0.5 + 8
    # pi = 1 everywhere reproduces T_full exactly
    assert loss_denominator("token_mean", 3, 2, lengths, torch.ones(3)) == 18.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(aggregation="sum"), "'sum'"),
        (dict(num_prompts=0), "num_prompts.*0"),
        (dict(group_size=2.5), "group_size.*2.5"),
        (dict(aggregation="seq_mean_token_sum_norm"), "max_completion_len.*None"),
        (dict(completion_lengths=None), "completion_lengths"),
        (dict(completion_lengths=torch.ones(2, 4, dtype=torch.long)), "2 rows.*num_prompts = 3"),
        (dict(completion_lengths=torch.ones(2, 4, dtype=torch.long), prompt_keep_prob=torch.tensor([0.5, 0.0])), "0.0"),
        (dict(completion_lengths=torch.zeros(3, 4, dtype=torch.long)), "no completion tokens"),
    ],
)
def test_loss_denominator_errors(kwargs, match):
    args = dict(aggregation="token_mean", num_prompts=3, group_size=4,
                completion_lengths=torch.ones(3, 4, dtype=torch.long), prompt_keep_prob=None, max_completion_len=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        loss_denominator(**args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(policy_loss="ppo"), "'ppo'.*gspo, ppo_clip"),
        (dict(kl_estimator="k4"), "'k4'.*k1, k2, k3"),
        (dict(aggregation="mean"), "'mean'"),
        (dict(eps_low=-0.1), "eps_low.*-0.1"),
        (dict(eps_low=1.0), "eps_low.*1.0"),
        (dict(eps_high=float("nan")), "eps_high.*nan"),
        (dict(kl_coef=-1.0), "kl_coef.*-1.0"),
        (dict(gspo_gradient="detach"), "'detach'.*autograd, stop_gradient"),
        (dict(kl_bias_correction="yes"), "kl_bias_correction.*'yes'"),
        (dict(gspo_log_ratio_cap=0.0), "gspo_log_ratio_cap.*0.0"),
        (dict(gspo_log_ratio_cap=float("inf")), "gspo_log_ratio_cap.*inf"),
        (dict(temperature=0.0), "temperature.*0.0"),
        (dict(temperature=float("inf")), "temperature.*inf"),
        (dict(temperature=True), "temperature.*True"),
    ],
)
def test_loss_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs).resolved()


def test_presets():
    assert set(LOSS_PRESETS) == {"grpo", "dapo", "gspo", "dr_grpo", "verl_grpo", "trl_grpo"}
    for name, cfg in LOSS_PRESETS.items():
        assert isinstance(cfg, LossConfig) and cfg.preset == name and cfg.advantage_estimator in ADVANTAGE_ESTIMATORS
        assert cfg.is_resolved and cfg.resolved() == cfg  # a preset is final: resolving it changes nothing
    assert LOSS_PRESETS["dapo"].eps_high > LOSS_PRESETS["dapo"].eps_low
    assert LOSS_PRESETS["dapo"].aggregation == "token_mean"
    assert LOSS_PRESETS["gspo"].policy_loss == "gspo"
    assert LOSS_PRESETS["dr_grpo"].advantage_estimator == "dr_grpo"
    assert LOSS_PRESETS["dr_grpo"].aggregation == "seq_mean_token_sum_norm"
    verl, trl = LOSS_PRESETS["verl_grpo"], LOSS_PRESETS["trl_grpo"]
    assert (verl.clip_ratio_c, verl.kl_clamp, verl.kl_coef, verl.aggregation) == (3.0, 10.0, 0.001, "token_mean")
    assert (trl.advantage_eps, trl.kl_coef, trl.aggregation) == (1e-4, 0.0, "token_mean")


def test_registry_new_policy_loss_is_one_function():
    @register_policy_loss("_test_vanilla_pg")
    def vanilla_pg(logp, old_logp, advantages, loss_mask, seq_index, cfg):
        return torch.exp(logp - old_logp) * advantages, {}

    try:
        cfg = LossConfig(policy_loss="_test_vanilla_pg", kl_coef=0.0).resolved()
        logp = torch.tensor([0.0, math.log(2.0)], dtype=DT)
        s, _ = per_token_objective(logp, torch.zeros(2, dtype=DT), torch.tensor([1.0, 3.0], dtype=DT),
                                   torch.ones(2), torch.arange(2), cfg)
        assert torch.allclose(s, torch.tensor([1.0, 6.0], dtype=DT))
    finally:
        POLICY_LOSSES.unregister("_test_vanilla_pg")
    with pytest.raises(ValueError, match="_test_vanilla_pg"):
        LossConfig(policy_loss="_test_vanilla_pg").resolved()


def test_one_loss_config_resolves_to_final_values():
    """The run's loss section and the loss code's config are one class: as written a field may say "the preset's
    value" (null, or "preset" where null means off); resolved() gives the same class with every field final, and
    the loss refuses a config that is not."""
    section = LossConfig(preset="verl_grpo", eps_high=0.3, kl_clamp=None)
    assert not section.is_resolved and section.gspo_log_ratio_cap == "preset"
    final = section.resolved(temperature=0.7)
    assert type(final) is LossConfig and final.is_resolved
    assert (final.eps_low, final.eps_high, final.kl_coef, final.aggregation) == (0.2, 0.3, 0.001, "token_mean")
    assert (final.kl_clamp, final.gspo_log_ratio_cap, final.clip_ratio_c) == (None, 10.0, 3.0)  # null = off
    assert (final.advantage_estimator, final.temperature) == ("grpo", 0.7)
    assert final.resolved() == final  # final values stay (the temperature too)
    assert LossConfig(preset="dr_grpo").resolved() == LOSS_PRESETS["dr_grpo"]
    t = torch.zeros(2, dtype=DT)
    with pytest.raises(ValueError, match=r"still say .*resolved\(temperature\)"):
        per_token_objective(t, t, t, torch.ones(2), torch.arange(2), section)
