"""LoRA in the Megatron engine (``megatron.lora``, ``PolicyEngine(lora=...)``): adapters == merged weights, only
adapters train (gradients, optimizer state, grad norm), the reference is the base model with adapters off (or with
the frozen starting adapters of model.lora.init), TP2 / TP2+SP / PP2 / DP2 with the DistributedOptimizer == one
process, and adapter-only checkpoints resume exactly."""
from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _engine_fixtures as F
from _dist import run_distributed, single_process_world
from _tiny import packed_batches

CFG = dict(rank=4, alpha=8.0, target_modules=("qkv", "proj", "fc1", "fc2"))


@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=F.SEED):
        yield


def _lora(**kw):
    from megatron_dppo.megatron.lora import LoraConfig

    return LoraConfig(**{**CFG, **kw})


def base_tensors(arch) -> dict[str, torch.Tensor]:
    """Full HF-named base weights, a function of the architecture only (every layout loads the same model)."""
    from megatron_dppo.convert.mapping import expected_hf_shapes

    out = {}
    for name, shape in expected_hf_shapes(arch).items():
        g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
        noise = torch.randn(shape, generator=g)
        out[name] = 1.0 + 0.1 * noise if "norm" in name else (0.1 * noise if name.endswith("bias") else 0.08 * noise)
    return out


def adapter_tensors(chunks, seed: int = 11, b_std: float = 0.03) -> dict:
    """Full, non-zero A and B for the adapters of the chunks (keys as ``lora.full_lora_tensors``), a function of
    (layer, projection) only: every layout gets the same numbers."""
    from megatron_dppo.megatron.lora import PROJECTIONS, adapters

    out = {}
    for layer, _, adapter in adapters(chunks):
        for p in adapter.pairs:
            g = torch.Generator().manual_seed(seed * 1000 + layer * 10 + PROJECTIONS.index(p))
            o, i = adapter.part_shapes[p]
            out[(layer, p, "lora_A")] = torch.randn(adapter.rank, i, generator=g) / math.sqrt(i)
            out[(layer, p, "lora_B")] = b_std * torch.randn(o, adapter.rank, generator=g)
    return out


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------
def test_config_targets_scaling_and_refusals():
    from megatron_dppo.megatron.lora import LoraConfig, check_lora_supported
    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig

    cfg = LoraConfig(rank=8, alpha=16, target_modules=("qkv", "fc2"))
    assert cfg.projections == ("q", "k", "v", "fc2") and cfg.scaling == 2.0
    assert LoraConfig(rank=16, alpha=8, use_rslora=True).scaling == pytest.approx(2.0)
    assert LoraConfig(target_modules=("v", "q")).projections == ("q", "v")
    for bad, match in [(dict(rank=0), "rank"), (dict(alpha=-1), "alpha"), (dict(dropout=1.0), "dropout"),
                       (dict(target_modules=("qkv", "lm_head")), "lm_head"), (dict(target_modules=()), "empty")]:
        with pytest.raises(ValueError, match=match):
            LoraConfig(**bad)
    dense = F.tiny_arch("qwen2")
    check_lora_supported(dense, ParallelConfig(tp=2), cfg)
    with pytest.raises(ValueError, match="num_kv_heads=2 < tp=4"):
        check_lora_supported(dense, ParallelConfig(tp=4), cfg)
    check_lora_supported(dense, ParallelConfig(tp=4), LoraConfig(target_modules=("proj", "fc1")))
    from _tiny import TINY_MOE_CONFIGS

    moe = ModelArch.from_hf_config(TINY_MOE_CONFIGS["qwen3_moe"])
    check_lora_supported(moe, ParallelConfig(), LoraConfig(target_modules=("qkv", "proj")))
    with pytest.raises(ValueError, match="Mixture-of-Experts"):
        check_lora_supported(moe, ParallelConfig(), LoraConfig(target_modules=("qkv", "fc1")))


