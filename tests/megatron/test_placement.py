"""Where the model's tensors live and which attention kernel may run them, proven on the CPU.

* Every parameter and buffer of a built chunk is on the engine's device in the params dtype, as Megatron-LM's
  training loop arranges (``.cuda()`` + ``Float16Module``): the local spec's torch RMSNorm is created in fp32 on
  the CPU and the MoE router weight on the CPU, so without ``model.place_model`` a bf16 GPU run broadcast CPU
  tensors over NCCL, ran the reference model across devices and exported fp32 norms.
* ``model.device_dtype_audit`` finds every misplaced tensor; the engine asserts it after building policy and
  reference.
* torch's FlashAttention varlen kernels take fp16/bf16 and head dims that are multiples of 8 up to 256: ``auto``
  does not pick varlen for anything else, and an explicit ``varlen`` fails at build time naming the value.
"""
from __future__ import annotations

import pytest
import torch
from _dist import single_process_world
from _tiny import TINY_CONFIGS, TINY_MOE_CONFIGS


@pytest.fixture(scope="module")
def world():
    with single_process_world():
        yield


def _arch(family):
    from megatron_dppo.megatron.model import ModelArch

    return ModelArch.from_hf_config({**TINY_CONFIGS, **TINY_MOE_CONFIGS}[family])


# ------------------------------------------------------------------------------------------------------------
# Parameters and buffers: device and dtype
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_every_parameter_is_built_in_the_params_dtype(world, family):
    """bf16 chunks (the CPU can build them; it trains fp32 only): the torch RMSNorms (input, pre-MLP, q/k, final)
    come out in bf16 too, as the router and the linear layers do."""
    from megatron_dppo.megatron.model import build_model_chunks, device_dtype_audit

    chunks = build_model_chunks(_arch(family), _parallel(), torch.bfloat16, attention_backend="sdpa")
    dtypes = {name: p.dtype for c in chunks for name, p in c.named_parameters()}
    assert {n: d for n, d in dtypes.items() if d != torch.bfloat16} == {}
    assert any("layernorm" in n for n in dtypes) and (family != "qwen3_moe" or any("router" in n for n in dtypes))
    assert device_dtype_audit(chunks, torch.device("cpu"), torch.bfloat16) == []
    # the audit names what does not fit another placement
    found = device_dtype_audit(chunks, torch.device("cpu"), torch.float32)
    assert len(found) == len(dtypes) and "decoder.final_layernorm.weight: bfloat16 on cpu" in found


def _parallel():
    from megatron_dppo.megatron.parallel import ParallelConfig

    return ParallelConfig()


def test_place_model_casts_every_tensor_and_keeps_the_parameter_objects(world):
    """fp32 -> bf16 in place: the same Parameter objects with their Megatron attributes, floating buffers cast,
    integer ones kept, the router's expert-bias buffers float32 as Megatron wants. The device move is the same
    ``param.data = param.data.to(device)`` that ``Module.cuda()`` does; a CPU-only machine has no second device
    to move to (meta tensors cannot take over a CPU tensor's data), so only the audit's device check runs here."""
    from megatron_dppo.megatron.model import FLOAT32_BUFFERS, build_gpt_model, device_dtype_audit, place_model

    model = build_gpt_model(_arch("qwen3_moe"), _parallel(), torch.float32, attention_backend="sdpa")
    model.register_buffer("scale", torch.ones(3))
    model.decoder.register_buffer(FLOAT32_BUFFERS[0], torch.zeros(4))
    model.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    cpu = torch.device("cpu")
    params = dict(model.named_parameters())
    assert len(device_dtype_audit(model, torch.device("meta"), torch.float32)) == len(params) + 3  # every tensor
    assert len(device_dtype_audit(model, cpu, torch.bfloat16)) == len(params) + 1  # floating, not expert_bias
    flags = {n: getattr(p, "sequence_parallel", None) for n, p in params.items()}
    place_model(model, cpu, torch.bfloat16)
    assert device_dtype_audit(model, cpu, torch.bfloat16) == []
    assert all(p is params[n] for n, p in model.named_parameters())
    assert {n: getattr(p, "sequence_parallel", None) for n, p in params.items()} == flags
    assert model.scale.dtype == torch.bfloat16 and model.steps.dtype == torch.int64
    assert getattr(model.decoder, FLOAT32_BUFFERS[0]).dtype == torch.float32


