"""Stage 8: asynchronous RL through the CLI (``rollout.placement=separate``): 1 trainer + 1 rollout worker under
torchrun, both on the one GPU (the trainer's Megatron group is NCCL of one rank; the weights and batches cross
on gloo through host memory), ``train.max_staleness=1``, a checkpoint, then resumed for more steps. bf16 on CUDA;
the small fp32 variant with ``--cpu-smoke``.

What it checks: both runs exit 0; every RL step is logged once; every batch's staleness is within the bound;
the worker's record shows the weight versions arriving in increasing order and the first resumed batch generated
again from the restored weights (staleness 0); the behaviour-vs-proximal KL of staleness-0 batches is small (the
worker generated with the weights the trainer holds, up to bf16 kernel differences). What it measures: the
trainer's wait for batches and the worker's idle seconds per step, the weight push time."""
from __future__ import annotations

import json
import math
import shutil
import sys

from .harness import Check, require
from .quickstart_stage import clean_env, quickstart_args, run_then_resume

KL_STALENESS0_MAX = 0.05  # bf16 trainer vs bf16 HF generate at the same weights; fp32 on the CPU is ~1e-7


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_async(c: Check) -> dict:
    c.need_shared_gpu("this stage runs a trainer and a rollout worker")
    out = c.work / "async"
    shutil.rmtree(out, ignore_errors=True)
    base = [*quickstart_args(c, out), "rollout.placement=separate", "rollout.workers=1", "train.max_staleness=1",
            "checkpoint.every=0", "rollout.worker_timeout_s=120",
            "loss.rollout_correction=tis"]  # (tis: logs the behaviour-vs-proximal KL)
    first, second = (2, 4) if c.cpu_smoke else (4, 8)
    env = clean_env()
    timings, logs, log_files = run_then_resume(
        c, "async", lambda steps: [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                   "--master-addr=127.0.0.1", f"--master-port={_free_port()}", *base,
                                   f"train.steps={steps}"], env, (first, second), timeout=180)

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [r for r in records if r.get("phase") == "rl"]
    require([r["step"] for r in rl] == list(range(second)), f"RL steps logged {[r['step'] for r in rl]}")
    staleness = [r["async/staleness"] for r in rl]
    require(all(0 <= s <= 1 for s in staleness), f"staleness outside the bound 1: {staleness}")
    require(staleness[first] == 0, f"the first resumed batch was not regenerated (staleness {staleness[first]})")
    kl0 = [r["rollout/kl_k3"] for r, s in zip(rl, staleness) if s == 0 and "rollout/kl_k3" in r]
    require(kl0 and all(math.isfinite(k) and abs(k) <= KL_STALENESS0_MAX for k in kl0),
            f"behaviour-vs-proximal KL of staleness-0 batches {kl0} (> {KL_STALENESS0_MAX})")
    worker = json.loads((out / "rollout_worker.json").read_text())
    arrived = worker["versions_arrived"]
    require(arrived == sorted(set(arrived)), f"weight versions arrived out of order: {arrived}")
    return {"runs_s": timings, "staleness": staleness, "kl_k3_staleness0_max": max(abs(k) for k in kl0),
            "trainer_wait_s": [round(r["async/trainer_wait_s"], 3) for r in rl],
            "rollout_idle_s": [round(r["async/rollout_idle_s"], 3) for r in rl],
            "weight_sync_s": [round(r.get("time/weight_sync", float("nan")), 3) for r in rl], "logs": log_files}