# ----------------------------------------------------------------------------------------------------------
# The adapters on a model chunk
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_forward_with_adapters_equals_forward_of_merged_weights(world, family):
    """fp32: logits with adapters == logits of W + scaling * B @ A (<= 1e-6 relative); the base comes back exactly."""
    from megatron_dppo.megatron import lora as L
    from megatron_dppo.megatron.logprobs import forward_thd
    from megatron_dppo.megatron.model import build_model_chunks
    from megatron_dppo.megatron.parallel import ParallelConfig

    chunks = build_model_chunks(F.tiny_arch(family, num_layers=2), ParallelConfig())
    L.add_lora_adapters(chunks, _lora())
    (model,) = chunks
    model.eval()
    batch = packed_batches()[0]
    base_weights = {n: p.detach().clone() for n, p in model.named_parameters() if not L.is_lora_param(n)}
    with torch.no_grad():
        initial = forward_thd(model, batch)
        with L.adapters_disabled(chunks):
            base = forward_thd(model, batch)
        assert torch.equal(initial, base)  # B = 0 at initialisation (PEFT's init): the base model exactly
        L.load_full_lora_tensors(chunks, adapter_tensors(chunks))
        adapted = forward_thd(model, batch)
        with L.merged(chunks):
            merged = forward_thd(model, batch)
        again = forward_thd(model, batch)
    scale = adapted.abs().max()
    assert (adapted - base).abs().max() > 0.1 * scale  # the adapters change the logits a lot
    assert (adapted - merged).abs().max() <= 1e-6 * scale
    assert torch.equal(adapted, again)
    assert all(torch.equal(p, base_weights[n]) for n, p in model.named_parameters() if n in base_weights)


def test_peft_initialisation(world):
    from megatron_dppo.megatron import lora as L
    from megatron_dppo.megatron.model import build_model_chunks
    from megatron_dppo.megatron.parallel import ParallelConfig

    chunks = build_model_chunks(F.tiny_arch("qwen2", num_layers=2), ParallelConfig())
    names = L.add_lora_adapters(chunks, _lora(rank=8))
    assert len(names) == 2 * 4
    frozen = [n for n, p in chunks[0].named_parameters() if not p.requires_grad]
    trainable = [n for n, p in chunks[0].named_parameters() if p.requires_grad]
    assert trainable and all(L.is_lora_param(n) for n in trainable)
    assert frozen and not any(L.is_lora_param(n) for n in frozen)
    full = L.full_lora_tensors(chunks)
    a = full[(1, "fc2", "lora_A")]  # [r, ffn]: U(-1/sqrt(ffn), 1/sqrt(ffn))
    bound = 1 / math.sqrt(a.shape[1])
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound and abs(float(a.mean())) < 0.1 * bound
    assert all(not t.any() for (_, _, which), t in full.items() if which == "lora_B")
    assert not torch.equal(full[(0, "q", "lora_A")], full[(1, "q", "lora_A")])


def test_dropout_only_in_training_forwards(world):
    """lora.dropout drops adapter inputs in train mode only: eval forwards (old / reference log-probs) are exact."""
    from megatron_dppo.megatron import lora as L
    from megatron_dppo.megatron.logprobs import forward_thd
    from megatron_dppo.megatron.model import build_model_chunks
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    outputs = {}
    for dropout in (0.0, 0.5):
        seed_everything(F.SEED)  # the same base both times
        chunks = build_model_chunks(F.tiny_arch("llama", num_layers=2), ParallelConfig())
        L.add_lora_adapters(chunks, _lora(dropout=dropout))
        L.load_full_lora_tensors(chunks, adapter_tensors(chunks))
        batch = packed_batches()[0]
        with torch.no_grad():
            chunks[0].eval()
            outputs[dropout, "eval"] = forward_thd(chunks[0], batch)
            chunks[0].train()
            outputs[dropout, "train"] = forward_thd(chunks[0], batch)
    assert torch.equal(outputs[0.5, "eval"], outputs[0.0, "eval"])
    assert torch.equal(outputs[0.0, "train"], outputs[0.0, "eval"])
    assert (outputs[0.5, "train"] - outputs[0.5, "eval"]).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------------------
