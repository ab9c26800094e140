"""Asynchronous RL on the CPU quickstart: 1 trainer + 1 rollout worker (``rollout.placement=separate``) at
``train.max_staleness`` 1 (and 0) against the synchronous colocated run, side by side (docs/benchmarks.md,
section 10; docs/async.md).

Each arm runs the quickstart config (``examples/quickstart.yaml``) through the CLI from the same warm start length,
with evaluation and checkpoints off, and reads ``metrics.jsonl`` (and the worker's ``rollout_worker.json``) over
the RL steps after the first (which carries start-up costs). Reported per arm:

* step time: the trainer's wall clock per RL step (colocated: generation + training + weight push; separate:
  waiting for the batch + training + weight send), median and total;
* idle seconds: the trainer waiting for a batch (``time/wait_rollout``), the worker waiting for weights
  (``async/rollout_idle_s``); colocated has no idle side but is serial: generation and training never overlap;
* CPU seconds per step: the trainer's (``time/step_cpu``) plus the worker's (``async/rollout_cpu_s``).

The arms run one after the other (``--arms`` order), never concurrently. On a shared machine the wall clock moves
with the other users' load: read the CPU seconds too, and run it more than once.

Run: ``.venv/bin/python benchmarks/async_overlap.py [--steps 30] [--sft-steps 20] [--arms sync,k0,k1]
[--repeats 2] [--out results.json]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if not __package__:  # `python benchmarks/async_overlap.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, cli, read_metrics, run

ARMS = {
    "sync": ("colocated, synchronous (1 process)", 1, []),
    "k0": ("separate, max_staleness 0 (1 + 1)", 2, ["rollout.placement=separate", "train.max_staleness=0"]),
    "k1": ("separate, max_staleness 1 (1 + 1)", 2, ["rollout.placement=separate", "train.max_staleness=1"]),
    "k2": ("separate, max_staleness 2 (1 + 1)", 2, ["rollout.placement=separate", "train.max_staleness=2"]),
}


def run_arm(name: str, steps: int, sft_steps: int, root: Path, extra: list[str], rep: int = 0) -> dict:
    label, nproc, overrides = ARMS[name]
    out = root / f"{name}-{rep}"
    common = [f"train.steps={steps}", f"train.sft_steps={sft_steps}", "eval.every=0", "checkpoint.every=0",
              "logging.plot=false", "logging.tensorboard=false", f"train.output_dir={out}", *overrides, *extra]
    cmd = cli("train", "--config", str(REPO / "examples" / "quickstart.yaml"), *common, nproc=nproc)
    wall = run(cmd, root / f"{name}-{rep}.log", env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    wall = wall["wall_s"]
    rl = read_metrics(out, "rl")[1:]  # the first RL step carries start-up costs
    step = [r["time/step"] for r in rl]
    total = lambda key: sum(r.get(key, 0.0) for r in rl)  # noqa: E731
    result = {
        "arm": name, "label": label, "steps_measured": len(rl), "process_wall_s": wall,
        "step_s_median": statistics.median(step), "step_s_total": sum(step),
        "trainer_idle_s": total("time/wait_rollout"), "worker_idle_s": total("async/rollout_idle_s"),
        "worker_busy_s": total("async/rollout_busy_s"),
        "cpu_s_per_step": (total("time/step_cpu") + total("async/rollout_cpu_s")) / len(rl),
        "staleness_mean": total("async/staleness") / len(rl),
        "reward_mean_last10": statistics.mean(r["reward/mean"] for r in rl[-10:]),
    }
    if nproc == 1:  # serial: the phases a separate worker would run in parallel with training
        result["generate_s_total"] = total("time/generate") + total("time/reward") + total("time/prune")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sft-steps", type=int, default=20)
    p.add_argument("--arms", default="sync,k0,k1")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every arm")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="async_overlap_") as tmp:
        for rep in range(args.repeats):  # the arms interleaved within each repetition
            for name in args.arms.split(","):
                results.append(run_arm(name, args.steps, args.sft_steps, Path(tmp), args.overrides, rep))
                r = results[-1]
                print(f"{r['label']:40s} step {r['step_s_median']:.3f} s (median; total {r['step_s_total']:.1f} s "
                      f"over {r['steps_measured']}) | idle: trainer {r['trainer_idle_s']:.1f} s, worker "
                      f"{r['worker_idle_s']:.1f} s | CPU {r['cpu_s_per_step']:.3f} s/step | staleness "
                      f"{r['staleness_mean']:.2f} | reward {r['reward_mean_last10']:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