def test_engine_policy_and_reference_pass_the_audit(world):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import seed_everything

    seed_everything(3)
    engine = PolicyEngine(_arch("qwen3_moe"), _parallel(), OptimConfig(lr=1e-3),
                          LossConfig(kl_coef=0.1, kl_estimator="k1").resolved(), dtype=torch.float32)
    assert engine.reference_chunks is not None
    assert engine.placement_audit() == []
    stray = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    engine.reference_chunks[0].register_parameter("stray", stray)
    assert engine.placement_audit() == ["reference.stray: float64 on cpu"]


# ------------------------------------------------------------------------------------------------------------
# torch's FlashAttention varlen kernels: dtype and head dim
# ------------------------------------------------------------------------------------------------------------
def _gpu_probe():
    from megatron_dppo.megatron.attention import BackendProbe

    return BackendProbe(cuda=True, te="transformer_engine is not installed", varlen=None)


def test_auto_never_picks_varlen_for_what_flash_attention_cannot_run():
    from megatron_dppo.megatron.attention import resolve_attention_backend as resolve

    gpu = _gpu_probe()
    assert resolve("auto", gpu, dtype=torch.bfloat16, head_dim=128) == "varlen"
    assert resolve("auto", gpu, dtype=torch.float16, head_dim=256) == "varlen"
    assert resolve("auto", gpu, dtype=torch.float32, head_dim=128) == "sdpa"  # the device check's fp32 MoE parity
    assert resolve("auto", gpu, dtype=torch.bfloat16, head_dim=20) == "sdpa"
    assert resolve("auto", gpu, dtype=torch.bfloat16, head_dim=320) == "sdpa"


@pytest.mark.parametrize("dtype,head_dim,match", [
    (torch.float32, 128, r"float16 or bfloat16 only, the model is torch.float32"),
    (torch.bfloat16, 20, r"head_dim=20: .* multiples of 8 up to 256"),
    (torch.bfloat16, 264, r"head_dim=264: .* multiples of 8 up to 256"),
])
def test_explicit_varlen_that_flash_attention_cannot_run_is_an_error(dtype, head_dim, match):
    from megatron_dppo.megatron.attention import resolve_attention_backend as resolve

    with pytest.raises(ValueError, match=r"model.attention_backend=varlen cannot be used: .*" + match):
        resolve("varlen", _gpu_probe(), dtype=dtype, head_dim=head_dim)


def test_varlen_module_refuses_an_fp32_model_at_build_time(world):
    """A config that reaches ``VarlenCoreAttention`` without the resolver (a hand-built spec) fails when the layer
    is built, not at the first forward inside the CUDA kernel; a replacement kernel (tests) is not limited."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dppo.megatron.attention import VarlenCoreAttention, varlen_attention
    from megatron_dppo.megatron.model import build_transformer_config

    config = build_transformer_config(_arch("qwen2"), _parallel(), torch.float32, attention_backend="sdpa")
    with pytest.raises(ValueError, match=r"varlen cannot be used: .*float16 or bfloat16 only.*torch.float32"):
        VarlenCoreAttention(config, 1, AttnMaskType.causal, "self")

    class WithKernel(VarlenCoreAttention):
        kernel = staticmethod(lambda *args, **kwargs: None)

    WithKernel(config, 1, AttnMaskType.causal, "self")
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match=r"float16 or bfloat16 only, the model is torch.float32"):
        varlen_attention(q, q, q, torch.tensor([0, 4], dtype=torch.int32), 4, causal=True, scale=0.3)