def _engine(arch, lora=None, kl=0.05, **optim):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.convert import load_hf_weights
    from megatron_dppo.megatron import lora as L
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    seed_everything(F.SEED)
    loss = LossConfig(kl_coef=kl, kl_estimator="k3").resolved()
    engine = PolicyEngine(arch, ParallelConfig(), OptimConfig(**{"lr": 1e-2, **optim}), loss, lora=lora)
    load_hf_weights(engine.model_chunks, arch, base_tensors(arch))
    if lora is not None:
        L.load_full_lora_tensors(engine.modules, adapter_tensors(engine.modules))
    elif engine.reference_chunks is not None:
        engine.sync_reference_from_policy()
    engine.optimizer.reload_model_params()
    return engine, loss


def _step(engine, loss, seed=3):
    from megatron_dppo.algo.losses import loss_denominator

    data = F.make_sequences(seed=seed)
    batches = F.rank_micro_batches(data, loss, 0, 1, 1)
    engine.fill_logprobs(batches)
    for b in batches:
        b.old_logprobs = b.old_logprobs + F.perturbation(b, 0.3, 0.0)
    return batches, engine.train_step(batches, loss_denominator(loss.aggregation, data["B"], data["G"]))


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_only_adapters_get_gradients_and_optimizer_state(world, distributed_optimizer):
    from megatron_dppo.megatron import lora as L

    arch = F.tiny_arch("qwen2", num_layers=2)
    engine, loss = _engine(arch, _lora(), grad_clip=1e9, distributed_optimizer=distributed_optimizer)
    assert engine.reference_chunks is None  # no reference copy
    adapters = {id(p) for p in L.lora_parameters(engine.modules)}
    before = {n: p.detach().clone() for n, p in engine.modules[0].named_parameters()}
    _, metrics = _step(engine, loss)
    assert metrics["update_ok"] == 1.0
    for n, p in engine.modules[0].named_parameters():
        assert torch.equal(p, before[n]) != L.is_lora_param(n), n  # base unchanged, every adapter tensor moved
        assert (getattr(p, "main_grad", None) is not None) == L.is_lora_param(n), n
    # DDP's gradient buffers and the optimizer's state hold the adapters and nothing else
    buffered = sum(b.numel for c in engine.model_chunks for b in c.buffers)
    assert buffered == sum(p.numel() for p in L.lora_parameters(engine.modules))
    inner = engine.optimizer.optimizer
    optimized = [p for g in inner.param_groups for p in g["params"]]
    states = sum(s["exp_avg"].numel() for s in inner.state.values())
    assert states == sum(p.numel() for p in L.lora_parameters(engine.modules))
    if not distributed_optimizer:
        assert {id(p) for p in optimized} == adapters
    # the reported norm is the adapters' gradient norm
    norm = math.sqrt(sum(float(p.main_grad.double().pow(2).sum()) for p in L.lora_parameters(engine.modules)))
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-6)


def test_reference_logprobs_with_adapters_off_equal_the_base_models(world):
    """The LoRA engine's reference log-probs (same chunks, adapters disabled) == a full-weights engine's policy
    log-probs on the same base, bit for bit; its policy log-probs differ (the adapters are on)."""
    arch = F.tiny_arch("qwen2", num_layers=2)
    lora_engine, loss = _engine(arch, _lora())
    base_engine, _ = _engine(arch, None, kl=0.0)
    data = F.make_sequences(seed=4)
    batches = F.rank_micro_batches(data, loss, 0, 1, 1)
    ref = lora_engine.compute_logprobs(batches, "reference")
    policy = lora_engine.compute_logprobs(batches, "policy")
    base = base_engine.compute_logprobs(batches, "policy")
    for r, p, b in zip(ref, policy, base):
        assert torch.equal(r, b)
        assert (p - b).abs().max() > 1e-3
    # after training the adapters, the reference is still the base
    _step(lora_engine, loss)
    for r, b in zip(lora_engine.compute_logprobs(batches, "reference"), base):
        assert torch.equal(r, b)


