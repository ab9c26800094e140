"""Checkpoints: bit-exact resume (weights, Adam, LR schedule, every RNG stream, trainer extras), atomic saves,
the `latest` pointer, and resharding (a TP1 checkpoint loads at TP2 / PP2, optimizer state included)."""
from __future__ import annotations

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


def _small_engine(**optim):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    seed_everything(F.SEED)
    return PolicyEngine(F.tiny_arch(num_layers=2), ParallelConfig(), OptimConfig(lr=1e-3, **optim),
                        LossConfig(kl_coef=0.0).resolved())


def test_resume_is_bit_exact(world, tmp_path):
    """N steps, save, M steps  ==  fresh engine (perturbed first), load, the same M steps: torch.equal on
    parameters, identical losses and grad norms, extras returned; RNG streams and Adam step counters restored."""
    result = F.resume_worker(str(tmp_path / "ckpt"), n_before=2, n_after=2)
    assert result["resumed"] == result["straight"]  # exact float equality of (loss, grad_norm) per step
    assert result["params_equal"]
    assert result["extra"] == {"cursor": 2, "history": {"q1": 0.5}}


def test_resume_restores_rng_and_adam_step(world, tmp_path):
    import random

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dppo.megatron.parallel import ParallelConfig

    def draws():
        with get_cuda_rng_tracker().fork():
            tracked = torch.rand(2)
        return torch.rand(2).tolist(), random.random(), float(np.random.rand()), tracked.tolist()

    engine, loss_cfg = F.resume_engine(ParallelConfig(), distributed_optimizer=False)
    for s in range(3):
        F.noisy_step(engine, s, loss_cfg)
    save_checkpoint(engine, tmp_path)
    expected = draws()
    F.noisy_step(engine, 50, loss_cfg)
    load_checkpoint(engine, tmp_path)
    assert draws() == expected
    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    steps = [s["step"] for s in inner.state.values()]
    assert len({id(s) for s in steps}) == len(steps)  # one tensor per parameter (not shared)
    assert all(float(s) == 3.0 for s in steps)
    assert engine.step == 3


def test_failed_save_leaves_no_partial_checkpoint(world, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    from megatron_dppo.megatron.checkpoint import latest_checkpoint, list_checkpoints, save_checkpoint

    engine = _small_engine()
    first = save_checkpoint(engine, tmp_path)
    real_save = dist_checkpointing.save

    def broken_save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        real_save(sharded_state_dict, checkpoint_dir, *args, **kwargs)  # everything written ...
        raise OSError("disk full")  # ... then the save fails

    monkeypatch.setattr(dist_checkpointing, "save", broken_save)
    engine.step = 5
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(engine, tmp_path)
    assert list_checkpoints(tmp_path) == [first]
    assert latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", first.name]  # no temporary left over
    assert not (tmp_path / "step_00000005").exists()

    # a crash (process killed) leaves a temporary directory: it is never read and the next save removes it
    (tmp_path / ".tmp-step_00000007").mkdir()
    (tmp_path / ".tmp-step_00000007" / "metadata.json").write_text("{}")
    monkeypatch.setattr(dist_checkpointing, "save", real_save)
    assert latest_checkpoint(tmp_path) == first
    second = save_checkpoint(engine, tmp_path)
    assert latest_checkpoint(tmp_path) == second
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_latest_pointer_keep_last_and_overwrite(world, tmp_path):
    from megatron_dppo.megatron.checkpoint import (
        latest_checkpoint,
        list_checkpoints,
        load_checkpoint,
        read_checkpoint_meta,
        resolve_checkpoint,
        save_checkpoint,
    )

    engine = _small_engine()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="neither a checkpoint directory"):
        resolve_checkpoint(tmp_path)
    for step in (1, 2, 3):
        engine.step = step
        save_checkpoint(engine, tmp_path, extra={"step": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000003"
    assert read_checkpoint_meta(tmp_path)["step"] == 3
    assert load_checkpoint(engine, tmp_path / "step_00000002") == {"step": 2}
    assert engine.step == 2
    save_checkpoint(engine, tmp_path, extra={"again": True})  # same step again: replaced atomically
    assert load_checkpoint(engine, tmp_path / "step_00000002") == {"again": True}
    # a root resolves as a resume does: the newest step that verifies (step 3), whatever `latest` names
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000003"
    assert load_checkpoint(engine, tmp_path) == {"step": 3}


def test_load_refuses_a_different_architecture(world, tmp_path):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig

    save_checkpoint(_small_engine(), tmp_path)
    other = PolicyEngine(F.tiny_arch(num_layers=4), ParallelConfig(), OptimConfig(), LossConfig(kl_coef=0.0).resolved())
    with pytest.raises(ValueError, match="num_layers"):
        load_checkpoint(other, tmp_path)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("optim_format", ["dp_reshardable", "fully_reshardable"])
def test_distributed_optimizer_resume_is_bit_exact(tmp_path, optim_format):
    """DP2 + DistributedOptimizer (both checkpoint formats): resume == uninterrupted run, bit for bit."""
    results = run_distributed(F.resume_worker, 2, args=(str(tmp_path / "ckpt"),),
                              kwargs=dict(distributed_optimizer=True, optim_format=optim_format), timeout=300)
    for res in results:
        assert res["resumed"] == res["straight"]
        assert res["params_equal"]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2_distopt"])
def test_tp1_checkpoint_loads_at_tp2_and_pp2(tmp_path_factory, layout):
    """A TP1 checkpoint (weights + Adam state) loads at TP2 / PP2: equal log-probs right after loading, and the
    next step (which uses the resharded Adam moments) equals TP1's next step. ``tp2_distopt``: the same with the
    DistributedOptimizer in its ``fully_reshardable`` checkpoint format."""
    root = tmp_path_factory.mktemp(f"reshard_{layout}")
    distopt = layout.endswith("distopt")
    ref = run_distributed(F.reshard_worker, 1, args=(str(root),),
                          kwargs=dict(save=True, distributed_optimizer=distopt), timeout=240)[0]
    kwargs = {"tp2": dict(tp=2), "pp2": dict(pp=2), "tp2_distopt": dict(tp=2, distributed_optimizer=True)}[layout]
    for res in run_distributed(F.reshard_worker, 2, args=(str(root),), kwargs=kwargs, timeout=300):
        assert res["step"] == ref["step"] == 2
        for sid in ref["at_ckpt"]:
            torch.testing.assert_close(res["at_ckpt"][sid], ref["at_ckpt"][sid], rtol=0, atol=2e-6)
        assert res["metrics"]["loss"] == pytest.approx(ref["metrics"]["loss"], rel=1e-5)
        assert res["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        for sid in ref["after"]:
            torch.testing.assert_close(res["after"][sid], ref["after"][sid], rtol=0, atol=1e-4)
