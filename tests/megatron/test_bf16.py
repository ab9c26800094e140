"""bf16 (and fp16) mixed precision in the training engine on CPU: Megatron-Core's own mixed-precision optimizers
(``Float16OptimizerWithFloat16Params``, the ``DistributedOptimizer``) with bf16 parameters and compute, fp32 main
params, fp32 gradient buffers (``main_grad``) and fp32 Adam state, exactly the GPU path's code.

Bounds from bf16's rounding (the derivation the parity tests and benchmarks/bf16_parity.py use)
----------------------------------------------------------------------------------------------
bf16 keeps 8 significant bits: each rounding to bf16 has a relative error of at most u = 2^-8. A forward pass
rounds its values to bf16 after each operation in series; per transformer layer at most 12 (input norm, QKV
projection, QK norm, RoPE, attention core, output projection, residual add, pre-MLP norm, gate/up projection,
SiLU * up, down projection, residual add), plus 3 outside the layers (embedding, final norm, output layer):
K = 12 L + 3. To first order the relative errors add, so each logit is off by at most K u Z, Z = the largest
|logit|. log-softmax is 2-Lipschitz in the max norm (|d log p_y| <= |dz_y| + max_v |dz_v|), hence

    |log p_bf16 - log p_fp32| <= 2 K u Z                                   (log-prob bound)

The backward pass runs the same chain again, so the gradient's relative L2 error and the loss's relative error are
bounded by 2 K u (first order, worst case: every rounding error in the same direction). TP2 against TP1 in bf16 is
held to the same bound: the two differ in the order of the bf16 partial sums, each within that chain. The measured
differences are an order of magnitude below these bounds; each test also checks they are above fp32's level, so
the run really computed in bf16.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _engine_fixtures as F
from _dist import run_distributed, single_process_world

U_BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significant bits)


def rounding_chain(num_layers: int) -> int:
    """K: bf16 roundings in series through a forward pass (module docstring)."""
    return 12 * num_layers + 3


@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=F.SEED):
        yield


def _engine(dtype, distributed_optimizer=False, kl_coef=0.05, lr=1e-2):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    seed_everything(F.SEED)
    loss_cfg = LossConfig(policy_loss="ppo_clip", kl_coef=kl_coef, kl_estimator="k3").resolved()
    return PolicyEngine(F.tiny_arch("llama", num_layers=2, tie=False), ParallelConfig(),
                        OptimConfig(lr=lr, distributed_optimizer=distributed_optimizer), loss_cfg, dtype=dtype)


def _batches(engine, seed=0):
    from megatron_dppo.algo.losses import loss_denominator

    data = F.make_sequences(seed=seed)
    batches = F.rank_micro_batches(data, engine.loss_cfg, 0, 1, 1)
    return batches, loss_denominator(engine.loss_cfg.aggregation, data["B"], data["G"])


def _objective(engine, batches) -> float:
    """sum over loss tokens of weight * advantage * log p: what a policy-gradient step increases."""
    logps = engine.compute_logprobs(batches)
    return sum(float((b.token_weight * b.advantages * b.loss_mask * lp).sum()) for b, lp in zip(batches, logps))


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_bf16_engine_trains_bf16_params_with_fp32_masters_and_state(world, distributed_optimizer):
    """model.dtype=bfloat16 on CPU: the model's parameters are bf16, the gradient buffers (main_grad) fp32, the
    optimizer steps fp32 main params with fp32 Adam moments (Megatron's mixed-precision optimizers), and three
    steps raise the advantage-weighted log-likelihood. The fp32 masters hold bits that bf16 parameters cannot."""
    engine = _engine(torch.bfloat16, distributed_optimizer)
    expected = "DistributedOptimizer" if distributed_optimizer else "Float16OptimizerWithFloat16Params"
    assert [type(o).__name__ for o in engine.optimizer.chained_optimizers] == [expected]
    params = [p for m in engine.modules for p in m.parameters()]
    assert {p.dtype for p in params} == {torch.bfloat16}
    batches, D = _batches(engine)
    before = _objective(engine, batches)
    for _ in range(3):
        engine.fill_logprobs(batches)
        metrics = engine.train_step(batches, D)
        assert metrics["update_ok"] == 1.0
    assert _objective(engine, batches) > before + 0.1
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.main_grad.dtype for p in params} == {torch.float32}
    from megatron_dppo.megatron.checkpoint import _inner_torch_optimizers

    (opt,) = _inner_torch_optimizers(engine)
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert masters and {m.dtype for m in masters} == {torch.float32}
    for m in masters:
        assert {opt.state[m]["exp_avg"].dtype, opt.state[m]["exp_avg_sq"].dtype} == {torch.float32}
    assert any(bool((m != m.bfloat16().float()).any()) for m in masters)  # not bf16-representable: real masters
    assert {p.dtype for c in engine.reference_chunks for p in c.parameters()} == {torch.bfloat16}  # the reference
    if not distributed_optimizer:  # every bf16 parameter is its master rounded to bf16
        for p in params:
            assert torch.equal(p, p.main_param.bfloat16())


def _max_abs_logit(engine, batches) -> float:
    from megatron_dppo.megatron.logprobs import forward_thd

    with torch.no_grad():
        return max(float(forward_thd(engine.modules[0], b).float().abs().max()) for b in batches)


def test_bf16_first_step_matches_fp32_within_bf16_rounding(world):
    """The same weights (fp32, and rounded to bf16), batch and old/reference log-probs: the bf16 engine's
    log-probs, loss, gradient and grad norm are within the bounds of the module docstring of the fp32 engine's
    (and differ from them by more than fp32 rounding: the bf16 run computes in bf16)."""
    f32, b16 = _engine(torch.float32), _engine(torch.bfloat16)
    with torch.no_grad():
        for p16, p32 in zip(b16.modules[0].parameters(), f32.modules[0].parameters()):
            p16.copy_(p32)
    b16.optimizer.reload_model_params()
    b16.sync_reference_from_policy()
    batches, D = _batches(f32)
    K = rounding_chain(2)
    Z = _max_abs_logit(f32, batches)
    logp32, logp16 = f32.compute_logprobs(batches), b16.compute_logprobs(batches)
    assert all(lp.dtype == torch.float32 for lp in logp16)  # fp32 log-probs from bf16 logits
    dlogp = max(float(((a - b) * bt.loss_mask).abs().max()) for a, b, bt in zip(logp32, logp16, batches))
    assert 1e-4 < dlogp <= 2 * K * U_BF16 * Z, (dlogp, 2 * K * U_BF16 * Z)

    for b, lp in zip(batches, logp32):  # the same old / reference log-probs for both engines
        b.old_logprobs = lp + F.perturbation(b, 0.3, 0.0)
        b.ref_logprobs = lp + F.perturbation(b, 0.2, 1.0)
    m32, m16 = f32.train_step(batches, D), b16.train_step(batches, D)
    g32 = torch.cat([p.main_grad.flatten() for p in f32.modules[0].parameters()])
    g16 = torch.cat([p.main_grad.flatten() for p in b16.modules[0].parameters()])
    rel_grad = float((g16 - g32).norm() / g32.norm())
    assert 1e-4 < rel_grad <= 2 * K * U_BF16, rel_grad
    assert abs(m16["loss"] - m32["loss"]) <= 2 * K * U_BF16 * abs(m32["loss"])
    assert abs(m16["grad_norm"] - m32["grad_norm"]) <= 2 * K * U_BF16 * m32["grad_norm"]


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_bf16_resume_equals_the_straight_run_bit_exactly(world, tmp_path, distributed_optimizer):
    """bf16 run: 2 steps, checkpoint, 2 steps == a fresh engine (moved away first) loaded from the checkpoint, the
    same 2 steps: identical losses and grad norms, torch.equal bf16 parameters. The checkpoint holds the fp32 main
    params and Adam moments: right after loading they equal the saved ones bit for bit, and they are fp32 values
    that bf16 weights alone could not give back."""
    res = F.resume_worker(str(tmp_path / "ckpt"), distributed_optimizer=distributed_optimizer, dtype="bfloat16")
    assert res["param_dtypes"] == ["torch.bfloat16"]
    assert res["resumed"] == res["straight"]
    assert res["params_equal"]
    assert res["optimizer_restored"]
    masters = [t for t in res["saved_optimizer"] if t.dtype == torch.float32]
    assert len(masters) == len(res["saved_optimizer"])
    assert any(bool((t != t.bfloat16().float()).any()) for t in masters)


@pytest.fixture(scope="module")
def bf16_tp1(tmp_path_factory, world):
    """The fp32 TP1 checkpoint and step (``layout_worker``), the bf16 TP1 step from it, the bf16 bound on the
    log-probs of that model (Z from the fp32 model's logits) and the relative bound 2 K u."""
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.checkpoint import load_checkpoint
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig

    root = tmp_path_factory.mktemp("bf16_layouts")
    ref32 = F.layout_worker(str(root), save=True)
    tp1 = F.layout_worker(str(root), dtype="bfloat16")
    f32 = PolicyEngine(F.tiny_arch(), ParallelConfig(), OptimConfig(), LossConfig(kl_coef=0.0).resolved())
    load_checkpoint(f32, str(root), load_optimizer=False, load_rng=False)
    Z = _max_abs_logit(f32, F.rank_micro_batches(F.make_sequences(), f32.loss_cfg, 0, 1, 1))
    K = rounding_chain(F.tiny_arch().num_layers)
    return root, ref32, tp1, 2 * K * U_BF16 * Z, 2 * K * U_BF16


BF16_LAYOUTS = {"tp2_sp": dict(tp=2, sp=True), "pp2": dict(pp=2), "cp2": dict(cp=2)}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", sorted(BF16_LAYOUTS))
def test_layouts_equal_tp1_in_bf16_within_bf16_rounding(bf16_tp1, layout):
    """bf16 TP2 + sequence parallel, PP2 and CP2 against bf16 TP1, all from the same (fp32 TP1) checkpoint:
    per-sample log-probs, loss and grad norm within the bf16 bound of the module docstring (gloo all-reduces the
    bf16 partial sums; the pipeline sends bf16 activations). bf16 TP1 itself differs from fp32 TP1 by more than
    fp32 rounding. (Slow, ~30 s each, like the other engine layouts; benchmarks/bf16_parity.py reports the
    single-process figures.)"""
    root, ref32, tp1, bound, relative = bf16_tp1
    differs_from_fp32 = max(float((tp1["before"][s] - ref32["before"][s]).abs().max()) for s in ref32["before"])
    assert differs_from_fp32 > 1e-4
    results = run_distributed(F.layout_worker, 2, args=(str(root),),
                              kwargs=dict(BF16_LAYOUTS[layout], dtype="bfloat16"), timeout=300)
    for res in results:
        assert sorted(res["before"]) == sorted(tp1["before"])
        dlogp = max(float((res["before"][s] - tp1["before"][s]).abs().max()) for s in tp1["before"])
        assert dlogp <= bound, (dlogp, bound)
        r, g = tp1["metrics"][0], res["metrics"][0]
        assert abs(g["loss"] - r["loss"]) <= relative * abs(r["loss"])
        assert abs(g["grad_norm"] - r["grad_norm"]) <= relative * r["grad_norm"]


def test_fp16_trains_with_megatrons_dynamic_loss_scaler(world):
    """model.dtype=float16 (supported, as on GPU): Megatron's DynamicGradScaler starts at 2^32, so the first updates
    overflow in fp16 and are skipped (update_ok 0, weights and fp32 masters untouched) while the scale halves; then
    the updates go through with fp32 masters and Adam state, and the policy improves."""
    from megatron_dppo.megatron.checkpoint import _inner_torch_optimizers

    engine = _engine(torch.float16)
    params = [p for m in engine.modules for p in m.parameters()]
    assert {p.dtype for p in params} == {torch.float16}
    batches, D = _batches(engine)
    scaler = engine.optimizer.chained_optimizers[0].grad_scaler
    assert type(scaler).__name__ == "DynamicGradScaler" and float(scaler.scale) == 2.0 ** 32
    start = [p.detach().clone() for p in params]
    before = _objective(engine, batches)
    skipped = 0
    while engine.fill_logprobs(batches) or engine.train_step(batches, D)["update_ok"] == 0.0:
        skipped += 1
        assert skipped < 40
        assert all(torch.equal(a, p) for a, p in zip(start, params))  # a skipped update changes nothing
    assert skipped > 0 and float(scaler.scale) < 2.0 ** 32
    for _ in range(3):
        engine.fill_logprobs(batches)
        engine.train_step(batches, D)
    assert _objective(engine, batches) > before + 0.1
    (opt,) = _inner_torch_optimizers(engine)
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert {m.dtype for m in masters} == {torch.float32}
    assert {opt.state[masters[0]]["exp_avg"].dtype} == {torch.float32}


def test_bf16_lora_trains_bf16_adapters_with_fp32_masters_and_keeps_the_base(world):
    """LoRA under bf16: the frozen base and the adapters are bf16; the optimizer holds fp32 masters of the adapters
    only; two steps move every adapter tensor and no base weight; the reference (adapters off) gives fp32 log-probs."""
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron import lora as L
    from megatron_dppo.megatron.checkpoint import _inner_torch_optimizers
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    seed_everything(F.SEED)
    loss_cfg = LossConfig(kl_coef=0.05, kl_estimator="k3").resolved()
    engine = PolicyEngine(F.tiny_arch("qwen2", num_layers=2), ParallelConfig(), OptimConfig(lr=1e-2), loss_cfg,
                          lora=L.LoraConfig(rank=4, alpha=8.0), dtype=torch.bfloat16)
    named = dict(engine.modules[0].named_parameters())
    assert {p.dtype for p in named.values()} == {torch.bfloat16}
    before = {n: p.detach().clone() for n, p in named.items()}
    batches, D = _batches(engine)
    engine.fill_logprobs(batches)
    assert all(b.ref_logprobs.dtype == torch.float32 for b in batches)
    for _ in range(2):  # (B starts at 0, so A moves from the second update on)
        engine.fill_logprobs(batches)
        assert engine.train_step(batches, D)["update_ok"] == 1.0
    for n, p in named.items():
        assert torch.equal(p, before[n]) != L.is_lora_param(n), n  # base unchanged, every adapter moved
    (opt,) = _inner_torch_optimizers(engine)
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert {m.dtype for m in masters} == {torch.float32}
    assert sum(m.numel() for m in masters) == sum(p.numel() for p in L.lora_parameters(engine.modules))
