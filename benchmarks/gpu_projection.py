"""A MODEL, not a measurement: each arm's time to an accuracy level projected from the CPU study to a GPU regime
where generation is 70-90% of the step (docs/benchmarks.md, "Adaptive group sizes", the projection).

What is measured (on the 2-core CPU box, per arm, from a study's JSON): the RL steps the arm needs to reach the
level (``--study``: the adaptive study's time to ``level`` divided by its CPU seconds per step; ``--example``:
section 14's, from the gain per step, linear), and its generated and trained tokens per step relative to GRPO's.

What is modelled: one step of the GPU workload costs

    T_arm = T_ref x (s x g_arm + (1 - s) x t_arm)

with g_arm, t_arm the arm's generated and trained tokens per step as fractions of GRPO's, s the generation share
of GRPO's step on the GPU (0.7, 0.8, 0.9: the issue's range), and T_ref GRPO's step time on the reference GPU
workload. T_ref and the per-token cost T_ref / tokens come from a published profile, NeMo RL's performance summary
(https://docs.nvidia.com/nemo/rl/latest/about/performance-summary.html, its source in the
NVIDIA-NeMo/RL repository; section "NeMo RL v0.7", "H100 BF16 Benchmarks"): GRPO, Qwen3-32B,
on policy, 32 H100 GPUs, G-GBS 2,048 samples per step, G-average sequence length 3,256 tokens, total step time
323 s (665 tokens / s / GPU). That table gives the step, not its split: the split s is this model's assumption,
and the per-token costs follow from it (c_gen = s T_ref / tokens, c_train = (1 - s) T_ref / tokens per token, in
GPU-seconds x 32). The time to the level is then steps_to_level x T_arm. Assumptions, spelled out:

1. An arm needs the same number of RL steps to the level on the GPU workload as it measured on the CPU (learning
   per step is a property of the algorithm and the task, not of the hardware); only RATIOS between arms are
   meant to carry over, not the absolute hours (the GPU workload is another model and task).
2. Generation and training cost scale linearly with the generated and trained tokens (no fixed per-step part; a
   smaller batch would in reality use the GPU less efficiently, which this model ignores and which favours the
   arms that generate less).
3. The reference and the arms run on-policy, colocated (generation and training in turn), as the profile's row.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, write_json

PROFILE = {"source": "NeMo RL performance summary (docs.nvidia.com/nemo/rl, about/performance-summary), v0.7, "
                     "H100 BF16, GRPO",
           "model": "Qwen3-32B", "policy": "on policy", "gpus": 32, "samples_per_step": 2048,
           "mean_sequence_tokens": 3256, "step_s": 323.0, "tokens_per_s_per_gpu": 665}
SHARES = (0.7, 0.8, 0.9)
# section 14's step profile of GRPO on SmolLM2 (docs/benchmarks.md, "Where a step goes", after the removals):
# CPU s per step of generation, training and the rest; used only by --example to split a measured CPU step
SECTION14_PROFILE = {"generate": 13.0, "train": 46.6, "other": 0.4}


def per_token_costs(share: float) -> dict:
    tokens = PROFILE["samples_per_step"] * PROFILE["mean_sequence_tokens"]
    gpu_s = PROFILE["step_s"] * PROFILE["gpus"]
    return {"gen_gpu_s_per_token": share * gpu_s / tokens, "train_gpu_s_per_token": (1 - share) * gpu_s / tokens}


def project(arms: dict, reference: str = "filter") -> dict:
    """arms: name -> {steps_to_level, cpu_s_to_level, cpu_per_step, g, t}. Returns the table rows."""
    rows = []
    for share in SHARES:
        for name, a in arms.items():
            step = PROFILE["step_s"] * (share * a["g"] + (1 - share) * a["t"])
            rows.append({"generation_share": share, "arm": name, **a, "gpu_step_s": step,
                         "gpu_h_to_level": a["steps_to_level"] * step / 3600.0})
    for r in rows:
        ref = next(x for x in rows if x["generation_share"] == r["generation_share"] and x["arm"] == reference)
        r["gpu_ratio_to_" + reference] = r["gpu_h_to_level"] / ref["gpu_h_to_level"]
        r["cpu_ratio_to_" + reference] = r["cpu_s_to_level"] / ref["cpu_s_to_level"]
    return {"rows": rows, "costs": {str(s): per_token_costs(s) for s in SHARES}, "profile": PROFILE}


def from_example(path: Path, level: float) -> dict:
    """Section 14's study (GRPO, filter, DPPO; 3 seeds): steps to ``level`` from the mean gain per step (linear),
    trained fraction = the kept fraction, generated fraction 1 for GRPO and the filter (they generate every group)
    and, for DPPO (whose prompt level skips generation; the JSON records no token counts), solved from its CPU s per
    step with section 14's step profile. A labelled example, not the study this script is for."""
    d = json.loads(path.read_text())
    p = SECTION14_PROFILE
    grpo_cpu = d["arms"]["grpo"]["cpu_per_step"]["mean"]
    scale = grpo_cpu / (p["generate"] + p["train"] + p["other"])
    arms = {}
    for name, a in d["arms"].items():
        steps, base, final = a["steps"]["mean"], a["base"]["mean"], a["final"]["mean"]
        per_step = (final - base) / steps
        n = (level - base) / per_step if per_step > 0 else math.inf
        t = a["kept_fraction"]
        g = 1.0 if name in ("grpo", "filter") else min(1.0, max(0.0, (a["cpu_per_step"]["mean"] / scale - p["other"]
                                                                      - p["train"] * t) / p["generate"]))
        arms[name] = {"steps_to_level": n, "cpu_per_step": a["cpu_per_step"]["mean"],
                      "cpu_s_to_level": n * a["cpu_per_step"]["mean"], "g": g, "t": t,
                      "g_source": "design" if name in ("grpo", "filter") else "solved from CPU s per step"}
    return arms


