"""Context parallelism in the engine (parallel.cp): the same global batch and weights at cp=2 (and with TP2 / PP2
at world size 4) give cp=1's log-probs, loss, grad norm and weights after one update, on CPU with gloo (the SDPA
backend's all-gather attention, megatron/cp_attention.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _engine_fixtures as F
from _dist import run_distributed, single_process_world


@pytest.fixture(scope="module")
def cp1_reference(tmp_path_factory):
    """cp=1 run in this process: saves the reference weights and records the step."""
    root = tmp_path_factory.mktemp("cp1_weights")
    with single_process_world(seed=F.SEED):
        result = F.layout_worker(str(root), save=True)
    return root, result


def _max_diff(ref: dict, got: dict) -> float:
    return max(float((got[k] - ref[k]).abs().max()) for k in ref)


def _assert_same_step(ref, got, label: str):
    assert sorted(ref["before"]) == sorted(got["before"])
    r, g = ref["metrics"][0], got["metrics"][0]
    diffs = {"logp": _max_diff(ref["before"], got["before"]), "loss": abs(g["loss"] - r["loss"]),
             "grad_norm": abs(g["grad_norm"] - r["grad_norm"]), "logp_after": _max_diff(ref["after"], got["after"])}
    if ref["params"] is not None and got["params"] is not None:
        diffs["grads"] = _max_diff(ref["grads"], got["grads"])
        diffs["weights_after"] = _max_diff(ref["params"], got["params"])
    print(f"{label} rank {got['rank']}: max abs diff vs cp=1 " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert diffs["logp"] <= 2e-6
    assert g["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-8)
    assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    for key in ("tokens", "sequences", "clip_fraction"):
        assert g[key] == pytest.approx(r[key], rel=1e-9)
    assert g["kl"] == pytest.approx(r["kl"], rel=1e-4)
    assert g["entropy"] == pytest.approx(r["entropy"], rel=1e-5)
    assert diffs["logp_after"] <= 1e-4
    if "weights_after" in diffs:
        assert diffs["grads"] <= 1e-6
        # Adam's first update is ~lr * sign(g) per weight (lr = 1e-2): a weight whose gradient is at rounding level
        # moves by a rounding-sensitive amount, so the weights agree to 1e-3 of a weight, the gradients to 1e-6
        assert diffs["weights_after"] <= 1e-3


@pytest.mark.multiproc
def test_cp2_equals_cp1(cp1_reference):
    root, ref = cp1_reference
    results = run_distributed(F.layout_worker, 2, args=(str(root),), kwargs=dict(cp=2), timeout=300)
    for res in results:
        _assert_same_step(ref, res, "cp2")


LAYOUTS = {  # world size 4
    "tp2_sp_cp2": dict(tp=2, sp=True, cp=2),
    "pp2_cp2": dict(pp=2, cp=2),
    "pp2_vpp2_cp2": dict(pp=2, vpp=2, cp=2),
    "cp2_dp2": dict(cp=2),
    "cp4": dict(cp=4),
}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cp2_layouts_at_world_size_4_equal_cp1(cp1_reference, layout):
    root, ref = cp1_reference
    results = run_distributed(F.layout_worker, 4, args=(str(root),), kwargs=LAYOUTS[layout], timeout=600)
    for res in results:
        _assert_same_step(ref, res, layout)


def resume_worker(src_root: str, ckpt_root: str, cp: int, resume: bool):
    """Not ``resume``: load the cp=1 weights, one step, checkpoint (weights, Adam state, reference model) to
    ``ckpt_root``, then a second step. ``resume``: load that checkpoint and take the second step. Returns the
    weights after the second step and its metrics."""
    from megatron.core import parallel_state

    from megatron_dppo.algo.losses import LossConfig, loss_denominator
    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel
    from megatron_dppo.packing import thd_pad_multiple

    arch, parallel = F.tiny_arch(), ParallelConfig(cp=cp)
    initialize_parallel(parallel, F.SEED, arch)
    loss_cfg = LossConfig(kl_coef=0.05, kl_estimator="k3", aggregation="seq_mean_token_mean").resolved()
    engine = PolicyEngine(arch, parallel, OptimConfig(lr=1e-3, weight_decay=0.01), loss_cfg)
    data = F.make_sequences()
    batches = F.rank_micro_batches(data, loss_cfg, parallel_state.get_data_parallel_rank(),
                                   parallel_state.get_data_parallel_world_size(), thd_pad_multiple(1, cp, False))
    D = loss_denominator(loss_cfg.aggregation, data["B"], data["G"])

    def step(phase: float):
        logp = engine.compute_logprobs(batches, "policy")
        for b, lp in zip(batches, logp):
            b.old_logprobs = lp + F.perturbation(b, 0.3, phase)
            b.ref_logprobs = engine.compute_logprobs([b], "reference")[0]
        return engine.train_step(batches, D)

    if resume:
        load_checkpoint(engine, ckpt_root)
    else:
        load_checkpoint(engine, src_root, load_optimizer=False, load_rng=False)
        engine.sync_reference_from_policy()
        step(0.0)
        save_checkpoint(engine, ckpt_root)
    metrics = step(1.0)
    params = {name: p.detach().clone() for name, p in engine.modules[0].named_parameters()}
    return {"params": params, "metrics": metrics, "step": engine.step}


@pytest.mark.multiproc
def test_checkpoint_saved_at_cp2_resumes_at_cp1(cp1_reference, tmp_path):
    """A checkpoint written at cp=2 (weights, Adam moments, reference model) resumes at cp=1: the next step is
    cp=2's next step."""
    root, _ = cp1_reference
    ckpt = str(tmp_path / "cp2_ckpt")
    straight = run_distributed(resume_worker, 2, args=(str(root), ckpt, 2, False), timeout=300)[0]
    with single_process_world(seed=F.SEED):
        resumed = resume_worker(str(root), ckpt, 1, True)
    assert resumed["step"] == straight["step"] == 2
    diff = _max_diff(straight["params"], resumed["params"])
    print(f"resume cp=2 -> cp=1: loss {straight['metrics']['loss']:.6f} vs {resumed['metrics']['loss']:.6f}, "
          f"weights after the resumed step max abs diff {diff:.1e}")
    assert resumed["metrics"]["loss"] == pytest.approx(straight["metrics"]["loss"], rel=1e-5)
    assert resumed["metrics"]["grad_norm"] == pytest.approx(straight["metrics"]["grad_norm"], rel=1e-5)
    assert diff <= 1e-5


