"""Stages 1-2: the environment (versions, GPU, attention backends, the measured GEMM peak that is the MFU
denominator) and the process group (NCCL on the device, gloo in the CPU smoke run) with Megatron's model-parallel
state, world of 1."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time

from .harness import Check, require, sync


def parse_compute_modes(csv: str) -> list[dict]:
    """Rows of ``nvidia-smi --query-gpu=index,pci.bus_id,compute_mode --format=csv,noheader``."""
    rows = []
    for line in csv.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            rows.append({"index": int(parts[0]) if parts[0].isdigit() else parts[0], "pci_bus_id": parts[1],
                         "compute_mode": parts[2]})
    return rows


def compute_mode_of(rows: list[dict], visible: str | None) -> str | None:
    """The compute mode of the GPU this process uses (CUDA device 0): the one mode when all GPUs share it, else
    that of the first of CUDA_VISIBLE_DEVICES when it is an index (nvidia-smi's order), else the only GPU's;
    None when unknown."""
    modes = {r["compute_mode"] for r in rows}
    if len(modes) <= 1:
        return modes.pop() if modes else None
    first = (visible or "").split(",")[0].strip()
    if first.isdigit():
        return next((r["compute_mode"] for r in rows if r["index"] == int(first)), None)
    return rows[0]["compute_mode"] if not first or len(rows) == 1 else None


def gpu_compute_modes() -> dict:
    """The compute mode of every GPU (nvidia-smi) and of the one in use: Exclusive_Process admits one process
    (a second one, e.g. the async stage's rollout worker, fails to create its CUDA context), Prohibited none."""
    if shutil.which("nvidia-smi") is None:
        return {"compute_mode": None, "compute_modes": "nvidia-smi not found"}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id,compute_mode", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"compute_mode": None, "compute_modes": f"nvidia-smi failed: {err}"}
    rows = parse_compute_modes(out.stdout)
    return {"compute_mode": compute_mode_of(rows, os.environ.get("CUDA_VISIBLE_DEVICES")),
            "compute_modes": rows or f"nvidia-smi: {(out.stdout + out.stderr).strip()[:300]}"}


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
    info.update(gpu_compute_modes())
    c.compute_mode = None if c.cpu_smoke else info["compute_mode"]  # (the CPU smoke run does not use the GPU)
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

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
        from megatron_dppo.distributed.launch import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    initialize_parallel(ParallelConfig(), seed=1234)
    backend = torch.distributed.get_backend()
    x = torch.full((4,), 3.0, device=c.device)
    torch.distributed.all_reduce(x)
    require(torch.equal(x, torch.full_like(x, 3.0)), f"all-reduce over a world of 1 changed the tensor: {x}")
    require(backend == ("gloo" if c.cpu_smoke else "nccl"), f"backend {backend}")
    c.parallel_ready = True
    return {"backend": backend, "world_size": torch.distributed.get_world_size()}
