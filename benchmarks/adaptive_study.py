"""Adaptive group sizes against the DAPO filter on a real pretrained model, at the same CPU budget per run: the
preregistered study of issue 45 (docs/benchmarks.md, "Adaptive group sizes").

    python benchmarks/adaptive_study.py --write-prereg   # once, then commit docs/benchmarks/adaptive_prereg.json
    python benchmarks/adaptive_study.py --extra model.gguf_cache=<folder>   # the runs (resumable)
    python benchmarks/adaptive_study.py --report --out docs/benchmarks/adaptive_study.json

The study takes longer than one sitting of the machine it was run on, whose disk did not outlast a sitting: its
finished runs are kept in ``docs/benchmarks/adaptive_study_runs/`` (each run's metrics, gzipped; committed) and
restored from there by the next start and by ``--report`` (``study_runner.archive_finished``); a run stopped
before its budget starts again from step 0 in the next sitting (same seed, same protocol).

Model and task as section 14 (``examples/smollm2_list_max_cpu.yaml``: SmolLM2-135M-Instruct, list_max with a
held-out test split), in the dtype the protocol's ``model_dtype`` names. Arms, nothing tuned per arm after the
preregistration (the allocation's options were fixed from the offline measurement, ``adaptive_fidelity.py``):

- ``grpo``: no pruning;
- ``filter``: GRPO + DAPO's filter (groups with one reward for all dropped);
- ``completion_dppo_filter``: DPPO's completion level only (optimal keep, r_o 0.7, floor 0.3) + the filter, the
  arm section 12 recommends where generation is a small share of the step;
- ``allocation_filter``: adaptive group sizes (``algo.pruner=adaptive``, rloo) + the filter;
- ``filter_rloo`` (secondary): the filter with the rloo estimator, which the allocation needs: how much of
  allocation - filter is the estimator's.

Every run trains until its RL steps have used ``budget_s`` process-CPU seconds (``train.cpu_budget_s``) and is
evaluated before RL and every ``eval_every_cpu_s`` CPU seconds on fresh samples of the same 200 held-out lists.
Primary endpoint: held-out pass@1 at the budget, arm - filter, paired by seed, two-sided Student t, Holm over the
``primary_family``. Secondary, unadjusted: time to the fixed ``level`` (the first crossing of the piecewise-linear
curve through the evaluations, censored at the budget) as a ratio to the filter's; RL steps; generated and trained
tokens per step (what ``gpu_projection.py`` reads). The protocol is written to ``--prereg`` before any run, the
runs refuse to start if it differs from this script's, and the report reads it from the file.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _tta_stats as S
from benchmarks import study_runner as SR
from benchmarks.common import REPO, read_metrics, write_json

EVAL_KEY = "eval/list_max_test/pass@1"
# The precision of every run, fixed before the runs. float32: the bf16 engine has landed, but on this model, task
# and learning rate bf16 learned less per step and less at an equal CPU budget (docs/benchmarks.md section 19, bf16
# learning: 2 seeds, pass@1 at 600 CPU s 0.15 against 0.30-0.34), so a bf16 study would compare arms in a regime
# where the updates barely reach the 16-bit weights. "bfloat16" passes model.dtype=bfloat16 to every run.
MODEL_DTYPE = "float32"

PROTOCOL = {
    "study": "adaptive group sizes vs the DAPO filter, SmolLM2-135M-Instruct, equal CPU budget (issue 45)",
    "config": "examples/smollm2_list_max_cpu.yaml",
    "model_dtype": MODEL_DTYPE,
    "arms": {
        "grpo": ["algo.pruner=none"],
        "filter": ["algo.pruner=none", "algo.drop_zero_variance_groups=true"],
        "completion_dppo_filter": ["algo.pruner=dppo", "algo.dppo_keep=optimal", "algo.r_q=0", "algo.r_o=0.7",
                                   "algo.keep_floor=0.3", "algo.keep_length_exponent=0.0",
                                   "algo.drop_zero_variance_groups=true"],
        "allocation_filter": ["algo.pruner=adaptive", "loss.advantage_estimator=rloo", "algo.adaptive_budget=0.5",
                              "algo.adaptive_generation_share=0.22", "algo.adaptive_signal=0.3",
                              "algo.posterior_max_weight=20", "algo.drop_zero_variance_groups=true"],
        "filter_rloo": ["algo.pruner=none", "loss.advantage_estimator=rloo", "algo.drop_zero_variance_groups=true"],
    },
    "seeds": [1, 2, 3, 4, 5],
    "budget_s": 600.0,
    "eval_every_cpu_s": 200.0,
    "level": 0.35,
    "common": ["train.cpu_threads=1", "train.steps=400", "eval.every=0", "eval.max_prompts=200", "eval.samples=2",
               "eval.pass_k=2", "checkpoint.every=4", "checkpoint.keep_last=1", "logging.plot=false",
               "logging.tensorboard=false", "logging.progress_bar=false"],
    "parallel": 2,
    "primary": "held-out pass@1 (200 test lists x 2 fresh samples) after the RL step that crosses budget_s",
    "primary_family": [["allocation_filter", "filter"], ["completion_dppo_filter", "filter"], ["grpo", "filter"]],
    "secondary": ["allocation_filter - filter_rloo and filter_rloo - filter at the budget (unadjusted)",
                  "time to level (first crossing, censored at the budget) / the filter's, paired geometric mean",
                  "RL steps, generated and trained tokens per step"],
    "test": "paired by seed, Student t (df = seeds - 1), two-sided, Holm over primary_family, alpha 0.05",
    "alpha": 0.05,
    "wins": "an arm wins iff its Holm p < alpha and arm - filter > 0 (loses: p < alpha and < 0)",
    "cpu": "2-core box, one torch thread per run, two runs side by side (seeds outermost, arms rotated by seed)",
    "estimated_wall_h": 4.5,
    "estimate": "25 runs x (600 RL CPU s + 4 evaluations of 400 samples, about 120 CPU s each, section 14) = "
                "about 27000 CPU s; two at a time on 2 cores: 3.8 h on a quiet box, 4.5 h with the start-ups",
}


def arm_overrides(protocol: dict, arm: str, seed: int) -> list[str]:
    dtype = [] if protocol["model_dtype"] == "float32" else [f"model.dtype={protocol['model_dtype']}"]
    return protocol["arms"][arm] + protocol["common"] + dtype + [
        f"train.seed={seed}", f"train.cpu_budget_s={protocol['budget_s']}",
        f"eval.every_cpu_s={protocol['eval_every_cpu_s']}"]


def jobs(work: Path, protocol: dict, extra: list[str]) -> list[SR.Job]:
    """Seeds outermost; within a seed the arms rotated by the seed, so every arm meets the same contention."""
    arms = list(protocol["arms"])
    out = []
    for i, seed in enumerate(protocol["seeds"]):
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
            out.append(SR.Job(f"{arm}_s{seed}", REPO / protocol["config"], arm_overrides(protocol, arm, seed) + extra,
                              work / f"{arm}_s{seed}", done=SR.cpu_budget_reached(protocol["budget_s"])))
    return out


def summarize_run(path: Path, protocol: dict) -> dict:
    records = read_metrics(path)
    cum = dict(SR.cumulative_cpu(records))
    evals = sorted((r for r in records if r.get("phase") == "eval"), key=lambda r: r["step"])
    points = [(0.0 if r["step"] < 0 else cum[r["step"]], r[EVAL_KEY], r["step"]) for r in evals if EVAL_KEY in r]
    budget = protocol["budget_s"]
    final = next((p for p in points if p[0] >= budget), None)
    rl = [r for r in records if r.get("phase") == "rl"]
    total = sum(r["time/step_cpu"] for r in rl)
    ts, ys = [p[0] for p in points], [p[1] for p in points]
    t_level, censored = S.time_to_target(ts, ys, protocol["level"], total)
    mean = lambda key: S._mean([r.get(key, math.nan) for r in rl])  # noqa: E731
    return {"points": points, "base": points[0][1] if points and points[0][2] < 0 else math.nan,
            "final": final[1] if final else math.nan, "final_cpu_s": final[0] if final else math.nan,
            "steps": len(rl), "rl_cpu_s": total, "cpu_per_step": total / max(1, len(rl)),
            "time_to_level": t_level, "censored": censored,
            "generated_tokens_per_step": mean("tokens/generated"),
            "trained_tokens_per_step": mean("tokens/trained_completion"),
            "trained_sequences_per_step": mean("tokens/trained_sequences")}


def analyse(work: Path, protocol: dict) -> dict:
    runs = {arm: {s: summarize_run(work / f"{arm}_s{s}", protocol) for s in protocol["seeds"]}
            for arm in protocol["arms"]}
    arms = {arm: {k: S.mean_ci([r[k] for r in rs.values()]) for k in
                  ("final", "base", "steps", "cpu_per_step", "time_to_level", "generated_tokens_per_step",
                   "trained_tokens_per_step")} for arm, rs in runs.items()}
    seeds = protocol["seeds"]
    tests = {}
    for a, b in protocol["primary_family"] + [["allocation_filter", "filter_rloo"], ["filter_rloo", "filter"]]:
        key = f"{a}-{b}"
        tests[key] = S.paired_test([runs[a][s]["final"] - runs[b][s]["final"] for s in seeds])
        tests[key]["time_to_level_ratio"] = S.ratio_test([runs[a][s]["time_to_level"] for s in seeds],
                                                         [runs[b][s]["time_to_level"] for s in seeds])
    family = {f"{a}-{b}": tests[f"{a}-{b}"]["p"] for a, b in protocol["primary_family"]}
    for key, p in S.holm(family).items():
        t = tests[key]
        t["p_holm"] = p
        t["verdict"] = ("wins" if p < protocol["alpha"] and t["mean"] > 0 else
                        "loses" if p < protocol["alpha"] and t["mean"] < 0 else "no difference shown")
    return {"protocol": protocol, "runs": {a: {str(s): r for s, r in rs.items()} for a, rs in runs.items()},
            "arms": arms, "tests": tests}


def main(argv=None) -> int:
    args = SR.study_arguments(__doc__, REPO / "runs" / "adaptive_study",
                              REPO / "docs" / "benchmarks" / "adaptive_prereg.json",
                              REPO / "docs" / "benchmarks" / "adaptive_study_runs").parse_args(argv)

    def report(protocol: dict, out: Path) -> None:
        rep = analyse(args.work, protocol)
        write_json(out, rep)
        for key, t in rep["tests"].items():
            print(f"{key}: {t['mean']:+.3f} [{t['lo']:+.3f}, {t['hi']:+.3f}] p {t['p']:.3f}"
                  + (f" Holm {t['p_holm']:.3f} {t['verdict']}" if "p_holm" in t else ""))

    return SR.run_study(args, PROTOCOL, jobs, report)


if __name__ == "__main__":
    sys.exit(main())