def test_reference_keeps_the_starting_adapters(world):
    """A run that starts from an adapter (model.lora.init: ``keep_as_reference``) has that adapter in its reference:
    at the start the reference log-probs ARE the policy's, bit for bit (a KL term is exactly 0, not the distance
    from the bare base), and after an update the reference is still the starting policy, not the base."""
    from megatron_dppo.megatron import lora as L

    arch = F.tiny_arch("qwen2", num_layers=2)
    engine, loss = _engine(arch, _lora())  # non-zero starting adapters (adapter_tensors)
    L.keep_as_reference(engine.modules)
    base_engine, _ = _engine(arch, None, kl=0.0)
    batches = F.rank_micro_batches(F.make_sequences(seed=4), loss, 0, 1, 1)
    start = engine.compute_logprobs(batches, "policy")
    base = base_engine.compute_logprobs(batches, "policy")
    for r, p, b in zip(engine.compute_logprobs(batches, "reference"), start, base):
        assert torch.equal(r, p) and (r - b).abs().max() > 1e-3
    _, metrics = _step(engine, loss)
    assert metrics["update_ok"] == 1.0
    for r, p, now in zip(engine.compute_logprobs(batches, "reference"), start,
                         engine.compute_logprobs(batches, "policy")):
        assert torch.equal(r, p) and (now - p).abs().max() > 1e-4
    with L.adapters_disabled(engine.modules):  # the bare base is still there underneath
        for b, own in zip(base, engine.compute_logprobs(batches, "policy")):
            assert torch.equal(b, own)
    assert not any("ref_" in k for k in engine.modules[0].state_dict())  # checkpoints hold the trained adapters only


