"""The CPU backend's redirections, one by one, and the compatibility helpers."""
from __future__ import annotations

import logging

import pytest
import torch
from _dist import single_process_world
from _tiny import TINY_CONFIGS, packed_batches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is applied only without CUDA")


@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=5):
        yield


def test_apply_is_idempotent_and_redirects_cuda_calls(world):
    from megatron_dppo.megatron import cpu

    calls = []
    cpu.register_cpu_patch(lambda: calls.append(1))  # already applied: runs once, now
    cpu.apply_cpu_backend()
    cpu.apply_cpu_backend()
    cpu._PATCHES.pop()
    assert calls == [1] and cpu.cpu_backend_applied()
    assert cpu.ensure_device_backend() == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")
    x = torch.ones(2)
    assert x.cuda() is x
    torch.cuda.synchronize()


def test_rng_tracker_keeps_cpu_states(world):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    expected_tp = torch.rand(4, generator=torch.Generator().manual_seed(123 + 2718))  # tp rank 0
    expected_default = torch.rand(6, generator=torch.Generator().manual_seed(123))
    first = torch.rand(3)
    with tracker.fork():
        in_fork = torch.rand(4)
    after = torch.rand(3)
    torch.testing.assert_close(in_fork, expected_tp)
    # the fork swapped the generator out and back: the default stream continues where it left off
    torch.testing.assert_close(torch.cat([first, after]), expected_default)
    with tracker.fork():  # the tracked stream continues too
        torch.testing.assert_close(torch.rand(2),
                                   torch.rand(6, generator=torch.Generator().manual_seed(123 + 2718))[4:])


def test_cuda_device_literals_become_cpu(world):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(3)
    assert mask.device.type == "cpu"
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(9))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    norm = get_grad_norm_fp32([p.grad for p in params])
    assert norm == pytest.approx(2.0 * 13 ** 0.5)
    clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)  # checks 'torch.cuda.FloatTensor'
    total = torch.cat([p.grad for p in params]).norm().item()
    assert total == pytest.approx(1.0, rel=1e-5)


def test_torch_norm_accepts_sequence_parallel(world):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                               sequence_parallel=True, tensor_model_parallel_size=2, use_cpu_initialization=True)
    norm = WrappedTorchNorm(config, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert all(p.sequence_parallel for p in norm.parameters())  # summed over TP by finalize_model_grads


def test_full_activation_recompute_matches(world):
    """With dropout on, activation recompute must replay the forward's random masks: it saves and restores the
    default and tracked RNG states (CPU generator states here). Gradients then equal the plain run's; a broken
    restore (different masks in the recomputed forward) would not."""
    from megatron.core import tensor_parallel

    from megatron_dppo.megatron.logprobs import thd_logprobs
    from megatron_dppo.megatron.model import ModelArch, build_gpt_model
    from megatron_dppo.megatron.parallel import ParallelConfig

    arch = ModelArch.from_hf_config(TINY_CONFIGS["qwen3"])
    dropout = dict(hidden_dropout=0.2, attention_dropout=0.2)
    plain = build_gpt_model(arch, ParallelConfig(), **dropout)
    recompute = build_gpt_model(arch, ParallelConfig(), recompute_granularity="full", recompute_method="uniform",
                                recompute_num_layers=1, **dropout)
    recompute.load_state_dict(plain.state_dict())
    batch = packed_batches()[0]
    grads, values = [], []
    for model in (plain, recompute, plain):
        tensor_parallel.model_parallel_cuda_manual_seed(77)
        model.train()
        model.zero_grad()
        logp, _ = thd_logprobs(model, batch, with_entropy=False)
        (logp * batch.loss_mask).sum().backward()
        values.append(logp.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(values[0], values[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)
    # control: another seed gives other dropout masks
    tensor_parallel.model_parallel_cuda_manual_seed(78)
    other = thd_logprobs(plain, batch, with_entropy=False)[0].detach()
    assert (other - values[0]).abs().max() > 1e-3


def test_compat_supported_kwargs_and_extras_log(caplog):
    from megatron_dppo.megatron import compat

    def f(a, b=1):
        return a, b

    assert compat.supported_kwargs(f, {"a": 1, "zzz": 2}) == {"a": 1}
    with pytest.raises(RuntimeError, match=r"does not take \['zzz'\]"):
        compat.supported_kwargs(f, {"a": 1, "zzz": 2}, required=("zzz",))
    assert compat.SUPPORTED_MCORE_MIN <= compat.mcore_version()[:2] <= compat.SUPPORTED_MCORE_MAX
    compat.log_gpu_extras_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="megatron_dppo.megatron.compat"):
        extras = compat.log_gpu_extras_once()
        compat.log_gpu_extras_once()
    lines = [r.getMessage() for r in caplog.records if "GPU extras" in r.getMessage()]
    assert len(lines) == 1 and "transformer_engine=" in lines[0] and "vllm=" in lines[0]
    assert isinstance(extras, compat.GpuExtras)
