"""Time to accuracy on the CPU quickstart task (in-distribution pass@1 from fresh samples of the training facts):
GRPO vs CPPO vs DPPO from the same warm-started policy (one seed; the multi-seed study is
benchmarks/time_to_accuracy.py).

1. One supervised warm start (``train.sft_steps`` of ``--config``, default examples/quickstart.yaml) through the
   CLI with ``train.steps=0``: it saves a checkpoint (policy, optimizer, RNG, data cursor) and the tokenizer.
2. For each pruner (``algo.pruner=none|cppo|dppo``, plus any ``--extra`` overrides) that directory is copied and
   the CLI resumes from it (``checkpoint.resume=must``), so every run starts from the same weights, optimizer
   state, tokenizer and data order; the RL steps, their seeds and evaluation prompts are identical.
3. From each run's ``metrics.jsonl``: the evaluation pass@1 at every evaluation (``eval/*/pass@1``, every
   ``eval.every`` steps), cumulative wall-clock of the RL steps (``time/step``: generate + reward + prune + pack +
   logprob + train + weight sync; evaluation and start-up excluded), steps and seconds until the evaluation pass@1
   first reaches ``--eval-target``, and the whole process wall-clock. A PNG shows evaluation pass@1 against steps
   and against seconds.

Methods are compared on evaluation accuracy only (the quickstart evaluates fresh samples of its training
facts, ``data.arithmetic_eval_split=train``: in-distribution, not held-out). The training reward (``reward/mean``,
the Horvitz-Thompson estimate over all drawn prompts for a pruned run) is printed as a diagnostic, never as the
comparison: it is measured on different prompts for each method and, for DPPO, is an estimate from the
generated prompts. One seed per method: for a comparison with confidence intervals use
``benchmarks/time_to_accuracy.py``.

Run (one run after the other; each run is the CLI in its own process):
    .venv/bin/python benchmarks/time_to_reward.py [--quick] [--out results.json] [--png curves.png]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/time_to_reward.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import QUIET, REPO, read_metrics, train, write_json

PRUNERS = {"grpo": ["algo.pruner=none"], "cppo": ["algo.pruner=cppo"], "dppo": ["algo.pruner=dppo"]}


def summarize(name: str, records: list[dict], process_s: float, eval_target: float) -> dict:
    rl = [r for r in records if r.get("phase") == "rl" and "reward/mean" in r]
    ev = [r for r in records if r.get("phase") == "eval"]
    seconds, total = [], 0.0
    for r in rl:
        total += r.get("time/step", 0.0)
        seconds.append(total)
    # an evaluation logged at step s follows RL step s (step -1: before the first RL step)
    evals = [(r["step"] + 1, seconds[r["step"]] if 0 <= r["step"] < len(seconds) else 0.0,
              next((v for k, v in r.items() if k.endswith("pass@1")), float("nan"))) for r in ev]
    hit = next(((step, sec) for step, sec, acc in evals if acc >= eval_target), None)
    kept = [r.get("prune/total_kept_fraction", 1.0) for r in rl]
    tail = [r["reward/mean"] for r in rl[-5:]]
    return {"name": name, "steps": len(rl), "eval_steps_to_target": None if hit is None else hit[0],
            "eval_seconds_to_target": None if hit is None else hit[1], "rl_seconds": total,
            "process_seconds": process_s, "evals": evals,
            "final_eval_pass@1": evals[-1][2] if evals else float("nan"),
            "train_reward_last5": sum(tail) / max(1, len(tail)), "mean_kept_fraction": sum(kept) / max(1, len(kept)),
            "tokens_trained": sum(r.get("tokens/trained_sequences", 0.0) for r in rl), "seconds": seconds,
            "train_s": sum(r.get("time/train", 0.0) for r in rl),
            "logprob_s": sum(r.get("time/logprob", 0.0) for r in rl),
            "generate_s": sum(r.get("time/generate", 0.0) for r in rl)}


def plot(results: list[dict], eval_target: float, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        axes[0].plot([e[0] for e in r["evals"]], [e[2] for e in r["evals"]], marker="o", label=r["name"])
        axes[1].plot([e[1] for e in r["evals"]], [e[2] for e in r["evals"]], marker="o", label=r["name"])
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("RL wall-clock (s, excl. eval)")
    for ax in axes:
        ax.axhline(eval_target, color="gray", linestyle="--", linewidth=0.8)
        ax.set_ylabel("in-distribution pass@1 (fresh samples)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("CPU quickstart, one seed: in-distribution accuracy of GRPO vs CPPO vs DPPO from the same warm start")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def markdown(rep: dict) -> str:
    c = rep["config"]
    lines = [f"config {c['config']} + {' '.join(rep['common'])}; target pass@1 (in-distribution, fresh samples) >= "
             f"{c['eval_target']} at an evaluation (every eval.every steps). Seconds = sum of RL step times (eval / "
             "start-up excluded). The "
             "training reward is a diagnostic (1/pi estimate over all drawn prompts), not the comparison.",
             "", "| run | steps | eval: steps to target | eval: s to target | RL s | train+logprob s | "
             "generate s | kept frac | tokens trained | final eval pass@1 | train reward, last 5 steps | "
             "process s |", "|---" * 12 + "|"]
    for r in rep["results"]:
        est = "not reached" if r.get("eval_steps_to_target") is None else str(r["eval_steps_to_target"])
        ess = "-" if r.get("eval_seconds_to_target") is None else f"{r['eval_seconds_to_target']:.1f}"
        lines.append(f"| {r['name']} | {r['steps']} | {est} | {ess} | {r['rl_seconds']:.1f} | "
                     f"{r['train_s'] + r['logprob_s']:.1f} | {r['generate_s']:.1f} | {r['mean_kept_fraction']:.2f} | "
                     f"{r['tokens_trained']:.0f} | {r['final_eval_pass@1']:.3f} | {r['train_reward_last5']:.3f} | "
                     f"{r['process_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "quickstart.yaml")
    ap.add_argument("--quick", action="store_true", help="shorter runs for a shared 2-core CPU")
    ap.add_argument("--runs", nargs="+", default=list(PRUNERS), choices=list(PRUNERS))
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    ap.add_argument("--eval-target", type=float, default=None,
                    help="evaluation pass@1 target (default 0.3; 0.15 with --quick)")
    ap.add_argument("--work-dir", type=Path, default=REPO / "runs" / "time_to_reward")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every run, e.g. algo.r_q=0.5")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--reuse", action="store_true",
                    help="do not train: re-read the runs already in --work-dir (e.g. with another --eval-target)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None, help="default: <work-dir>/time_to_reward.png")
    args = ap.parse_args(argv)
    common = [*QUIET, "checkpoint.every=0", "logging.print_every=10"]
    if args.eval_target is None:
        args.eval_target = 0.15 if args.quick else 0.3
    if args.quick:
        common += ["train.sft_steps=60", "eval.max_prompts=50", "eval.every=10", "train.prompts_per_step=32"]
        args.steps = args.steps or 30
    if args.steps:
        common.append(f"train.steps={args.steps}")
    common += args.extra
    work = args.work_dir
    warm_s, results = None, []
    if args.reuse:
        old = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}
        process_s = {r["name"]: r["process_seconds"] for r in old.get("results", [])}
        warm_s = old.get("warm_start_seconds")
        for name in args.runs:
            results.append(summarize(name, read_metrics(work / name),
                                     process_s.get(name, float("nan")), args.eval_target))
    else:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        warm = work / "warm"
        print(f"warm start -> {warm}", flush=True)
        warm_s = train(args.config, common + ["train.steps=0", "eval.every=0", f"train.output_dir={warm}"],
                       work / "warm.log", args.timeout)["wall_s"]
        for name in args.runs:
            out = work / name
            shutil.copytree(warm, out)
            print(f"{name}: {' '.join(PRUNERS[name])} -> {out}", flush=True)
            s = train(args.config, common + PRUNERS[name] + ["checkpoint.resume=must", f"train.output_dir={out}"],
                      work / f"{name}.log", args.timeout)["wall_s"]
            results.append(summarize(name, read_metrics(out), s, args.eval_target))
            print(f"  {name}: {results[-1]['steps']} steps, {results[-1]['rl_seconds']:.1f} s RL, final eval "
                  f"pass@1 {results[-1]['final_eval_pass@1']:.3f}", flush=True)
    png = args.png or work / "time_to_reward.png"
    plot(results, args.eval_target, png)
    rep = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "common": common,
           "warm_start_seconds": warm_s, "png": str(png), "results": results}
    print(markdown(rep))
    print(f"\nplot: {png}")
    write_json(args.out, rep)


if __name__ == "__main__":
    main()
