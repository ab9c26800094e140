"""Stages 1-2: the environment (versions, GPU, attention backends, the measured GEMM peak that is the MFU
denominator) and the process group (NCCL on the device, gloo in the CPU smoke run) with Megatron's model-parallel
state, world of 1."""
from __future__ import annotations

import os
import platform
import time

from .harness import Check, require, sync


def stage_environment(c: Check) -> dict:
    import importlib.metadata as md

    import torch

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": version("transformers"), "megatron_core": version("megatron-core"),
            "transformer_engine": version("transformer-engine") or version("transformer_engine"),
            "vllm": version("vllm"), "math_verify": version("math-verify")}
    if not c.cpu_smoke:
        require(torch.cuda.is_available(), "CUDA is not available")
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        from torch.nn.attention.varlen import varlen_attn

        import inspect

        info["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    except ImportError as err:
        info["varlen_attn_signature"] = f"unavailable: {err}"
    # measured dense GEMM peak: the MFU denominator
    n, dtype = (256, torch.float32) if c.cpu_smoke else (8192, torch.bfloat16)
    a = torch.randn(n, n, dtype=dtype, device=c.device)
    b = torch.randn(n, n, dtype=dtype, device=c.device)
    for _ in range(3):
        a @ b
    sync()
    reps = 3 if c.cpu_smoke else 10
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    seconds = (time.perf_counter() - t0) / reps
    c.peak_flops = 2 * n**3 / seconds
    info["gemm"] = f"{n}^3 {str(dtype).replace('torch.', '')}"
    info["gemm_tflops"] = round(c.peak_flops / 1e12, 3)
    if not c.cpu_smoke:
        require(c.peak_flops > 300e12, f"bf16 GEMM at {c.peak_flops / 1e12:.0f} TFLOP/s (< 300): GPU not healthy")
    return info



def stage_dist(c: Check) -> dict:
    import torch

    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from megatron_dppo.dist.launch import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    initialize_parallel(ParallelConfig(), seed=1234)
    backend = torch.distributed.get_backend()
    x = torch.full((4,), 3.0, device=c.device)
    torch.distributed.all_reduce(x)
    require(torch.equal(x, torch.full_like(x, 3.0)), f"all-reduce over a world of 1 changed the tensor: {x}")
    require(backend == ("gloo" if c.cpu_smoke else "nccl"), f"backend {backend}")
    c.parallel_ready = True
    return {"backend": backend, "world_size": torch.distributed.get_world_size()}
