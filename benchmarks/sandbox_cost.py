"""What the python tool's sandbox costs (docs/benchmarks.md section 18; docs/environments.md, "The python tool's
sandbox").

1. Per call: start-up of one call that runs ``48*97`` (``print_last``), wall milliseconds and CPU milliseconds (the
   caller's reaped children plus, under bwrap, the call's control group: bwrap's init and the interpreter), median
   and 90th percentile over ``--calls`` calls, for ``isolation=none`` (the old subprocess), ``bwrap`` (namespaces +
   a control group per call) and ``bwrap`` without the installed packages mounted (``site_packages=false``). Calls
   run one at a time.
2. In training: the calculator example (examples/calculator_multiplication.yaml) from ONE shared warm start, then
   ``--steps`` RL steps in three arms that differ only in the tool behind ``<calc>...</calc>``: the built-in
   calculator (in-process, no sandbox), the python tool under bwrap, the python tool with isolation=none (both with
   ``print_last``, so a correct call is answered exactly as the calculator answers it). Per arm: held-out pass@1
   after RL (the test split), RL wall and CPU seconds (process + children, from wait4: the sandboxes' CPU
   included, except under bwrap: see ``rl_step_cpu_s``), the RL steps' CPU seconds with every sandboxed call
   (``time/step_cpu``), the generation phase's share of the step, tool calls and errors per episode.

    .venv/bin/python benchmarks/sandbox_cost.py --calls 50 --steps 20 --out runs/sandbox_cost/results.json
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/sandbox_cost.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import QUIET, REPO, machine, read_metrics, train, write_json

CONFIG = REPO / "examples" / "calculator_multiplication.yaml"
COMMON = [*QUIET, "checkpoint.every=0", "logging.print_every=5"]
PYTHON_TOOL = "env.name=python"
ARMS = {
    "calculator": [],
    "python-bwrap": [PYTHON_TOOL, "env.kwargs={tag: calc, max_calls: 1, print_last: true, isolation: bwrap}"],
    "python-none": [PYTHON_TOOL, "env.kwargs={tag: calc, max_calls: 1, print_last: true, isolation: none}"],
}
MODES = {"none": {"isolation": "none"}, "bwrap": {"isolation": "bwrap"},
         "bwrap-stdlib": {"isolation": "bwrap", "site_packages": False}}


def per_call(calls: int) -> dict:
    from megatron_dppo.env.sandbox import run_python

    out = {}
    for name, kwargs in MODES.items():
        run_python("pass", timeout_s=30, **kwargs)  # the start-up check (once per process) is not a call's cost
        walls, cpus = [], []
        for _ in range(calls):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            result = run_python("48*97", timeout_s=30, print_last=True, **kwargs)
            walls.append(1000 * (time.perf_counter() - t0))
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            inside = result.cpu_s if kwargs["isolation"] != "none" else 0.0  # reaped in bwrap's pid namespace
            cpus.append(1000 * (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime + inside))
            assert result.stdout.strip() == "4656", result
        out[name] = {"wall_ms_p50": statistics.median(walls), "wall_ms_p90": _p90(walls),
                     "cpu_ms_p50": statistics.median(cpus), "cpu_ms_p90": _p90(cpus), "calls": calls,
                     "limits": result.limits}
        print(f"{name:>13}: wall {out[name]['wall_ms_p50']:.0f} ms (p90 {out[name]['wall_ms_p90']:.0f}), "
              f"CPU {out[name]['cpu_ms_p50']:.0f} ms (p90 {out[name]['cpu_ms_p90']:.0f}), limits {result.limits}",
              flush=True)
    return out


def _p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def training(args, work: Path) -> dict:
    common = COMMON + [f"train.seed={args.seed}", f"train.sft_steps={args.sft_steps}",
                      f"eval.max_prompts={args.eval_prompts}", "eval.samples=2", "eval.pass_k=2"]
    warm = work / "warm"
    if not (warm / "checkpoints" / "latest").exists():
        shutil.rmtree(warm, ignore_errors=True)
        print(f"[{time.strftime('%H:%M:%S')}] warm start", flush=True)
        train(CONFIG, common + ["train.steps=0", "eval.every=0", f"train.output_dir={warm}"], work / "warm.log",
            args.timeout)
    out = {}
    for arm, extra in ARMS.items():
        run = work / arm
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(warm, run)
        print(f"[{time.strftime('%H:%M:%S')}] {arm}", flush=True)
        usage = train(CONFIG, common + extra + [f"train.steps={args.steps}", f"eval.every={args.steps}",
                                             "checkpoint.resume=must", f"train.output_dir={run}"],
                    work / f"{arm}.log", args.timeout)
        rs = read_metrics(run)
        rl = [r for r in rs if r.get("phase") == "rl"]
        evals = [r for r in rs if r.get("phase") == "eval"]
        key = next(k for k in evals[-1] if k.endswith("/pass@1"))
        step_s = sum(r["time/step"] for r in rl)
        gen_s = sum(r.get("time/generate", 0.0) for r in rl)
        out[arm] = {"pass@1_before": evals[0][key], "pass@1_after": evals[-1][key], "metric": key,
                    "process_wall_s": usage["wall_s"], "process_cpu_s": usage["cpu_s"], "steps": len(rl),
                    # the steps' CPU with every child and sandboxed call (time/step_cpu; wait4 cannot see the calls
                    # reaped inside bubblewrap's pid namespace, so process_cpu_s undercounts the bwrap arm)
                    "rl_step_cpu_s": sum(r["time/step_cpu"] for r in rl),
                    "step_s_mean": step_s / len(rl), "generate_share": gen_s / step_s if step_s else 0.0,
                    "tool_calls_per_episode": statistics.fmean(r.get("env/tool_calls_mean", 0.0) for r in rl),
                    "tool_errors_per_step": statistics.fmean(r.get("env/tool_errors", 0.0) for r in rl),
                    "reward_mean": statistics.fmean(r["reward/mean"] for r in rl)}
        print(f"   {arm}: pass@1 {out[arm]['pass@1_before']:.3f} -> {out[arm]['pass@1_after']:.3f}, step "
              f"{out[arm]['step_s_mean']:.2f} s (generation {100 * out[arm]['generate_share']:.0f}%), RL steps' CPU "
              f"{out[arm]['rl_step_cpu_s']:.0f} s, process CPU "
              f"{usage['cpu_s']:.0f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3 * 3600)
    ap.add_argument("--skip-training", action="store_true")
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "sandbox_cost")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    res = {"per_call": per_call(args.calls), "machine": machine(), "euid": os.geteuid()}
    if not args.skip_training:
        res["training"] = training(args, args.work)
    write_json(args.out or args.work / "results.json", res)


if __name__ == "__main__":
    main()
