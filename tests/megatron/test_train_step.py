"""PolicyEngine.train_step: the loss equals the algorithm core's reference objective, the gradient is exactly
grad(sum of numerators) / D whatever the micro-batching, and every parallel layout gives the same step."""
from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _engine_fixtures as F
from _dist import run_distributed, single_process_world


@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=F.SEED):
        yield


def _engine(loss_cfg, **optim):
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    seed_everything(F.SEED)
    return PolicyEngine(F.tiny_arch("llama", num_layers=2, tie=False), ParallelConfig(), OptimConfig(**optim),
                        loss_cfg)


def _fill(engine, batches):
    logp = engine.compute_logprobs(batches, "policy")
    for b, lp in zip(batches, logp):
        b.old_logprobs = lp + F.perturbation(b, 0.3, 0.0)
        b.ref_logprobs = lp + F.perturbation(b, 0.2, 1.0)
    return logp


def _padded(data, batches, values_per_batch, fill=0.0):
    """[B, G, L_max] tensor of per-completion-token values (from the packed batches) and the mask."""
    B, G = data["B"], data["G"]
    lengths = data["completion_lengths"]
    L = int(lengths.max())
    out = torch.full((B, G, L), fill, dtype=torch.float64)
    mask = torch.zeros(B, G, L, dtype=torch.float64)
    for q in range(B):
        for i in range(G):
            mask[q, i, : int(lengths[q, i])] = 1.0
    for b, values in zip(batches, values_per_batch):
        for sid, vals in zip(b.sample_ids.tolist(), b.completion_values(values)):
            q, i = divmod(sid, G)
            assert vals.numel() == int(lengths[q, i])
            out[q, i, : vals.numel()] = vals.double()
    return out, mask


