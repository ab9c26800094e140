"""Stages 5 and 6: a training step of a device-sized engine (bf16, distributed optimizer: finite loss, fp32 master
weights changed, every tensor placed, tokens/s, MFU against the measured peak, peak memory), and a checkpoint
saved, loaded into a fresh engine and stepped once more on both."""
from __future__ import annotations

import contextlib
import math
import os
import time

from .harness import Check, require, sync
from .shapes import build_engine, master_weights, random_micro_batches, small_arch, train_arch, training_flops


def stage_train_step(c: Check) -> dict:
    import torch

    c.need_parallel()
    arch = train_arch(c)
    t0 = time.perf_counter()
    engine = build_engine(c, arch, seed=3)
    sync()
    build_s = time.perf_counter() - t0
    misplaced = engine.placement_audit()  # the engine asserts it too; reported so a device run shows it
    require(not misplaced, f"tensors not on {engine.device} in {engine.dtype}: {misplaced[:5]}")
    n_params = sum(p.numel() for m in engine.modules for p in m.parameters())
    masters = master_weights(engine)
    master_dtypes = sorted({str(p.dtype) for p in masters})
    require(master_dtypes == ["torch.float32"], f"optimizer master weights are {master_dtypes}, not fp32")
    sample = [p.detach().clone() for p in masters[:4]]
    capacity, n_micro = (256, 2) if c.cpu_smoke else (16384, 4)
    batches, lengths = random_micro_batches(arch, n_micro, capacity, 16 if c.cpu_smoke else 128,
                                            128 if c.cpu_smoke else 2048, seed=4)

    def one_step():
        sync()
        a = time.perf_counter()
        engine.fill_logprobs(batches, old=True)
        sync()
        b = time.perf_counter()
        metrics = engine.train_step(batches, float(len(lengths)))
        sync()
        return b - a, time.perf_counter() - b, metrics

    one_step()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    steps = 2 if c.cpu_smoke else 3
    times = [one_step() for _ in range(steps)]
    fwd_s = sum(t[0] for t in times) / steps
    train_s = sum(t[1] for t in times) / steps
    metrics = times[-1][2]
    tokens = sum(lengths)
    flops = training_flops(arch, lengths)
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(sample, masters[:4]))
    figures = {
        "arch": "small (cpu smoke)" if c.cpu_smoke else "llama-1.1b (TinyLlama shape)", "params": n_params,
        "attention_backend": engine.modules[0].attention_backend, "device_dtype_audit": misplaced,
        "dtype": str(c.dtype), "master_weights": master_dtypes[0], "master_weights_changed": changed,
        "distributed_optimizer": True, "micro_batches": len(batches), "tokens_per_step": tokens,
        "build_s": round(build_s, 2), "logprob_s": fwd_s, "train_step_s": train_s,
        "train_tokens_per_s": tokens / train_s, "logprob_tokens_per_s": tokens / fwd_s,
        "train_tflops": flops / train_s / 1e12, "train_mfu": flops / train_s / c.peak_flops if c.peak_flops else None,
        "logprob_mfu": flops / 3 / fwd_s / c.peak_flops if c.peak_flops else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
    }
    require(math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]), f"non-finite: {metrics}")
    require(changed, "the fp32 master weights did not change after the optimizer steps")
    return figures


def stage_checkpoint(c: Check) -> dict:
    """Save, load into a fresh engine, compare every tensor of the training state, then one more step on each
    (``compare_next_step``), with deterministic kernels on."""
    c.need_parallel()
    with deterministic_kernels():
        return _save_load_step(c)


def _save_load_step(c: Check) -> dict:
    import shutil

    import torch

    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dppo.megatron.offload import train_state_tensors

    arch = small_arch(c)
    batches, lengths = random_micro_batches(arch, 2, 256 if c.cpu_smoke else 4096, 16, 128 if c.cpu_smoke
                                            else 1024, seed=5)
    engine = build_engine(c, arch, seed=7)
    engine.train_step(batches, float(len(lengths)))
    root = c.work / "checkpoint_stage"
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    path = save_checkpoint(engine, root)
    save_s = time.perf_counter() - t0
    fresh = build_engine(c, arch, seed=99)
    fresh.train_step(batches, float(len(lengths)))  # optimizer state exists, different from the saved one
    t0 = time.perf_counter()
    load_checkpoint(fresh, path)
    load_s = time.perf_counter() - t0
    a = list(train_state_tensors(engine.model_chunks, engine.optimizer, grads=False))
    b = list(train_state_tensors(fresh.model_chunks, fresh.optimizer, grads=False))
    require(len(a) == len(b), f"{len(a)} vs {len(b)} state tensors")
    bad = sum(not torch.equal(x, y) for x, y in zip(a, b) if x.shape == y.shape)
    require(bad == 0, f"{bad} state tensors differ after load")
    m1 = engine.train_step(batches, float(len(lengths)))
    m2 = fresh.train_step(batches, float(len(lengths)))
    shutil.rmtree(root, ignore_errors=True)
    return {"state_tensors": len(a), "bit_exact": True, "save_s": round(save_s, 2), "load_s": round(load_s, 2),
            **compare_next_step(m1, m2, exact_grad_norm=c.cpu_smoke)}


# Relative grad-norm difference allowed between the resumed and the original engine's next step on a GPU: its
# backward kernels (FlashAttention, embedding and scatter atomics) may add in another order from run to run even
# with torch's deterministic algorithms asked for; the CPU's are exact.
GRAD_NORM_RTOL = 1e-3


def compare_next_step(original: dict, resumed: dict, exact_grad_norm: bool) -> dict:
    """The step after a resume against the same step of the engine that saved: the loss (a forward pass over the
    same weights and inputs) must be bit-exact; the grad norm bit-exact when ``exact_grad_norm`` (CPU), else
    within ``GRAD_NORM_RTOL`` (the figures say whether it was exact)."""
    require(original["loss"] == resumed["loss"],
            f"next step's loss differs after resume: {original['loss']!r} vs {resumed['loss']!r}")
    g1, g2 = original["grad_norm"], resumed["grad_norm"]
    rel = abs(g1 - g2) / max(abs(g1), 1e-30)
    limit = 0.0 if exact_grad_norm else GRAD_NORM_RTOL
    require(rel <= limit, f"next step's grad norm differs after resume: {g1!r} vs {g2!r} (relative {rel:.2e} > "
                          f"{limit:g})")
    return {"next_step_loss_equal": True, "next_step_grad_norm_exact": g1 == g2, "next_step_grad_norm_rel_diff": rel}


@contextlib.contextmanager
def deterministic_kernels():
    """torch's deterministic algorithms (``warn_only``: a kernel without a deterministic variant still runs) and
    Transformer Engine's deterministic fused attention for the duration; cuBLAS's workspace setting
    (``CUBLAS_WORKSPACE_CONFIG``) must precede CUDA's start-up, so ``gpu_check.sh`` exports it."""
    import torch

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO"))
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if before[2] is None:
            os.environ.pop("NVTE_ALLOW_NONDETERMINISTIC_ALGO", None)
        else:
            os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = before[2]