def test_gradient_audit_measures_the_adapters_gradient(world):
    """The pruning audit (train/audit.py) on a LoRA engine: its gradient is the adapters' (the parameters that
    train), the same vector the update uses (its norm is the step's grad norm), and it leaves nothing behind."""
    from megatron_dppo.algo.losses import loss_denominator
    from megatron_dppo.megatron import lora as L
    from megatron_dppo.train.audit import pruning_audit, step_gradient

    arch = F.tiny_arch("qwen2", num_layers=2)
    engine, loss = _engine(arch, _lora(), grad_clip=1e9)
    data = F.make_sequences(seed=6)
    denominator = loss_denominator(loss.aggregation, data["B"], data["G"])
    batches = F.rank_micro_batches(data, loss, 0, 1, 1)
    engine.fill_logprobs(batches)
    grad = step_gradient(engine, batches, denominator)
    assert grad.numel() == sum(p.numel() for p in L.lora_parameters(engine.modules))
    before = [p.detach().clone() for p in engine.modules[0].parameters()]
    repacked = F.rank_micro_batches(data, loss, 0, 1, 1, capacity=40)
    engine.fill_logprobs(repacked)
    same = pruning_audit(engine, batches, repacked, denominator)
    assert same.cosine == pytest.approx(1.0, abs=1e-6) and same.full_grad_norm > 0
    assert all(torch.equal(p, q) for p, q in zip(engine.modules[0].parameters(), before))
    metrics = engine.train_step(batches, denominator)
    assert metrics["grad_norm"] == pytest.approx(same.full_grad_norm, rel=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Parallel layouts (subprocesses, gloo)
# ----------------------------------------------------------------------------------------------------------
def lora_layout_worker(tp: int = 1, pp: int = 1, sp: bool = False, distributed_optimizer: bool = False, cp: int = 1):
    """The same base, adapters and global batch at any layout: log-probs (policy, reference), one step's metrics
    and the full adapter tensors at construction and after the step."""
    from megatron.core import parallel_state

    from megatron_dppo.algo.losses import LossConfig, loss_denominator
    from megatron_dppo.convert import load_hf_weights
    from megatron_dppo.megatron import lora as L
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine, _pad_multiple
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel

    arch = F.tiny_arch("qwen2", num_layers=2)  # q/k/v biases, tied embeddings (PP: the last stage's copy)
    parallel = ParallelConfig(tp=tp, pp=pp, sp=sp, cp=cp)
    initialize_parallel(parallel, F.SEED, arch)
    loss = LossConfig(kl_coef=0.05, kl_estimator="k3").resolved()
    # adam_eps well above the gradients' rounding noise: a first Adam step moves an entry by ~lr * g / |g|, which
    # would turn the float noise of a near-zero gradient into an lr-sized difference between layouts
    optim = OptimConfig(lr=1e-2, adam_eps=1e-3, distributed_optimizer=distributed_optimizer)
    engine = PolicyEngine(arch, parallel, optim, loss, lora=_lora())
    initial = L.full_lora_tensors(engine.modules)
    load_hf_weights(engine.model_chunks, arch, base_tensors(arch))
    L.load_full_lora_tensors(engine.modules, adapter_tensors(engine.modules))
    engine.optimizer.reload_model_params()
    data = F.make_sequences(seed=5)
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    batches = F.rank_micro_batches(data, loss, dp_rank, dp, _pad_multiple(parallel))
    engine.fill_logprobs(batches)
    old = F.per_sample_completion_logp(batches, [b.old_logprobs for b in batches])
    ref = F.per_sample_completion_logp(batches, [b.ref_logprobs for b in batches])
    for b in batches:
        b.old_logprobs = b.old_logprobs + F.perturbation(b, 0.3, 0.0)
    metrics = engine.train_step(batches, loss_denominator(loss.aggregation, data["B"], data["G"]))
    return {"old": old, "ref": ref, "metrics": metrics, "initial": initial,
            "after": L.full_lora_tensors(engine.modules)}


@pytest.fixture(scope="module")
def single_process(world):
    return lora_layout_worker()


def _gathered(results):
    """Per-sample log-probs of all DP ranks."""
    merged = {"old": {}, "ref": {}}
    for res in results:
        for key in merged:
            merged[key].update(res[key])
    return merged


LAYOUTS = {"tp2": (2, dict(tp=2)), "tp2_sp": (2, dict(tp=2, sp=True)), "pp2": (2, dict(pp=2)),
           "dp2_distributed_optimizer": (2, dict(distributed_optimizer=True)), "cp2": (2, dict(cp=2))}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_single_process(single_process, layout):
    """Initial adapters, policy and reference log-probs, loss, grad norm and the updated adapters of TP2 (A
    replicated, B split / A split, B replicated), TP2+SP (partial gradients all-reduced), PP2, DP2 with the
    DistributedOptimizer and CP2 (each rank adapts its part of every sequence; DDP sums over DP x CP) == one
    process."""
    world_size, kwargs = LAYOUTS[layout]
    results = run_distributed(lora_layout_worker, world_size, kwargs=kwargs, timeout=420)
    ref = single_process
    got = _gathered(results)
    for key in ("old", "ref"):
        assert sorted(got[key]) == sorted(ref[key])
        for sid in ref[key]:
            torch.testing.assert_close(got[key][sid], ref[key][sid], rtol=0, atol=2e-6)
    for res in results:
        assert res["initial"].keys() == ref["initial"].keys()
        assert all(torch.equal(res["initial"][k], v) for k, v in ref["initial"].items())  # layout-independent init
        m, r = res["metrics"], ref["metrics"]
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-8)
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
        for k, v in ref["after"].items():
            torch.testing.assert_close(res["after"][k], v, rtol=0, atol=1e-5, msg=str(k))


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: adapters and their optimizer state only, exact resume, the base is checked
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_adapter_checkpoint_resumes_exactly_and_holds_no_base_weights(world, tmp_path, distributed_optimizer):
    from megatron_dppo.megatron import lora as L
    from megatron_dppo.megatron.checkpoint import load_checkpoint, read_checkpoint_meta, save_checkpoint

    arch = F.tiny_arch("qwen2", num_layers=2)
    kw = dict(distributed_optimizer=distributed_optimizer, weight_decay=0.1, warmup_steps=1)
    engine, loss = _engine(arch, _lora(), **kw)
    for s in range(2):
        _step(engine, loss, seed=20 + s)
    path = save_checkpoint(engine, tmp_path)
    straight = [_step(engine, loss, seed=30 + s)[1] for s in range(2)]
    final = L.full_lora_tensors(engine.modules)

    resumed, _ = _engine(arch, _lora(), **kw)
    _step(resumed, loss, seed=99)  # move adapters and Adam state away first
    load_checkpoint(resumed, tmp_path)
    assert resumed.step == 2
    again = [_step(resumed, loss, seed=30 + s)[1] for s in range(2)]
    assert [m["loss"] for m in again] == [m["loss"] for m in straight]
    assert [m["grad_norm"] for m in again] == [m["grad_norm"] for m in straight]
    assert all(torch.equal(t, final[k]) for k, t in L.full_lora_tensors(resumed.modules).items())

    meta = read_checkpoint_meta(path)
    assert meta["lora"]["rank"] == 4 and meta["lora_base"] == {"path": None, "sha256": None}
    from torch.distributed.checkpoint import FileSystemReader

    sizes = {k: v.size for k, v in FileSystemReader(str(path)).read_metadata().state_dict_metadata.items()
             if hasattr(v, "size")}
    adapter_keys = {k for k in sizes if L.is_lora_param(k) and not k.startswith("optimizer.")}
    assert len(adapter_keys) == 14  # 7 projections x (A, B), layers stacked
    numel = sum(p.numel() for p in L.lora_parameters(engine.modules))
    if distributed_optimizer:  # dp_reshardable: the flat buffer of the optimized (adapter) parameters
        flat = {k: s for k, s in sizes.items() if k not in adapter_keys}
        assert all(k.startswith("optimizer.distributed.") for k in flat)
        assert sum(s.numel() for k, s in flat.items() if k.endswith(".param")) == numel
    else:
        assert all(L.is_lora_param(k) for k in sizes), [k for k in sizes if not L.is_lora_param(k)][:3]
        assert sum(s.numel() for k, s in sizes.items() if ".exp_avg_sq." in k) == numel