MOE_LAYOUTS = {"cp2": dict(cp=2), "cp2_ep2": dict(cp=2, ep=2)}  # ep2: the experts split over the two CP ranks


@pytest.fixture(scope="module")
def moe_cp1_reference(tmp_path_factory):
    from test_moe_parallel import moe_layout_worker

    root = tmp_path_factory.mktemp("moe_cp1")
    with single_process_world(seed=F.SEED):
        result = moe_layout_worker(str(root / "weights"), family="mixtral", save=True)
    return root, result


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k == "cp2_ep2" else k
                                    for k in sorted(MOE_LAYOUTS)])
def test_moe_cp2_equals_cp1(moe_cp1_reference, layout):
    """Mixtral-style MoE (no aux loss, no routing replay): cp=2, and cp=2 with the experts split over the CP
    ranks (ep=2), give cp=1's log-probs, loss, grad norm and weights after one update."""
    from test_moe_parallel import moe_layout_worker

    root, ref = moe_cp1_reference
    results = run_distributed(moe_layout_worker, 2, args=(str(root / "weights"),),
                              kwargs=dict(MOE_LAYOUTS[layout], family="mixtral"), timeout=400)
    for res in results:
        for key in ("params",):  # moe_layout_worker: [loaded, trained, second] under global expert names
            got, want = res[key][1], ref[key][1]
            diff = _max_diff(want, got)
            print(f"moe {layout}: weights after the update max abs diff vs cp=1 {diff:.1e}")
            assert diff <= 1e-3
        _assert_same_step(dict(ref, params=None), dict(res, params=None, rank=0), f"moe {layout}")


def test_cp_options_are_validated():
    from megatron_dppo.megatron.model import build_transformer_config
    from megatron_dppo.megatron.parallel import ParallelConfig

    with pytest.raises(ValueError, match="world size 6 is not divisible by tp\\*pp\\*cp = 1\\*1\\*4"):
        ParallelConfig(cp=4).dp(6)
    assert ParallelConfig(cp=2, tp=2).dp(8) == 2
    with pytest.raises(ValueError, match="cp=0"):
        ParallelConfig(cp=0)
    with pytest.raises(ValueError, match="cp_comm_type='ring' is invalid: expected one of \\('p2p'"):
        ParallelConfig(cp=2, cp_comm_type="ring")
    config = build_transformer_config(F.tiny_arch(), ParallelConfig(cp=2, cp_comm_type="all_gather"), torch.float32,
                                      attention_backend="sdpa")
    assert config.context_parallel_size == 2 and config.cp_comm_type == "all_gather"
    from _tiny import TINY_MOE_CONFIGS

    from megatron_dppo.megatron.model import ModelArch

    arch = ModelArch.from_hf_config(TINY_MOE_CONFIGS["mixtral"])
    with pytest.raises(ValueError, match="moe_aux_loss_coeff=0.01 with cp=2"):
        build_transformer_config(arch, ParallelConfig(cp=2), torch.float32, attention_backend="sdpa",
                                 moe_aux_loss_coeff=0.01)


def test_config_accepts_cp_and_the_core_attentions_take_the_cp_group():
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dppo.config import load_config
    from megatron_dppo.megatron.attention import SDPACoreAttention, VarlenCoreAttention
    from megatron_dppo.megatron.model import build_transformer_config
    from megatron_dppo.megatron.parallel import ParallelConfig

    quickstart = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
    cfg = load_config(quickstart, ["parallel.cp=2", "parallel.cp_comm_type=a2a"])
    assert (cfg.parallel.cp, cfg.parallel.cp_comm_type) == (2, "a2a")
    with pytest.raises(ValueError, match="parallel.cp_comm_type"):
        load_config(quickstart, ["parallel.cp_comm_type=ring"])
    with pytest.raises(ValueError, match="parallel.cp=2 with model.moe_routing_replay=False / "
                                         "model.moe_aux_loss_coeff=0.01"):
        load_config(quickstart, ["parallel.cp=2", "model.moe_aux_loss_coeff=0.01"])
    cfg.parallel.cp = 0
    with pytest.raises(ValueError, match="parallel.cp=0 is invalid"):
        cfg.parallel.validate()
    config = build_transformer_config(F.tiny_arch(), ParallelConfig(cp=2), torch.float32, attention_backend="sdpa")
    groups = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1), cp=SimpleNamespace(size=lambda: 2))
    assert SDPACoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=groups).cp_group is groups.cp

    class Varlen(VarlenCoreAttention):
        kernel = staticmethod(lambda *args, **kwargs: None)

    assert Varlen(config, 1, AttnMaskType.causal, "self", pg_collection=groups).cp_group is groups.cp
    with pytest.raises(ValueError, match="attention_dropout=0.1 with context_parallel_size=2"):
        SDPACoreAttention(config, 1, AttnMaskType.causal, "self", attention_dropout=0.1, pg_collection=groups)
