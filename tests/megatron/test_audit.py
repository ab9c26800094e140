"""megatron_dppo.train.audit: full-batch vs pruned gradient of one step, on the Megatron engine (1 process)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _engine_fixtures import make_sequences, rank_micro_batches, tiny_arch


def _engine_and_data():
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig

    loss_cfg = LossConfig(kl_coef=0.0).resolved()
    engine = PolicyEngine(tiny_arch(num_layers=2), ParallelConfig(), OptimConfig(lr=1e-2), loss_cfg)
    data = make_sequences(num_prompts=3, group=4, seed=3)
    return engine, loss_cfg, data


def test_audit_identity_pruned_and_no_side_effects():
    from _dist import single_process_world

    from megatron_dppo.train.audit import pruning_audit, step_gradient

    with single_process_world():
        engine, loss_cfg, data = _engine_and_data()
        D = float(data["B"] * data["G"])
        full = dict(data, keep=torch.ones_like(data["keep"]), weight=torch.ones_like(data["weight"]))
        full_mbs = rank_micro_batches(full, loss_cfg, 0, 1, 1)
        pruned_mbs = rank_micro_batches(data, loss_cfg, 0, 1, 1)
        params_before = [p.detach().clone() for m in engine.modules for p in m.parameters()]

        same = pruning_audit(engine, full_mbs, rank_micro_batches(full, loss_cfg, 0, 1, 1, capacity=40), D,
                             weights=torch.ones(12))
        assert same.cosine == pytest.approx(1.0, abs=1e-6)
        assert same.rel_error < 1e-5  # same sequences, another packing: round-off only
        assert same.ess == pytest.approx(12.0)
        assert same.full_grad_norm > 0

        res = pruning_audit(engine, full_mbs, pruned_mbs, D, weights=data["weight"][data["keep"]])
        assert -1.0 <= res.cosine < 1.0 - 1e-6 and res.rel_error > 1e-4  # a real pruning changes the gradient
        assert res.pruned_sequences == int(data["keep"].sum()) and res.full_sequences == 12
        assert 0 < res.ess <= int(data["keep"].sum())

        # no optimizer step, weights untouched, gradient buffers zeroed
        assert engine.step == 0
        for a, m in zip(params_before, [p for m in engine.modules for p in m.parameters()]):
            assert torch.equal(a, m.detach())
        for p in (p for m in engine.modules for p in m.parameters()):
            assert float(p.main_grad.abs().max()) == 0.0

        # linearity: gradient of the full batch == sum of one-sequence gradients (the audit's vector is the
        # engine's gradient, not a rescaled one)
        g = step_gradient(engine, full_mbs, D)
        parts = torch.zeros_like(g)
        for i in range(12):
            keep = torch.zeros_like(data["keep"]).flatten()
            keep[i] = True
            one = dict(full, keep=keep.view_as(data["keep"]))
            parts += step_gradient(engine, rank_micro_batches(one, loss_cfg, 0, 1, 1), D)
        assert torch.allclose(parts, g, rtol=1e-4, atol=1e-7)


def test_audit_rejects_bad_denominator():
    from _dist import single_process_world

    from megatron_dppo.train.audit import step_gradient

    with single_process_world():
        engine, loss_cfg, data = _engine_and_data()
        with pytest.raises(ValueError, match="denominator"):
            step_gradient(engine, rank_micro_batches(data, loss_cfg, 0, 1, 1), 0.0)


def dp_audit_worker(distributed_optimizer: bool):
    """DP=2: each rank holds half the micro-batches; the audit gradient must be the whole batch's."""
    from _engine_fixtures import SEED
    from megatron.core import parallel_state

    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel
    from megatron_dppo.train.audit import pruning_audit, step_gradient

    initialize_parallel(ParallelConfig(), SEED, tiny_arch(num_layers=2))
    loss_cfg = LossConfig(kl_coef=0.0).resolved()
    engine = PolicyEngine(tiny_arch(num_layers=2), ParallelConfig(),
                          OptimConfig(lr=1e-2, distributed_optimizer=distributed_optimizer), loss_cfg)
    data = make_sequences(num_prompts=3, group=4, seed=3)
    full = dict(data, keep=torch.ones_like(data["keep"]), weight=torch.ones_like(data["weight"]))
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    D = float(data["B"] * data["G"])
    g_dp = step_gradient(engine, rank_micro_batches(full, loss_cfg, rank, size, 1), D)
    res = pruning_audit(engine, rank_micro_batches(full, loss_cfg, rank, size, 1),
                        rank_micro_batches(data, loss_cfg, rank, size, 1), D, weights=data["weight"][data["keep"]])
    return {"g_dp": g_dp, "audit": res, "rank": rank}


@pytest.mark.multiproc
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_audit_data_parallel_equals_single_process(distributed_optimizer):
    """DP=2 (also with the distributed optimizer, which normally reduce-scatters): the audit's gradient and its
    cosine / relative error equal the single-process ones on the whole batch, on every rank."""
    from _dist import run_distributed, single_process_world

    from megatron_dppo.train.audit import pruning_audit, step_gradient

    out = run_distributed(dp_audit_worker, world_size=2, args=(distributed_optimizer,), timeout=240)
    with single_process_world():
        engine, loss_cfg, data = _engine_and_data()
        full = dict(data, keep=torch.ones_like(data["keep"]), weight=torch.ones_like(data["weight"]))
        D = float(data["B"] * data["G"])
        g = step_gradient(engine, rank_micro_batches(full, loss_cfg, 0, 1, 1), D)
        ref = pruning_audit(engine, rank_micro_batches(full, loss_cfg, 0, 1, 1),
                            rank_micro_batches(data, loss_cfg, 0, 1, 1), D, weights=data["weight"][data["keep"]])
    for r in out:
        assert torch.allclose(r["g_dp"], g, rtol=1e-4, atol=1e-7), (r["rank"], float((r["g_dp"] - g).abs().max()))
        assert r["audit"].cosine == pytest.approx(ref.cosine, abs=1e-5)
        assert r["audit"].rel_error == pytest.approx(ref.rel_error, rel=1e-4, abs=1e-6)
        assert r["audit"].ess == pytest.approx(ref.ess)


def test_full_completion_cut_keeps_every_generated_completion_with_prompt_weight():
    from megatron_dppo.algo.pruning import DPPOPruner, make_generator
    from megatron_dppo.train.audit import full_completion_cut

    history = torch.tensor([0.0, 0.1, 0.9, 0.8, float("nan"), 0.0])
    prompt = DPPOPruner(0.5, 0.5).select_prompts(history, make_generator(0, 3, "prompts"))
    cut = full_completion_cut(prompt, 4)
    assert cut.keep.shape == (6, 4)
    assert torch.equal(cut.keep, prompt.keep.unsqueeze(1).expand(6, 4))
    expected = torch.where(prompt.keep, prompt.weight, torch.zeros(6)).unsqueeze(1).expand(6, 4)
    assert torch.allclose(cut.weight, expected)