def test_adapter_checkpoint_refuses_another_base_or_config(world, tmp_path):
    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
    from _hf_models import save_hf_model

    arch = F.tiny_arch("qwen2", num_layers=2)
    base_a = save_hf_model("qwen2_untied", tmp_path / "a", seed=0)
    base_b = save_hf_model("qwen2_untied", tmp_path / "b", seed=1)
    engine, loss = _engine(arch, _lora())
    engine.set_lora_base(base_a)
    _step(engine, loss)
    save_checkpoint(engine, tmp_path / "ckpt")

    other, _ = _engine(arch, _lora())
    other.set_lora_base(base_b)
    with pytest.raises(ValueError, match="trained on the base"):
        load_checkpoint(other, tmp_path / "ckpt")
    other.set_lora_base(base_a)
    load_checkpoint(other, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="LoRA config differs"):
        bigger, _ = _engine(arch, _lora(rank=8))
        bigger.set_lora_base(base_a)
        load_checkpoint(bigger, tmp_path / "ckpt")
    full, _ = _engine(arch, None)
    with pytest.raises(ValueError, match="LoRA adapters"):
        load_checkpoint(full, tmp_path / "ckpt")
    from megatron_dppo.convert.checkpoint import find_model_checkpoint

    with pytest.raises(ValueError, match="LoRA training checkpoint"):  # no weights to convert
        find_model_checkpoint(tmp_path / "ckpt")
