"""Staged device check of the GPU path (written for the lent H200; <= 6 minutes). Every stage is guarded: a
failing or skipped stage is recorded and the next one runs. After every stage the JSON report is rewritten to
``<out>/gpu_check.json`` (``--out``, default ``$OUT``, else ``gpu_check_out/``), so a timeout keeps the figures so far.
Only the report and short logs (``*.log``, output tails) go to ``<out>``: run folders and checkpoints live in a
scratch folder (``--work``, default a fresh temporary folder) that is removed at the end.

The stages live in ``scripts/gpu_checks/`` by concept: ``harness`` (the runner and report), ``shapes`` (models,
batches, engines, FLOPs), ``env_stages`` (1-2), ``attention_stage`` (3), ``parity_stages`` (4, 5b),
``train_stages`` (5, 6), ``quickstart_stage`` (7), ``async_stage`` (8).

A stage that takes the whole process down (the time limit's SIGTERM, a CUDA abort, a segfault) stays in the report
as ``crashed`` (``gpu_checks/harness.py``).

Stages (pass/fail thresholds in each):

1. environment   versions, GPU and its compute mode (nvidia-smi: under Exclusive_Process, which admits one
                 process, the quickstart and async stages skip), attention backends available; measured bf16 GEMM
                 peak (8192^3, mean of 10).
2. dist          NCCL process group + Megatron model-parallel state, world of 1; an all-reduce.
3. varlen        torch varlen FlashAttention (through ``attention.varlen_attention``) == per-sequence SDPA,
                 forward and backward, GQA, bf16 and fp16 against an fp32 reference (must be within 2x of bf16
                 SDPA's own error); ``VarlenCoreAttention`` == ``SDPACoreAttention`` on a packed batch with padded
                 segments and tail padding (within a few rounding steps of each tensor's largest value).
4. hf_parity     llama / qwen2 / qwen3 random models: every tensor on the GPU in bf16 (``device_dtype_audit``),
                 Megatron THD logits vs transformers per sequence, and the Megatron -> HF export round trip
                 (bit-exact).
5. train_step    ~1.1B Llama (TinyLlama shape), bf16, distributed optimizer: every tensor placed, finite loss, fp32
                 master weights changed, tokens/s, MFU against the measured peak, peak memory.
5b. moe         tiny Qwen3-MoE: Megatron THD logits (fp32) vs transformers, then a small 16-expert model's
                forward + backward + update in the training dtype (grouped-GEMM experts when TE is present).
6. checkpoint    save / load into a fresh engine: every tensor of the training state bit-exact; the next step's
                 loss bit-exact and its grad norm within 1e-3 relative (exact on the CPU), deterministic kernels on.
7. quickstart    the CLI quickstart in bf16 on CUDA for a few steps, then resumed for more (subprocess).
8. async         the quickstart with rollout.placement=separate under torchrun (1 trainer + 1 rollout worker on
                 the one GPU), max_staleness 1, then resumed: the bound holds, versions arrive in order, the
                 staleness-0 behaviour-vs-proximal KL is small; the trainer's wait and the worker's idle seconds.
                 Last, so that a device run short of time loses only it (``--skip async`` leaves it out).

``--cpu-smoke`` runs the same stages small in fp32 on the CPU (CPU reference kernel for varlen), in under a
minute: it is part of the default test suite so this script cannot rot. ``--cpu-smoke --dtype bfloat16 --only
dist,train_step,checkpoint`` runs the device's bf16 training stages (Megatron's mixed-precision optimizers, fp32
masters, the bit-exact checkpoint) on the CPU (tested too). The device call (``run`` tool):

    command:   bash scripts/gpu_check.sh
    carry:     [".whl"]            (scripts/device_wheels.sh fills it here; ~3 MB)
    timeout_s: 420
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_checks.async_stage import stage_async  # noqa: E402 - after the repository joins sys.path
from gpu_checks.attention_stage import stage_varlen  # noqa: E402
from gpu_checks.env_stages import stage_dist, stage_environment  # noqa: E402
from gpu_checks.harness import REPORT, Check, Stop  # noqa: E402
from gpu_checks.parity_stages import stage_hf_parity, stage_moe  # noqa: E402
from gpu_checks.quickstart_stage import stage_quickstart  # noqa: E402
from gpu_checks.train_stages import stage_checkpoint, stage_train_step  # noqa: E402

STAGES = [("environment", stage_environment), ("dist", stage_dist), ("varlen", stage_varlen),
          ("hf_parity", stage_hf_parity), ("train_step", stage_train_step), ("moe", stage_moe),
          ("checkpoint", stage_checkpoint),
          ("quickstart", stage_quickstart), ("async", stage_async)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="the same stages, small, fp32, on the CPU")
    parser.add_argument("--out", default=None, help="report folder (default: $OUT, else gpu_check_out/)")
    parser.add_argument("--work", default=None, help="scratch folder for run folders and checkpoints (default: a "
                                                     "temporary folder, removed at the end)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="the models' and engines' dtype (default: bfloat16 on the device, float32 with "
                             "--cpu-smoke; --cpu-smoke --dtype bfloat16 runs the GPU's mixed-precision training code "
                             "on the CPU)")
    parser.add_argument("--only", default=None, help="comma-separated stage names (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated stage names not to run")
    args = parser.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or REPO / "gpu_check_out")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_check_work_"))
    signal.signal(signal.SIGTERM, _stop)  # the time limit (`timeout`): the running stage is recorded as crashed
    try:
        return run_stages(Check(args.cpu_smoke, out, work, args.dtype), args)
    except Stop:
        return 128 + signal.SIGTERM
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def _stop(signum, frame):
    raise Stop(f"stopped by signal {signal.Signals(signum).name} (the time limit?)")


def run_stages(check: Check, args) -> int:
    out = check.out
    wanted = set(args.only.split(",")) if args.only else None
    skipped = set(filter(None, args.skip.split(",")))
    try:
        import torch

        if not args.cpu_smoke and not torch.cuda.is_available():
            check.report["error"] = "no CUDA device visible (use --cpu-smoke on a CPU)"
            check.write()
            print("gpu_check: no CUDA device visible; nothing to check (--cpu-smoke runs the CPU variant)")
            return 2
        if args.cpu_smoke:
            torch.set_num_threads(1)
    except ImportError as err:
        check.report["error"] = f"torch does not import: {err}"
        check.write()
        return 2
    ok = True
    try:
        for name, fn in STAGES:
            if name in skipped:
                check.report["stages"][name] = {"status": "skip", "reason": "--skip"}
            elif wanted is None or name in wanted or name in ("environment", "dist"):
                ok = check.run(name, lambda fn=fn: fn(check)) and ok
    except BaseException:  # a stop from outside: the stage is recorded as crashed; say what ran
        check.report["summary"] = {k: v["status"] for k, v in check.report["stages"].items()}
        check.write()
        raise
    try:
        from megatron_dppo.megatron.parallel import destroy_parallel

        destroy_parallel()
    except Exception:  # noqa: BLE001 - teardown of a failed setup
        pass
    statuses = {k: v["status"] for k, v in check.report["stages"].items()}
    check.report["summary"] = statuses
    check.write()
    print(f"gpu_check: {statuses} -> {out / REPORT}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
