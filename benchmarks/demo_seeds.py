"""What the demo (`make demo`, examples/quickstart.yaml) shows over several seeds: the table of README.md "What the
demo shows" and docs/benchmarks.md section 17.

The demo is deterministic on one machine (two runs log equal metrics) but not across machines: CPU kernels differ
in their rounding and RL amplifies it, so another machine follows another trajectory, as another seed does. The
spread over seeds is therefore what a newcomer should expect. ``train.seed`` sets the model's initialization, the
tokenizer's training data order, the warm start's batches, the prompt order and every sampling and pruning draw.

For each seed the CLI runs the demo unchanged except ``train.seed=N``, ``train.output_dir=RUNS/seed_N`` and
``checkpoint.every=0`` (no intermediate checkpoints: they do not change any metric), one run after the other, and
this script reads its ``metrics.jsonl``:

    warm start   NLL per token of the first and the last warm-start step (``sft/nll``)
    HT reward    the mean of ``reward/mean`` (the unbiased Horvitz-Thompson training reward over every drawn prompt)
                 over the first 10 and the last 10 RL steps
    eval pass@1  ``eval/*/pass@1`` before the first RL step and after the last (fresh samples of the facts)
    RL CPU s     the sum of ``time/step_cpu`` (the trainer's CPU seconds of the RL steps; the wall clock of a
                 shared machine says little)

then prints one row per seed and the mean, standard deviation, minimum and maximum of every column (the rises
included), and writes them as JSON with ``--out``.

    .venv/bin/python benchmarks/demo_seeds.py [--seeds 1234,1,2,3,4,5,6] [--runs runs/demo_seeds] [--reuse]
                                              [--out results.json] [key=value ...]   # overrides for every run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/demo_seeds.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import read_metrics, train

COLUMNS = ("sft_nll_first", "sft_nll_last", "ht_first10", "ht_last10", "ht_rise", "eval_first", "eval_last",
           "eval_rise", "rl_cpu_s")


def summarize(records: list[dict]) -> dict:
    """One run's row (the module docstring's columns) from its metrics records."""
    rl = sorted((r for r in records if r.get("phase") == "rl"), key=lambda r: r["step"])
    sft = sorted((r for r in records if r.get("phase") == "sft"), key=lambda r: r["step"])
    evals = sorted((r for r in records if r.get("phase") == "eval"), key=lambda r: r["step"])
    if len(rl) < 20 or len(evals) < 2:
        raise ValueError(f"a demo run has >= 20 RL steps and >= 2 evaluations; this one {len(rl)} and {len(evals)}")
    key = next(k for k in evals[0] if k.startswith("eval/") and k.endswith("/pass@1"))
    row = {"ht_first10": statistics.fmean(r["reward/mean"] for r in rl[:10]),
           "ht_last10": statistics.fmean(r["reward/mean"] for r in rl[-10:]),
           "eval_first": evals[0][key], "eval_last": evals[-1][key],
           "rl_cpu_s": sum(r.get("time/step_cpu", 0.0) for r in rl),
           "sft_nll_first": sft[0]["sft/nll"] if sft else float("nan"),
           "sft_nll_last": sft[-1]["sft/nll"] if sft else float("nan")}
    row["ht_rise"] = row["ht_last10"] - row["ht_first10"]
    row["eval_rise"] = row["eval_last"] - row["eval_first"]
    return row


def spread(rows: list[dict]) -> dict:
    """Mean, standard deviation, minimum and maximum of each column over the seeds."""
    out = {}
    for c in COLUMNS:
        xs = [r[c] for r in rows]
        out[c] = {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                  "min": min(xs), "max": max(xs)}
    return out


def run_seed(config: str, seed: int, out: Path, overrides: list[str]) -> float:
    """The demo at ``train.seed=seed`` into ``out`` (started over, its output in ``<out>.log``); returns its
    wall-clock seconds."""
    shutil.rmtree(out, ignore_errors=True)
    return train(config, [f"train.seed={seed}", f"train.output_dir={out}", "checkpoint.every=0",
                          "logging.progress_bar=false", *overrides], out.with_suffix(".log"))["wall_s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/quickstart.yaml")
    parser.add_argument("--seeds", default="1234,1,2,3,4,5,6", help="comma-separated train.seed values")
    parser.add_argument("--runs", default="runs/demo_seeds", help="the runs' folders: RUNS/seed_N")
    parser.add_argument("--reuse", action="store_true", help="read a seed's finished run instead of running it")
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more overrides for every run")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    rows = []
    for seed in seeds:
        out = Path(args.runs) / f"seed_{seed}"
        wall = None
        if not (args.reuse and any(r.get("phase") == "rl" for r in read_metrics(out))):
            wall = run_seed(args.config, seed, out, args.overrides)
        rows.append({"seed": seed, **summarize(read_metrics(out)), "wall_s": wall})
    print(f"{'seed':>6} {'warm-start NLL':>15} {'HT reward (10 steps)':>22} {'eval pass@1':>15} {'RL CPU s':>9}")
    for r in rows:
        print(f"{r['seed']:>6} {r['sft_nll_first']:>6.2f} -> {r['sft_nll_last']:<5.2f} "
              f"{r['ht_first10']:>8.3f} -> {r['ht_last10']:.3f} ({r['ht_rise']:+.3f}) "
              f"{r['eval_first']:>5.3f} -> {r['eval_last']:.3f} ({r['eval_rise']:+.3f}) {r['rl_cpu_s']:>7.0f}")
    stats = spread(rows)
    for c in COLUMNS:
        s = stats[c]
        print(f"  {c:14s} mean {s['mean']:.3f}  sd {s['sd']:.3f}  min {s['min']:.3f}  max {s['max']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "overrides": args.overrides, "rows": rows,
                                              "spread": stats, "machine": platform.platform(),
                                              "cpu_count": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