CASES = {
    "grpo_kl": dict(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=0.05, kl_estimator="k3",
                    aggregation="seq_mean_token_mean"),
    "dapo_token_mean": dict(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=0.0, aggregation="token_mean"),
    "gspo": dict(policy_loss="gspo", eps_low=0.05, eps_high=0.05, kl_coef=0.02, kl_estimator="k1",
                 aggregation="seq_mean_token_mean"),
    "dr_grpo": dict(policy_loss="ppo_clip", kl_coef=0.1, kl_estimator="k2", aggregation="seq_mean_token_sum_norm"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pruned_weighted_step_loss_equals_reference_objective(world, case):
    """Packed THD micro-batches of the KEPT completions, token weights w (1/pi) or w/|o|, the full-batch D:
    the engine's loss equals -reference_objective on the padded [B, G, L] tensors (pruned rows weight 0)."""
    from megatron_dppo.algo.losses import LossConfig, loss_denominator, reference_objective

    cfg = LossConfig(**CASES[case]).resolved()
    engine = _engine(cfg, lr=1e-3)
    data = F.make_sequences(num_prompts=3, group=4, seed=1)
    assert 0 < int(data["keep"].sum()) < data["keep"].numel()  # some completions pruned
    batches = F.rank_micro_batches(data, cfg, 0, 1, 1, capacity=20)
    assert len(batches) >= 2
    logp = _fill(engine, batches)
    L_max = int(data["completion_lengths"].max())
    D = loss_denominator(cfg.aggregation, data["B"], data["G"], data["completion_lengths"],
                         max_completion_len=L_max)

    metrics = engine.train_step(batches, D)

    lp, mask = _padded(data, batches, logp)
    old, _ = _padded(data, batches, [b.old_logprobs for b in batches])
    ref, _ = _padded(data, batches, [b.ref_logprobs for b in batches])
    J = reference_objective(lp, old, data["advantages"].double(), mask, cfg, ref_logp=ref,
                            weight=data["weight"].double(), denominator=D)
    assert metrics["loss"] == pytest.approx(-float(J), rel=1e-5, abs=1e-7)
    assert metrics["tokens"] == float(data["completion_lengths"][data["keep"]].sum())
    if cfg.policy_loss == "ppo_clip":
        assert metrics["clip_fraction"] > 0  # the comparison covers the clipped branch
    if cfg.kl_coef > 0:
        assert metrics["kl"] != 0.0
    assert metrics["grad_norm"] > 0 and metrics["update_ok"] == 1.0


def test_gradient_is_sum_of_numerators_over_D_for_any_micro_batching(world):
    """main_grad after train_step == autograd of (sum_m numerator_m) / D on the plain model, whether the same
    sequences come as 1 or 3 micro-batches plus an empty one (no division by the micro-batch count)."""
    from megatron_dppo.algo.losses import LossConfig, loss_numerator
    from megatron_dppo.megatron.logprobs import forward_thd, vocab_parallel_logprobs

    cfg = LossConfig(**CASES["grpo_kl"]).resolved()
    data = F.make_sequences(num_prompts=2, group=4, seed=2)
    D = float(data["B"] * data["G"])
    grads = {}
    for split in (1, 3):
        engine = _engine(cfg, lr=1e-3, grad_clip=0.0)
        batches = F.rank_micro_batches(data, cfg, 0, 1, 1, split=split)
        _fill(engine, batches)
        module = engine.modules[0]
        params = [p for p in module.parameters() if p.requires_grad]
        total = 0.0
        for b in batches:
            logp, _ = vocab_parallel_logprobs(forward_thd(module, b), b.labels, with_entropy=False)
            num, _ = loss_numerator(logp, b.old_logprobs, b.advantages, b.token_weight, b.loss_mask, b.seq_index,
                                    cfg, b.ref_logprobs)
            total = total + num
        reference = torch.autograd.grad(total / D, params)

        empty = dataclasses.replace(batches[0], tokens=torch.zeros(0, dtype=torch.long))  # -> a dummy
        metrics = engine.train_step(batches + [empty], D)
        assert metrics["micro_batches"] == len(batches) + 1
        got = [p.main_grad for p in params]
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
        grads[split] = torch.cat([g.flatten() for g in got])
        norm = torch.cat([r.flatten() for r in reference]).norm().item()
        assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    torch.testing.assert_close(grads[1], grads[3], rtol=1e-5, atol=1e-7)


def test_denominator_scales_the_gradient_and_must_be_positive(world):
    from megatron_dppo.algo.losses import LossConfig

    cfg = LossConfig(kl_coef=0.0).resolved()
    data = F.make_sequences(num_prompts=2, group=2, seed=3)
    norms = []
    for D in (4.0, 8.0):
        engine = _engine(cfg, lr=0.0, grad_clip=0.0)
        batches = F.rank_micro_batches(data, cfg, 0, 1, 1)
        _fill(engine, batches)
        norms.append(engine.train_step(batches, D)["grad_norm"])
    assert norms[1] == pytest.approx(norms[0] / 2, rel=1e-6)
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="denominator"):
            engine.train_step(batches, bad)


def test_kl_without_reference_logprobs_is_an_error(world):
    from megatron_dppo.algo.losses import LossConfig

    engine = _engine(LossConfig(kl_coef=0.1, kl_estimator="k1").resolved(), lr=1e-3)
    data = F.make_sequences(num_prompts=1, group=2, seed=4)
    batches = F.rank_micro_batches(data, engine.loss_cfg, 0, 1, 1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        engine.train_step(batches, 2.0)
    engine.fill_logprobs(batches)  # old + reference (kl_coef > 0) -> trains
    assert all(b.ref_logprobs is not None and b.old_logprobs is not None for b in batches)
    assert engine.train_step(batches, 2.0)["update_ok"] == 1.0
    with pytest.raises(ValueError, match="reference"):
        _engine(LossConfig(kl_coef=0.0).resolved(), lr=1e-3).compute_logprobs(batches, "reference")


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo"])
def test_skipping_the_old_logprob_pass_gives_the_identical_update(world, policy_loss):
    """One update per rollout: old log-probs recomputed by the forward-only pass == the train forward's own
    log-probs, bit for bit (same fp32 kernels on the same inputs at the same weights), so the update with
    old_logprobs=None (old = logp.detach(), what the trainer does: stages.old_logprobs_needed) gives the SAME
    weights, loss, gradient norm and ratio, exactly (torch.equal, no tolerance)."""
    from megatron_dppo.algo.losses import LossConfig

    cfg = LossConfig(kl_coef=0.0, policy_loss=policy_loss, eps_low=0.2, eps_high=0.28).resolved()
    data = F.make_sequences(num_prompts=3, group=4, seed=11)
    results = []
    for recompute in (True, False):
        engine = _engine(cfg, lr=1e-2)
        batches = F.rank_micro_batches(data, cfg, 0, 1, 1)
        assert len(batches) > 1  # several micro-batches
        old = None
        if recompute:
            engine.fill_logprobs(batches, old=True)
            old = [b.old_logprobs.clone() for b in batches]
        else:
            assert all(b.old_logprobs is None for b in batches)
        metrics = engine.train_step(batches, 7.0)
        params = [p.detach().clone() for chunk in engine.modules for p in chunk.parameters()]
        results.append((metrics, params, old, engine.last_logprobs))
    (m_old, p_old, old, train_lp_a), (m_skip, p_skip, _, train_lp) = results
    for a, b in zip(p_old, p_skip):
        assert torch.equal(a, b)
    for key in ("loss", "grad_norm", "ratio", "clip_fraction", "entropy"):
        assert m_old[key] == m_skip[key], key
    assert m_skip["ratio"] == 1.0
    # the train forward's log-probs (the mismatch metric's source when the pass is skipped) == the old pass
    assert len(train_lp) == len(old)
    for a, b, c in zip(old, train_lp, train_lp_a):
        assert torch.equal(a, b) and torch.equal(a, c)


def _step_with_logits_at(loss_positions_only: bool, loss_cfg, data):
    """fill_logprobs (old + reference) and one train step on fresh engines with the same weights."""
    engine = _engine(loss_cfg, lr=1e-2)
    engine.logits_at_loss_positions = loss_positions_only
    batches = F.rank_micro_batches(data, loss_cfg, 0, 1, 1)
    engine.fill_logprobs(batches, old=True, reference=True)
    old = [b.old_logprobs.clone() for b in batches]
    for b in batches:  # a live ratio and KL term: old and reference offset (layout-independent)
        b.old_logprobs = b.old_logprobs + F.perturbation(b, 0.3, 0.0)
        b.ref_logprobs = b.ref_logprobs + F.perturbation(b, 0.2, 1.0)
    metrics = engine.train_step(batches, 7.0)
    grads = [p.main_grad.detach().clone() for chunk in engine.model_chunks for p in chunk.parameters()]
    params = [p.detach().clone() for chunk in engine.modules for p in chunk.parameters()]
    return batches, old, metrics, grads, params, engine.last_logprobs


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo"])
def test_logits_at_loss_positions_only_give_the_same_update(world, policy_loss, monkeypatch):
    """The output layer on the loss positions only (PolicyEngine.logits_at_loss_positions, the default) gives the
    full computation's old / reference log-probs at every loss position, the same loss, entropy, ratio, gradient
    and updated weights (fp32 summation order aside), and zeros where no loss is taken. Negative control: logits
    taken one position off give other numbers, so the comparison has power."""
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron import logprobs

    cfg = LossConfig(policy_loss=policy_loss, eps_low=0.2, eps_high=0.28, kl_coef=0.05, kl_estimator="k3").resolved()
    data = F.make_sequences(num_prompts=3, group=4, seed=5)
    batches, old_full, m_full, g_full, p_full, lp_full = _step_with_logits_at(False, cfg, data)
    _, old_part, m_part, g_part, p_part, lp_part = _step_with_logits_at(True, cfg, data)
    assert sum(int((b.loss_mask == 0).sum()) for b in batches) > 10  # prompt positions: something to skip
    for b, a, c, la, lc in zip(batches, old_full, old_part, lp_full, lp_part):
        mask = b.loss_mask > 0
        torch.testing.assert_close(c[mask], a[mask], rtol=0, atol=1e-5)
        torch.testing.assert_close(lc[mask], la[mask], rtol=0, atol=1e-5)
        assert torch.equal(c[~mask], torch.zeros_like(c[~mask])) and bool((a[~mask] != 0).any())
    for key in ("loss", "grad_norm", "entropy", "ratio", "kl", "clip_fraction"):
        assert m_part[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(g_full, g_part):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    # the updated weights: Adam's first step is ~lr * g / |g|, so a gradient entry near 0 turns rounding into up to
    # ~lr * 1e-2 (the layout tests' tolerance, after_atol=1e-4)
    for a, b in zip(p_full, p_part):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)

    positions = logprobs.loss_positions
    monkeypatch.setattr(logprobs, "loss_positions", lambda batch, group=None: (positions(batch, group) - 1))
    _, old_off, m_off, g_off, *_ = _step_with_logits_at(True, cfg, data)
    assert max(float((c - a)[b.loss_mask > 0].abs().max()) for b, a, c in zip(batches, old_full, old_off)) > 0.1
    assert max(float((b - a).abs().max() / a.abs().max()) for a, b in zip(g_full, g_off)) > 0.1


def test_old_logprobs_needed_only_when_the_ratio_can_differ_from_one():
    from megatron_dppo.config import Config, load_config
    from megatron_dppo.run.build import build_loss
    from megatron_dppo.train.stages import old_logprobs_needed

    def needed(*overrides: str) -> bool:
        cfg = load_config(None, overrides, validate=False)
        return old_logprobs_needed(cfg, build_loss(cfg)[0])  # the resolved loss config, as the trainer passes

    assert Config().train.recompute_old_logprobs is False
    assert not needed()  # one update per rollout: ratio identically 1
    assert not needed("loss.kl_coef=0.1")  # a KL term needs the reference pass, not the old one
    assert needed("train.recompute_old_logprobs=true")
    assert needed("train.mini_batches=2") and needed("train.epochs=2")  # ratio live after the first update
    assert needed("loss.rollout_correction=tis")  # its weights compare the engine with the old log-probs


def test_schedule_is_applied_to_the_optimizer(world):
    from megatron_dppo.algo.losses import LossConfig

    engine = _engine(LossConfig(kl_coef=0.0).resolved(), lr=1e-3, warmup_steps=4, weight_decay=0.1)
    data = F.make_sequences(num_prompts=1, group=2, seed=6)
    batches = F.rank_micro_batches(data, engine.loss_cfg, 0, 1, 1)
    for step in range(2):
        metrics = engine.train_step(batches, 2.0)
        assert metrics["lr"] == pytest.approx(1e-3 * (step + 1) / 4)
        groups = engine.optimizer.param_groups
        assert {g["lr"] for g in groups} == {metrics["lr"]}
        assert {g["weight_decay"] for g in groups} == {0.0, 0.1}  # no decay on norms / biases
    assert engine.step == 2 and engine.current_lr() == pytest.approx(7.5e-4)


def test_lr_schedule_warmup_constant_cosine():
    from megatron_dppo.algo.lr_schedule import lr_at_step
    from megatron_dppo.config.sections import OptimConfig

    warm = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_at_step(warm, s, 1.0, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimConfig(lr=1.0, min_lr=0.1, scheduler="cosine", warmup_steps=2)
    values = [lr_at_step(cos, s, 1.0, 0.1, total_steps=12) for s in range(14)]
    assert values[:3] == [0.5, 1.0, 1.0]
    assert values[7] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[12] == values[13] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[2:], values[3:]))
    with pytest.raises(ValueError, match="total_steps"):
        lr_at_step(OptimConfig(scheduler="cosine", warmup_steps=5), 0, 1.0, 0.0, total_steps=5)
    with pytest.raises(ValueError, match="optim.scheduler"):
        OptimConfig(scheduler="linear")
    with pytest.raises(ValueError, match="min_lr"):
        OptimConfig(lr=1e-6, min_lr=1e-5)


def test_pad_thd_batch_keeps_the_loss_positions():
    from megatron_dppo.packing import build_thd_batch
    from megatron_dppo.packing.thd import pad_thd_batch

    b = build_thd_batch([[1, 2, 3, 4], [5, 6, 7]], [2, 1], [0, 1], [1.0, -1.0], [0.5, 0.25])
    p = pad_thd_batch(b, 12)
    assert p.tokens.numel() == 12 and int(p.cu_seqlens_padded[-1]) == 12
    assert torch.equal(p.cu_seqlens, b.cu_seqlens) and p.max_seqlen == 8
    assert torch.equal(p.loss_mask[:7], b.loss_mask) and float(p.loss_mask[7:].sum()) == 0.0
    assert (p.seq_index[7:] == -1).all() and p.num_tokens == b.num_tokens
    with pytest.raises(ValueError, match="pad"):
        pad_thd_batch(b, 3)


# ----------------------------------------------------------------------------------------------------------
# Parallel layouts (subprocesses, gloo): the same global batch and weights (one TP1 checkpoint)
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp1_reference(tmp_path_factory, world):
    """TP1 run in this process: saves the reference weights and records the step."""
    root = tmp_path_factory.mktemp("tp1_weights")
    result = F.layout_worker(str(root), save=True)
    return root, result


def _assert_same_step(ref, got, after_atol=1e-4):
    assert sorted(ref["before"]) == sorted(got["before"])
    for sid in ref["before"]:
        torch.testing.assert_close(got["before"][sid], ref["before"][sid], rtol=0, atol=2e-6)
    r, g = ref["metrics"][0], got["metrics"][0]
    assert g["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-8)
    assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    for key in ("tokens", "sequences", "clip_fraction"):
        assert g[key] == pytest.approx(r[key], rel=1e-9)
    assert g["kl"] == pytest.approx(r["kl"], rel=1e-4)
    # after one Adam step: the updated weights agree too (so the gradients did, not just their norm)
    for sid in ref["after"]:
        torch.testing.assert_close(got["after"][sid], ref["after"][sid], rtol=0, atol=after_atol)


@pytest.mark.multiproc
def test_dp2_distributed_optimizer_uneven_micro_batches_equal_tp1(tp1_reference):
    """DP2 + DistributedOptimizer, rank 0 with 2 and rank 1 with 3 micro-batches (the engine pads with a dummy):
    the gradient is the SUM over ranks / D, so loss, grad norm and the updated weights equal TP1's."""
    root, ref = tp1_reference
    results = run_distributed(F.layout_worker, 2, args=(str(root),),
                              kwargs=dict(distributed_optimizer=True, uneven=True), timeout=240)
    assert results[0]["metrics"][0]["micro_batches"] == 3.0
    for res in results:
        _assert_same_step(ref, res)


@pytest.mark.slow
@pytest.mark.multiproc
def test_tp2_sp_equals_tp1_at_a_sampling_temperature(tmp_path, world):
    """LossConfig.temperature = 0.7 (every log-prob of softmax(logits / T)): TP2 + sequence parallel from the TP1
    checkpoint gives TP1's tempered log-probs, loss, grad norm and updated weights (each rank divides its vocabulary
    shard before the parallel log-softmax); the tempered step is not the T = 1 step. (Slow, like the other engine
    layouts; the default suite checks TP2 at T != 1 on the vocab-parallel kernel, test_logprobs.py.)"""
    tempered = F.layout_worker(str(tmp_path), save=True, temperature=0.7)
    results = run_distributed(F.layout_worker, 2, args=(str(tmp_path),), kwargs=dict(tp=2, sp=True, temperature=0.7),
                              timeout=240)
    for res in results:
        _assert_same_step(tempered, res)
    untempered = F.layout_worker(str(tmp_path), temperature=1.0)
    assert untempered["metrics"][0]["grad_norm"] != pytest.approx(tempered["metrics"][0]["grad_norm"], rel=1e-3)
    assert max(float((untempered["before"][s] - tempered["before"][s]).abs().max()) for s in tempered["before"]) > 0.1


LAYOUTS = {
    "tp2_sp": (2, dict(tp=2, sp=True)),
    "pp2": (2, dict(pp=2)),
    "tp2_pp2": (4, dict(tp=2, pp=2)),
    "pp2_vpp2": (2, dict(pp=2, vpp=2)),
    "dp2": (2, dict()),
}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_tp1(tp1_reference, layout):
    """TP2+SP, PP2, TP2xPP2, PP2 with 2 virtual stages, DP2: weights loaded from the TP1 checkpoint give the
    same log-probs, loss, grad norm and updated weights."""
    root, ref = tp1_reference
    world_size, kwargs = LAYOUTS[layout]
    results = run_distributed(F.layout_worker, world_size, args=(str(root),), kwargs=kwargs, timeout=420)
    for res in results:
        _assert_same_step(ref, res)
