"""Mixture-of-Experts policies under expert / tensor / data parallelism (CPU, gloo): the same weights (one
single-process checkpoint, resharded by dist_checkpointing) give the same log-probs, loss, grad norm and updated
weights at DP2xEP2, TP2+SP, TP2xEP2 (+SP) as in one process; packed THD micro-batches score like one sequence at a
time; checkpoints move between EP sizes bit for bit; an EP2 run resumed from a checkpoint equals the straight run.

Tolerances are the dense layout tests' (test_train_step.py): log-probs before the step atol 2e-6, loss and grad
norm rel 1e-5, log-probs after one Adam step atol 1e-4 (Adam divides by sqrt(v): tiny gradient differences of the
summation order grow). Weights moved by a checkpoint are compared with torch.equal.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dist import run_distributed, single_process_world  # noqa: E402
import _engine_fixtures as F  # noqa: E402
from _tiny import TINY_MOE_CONFIGS, packed_batches  # noqa: E402


@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=F.SEED):
        yield


def moe_arch(family: str = "qwen3_moe", **hf_changes):
    from megatron_dppo.megatron.model import ModelArch

    return ModelArch.from_hf_config({**TINY_MOE_CONFIGS[family], **hf_changes})


def global_params(engine) -> dict[str, torch.Tensor]:
    """This rank's parameters under layout-independent names: local expert i of EP rank j is expert
    j * E / ep + i (tensor-parallel shards are not gathered: use at tp = etp = 1)."""
    import re

    from megatron.core import parallel_state

    from megatron_dppo.megatron.moe import global_expert_index

    ep, rank = parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()
    experts = engine.arch.moe.num_experts
    out = {}
    for name, p in engine.modules[0].named_parameters():
        name = re.sub(r"local_experts\.(\d+)\.",
                      lambda m: f"local_experts.{global_expert_index(int(m.group(1)), experts, rank, ep)}.", name)
        out[name] = p.detach().clone()
    return out


def _loss_cfg():
    from megatron_dppo.algo.losses import LossConfig

    return LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=0.05, kl_estimator="k3",
                      aggregation="seq_mean_token_mean")


def moe_layout_worker(root: str, family: str = "qwen3_moe", save: bool = False, tp: int = 1, ep: int = 1,
                      etp: int = 1, sp: bool = False, distributed_optimizer: bool = False,
                      save_after: str | None = None):
    """Load (``save``: create and write) the single-process weights from ``root``, fill perturbed old/ref
    log-probs, one train step, log-probs again. ``save_after``: then checkpoint there (weights + Adam state) and
    take a second step on the same micro-batches. Returns per-sample completion log-probs, metrics, and (tp = 1)
    the parameters under global names right after loading / after each step."""
    from megatron.core import parallel_state

    from megatron_dppo.algo.losses import loss_denominator
    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel
    from megatron_dppo.megatron.train_step import OptimConfig, PolicyEngine
    from megatron_dppo.packing import thd_pad_multiple

    arch = moe_arch(family)
    parallel = ParallelConfig(tp=tp, sp=sp, ep=ep, etp=etp)
    initialize_parallel(parallel, F.SEED, arch)
    loss_cfg = _loss_cfg()
    optim = OptimConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.01, use_distributed_optimizer=distributed_optimizer)
    engine = PolicyEngine(arch, parallel, optim, loss_cfg)
    if save:
        save_checkpoint(engine, root)
    else:
        load_checkpoint(engine, root, load_optimizer=False, load_rng=False)
        engine.sync_reference_from_policy()
    keep_params = tp == 1 and etp == 1
    loaded = global_params(engine) if keep_params else None

    data = F.make_sequences()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    batches = F.rank_micro_batches(data, loss_cfg, dp_rank, dp_size, thd_pad_multiple(tp, 1, sp))
    D = loss_denominator(loss_cfg.aggregation, data["B"], data["G"])
    logp = engine.compute_logprobs(batches, "policy")
    before = F.per_sample_completion_logp(batches, logp)
    for b, lp in zip(batches, logp):
        b.old_logprobs = lp + F.perturbation(b, 0.3, 0.0)
        b.ref_logprobs = lp + F.perturbation(b, 0.2, 1.0)
    metrics = [engine.train_step(batches, D)]
    after = F.per_sample_completion_logp(batches, engine.compute_logprobs(batches, "policy"))
    trained = global_params(engine) if keep_params else None
    second = None
    if save_after is not None:
        save_checkpoint(engine, save_after)
        metrics.append(engine.train_step(batches, D))
        second = global_params(engine) if keep_params else None

    group = parallel_state.get_data_parallel_group()
    parts_before, parts_after = [None] * dp_size, [None] * dp_size
    torch.distributed.all_gather_object(parts_before, before, group=group)
    torch.distributed.all_gather_object(parts_after, after, group=group)
    params = None
    if keep_params:  # the experts of every EP rank under their global names
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (loaded, trained, second))
        params = [{k: v for part in gathered for k, v in (part[i] or {}).items()} for i in range(3)]
    merge = lambda parts: {k: v for p in parts for k, v in p.items()}  # noqa: E731
    return {"before": merge(parts_before), "after": merge(parts_after), "metrics": metrics, "params": params,
            "edp": parallel_state.get_expert_data_parallel_world_size(),
            "experts": sum(1 for n, _ in engine.modules[0].named_parameters() if "local_experts" in n)}


def _assert_same_step(ref, got):
    assert sorted(ref["before"]) == sorted(got["before"])
    for sid in ref["before"]:
        torch.testing.assert_close(got["before"][sid], ref["before"][sid], rtol=0, atol=2e-6)
    r, g = ref["metrics"][0], got["metrics"][0]
    assert g["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-8)
    assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert r["grad_norm"] > 1.0  # clipped (clip_grad 1): the norm scales every expert and dense gradient
    for key in ("tokens", "sequences", "clip_fraction"):
        assert g[key] == pytest.approx(r[key], rel=1e-9)
    assert g["kl"] == pytest.approx(r["kl"], rel=1e-4)
    for sid in ref["after"]:
        torch.testing.assert_close(got["after"][sid], ref["after"][sid], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def ep1_reference(tmp_path_factory, world):
    """Single process (EP1/TP1/DP1): writes the weights every layout loads, records the step."""
    root = tmp_path_factory.mktemp("moe_ep1")
    return root, moe_layout_worker(str(root / "weights"), save=True)


LAYOUTS = {
    # world 2, tp 1: dp 2 and the experts split 2 + 2 (the common layout: dense replicated, experts sharded)
    "dp2_ep2": dict(ep=2),
    # experts whole (etp 1) and replicated on both TP ranks, each routing its own sequence-parallel tokens
    "tp2_sp": dict(tp=2, sp=True),
    "tp2_sp_ep2": dict(tp=2, ep=2, sp=True),
    "tp2_sp_etp2": dict(tp=2, etp=2, sp=True),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_single_process(ep1_reference, layout, tmp_path):
    root, ref = ep1_reference
    results = run_distributed(moe_layout_worker, 2, args=(str(root / "weights"),), kwargs=LAYOUTS[layout],
                              timeout=300)
    for res in results:
        _assert_same_step(ref, res)
    kw = LAYOUTS[layout]
    assert results[0]["experts"] == 2 * (4 // kw.get("ep", 1)) * 3  # fc1 + fc2 of 4/ep experts x 3 MoE layers
    assert results[0]["edp"] == 2 // (kw.get("ep", 1) * kw.get("etp", 1))
