"""Stage 7: the CLI quickstart (a subprocess: its own process group) for a few steps, then resumed for more: bf16
on CUDA, the small fp32 variant with ``--cpu-smoke``."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from .harness import Check, require

REPO = Path(__file__).resolve().parents[2]


def stage_quickstart(c: Check) -> dict:
    """Two CLI runs, the second resuming the first's checkpoint; the run folder lives in ``c.work``, the tail of
    each run's output goes to ``quickstart_run<i>.log`` next to the report."""
    import shutil

    c.need_shared_gpu("this stage runs the CLI in a subprocess")
    out = c.work / "quickstart"
    shutil.rmtree(out, ignore_errors=True)
    base = [sys.executable, *quickstart_args(c, out)]
    first, second = (1, 2) if c.cpu_smoke else (4, 8)
    env = clean_env()
    timings, logs, log_files = run_then_resume(c, "quickstart", lambda steps: base + [f"train.steps={steps}"], env,
                                               (first, second), timeout=150 if not c.cpu_smoke else 120)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [m for m in metrics if m.get("phase") == "rl" and "reward/mean" in m]
    steps_seen = sorted({m.get("step") for m in rl})
    require(steps_seen == list(range(second)), f"RL steps logged {steps_seen}, expected 0..{second - 1}")
    rewards = [m["reward/mean"] for m in rl]
    require(all(math.isfinite(r) for r in rewards), f"non-finite rewards {rewards}")
    return {"runs_s": timings, "rl_steps": len(steps_seen), "reward_mean_last": rewards[-1], "logs": log_files,
            "banner": next((line for line in logs[0].splitlines() if line.startswith("megatron-dppo:")), None)}


def quickstart_args(c: Check, out: Path) -> list[str]:
    """``-m megatron_dppo.cli train`` on the quickstart into ``out``, no evaluation: bf16 with a 20-step warm start
    on CUDA; tiny (1 warm-start step, 4 prompts x 2, 3 new tokens) with ``--cpu-smoke``."""
    args = ["-m", "megatron_dppo.cli", "train", "--config", str(REPO / "examples" / "quickstart.yaml"),
            f"train.output_dir={out}", "eval.every=0", "logging.progress_bar=false"]
    if c.cpu_smoke:
        return args + ["train.sft_steps=1", "train.prompts_per_step=4", "train.group_size=2",
                       "train.sft_batch_size=8", "data.arithmetic_train_size=16", "rollout.max_new_tokens=3"]
    return args + ["model.dtype=bfloat16", "train.sft_steps=20", "train.cpu_threads=4"]


def clean_env() -> dict:
    """This environment with the repository importable and no rank variables (a CLI run starts its own world)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_then_resume(c: Check, name: str, command, env: dict, steps: tuple[int, int], timeout: float):
    """``command(steps)`` for each of ``steps`` (the second run resumes the first's checkpoint); returns the wall
    seconds, the outputs and the log files (``<name>_run<i>.log`` next to the report) of the two runs."""
    timings, logs, log_files = [], [], []
    for run, n in enumerate(steps, 1):
        t0 = time.perf_counter()
        proc = subprocess.run(command(n), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        timings.append(round(time.perf_counter() - t0, 1))
        logs.append(proc.stdout + proc.stderr)
        log_files.append(c.write_log(f"{name}_run{run}", logs[-1]))
        require(proc.returncode == 0, f"{name} train.steps={n} exited {proc.returncode}:\n{logs[-1][-3000:]}")
    require("resuming" in logs[1], f"the second {name} run did not resume from the first run's checkpoint")
    return timings, logs, log_files