def from_study(path: Path) -> dict:
    """The adaptive study's report (``adaptive_study.py --report``): per arm, the mean over seeds of the time to
    the level (CPU s; censored runs count at the budget, flagged), CPU s per step, tokens per step / GRPO's."""
    d = json.loads(path.read_text())
    grpo = d["arms"]["grpo"]
    arms = {}
    for name, a in d["arms"].items():
        cps = a["cpu_per_step"]["mean"]
        arms[name] = {"steps_to_level": a["time_to_level"]["mean"] / cps, "cpu_per_step": cps,
                      "cpu_s_to_level": a["time_to_level"]["mean"],
                      "censored_runs": sum(r["censored"] for r in d["runs"][name].values()),
                      "g": a["generated_tokens_per_step"]["mean"] / grpo["generated_tokens_per_step"]["mean"],
                      "t": a["trained_tokens_per_step"]["mean"] / grpo["trained_tokens_per_step"]["mean"],
                      "g_source": "measured tokens/generated"}
    return arms


def markdown(rep: dict) -> str:
    ref = rep["reference"]
    lines = [f"MODEL (not measured on a GPU): {rep['label']}" + (
                 "; a censored run never reached the level and counts at its budget (a lower bound)"
                 if any(a.get("censored_runs") for a in rep["arms"].values()) else ""), "",
             f"| arm | CPU: steps to {rep['level']} | CPU s / step | CPU s to level (x {ref}) | generated / trained "
             f"(x GRPO) | " + " | ".join(f"GPU s={s}: h to level (x {ref})" for s in SHARES) + " |",
             "|---|---:|---:|---|---|" + "---|" * len(SHARES)]
    for name in rep["arms"]:
        rs = [r for r in rep["rows"] if r["arm"] == name]
        a = rs[0]
        censored = f" ({a['censored_runs']} censored)" if a.get("censored_runs") else ""
        lines.append(f"| {name} | {a['steps_to_level']:.1f}{censored} | {a['cpu_per_step']:.1f} | "
                     f"{a['cpu_s_to_level']:.0f} ({a['cpu_ratio_to_' + ref]:.2f}) | {a['g']:.2f} / {a['t']:.2f} | "
                     + " | ".join(f"{r['gpu_h_to_level']:.2f} ({r['gpu_ratio_to_' + ref]:.2f})" for r in rs) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--study", type=Path, help="the adaptive study's report JSON (adaptive_study.py --report)")
    src.add_argument("--example", type=Path, nargs="?", const=REPO / "docs" / "benchmarks" / "real_model_study.json",
                     help="section 14's study JSON, as a labelled example")
    ap.add_argument("--level", type=float, default=0.35, help="--example: the held-out pass@1 level")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.study:
        arms, label = from_study(args.study), f"from the study {args.study.name}"
        level = json.loads(args.study.read_text())["protocol"]["level"]
    else:
        arms, label = from_example(args.example, args.level), (
            f"EXAMPLE on section 14's data ({args.example.name}: 3 seeds, GRPO / filter / DPPO default), steps to "
            f"the level from the mean gain per step (linear)")
        level = args.level
    rep = {"label": label, "level": level, "reference": "filter", "arms": arms, **project(arms)}
    write_json(args.out, rep)
    print(markdown(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
