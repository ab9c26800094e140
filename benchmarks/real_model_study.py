"""GRPO vs the DAPO filter vs DPPO on a real pretrained model, at the same CPU budget per run.

    python benchmarks/real_model_study.py --write-prereg   # once, then commit docs/benchmarks/real_model_prereg.json
    python benchmarks/real_model_study.py                  # the runs (resumable: run it again after any stop)
    python benchmarks/real_model_study.py --report         # the analysis and its figure, from the runs' metrics

Model and task: ``examples/smollm2_list_max_cpu.yaml`` (SmolLM2-135M-Instruct, "the largest of five numbers",
a procedurally generated task whose test lists are held out: none of them is a training list). Three arms, nothing
tuned per arm:

- ``grpo``: no pruning;
- ``filter``: GRPO + DAPO's filter (groups whose rewards are all equal are dropped before the update);
- ``dppo``: DPPO with its default keep rule (``algo.pruner=dppo`` and the defaults of every other algo option).

Every run trains from the pretrained model until its RL steps have used ``budget_s`` process CPU seconds
(``train.cpu_budget_s``: generation to weight push, evaluation excluded) and is evaluated before the first step,
every ``eval_every_cpu_s`` CPU seconds and at the budget, on fresh samples of the same held-out test prompts.
The protocol (arms, seeds, budget, endpoints, tests) is written to ``--prereg`` before any run and the runs refuse
to start if the script's protocol and the committed file differ; the report reads the protocol from the file.

Primary endpoint: held-out pass@1 at the budget. Comparisons, paired by seed (same seed = same data order and the
same first rollout): dppo - filter, dppo - grpo, filter - grpo; Student-t intervals over seeds, Holm over the three
two-sided tests. With 3 seeds the t quantile is 4.30, so the study can only detect large differences; the report
states the smallest difference each comparison could have detected (its half-width).

The runs go through ``study_runner.run_jobs``: each is a ``megatron-dppo train`` process with
``checkpoint.resume=auto``, so a stopped study continues from the runs' checkpoints.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/real_model_study.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _tta_stats as S
from benchmarks import study_runner as SR
from benchmarks.common import REPO, read_metrics

CONFIG = REPO / "examples" / "smollm2_list_max_cpu.yaml"
EVAL_KEY = "eval/list_max_test/pass@1"

PROTOCOL = {
    "config": "examples/smollm2_list_max_cpu.yaml",
    "arms": {
        "grpo": ["algo.pruner=none"],
        "filter": ["algo.pruner=none", "algo.drop_zero_variance_groups=true"],
        "dppo": ["algo.pruner=dppo"],
    },
    "seeds": [1, 2, 3],
    "budget_s": 600.0,
    "eval_every_cpu_s": 300.0,
    # every run: one torch thread, two runs side by side on the 2-core machine (the same for every arm)
    "common": ["train.cpu_threads=1", "train.steps=200", "eval.every=0", "eval.max_prompts=200", "eval.samples=2",
               "eval.pass_k=2", "checkpoint.every=4", "checkpoint.keep_last=1", "logging.plot=false",
               "logging.tensorboard=false", "logging.progress_bar=false"],
    "parallel": 2,
    "primary": "held-out pass@1 (200 test prompts x 2 fresh samples) after the RL step that crosses budget_s",
    "secondary": "held-out pass@1 at eval_every_cpu_s (half the budget); RL steps and steps' CPU s in the budget",
    "comparisons": [["dppo", "filter"], ["dppo", "grpo"], ["filter", "grpo"]],
    "test": "paired by seed, Student t (df = seeds - 1), two-sided, Holm over the comparisons, alpha 0.05",
    "alpha": 0.05,
}


def arm_overrides(arm: str, seed: int, protocol: dict = PROTOCOL) -> list[str]:
    p = protocol
    return p["arms"][arm] + p["common"] + [f"train.seed={seed}", f"train.cpu_budget_s={p['budget_s']}",
                                           f"eval.every_cpu_s={p['eval_every_cpu_s']}"]


def jobs(work: Path, protocol: dict, extra: list[str]) -> list[SR.Job]:
    """Seeds outermost, so two runs side by side are of different arms as often as not and every arm meets the
    same contention."""
    return [SR.Job(f"{arm}_s{seed}", REPO / protocol["config"], arm_overrides(arm, seed, protocol) + extra,
                   work / f"{arm}_s{seed}", done=SR.cpu_budget_reached(protocol["budget_s"]))
            for seed in protocol["seeds"] for arm in protocol["arms"]]


# ----------------------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------------------
def summarize_run(path: Path, protocol: dict) -> dict:
    records = read_metrics(path)
    cum = dict(SR.cumulative_cpu(records))
    evals = sorted((r for r in records if r.get("phase") == "eval"), key=lambda r: r["step"])
    points = [(0.0 if r["step"] < 0 else cum[r["step"]], r[EVAL_KEY], r["step"]) for r in evals if EVAL_KEY in r]
    budget, half = protocol["budget_s"], protocol["eval_every_cpu_s"]
    final = next((p for p in points if p[0] >= budget), None)
    mid = next((p for p in points if p[0] >= half), None)
    rl = [r for r in records if r.get("phase") == "rl"]
    n = protocol_eval_samples(protocol)
    return {"points": points, "base": points[0][1] if points and points[0][2] < 0 else math.nan,
            "final": final[1] if final else math.nan, "final_cpu_s": final[0] if final else math.nan,
            "final_wilson": S.wilson(final[1] * n, n) if final else (math.nan, math.nan),
            "mid": mid[1] if mid else math.nan, "steps": len(rl), "rl_cpu_s": sum(r["time/step_cpu"] for r in rl),
            "cpu_per_step": sum(r["time/step_cpu"] for r in rl) / max(1, len(rl)),
            "kept_fraction": S._mean([r.get("prune/total_kept_fraction", math.nan) for r in rl])}


def protocol_eval_samples(protocol: dict) -> int:
    opts = dict(o.split("=", 1) for o in protocol["common"])
    return int(opts["eval.max_prompts"]) * int(opts["eval.samples"])


def analyse(work: Path, protocol: dict) -> dict:
    runs = {arm: {s: summarize_run(work / f"{arm}_s{s}", protocol) for s in protocol["seeds"]}
            for arm in protocol["arms"]}
    arms = {arm: {"final": S.mean_ci([r["final"] for r in rs.values()]),
                  "mid": S.mean_ci([r["mid"] for r in rs.values()]),
                  "base": S.mean_ci([r["base"] for r in rs.values()]),
                  "steps": S.mean_ci([r["steps"] for r in rs.values()]),
                  "cpu_per_step": S.mean_ci([r["cpu_per_step"] for r in rs.values()]),
                  "kept_fraction": S._mean([r["kept_fraction"] for r in rs.values()])}
            for arm, rs in runs.items()}
    tests = {}
    for a, b in protocol["comparisons"]:
        for endpoint in ("final", "mid"):
            diffs = [runs[a][s][endpoint] - runs[b][s][endpoint] for s in protocol["seeds"]]
            tests[f"{a}-{b}:{endpoint}"] = S.paired_test(diffs)
    adj = S.holm({k: v["p"] for k, v in tests.items() if k.endswith(":final")})
    for k, p in adj.items():
        tests[k]["p_holm"] = p
    return {"protocol": protocol, "runs": {a: {str(s): r for s, r in rs.items()} for a, rs in runs.items()},
            "arms": arms, "tests": tests}


def markdown(rep: dict) -> str:
    p = rep["protocol"]
    f = lambda d, signed=False: (f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" if signed  # noqa: E731
                                 else f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]")
    lines = [f"Budget {p['budget_s']:.0f} RL CPU s per run, seeds {p['seeds']}; 95% t intervals over seeds.", "",
             "| arm | held-out pass@1 at the budget | at half | RL steps in the budget | CPU s per step | kept |",
             "|---|---|---|---|---|---|"]
    for arm, a in rep["arms"].items():
        lines.append(f"| {arm} | {f(a['final'])} | {f(a['mid'])} | {a['steps']['mean']:.1f} | "
                     f"{a['cpu_per_step']['mean']:.1f} | {a['kept_fraction']:.2f} |")
    lines += ["", "| comparison (paired by seed) | at the budget | p | Holm p | at half |", "|---|---|---|---|---|"]
    for a, b in p["comparisons"]:
        t, m = rep["tests"][f"{a}-{b}:final"], rep["tests"][f"{a}-{b}:mid"]
        lines.append(f"| {a} - {b} | {f(t, True)} | {t['p']:.3f} | {t['p_holm']:.3f} | {f(m, True)} |")
    lines += ["", "Per run (pass@1 at the budget, 95% Wilson interval of its 400 samples; steps):"]
    for arm, rs in rep["runs"].items():
        lines.append(f"- {arm}: " + "; ".join(f"s{s} {r['final']:.3f} [{r['final_wilson'][0]:.3f}, "
                                               f"{r['final_wilson'][1]:.3f}] in {r['steps']} steps"
                                               for s, r in rs.items()))
    return "\n".join(lines)


def plot(rep: dict, path: Path, title: str = "SmolLM2-135M-Instruct on list_max, equal CPU budget per run") -> Path:
    """Held-out pass@1 against RL CPU seconds: every run's evaluations (thin) and each arm's mean over seeds at the
    protocol's points (0, the half budget, the budget; thick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (arm, rs) in enumerate(rep["runs"].items()):
        color = f"C{i}"
        for r in rs.values():
            ax.plot([p[0] for p in r["points"]], [p[1] for p in r["points"]], color=color, alpha=0.3, lw=0.8)
        a, budget = rep["arms"][arm], rep["protocol"]["budget_s"]
        ax.plot([0, rep["protocol"]["eval_every_cpu_s"], budget], [a["base"]["mean"], a["mid"]["mean"],
                a["final"]["mean"]], color=color, lw=2.2, marker="o", label=f"{arm} (mean of {len(rs)} seeds)")
    ax.set_xlabel("RL CPU seconds (process CPU of the steps, evaluation excluded)")
    ax.set_ylabel("held-out pass@1")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = SR.study_arguments(__doc__, REPO / "runs" / "real_model_study",
                              REPO / "docs" / "benchmarks" / "real_model_prereg.json").parse_args(argv)

    def report(protocol: dict, out: Path) -> None:
        rep = analyse(args.work, protocol)
        out.write_text(json.dumps(rep, indent=1))
        print(markdown(rep))
        print(f"figure: {plot(rep, args.work / 'real_model_study.png')}")

    return SR.run_study(args, PROTOCOL, jobs, report)


if __name__ == "__main__":
    sys.exit(main())
