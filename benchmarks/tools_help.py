"""Do tools help? The calculator example (examples/calculator_multiplication.yaml: 2-digit x 2-digit
multiplication, a ~1.7M-parameter Qwen2 trained from scratch on CPU) with and without the calculator, and GRPO
against DPPO with episodes as units (docs/benchmarks.md, "Tools help"; docs/environments.md, "Example").

Arms (nothing tuned per arm):
    tool-dppo    the example: warm start on tool-use traces, then DPPO (r_q = r_o = 0.5) on calculator episodes
    tool-grpo    the same with algo.pruner=none
    plain-dppo   no calculator: warm start on the answers, DPPO on single-turn completions; ``--plain-steps`` RL
                 steps (its steps are cheaper: more of them, so that its CPU time covers the tool arms')
Per seed ONE warm start per mode (tool traces, answers) is trained and copied into its arms
(``checkpoint.resume=must``): the tool arms share weights, data order and evaluation seeds.

Clock: process CPU seconds (``time/step_cpu`` of every warm-start and RL step, summed), robust to the other users
of a shared machine; evaluation and start-up are excluded. Accuracy: held-out pass@1 (the test split, never
trained on; ``eval.max_prompts`` prompts x ``eval.samples`` samples, the last assistant turn scored), before RL and
every ``eval.every`` steps; curves are smoothed by a 3-evaluation running mean and interpolated in CPU time.

Endpoints (95% Student-t intervals over seeds, paired by seed):
    1. accuracy at equal CPU time T_eq (the smallest total CPU of any tool run, warm start included; a plain run
       that ended before it holds its last value, flagged): each arm, and the difference tool-dppo - plain-dppo;
    2. RL CPU seconds until the smoothed accuracy first reaches ``--level`` (fixed before the study: from a pilot
       on a seed outside it), tool-dppo / tool-grpo as a paired ratio (a run that never reaches it is censored at
       its total and flagged);
    3. the noise floor: the binomial standard error of one evaluation, and the spread of each arm over seeds.

    .venv/bin/python benchmarks/tools_help.py --seeds 1 2 3 --level 0.5 --out runs/tools_help/results.json
``--reuse`` re-analyses the finished runs of the work folder.
"""
from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/tools_help.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _tta_stats as S
from benchmarks.common import QUIET, REPO, machine, read_metrics, run_pool, train, write_json

CONFIG = REPO / "examples" / "calculator_multiplication.yaml"
PLAIN = ["env=null", "data.arithmetic_warm_start=answer", "rollout.max_new_tokens=8"]
MODES = {"tool": [], "plain": PLAIN}
ARMS = {"tool-dppo": ("tool", []), "tool-grpo": ("tool", ["algo.pruner=none"]), "plain-dppo": ("plain", [])}
COMMON = [*QUIET, "checkpoint.every=0", "logging.print_every=10"]


def read_run(out: Path) -> dict:
    """A run's warm-start CPU seconds, its RL CPU time at each evaluation, the held-out pass@1 there."""
    rs = read_metrics(out)
    warm = sum(r.get("time/step_cpu", 0.0) for r in rs if r.get("phase") == "sft")
    rl = [r for r in rs if r.get("phase") == "rl"]
    cpu = [0.0]
    for r in rl:
        cpu.append(cpu[-1] + r["time/step_cpu"])
    evals = [r for r in rs if r.get("phase") == "eval"]
    key = next(k for k in evals[0] if k.endswith("/pass@1"))
    ts = [cpu[r["step"] + 1] for r in evals]  # eval after step s: s + 1 updates done
    acc = [r[key] for r in evals]
    return {"warm_cpu": warm, "rl_t": ts, "acc": acc, "smoothed": S.running_mean(acc), "rl_total": cpu[-1],
            "steps": len(rl), "metric": key,
            "turns": statistics.fmean(r.get("env/turns_mean", 1.0) for r in rl) if rl else float("nan"),
            "tool_calls": statistics.fmean(r.get("env/tool_calls_mean", 0.0) for r in rl) if rl else float("nan"),
            "kept": statistics.fmean(r["prune/total_kept_fraction"] for r in rl) if rl else float("nan")}


