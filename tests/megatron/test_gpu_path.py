"""The GPU path, proven where a CPU reaches it: attention backend selection and its errors, the varlen attention
shim over torch's changing ``varlen_attn`` signatures (with a CPU reference kernel of each signature; the real
kernel is compared on the device by ``scripts/gpu_check.py``), padded THD offsets, fusion flags following the
spec, keys Megatron must honour, the CP refusal, and the training-state offload (bit-exact round trip)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from _dist import single_process_world
from _tiny import TINY_CONFIGS, TINY_MOE_CONFIGS, packed_batches


@pytest.fixture(scope="module")
def world():
    with single_process_world():
        yield


# ------------------------------------------------------------------------------------------------------------
# Backend selection
# ------------------------------------------------------------------------------------------------------------
def _probe(cuda=True, te=None, varlen=None):
    from megatron_dppo.megatron.attention import BackendProbe

    return BackendProbe(cuda=cuda, te=te, varlen=varlen)


def test_auto_prefers_te_then_varlen_then_sdpa():
    from megatron_dppo.megatron.attention import resolve_attention_backend as resolve

    assert resolve("auto", _probe()) == "te"
    assert resolve("auto", _probe(te="transformer_engine is not installed")) == "varlen"
    assert resolve("auto", _probe(te="smoke test failed", varlen="capability 7.5")) == "sdpa"
    cpu = _probe(cuda=False, te="no CUDA device", varlen="no CUDA device")
    assert resolve("auto", cpu) == "sdpa"
    for name in ("sdpa",):
        assert resolve(name, cpu) == "sdpa"
    assert resolve("te", _probe()) == "te" and resolve("varlen", _probe(te="absent")) == "varlen"


def test_explicit_backend_that_cannot_work_is_an_error_not_a_fallback():
    from megatron_dppo.megatron.attention import resolve_attention_backend as resolve

    cpu = _probe(cuda=False, te="no CUDA device (Transformer Engine is GPU only)",
                 varlen="no CUDA device (torch's varlen FlashAttention kernels are CUDA only)")
    with pytest.raises(ValueError, match=r"attention_backend=te cannot be used: no CUDA device"):
        resolve("te", cpu)
    with pytest.raises(ValueError, match=r"attention_backend=varlen cannot be used: no CUDA device"):
        resolve("varlen", cpu)
    with pytest.raises(ValueError, match=r"attention_backend=te cannot be used: transformer_engine imports but"):
        resolve("te", _probe(te="transformer_engine imports but its smoke test failed (RuntimeError: x)"))
    with pytest.raises(ValueError, match=r"'flash'.*expected one of \('auto', 'te', 'varlen', 'sdpa'\)"):
        resolve("flash", cpu)


def test_this_machine_probe_and_layer_spec_follow_the_backend(world):
    from megatron_dppo.megatron.attention import SDPACoreAttention, VarlenCoreAttention, probe_backends
    from megatron_dppo.megatron.model import ModelArch, build_layer_spec, build_transformer_config
    from megatron_dppo.megatron.parallel import ParallelConfig

    probe = probe_backends()
    if not torch.cuda.is_available():
        assert probe.te and probe.varlen and "no CUDA device" in probe.varlen
        with pytest.raises(ValueError, match="varlen cannot be used"):
            build_layer_spec(ModelArch.from_hf_config(TINY_CONFIGS["llama"]), attention_backend="varlen")
    arch = ModelArch.from_hf_config(TINY_CONFIGS["qwen3"])
    core = lambda spec: spec.submodules.self_attention.submodules.core_attention  # noqa: E731
    assert core(build_layer_spec(arch, attention_backend="sdpa")) is SDPACoreAttention
    assert core(build_layer_spec(arch, te=False)) is SDPACoreAttention  # the older boolean form
    from megatron_dppo.megatron.attention import core_attention_class

    assert core_attention_class("varlen") is VarlenCoreAttention
    # fusion flags follow the spec actually built (TE kernels only with the TE spec)
    config = build_transformer_config(arch, ParallelConfig(), torch.float32, attention_backend="sdpa")
    assert not (config.apply_rope_fusion or config.bias_activation_fusion or config.masked_softmax_fusion)


def test_keys_megatron_must_honour_are_never_dropped():
    from megatron_dppo.megatron import compat

    @dataclasses.dataclass
    class OldOptimizerConfig:  # a release lacking the distributed optimizer switch
        lr: float = 1.0

    assert compat.supported_kwargs(OldOptimizerConfig, {"lr": 2.0, "some_perf_flag": 1}) == {"lr": 2.0}
    for key in ("use_distributed_optimizer", "bf16", "main_params_dtype", "variable_seq_lengths"):
        with pytest.raises(RuntimeError, match=f"does not take \\['{key}'\\]"):
            compat.supported_kwargs(OldOptimizerConfig, {"lr": 2.0, key: True})


# ------------------------------------------------------------------------------------------------------------
# varlen attention: the signature shim, against a reference of each torch signature
# ------------------------------------------------------------------------------------------------------------
def _per_sequence(q, k, v, cu, causal, scale, gqa):
    out = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa).transpose(0, 1))
    return torch.cat(out)


def kernel_torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert query.size(1) == key.size(1), "2.10 has no GQA"
    return _per_sequence(query, key, value, cu_seq_q, is_causal, None, False)


def kernel_torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1)):
    assert query.size(1) == key.size(1), "2.11 has no GQA flag"
    return _per_sequence(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), scale, False)


def kernel_torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert enable_gqa or query.size(1) == key.size(1)
    return _per_sequence(query, key, value, cu_seq_q, tuple(window_size) == (-1, 0), scale, enable_gqa)


@pytest.mark.parametrize("kernel", [kernel_torch_2_10, kernel_torch_2_11, kernel_torch_2_13])
@pytest.mark.parametrize("scale_factor", [1.0, 0.5])
def test_varlen_shim_equals_per_sequence_attention(kernel, scale_factor):
    from megatron_dppo.megatron.attention import varlen_attention

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, hd = 4, 2, 8
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    q = torch.randn(20, heads, hd, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(20, kv_heads, hd, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(20, kv_heads, hd, generator=g, dtype=torch.float64, requires_grad=True)
    scale = scale_factor / math.sqrt(hd)
    out = varlen_attention(q, k, v, cu, 8, causal=True, scale=scale, kernel=kernel)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = _per_sequence(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, True, scale, False)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_varlen_module_equals_sdpa_twin_on_padded_thd(world):
    """VarlenCoreAttention (with a 2.13-signature reference kernel) == SDPACoreAttention on a packed batch with
    padded segments (padded offsets as cu_seqlens, as logprobs.packed_seq_params passes them), forward and
    backward."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dppo.megatron.attention import SDPACoreAttention, VarlenCoreAttention
    from megatron_dppo.megatron.logprobs import packed_seq_params
    from megatron_dppo.megatron.model import ModelArch, build_transformer_config
    from megatron_dppo.megatron.parallel import ParallelConfig

    arch = ModelArch.from_hf_config(TINY_CONFIGS["qwen3"])  # GQA 4:2, head_dim 24
    config = build_transformer_config(arch, ParallelConfig(), torch.float32, attention_backend="sdpa")
    batch = packed_batches(pad_multiple=8)[1]
    assert not torch.equal(batch.cu_seqlens, batch.cu_seqlens_padded)  # real padding inside the batch
    params = packed_seq_params(batch)
    assert torch.equal(params.cu_seqlens_q, batch.cu_seqlens_padded.int())
    assert torch.equal(params.cu_seqlens_q_padded, batch.cu_seqlens_padded.int())
    t = batch.tokens.numel()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(t, 4, 24, generator=g, requires_grad=True)
    k = torch.randn(t, 2, 24, generator=g, requires_grad=True)
    v = torch.randn(t, 2, 24, generator=g, requires_grad=True)
    w = torch.randn(t, 4 * 24, generator=g)
    class Varlen213(VarlenCoreAttention):  # the kernel is set before the layer is built: it decides the dtype rule
        kernel = staticmethod(kernel_torch_2_13)

    outs, grads = [], []
    for cls in (SDPACoreAttention, Varlen213):
        module = cls(config, 1, AttnMaskType.causal, "self")
        out = module(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        outs.append(out)
        grads.append(torch.autograd.grad((out * w).sum(), (q, k, v)))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# Training-state offload: storages freed, restored bit-exact, training continues identically
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_train_state_offload_round_trip_is_bit_exact(world, family):
    """Dense, and MoE, whose optimizer chains a dense and an expert optimizer: every Adam state of both leaves."""
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.offload import _inner_optimizers, engine_offloader, train_state_tensors
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    arch = ModelArch.from_hf_config({**TINY_CONFIGS, **TINY_MOE_CONFIGS}[family])
    seed_everything(5)
    engine = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=1e-3), LossConfig(kl_coef=0.0).resolved(),
                          dtype=torch.float32, reference=False)
    batches = packed_batches()
    engine.train_step(batches, 7.0)  # Adam state exists now
    before = [t.clone() for t in train_state_tensors(engine.model_chunks, engine.optimizer)]
    offloader = engine_offloader(engine, device_type="cpu")  # the mechanism is device independent
    freed = offloader.offload()
    assert freed > 0 and offloader.offloaded
    assert all(t.untyped_storage().nbytes() == 0 for t in train_state_tensors(engine.model_chunks, engine.optimizer))
    inner = list(_inner_optimizers(engine.optimizer))
    assert len(inner) == (2 if arch.moe else 1)
    adam = [t for opt in inner for state in opt.state.values() for t in state.values() if torch.is_tensor(t)
            and t.numel() > 1]
    assert adam and all(t.untyped_storage().nbytes() == 0 for t in adam)
    assert offloader.onload() == freed and not offloader.offloaded
    after = list(train_state_tensors(engine.model_chunks, engine.optimizer))
    assert len(after) == len(before)
    for a, b in zip(after, before):
        assert torch.equal(a, b)
    # and training goes on exactly as without the round trip
    seed_everything(5)
    twin = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=1e-3), LossConfig(kl_coef=0.0).resolved(),
                        dtype=torch.float32, reference=False)
    twin.train_step(batches, 7.0)
    m1, m2 = engine.train_step(batches, 7.0), twin.train_step(batches, 7.0)
    assert m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]
    for p, q in zip(engine.modules[0].parameters(), twin.modules[0].parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------------------------------------
# Checkpoints across layer specs
# ------------------------------------------------------------------------------------------------------------
class _TEStyleModule(torch.nn.Module):
    """State-dict names of a TE layer: fused layer-norm weight, an ``_extra_state`` entry."""

    def __init__(self):
        super().__init__()
        self.linear_qkv = torch.nn.Linear(2, 2)
        self.linear_qkv.layer_norm_weight = torch.nn.Parameter(torch.ones(2))

    def get_extra_state(self):
        return None


def test_checkpoint_across_layer_specs_fails_with_a_clear_message():
    from types import SimpleNamespace

    from megatron_dppo.megatron.checkpoint import check_layer_spec, layer_spec_of

    local = SimpleNamespace(modules=[torch.nn.Sequential(torch.nn.Linear(2, 2))])
    te = SimpleNamespace(modules=[_TEStyleModule()])
    assert layer_spec_of(local.modules) == "local" and layer_spec_of(te.modules) == "te"
    check_layer_spec({"layer_spec": "local"}, local, "ckpt")
    check_layer_spec({}, local, "ckpt")  # checkpoints written before the field: local spec
    with pytest.raises(ValueError, match=r"ckpt: the checkpoint was written with the Transformer Engine layer spec "
                                         r".*this run builds the local layer spec.*convert megatron-to-hf"):
        check_layer_spec({"layer_spec": "te"}, local, "ckpt")
    with pytest.raises(ValueError, match="written with the local layer spec"):
        check_layer_spec({"layer_spec": "local"}, te, "ckpt")
