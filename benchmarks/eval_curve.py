"""Held-out accuracy of one run against its RL steps and its CPU seconds, from the run's metrics.jsonl.

    .venv/bin/python benchmarks/eval_curve.py runs/smollm2_list_max --out docs/benchmarks/smollm2_list_max_grpo

Reads every evaluation record (``phase == "eval"``; the one before RL has step -1) and the RL steps' process CPU
seconds (``time/step_cpu``, summed over ranks; evaluation and start-up excluded). Writes ``OUT.json`` (each
evaluation: the RL steps done, the cumulative RL CPU seconds, every ``eval/*`` metric; with the 95% Wilson interval
of pass@1 from the evaluation's number of samples) and ``OUT.png`` (pass@1 vs steps and vs CPU seconds), and
prints the table. One run is one seed: a curve, not a comparison.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/eval_curve.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._tta_stats import wilson
from benchmarks.common import read_metrics
from benchmarks.study_runner import cumulative_cpu


def curve(run: Path, samples: int) -> list[dict]:
    records = read_metrics(run)
    cpu, out = dict(cumulative_cpu(records)), []
    for r in records:
        if r.get("phase") != "eval":
            continue
        point = {"rl_steps": r["step"] + 1, "rl_cpu_s": cpu.get(r["step"], 0.0)}
        point.update({k: v for k, v in r.items() if k.startswith("eval/")})
        key = next(k for k in r if k.startswith("eval/") and k.endswith("/pass@1"))
        point["pass@1"], point["pass@1_ci95"] = r[key], wilson(r[key] * samples, samples)
        out.append(point)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the run's output folder (train.output_dir)")
    ap.add_argument("--out", type=Path, required=True, help="prefix of OUT.json and OUT.png")
    ap.add_argument("--samples", type=int, default=None, help="samples per evaluation (default: the run's config, "
                                                                "eval.max_prompts x eval.samples)")
    args = ap.parse_args()
    if args.samples is None:
        import yaml

        ev = yaml.safe_load((args.run / "config.yaml").read_text())["eval"]
        args.samples = ev["max_prompts"] * ev["samples"]
    points = curve(args.run, args.samples)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"run": str(args.run), "samples": args.samples,
                                                         "evaluations": points}, indent=1))
    print("| RL steps | RL CPU s | pass@1 | 95% interval |\n|---:|---:|---:|---|")
    for p in points:
        lo, hi = p["pass@1_ci95"]
        print(f"| {p['rl_steps']} | {p['rl_cpu_s']:.0f} | {p['pass@1']:.3f} | [{lo:.3f}, {hi:.3f}] |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, key, label in ((axes[0], "rl_steps", "RL steps"), (axes[1], "rl_cpu_s", "RL CPU seconds")):
        x = [p[key] for p in points]
        ax.plot(x, [p["pass@1"] for p in points], marker="o")
        ax.fill_between(x, [p["pass@1_ci95"][0] for p in points], [p["pass@1_ci95"][1] for p in points], alpha=0.2)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out pass@1")
    fig.suptitle(f"{args.run.name}: held-out pass@1 ({args.samples} samples per evaluation, 95% Wilson)")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