def train_runs(args, work: Path) -> dict:
    overrides = COMMON + [f"train.sft_steps={args.sft_steps}",
                          f"eval.every={args.eval_every}", f"eval.max_prompts={args.eval_prompts}",
                          f"eval.samples={args.eval_samples}", f"eval.pass_k={args.eval_samples}"] + list(args.extra)
    process = {}

    def warm(job):
        seed, mode = job
        out = work / f"warm-{mode}-s{seed}"
        if args.reuse and (out / "checkpoints" / "latest").exists():
            return
        shutil.rmtree(out, ignore_errors=True)
        print(f"[{time.strftime('%H:%M:%S')}] warm start {mode} seed {seed}", flush=True)
        process[f"{seed}:warm-{mode}"] = train(CONFIG, overrides + MODES[mode] + [
            f"train.seed={seed}", "train.steps=0", "eval.every=0", f"train.output_dir={out}"],
            work / f"warm-{mode}-s{seed}.log", args.timeout)

    def train_arm(job):
        seed, arm = job
        mode, extra = ARMS[arm]
        out = work / f"{arm}-s{seed}"
        steps = args.plain_steps if mode == "plain" else args.steps
        if args.reuse and (out / "metrics.jsonl").exists() and read_run(out)["steps"] >= steps:
            return
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(work / f"warm-{mode}-s{seed}", out)
        print(f"[{time.strftime('%H:%M:%S')}] {arm} seed {seed}", flush=True)
        process[f"{seed}:{arm}"] = train(CONFIG, overrides + MODES[mode] + extra + [
            f"train.steps={steps}", f"train.seed={seed}", "checkpoint.resume=must", f"train.output_dir={out}"],
            work / f"{arm}-s{seed}.log", args.timeout)
        r = read_run(out)
        print(f"[{time.strftime('%H:%M:%S')}]   {arm} seed {seed}: pass@1 {r['acc'][0]:.3f} -> {r['acc'][-1]:.3f}, "
              f"RL {r['rl_total']:.0f} CPU-s", flush=True)

    work.mkdir(parents=True, exist_ok=True)
    failed = run_pool([(s, m) for s in args.seeds for m in MODES], warm, args.parallel)
    jobs = [(s, a) for k, s in enumerate(args.seeds) for a in (list(ARMS)[k % 3:] + list(ARMS)[:k % 3])]
    failed += run_pool(jobs, train_arm, args.parallel)
    for job, err in failed:
        print(f"FAILED {job}: {err}", flush=True)
    return process


def analyse(args, work: Path) -> dict:
    runs = {(s, a): read_run(work / f"{a}-s{s}") for s in args.seeds for a in ARMS
            if (work / f"{a}-s{s}" / "metrics.jsonl").exists()}
    seeds = [s for s in args.seeds if all((s, a) in runs for a in ARMS)]
    total = {k: r["warm_cpu"] + r["rl_total"] for k, r in runs.items()}
    t_eq = min(total[(s, a)] for s in seeds for a in ARMS if ARMS[a][0] == "tool")

    def at(run, t):  # smoothed held-out pass@1 at total CPU time t (warm start included)
        return S.interp([run["warm_cpu"] + x for x in run["rl_t"]], run["smoothed"], t)

    short = [f"{a}-s{s}" for (s, a), t in total.items() if s in seeds and t < t_eq]
    out = {"seeds": seeds, "T_eq_cpu_s": t_eq, "ended_before_T_eq": short, "level": args.level,
           "metric": runs[(seeds[0], "tool-dppo")]["metric"], "arms": {},
           "runs": {f"{a}-s{s}": r for (s, a), r in runs.items()}}
    for a in ARMS:
        rs = [runs[(s, a)] for s in seeds]
        out["arms"][a] = {
            "warm_cpu_s": S.mean_ci([r["warm_cpu"] for r in rs]), "rl_cpu_s": S.mean_ci([r["rl_total"] for r in rs]),
            "pre_rl": S.mean_ci([r["acc"][0] for r in rs]), "final": S.mean_ci([r["smoothed"][-1] for r in rs]),
            "at_T_eq": S.mean_ci([at(r, t_eq) for r in rs]),
            "turns": statistics.fmean(r["turns"] for r in rs),
            "tool_calls": statistics.fmean(r["tool_calls"] for r in rs),
            "kept": statistics.fmean(r["kept"] for r in rs)}
    out["tool_minus_plain_at_T_eq"] = S.paired_test(
        [at(runs[(s, "tool-dppo")], t_eq) - at(runs[(s, "plain-dppo")], t_eq) for s in seeds])
    times = {}
    for a in ("tool-dppo", "tool-grpo"):
        times[a] = [S.time_to_target(runs[(s, a)]["rl_t"], runs[(s, a)]["smoothed"], args.level,
                                     runs[(s, a)]["rl_total"]) for s in seeds]
    out["time_to_level"] = {a: [{"seed": s, "rl_cpu_s": t, "censored": c} for s, (t, c) in zip(seeds, v)]
                            for a, v in times.items()}
    out["dppo_over_grpo_time_to_level"] = S.ratio_test([t for t, _ in times["tool-dppo"]],
                                                       [t for t, _ in times["tool-grpo"]])
    n = args.eval_prompts * args.eval_samples
    p = statistics.fmean(r["acc"][-1] for r in runs.values())
    out["noise_floor"] = {"eval_binomial_se_at_mean_final": math.sqrt(max(p * (1 - p), 1e-12) / n),
                          "eval_samples": n,
                          "seed_sd_final": {a: statistics.stdev([runs[(s, a)]["smoothed"][-1] for s in seeds])
                                            if len(seeds) > 1 else float("nan") for a in ARMS}}
    out["machine"] = machine()
    return out


def markdown(res: dict) -> str:
    def ci(d, scale=100.0, fmt="{:.1f}"):
        return f"{fmt.format(scale * d['mean'])} [{fmt.format(scale * d['lo'])}, {fmt.format(scale * d['hi'])}]"

    lines = [f"Seeds {res['seeds']}; held-out pass@1 ({res['metric']}) in percent, mean [95% CI over seeds]; CPU "
             "seconds of the warm-start and RL steps (evaluation excluded).", "",
             f"| arm | warm start CPU-s | RL CPU-s | pass@1 before RL | pass@1 at T_eq = {res['T_eq_cpu_s']:.0f} CPU-s "
             "| final pass@1 | turns | tool calls | kept |", "|---|---|---|---|---|---|---|---|---|"]
    for a, d in res["arms"].items():
        lines.append(f"| {a} | {d['warm_cpu_s']['mean']:.0f} | {d['rl_cpu_s']['mean']:.0f} | {ci(d['pre_rl'])} | "
                     f"{ci(d['at_T_eq'])} | {ci(d['final'])} | {d['turns']:.2f} | {d['tool_calls']:.2f} | "
                     f"{d['kept']:.2f} |")
    diff = res["tool_minus_plain_at_T_eq"]
    ratio = res["dppo_over_grpo_time_to_level"]
    cens = {a: sum(x["censored"] for x in v) for a, v in res["time_to_level"].items()}
    lines += ["", f"- tool-dppo - plain-dppo at T_eq: {100 * diff['mean']:+.1f} points [{100 * diff['lo']:+.1f}, "
                  f"{100 * diff['hi']:+.1f}] (p = {diff['p']:.3g}).",
              f"- RL CPU seconds to pass@1 {res['level']:.2f} (smoothed), tool-dppo / tool-grpo: geometric mean "
              f"{ratio['geo_mean']:.2f} [{ratio['lo']:.2f}, {ratio['hi']:.2f}] (n = {ratio['n']}, "
              f"p = {ratio['p']:.3g}); censored runs (never reached): {cens}.",
              "- Noise floor: one evaluation's binomial standard error "
              f"{100 * res['noise_floor']['eval_binomial_se_at_mean_final']:.1f} points "
              f"({res['noise_floor']['eval_samples']} samples); spread of the final pass@1 over seeds (sd): "
              + ", ".join(f"{a} {100 * v:.1f}" for a, v in res["noise_floor"]["seed_sd_final"].items()) + " points."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--level", type=float, required=True, help="held-out pass@1 of endpoint 2, fixed in advance")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--plain-steps", type=int, default=150)
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=6 * 3600)
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "tools_help")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reuse", action="store_true", help="keep finished runs of the work folder")
    ap.add_argument("extra", nargs="*", help="config overrides for every run (key=value)")
    args = ap.parse_args()
    process = train_runs(args, args.work)
    res = analyse(args, args.work)
    res["process"] = process
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print(markdown(res))
    write_json(args.out, res)


if __name__ == "__main__":
    main()
