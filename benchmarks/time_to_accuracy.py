"""Preregistered time-to-accuracy study: GRPO vs DPPO (several settings) vs CPPO vs the DAPO zero-variance filter
on the CPU quickstart (examples/quickstart.yaml: a tiny Qwen2 learning single-digit + and - facts).

Design
------
* Task and metric. Each run: the quickstart's supervised warm start (``train.sft_steps``, 100), then ``--steps``
  (150) RL steps of 64 prompts x 8 completions. Accuracy is IN-DISTRIBUTION pass@1 FROM FRESH SAMPLES, NOT
  held-out: single-digit facts cannot be held out (one cannot infer "7+5" from the others), so the quickstart
  evaluates on fresh draws of the training split (``data.arithmetic_eval_split=train``; the 180 facts of the
  train split, drawn ``eval.max_prompts`` = 1024 times, which covers ~178-180 of them; the coverage per seed is
  recorded) with ``eval.samples`` = 4 fresh completions each, before RL and every ``eval.every`` (25) steps.
  The training reward is never used to compare arms.
* Pairing. Per seed ONE warm start is trained and copied into every arm (``checkpoint.resume=must``): within a
  seed all arms share weights, optimizer state, tokenizer, data order, evaluation prompts and evaluation sampling
  seeds. Runs are interleaved (seed-major, arm order rotated per seed); ``--parallel`` run at once.
* Clock (``--clock``). ``cpu`` (default): cumulative ``time/step_cpu`` (process CPU seconds of each RL step,
  summed over ranks), robust to other users of a shared machine; ``wall``: cumulative ``time/step``. Evaluation
  and start-up are excluded from both.
* Curves. Each run's accuracy curve is smoothed by a 3-evaluation running mean and interpolated linearly in
  time (benchmarks/_tta_stats.py); gain = smoothed accuracy - the run's own pre-RL accuracy.

Two phases
----------
1. ``--calibrate``: GRPO only, on calibration seeds (101, 102) used for nothing else. Writes the preregistration
   (``--prereg``, default docs/benchmarks/tta_prereg.json): G_cal = mean GRPO gain at the last step;
   g* = 0.6 G_cal; T* = 0.5 x mean GRPO total RL seconds; non-inferiority margin = 0.25 G_cal; the arms, main
   seeds, protocol, endpoints and the multiple-comparison rule; the git commit. G_cal < 0.10: ``"fit": false``
   and the main phase refuses to run (the task does not move enough to compare anything).
2. main (default): reads the preregistration (refuses if absent, unfit, or made for another clock / steps /
   config / overrides), runs every arm on the main seeds (1..8) and analyses with the PREREGISTERED g*, T* and
   margin only (nothing is re-derived from the main runs).

Endpoints (paired per seed; 95% Student-t intervals over seeds)
-----------------------------------------------------------------
1. time to g*: first RL time the smoothed gain curve reaches g*; a run that never does is CENSORED at its total
   RL time (counted there, flagged; n/N reached is reported). Paired ratio arm/GRPO, geometric mean, t on logs.
2. gain at T*: arm - GRPO difference of the smoothed, interpolated gain at T* (a run that ended before T* holds
   its last value, flagged).
3. the papers' protocol: final smoothed accuracy at the last step, arm - GRPO; non-inferior iff the lower 95%
   bound > -margin (one-sided test at 0.025); plus the total-RL-time ratio arm/GRPO.
4. endpoints 1-3 against the DAPO filter instead of GRPO.
Also: area under the smoothed gain curve over [0, T*] / T*, paired difference; kept fractions and zero-variance
group share per evaluation interval. Holm over the DPPO arms (dppo-0.5, dppo-0.7, dppo-0.5-zvf, dppo-opt), one
family per endpoint 1-3, family-wise alpha 0.05 (endpoint 3 one-sided 0.025); everything else is secondary
(unadjusted p). ``dapo-filter`` is the negative control of accuracy per step: with kl_coef = 0 its gradient
equals GRPO's (dropped groups have zero advantage), so any difference it shows at equal steps is noise; it
skips those groups' training passes, so its time differences are real.

Run (a few hours on a shared 2-core box):
    .venv/bin/python benchmarks/time_to_accuracy.py --calibrate
    .venv/bin/python benchmarks/time_to_accuracy.py --parallel 2 --out docs/benchmarks/tta_results.json \\
        --png docs/benchmarks/tta
``--reuse`` re-analyses finished runs in the work dir; ``--resume`` continues an interrupted phase;
``--from-results JSON`` re-renders a saved study (plots, markdown, post-hoc checks) without its run folders.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

if not __package__:  # `python benchmarks/time_to_accuracy.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _tta_stats as S
from benchmarks._tta_report import EVAL_LABEL, markdown, plot, posthoc
from benchmarks.common import QUIET, REPO, machine, read_metrics, run_pool, train, write_json
from megatron_dppo.config import load_config

METHODS = {  # nothing is tuned per arm
    "grpo": ["algo.pruner=none"],
    "dapo-filter": ["algo.pruner=none", "algo.drop_zero_variance_groups=true"],
    "dppo-0.5": ["algo.pruner=dppo", "algo.r_q=0.5", "algo.r_o=0.5"],
    "dppo-0.7": ["algo.pruner=dppo", "algo.r_q=0.7", "algo.r_o=0.7"],
    "dppo-0.5-zvf": ["algo.pruner=dppo", "algo.r_q=0.5", "algo.r_o=0.5", "algo.drop_zero_variance_groups=true"],
    "dppo-opt": ["algo.pruner=dppo", "algo.dppo_keep=optimal", "algo.r_q=0.5", "algo.r_o=0.5", "algo.keep_floor=0.1",
                 "algo.keep_length_exponent=0.0"],
    "cppo-0.5-alloc": ["algo.pruner=cppo", "algo.cppo_rate=0.5", "algo.cppo_allocation=true"],
    # exploratory, after the study (not preregistered): the optimal rule at the floor the gradient measurement chose
    "dppo-opt-0.3": ["algo.pruner=dppo", "algo.dppo_keep=optimal", "algo.r_q=0.5", "algo.r_o=0.5",
                     "algo.keep_floor=0.3", "algo.keep_length_exponent=0.0"],
    # ablations, on request only (--arms)
    "dppo-0.5-prompt-only": ["algo.pruner=dppo", "algo.r_q=0.5", "algo.r_o=0"],
    "dppo-0.5-completion-only": ["algo.pruner=dppo", "algo.r_q=0", "algo.r_o=0.5"],
}
DEFAULT_ARMS = ["grpo", "dapo-filter", "dppo-0.5", "dppo-0.7", "dppo-0.5-zvf", "dppo-opt", "cppo-0.5-alloc"]
DPPO_FAMILY = ["dppo-0.5", "dppo-0.7", "dppo-0.5-zvf", "dppo-opt"]
COMMON = [*QUIET, "checkpoint.every=0", "logging.print_every=10", "data.arithmetic_eval_split=train"]
ALPHA = 0.05
RULES = {"g_star": 0.6, "T_star": 0.5, "margin": 0.25, "min_gain": 0.10}
CLOCK_KEYS = {"cpu": "time/step_cpu", "wall": "time/step"}


class PreregError(RuntimeError):
    """The preregistration is absent, unfit, or does not match the command line."""


# ----------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------
def schedule(seeds: list[int], arms: list[str]) -> list[tuple[int, str]]:
    """Seed-major, the arm order rotated by one from seed to seed (each arm runs early and late)."""
    out = []
    for k, seed in enumerate(seeds):
        order = arms[k % len(arms):] + arms[:k % len(arms)]
        out += [(seed, m) for m in order]
    return out


def train_runs(args, work: Path, seeds: list[int], arms: list[str], overrides: list[str]) -> dict:
    """Warm start per seed, then every (seed, arm) from it; ``--resume`` keeps finished ones. Returns the
    processes' wall / CPU seconds."""
    cfg = load_config(args.config, overrides)
    steps, sft_steps = cfg.train.steps, cfg.train.sft_steps
    if work.exists() and not args.resume:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    lock, process = threading.Lock(), {}
    if args.resume and (work / "process.json").exists():
        process.update(json.loads((work / "process.json").read_text()))

    def record(key: str, value: dict) -> None:
        with lock:
            process[key] = value
            (work / "process.json").write_text(json.dumps(process, indent=1))

    def warm(seed: int) -> None:
        out = work / f"warm{seed}"
        if args.resume and count_phase(out, "sft") >= sft_steps and (out / "checkpoints" / "latest").exists():
            return
        shutil.rmtree(out, ignore_errors=True)
        print(f"[{time.strftime('%H:%M:%S')}] warm start seed {seed}", flush=True)
        record(f"{seed}:warm", train(args.config, overrides + [f"train.seed={seed}", "train.steps=0", "eval.every=0",
                                                             f"train.output_dir={out}"], work / f"warm{seed}.log",
                                   args.timeout))

    def train_arm(job: tuple[int, str]) -> None:
        seed, arm = job
        out = work / f"{arm}_s{seed}"
        if args.resume and run_finished(out, steps):
            return
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(work / f"warm{seed}", out)
        print(f"[{time.strftime('%H:%M:%S')}] {arm} seed {seed}", flush=True)
        record(f"{seed}:{arm}", train(args.config, overrides + METHODS[arm] + [
            f"train.seed={seed}", "checkpoint.resume=must", f"train.output_dir={out}"], work / f"{arm}_s{seed}.log",
            args.timeout))
        r = read_run(out, args.clock)
        print(f"[{time.strftime('%H:%M:%S')}]   {arm} seed {seed}: {r['steps']} steps, "
              f"{r['total']:.1f} {args.clock}-s, "
              f"pass@1 {r['acc'][0]:.3f} -> {r['acc'][-1]:.3f}", flush=True)

    failed = run_pool(seeds, warm, args.parallel)
    warmed = [s for s in seeds if (work / f"warm{s}" / "checkpoints" / "latest").exists()]
    failed += run_pool(schedule(warmed, arms), train_arm, args.parallel)
    if failed:
        print(f"{len(failed)} run(s) failed: {[job for job, _ in failed]} (left out of the analysis)", flush=True)
    return process


def count_phase(path: Path, phase: str) -> int:
    return len(read_metrics(path, phase))


def run_finished(path: Path, steps: int) -> bool:
    return count_phase(path, "rl") >= steps and (path / "checkpoints" / "latest").exists()


# ----------------------------------------------------------------------------------------------------------
# Protocol and preregistration
# ----------------------------------------------------------------------------------------------------------
def study_overrides(args) -> list[str]:
    return COMMON + [f"train.steps={args.steps}", f"eval.every={args.eval_every}",
                     f"eval.max_prompts={args.eval_prompts}", f"eval.samples={args.eval_samples}",
                     f"eval.pass_k={min(4, args.eval_samples)}"] + list(args.extra)


def protocol(args) -> dict:
    """What the preregistration fixes and the main phase must match."""
    config = Path(args.config).resolve()
    return {"config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config),
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(), "clock": args.clock,
            "steps": args.steps, "overrides": study_overrides(args)}


def protocol_mismatch(registered: dict, current: dict) -> list[str]:
    return [f"{k}: preregistered {registered.get(k)!r}, command line {current.get(k)!r}"
            for k in ("config", "config_sha256", "clock", "steps", "overrides") if registered.get(k) != current.get(k)]


def load_prereg(path: Path, current: dict) -> dict:
    """The preregistration at ``path``, checked against the current protocol; PreregError when it is absent,
    unfit, or made for another protocol."""
    if not Path(path).exists():
        raise PreregError(f"no preregistration at {path}: run the calibration first (--calibrate --prereg {path})")
    prereg = json.loads(Path(path).read_text())
    if not prereg.get("fit", False):
        raise PreregError(f"task unfit ({path}): {prereg.get('reason', 'fit is false')}")
    diff = protocol_mismatch(prereg.get("protocol", {}), current)
    if diff:
        raise PreregError(f"the preregistration {path} was made for another protocol; run with its settings or "
                          "calibrate again:\n  " + "\n  ".join(diff))
    return prereg


def git_info() -> dict:
    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def eval_coverage(cfg, seed: int) -> dict:
    """How many distinct facts the evaluation prompts of ``seed`` cover, of the training split's facts."""
    from dataclasses import replace

    from megatron_dppo.run.build import arithmetic_task

    if cfg.data.task != "arithmetic":
        return {}
    task = arithmetic_task(replace(cfg, train=replace(cfg.train, seed=seed)))
    d, n = cfg.data, cfg.data.arithmetic_train_size
    start = n if d.arithmetic_eval_split == "train" else 0
    evals = {task.expression(i, d.arithmetic_eval_split) for i in range(start, start + cfg.eval.max_prompts)}
    out = {"eval_draws": cfg.eval.max_prompts, "eval_distinct": len(evals),
           "train_records_distinct": len({task.expression(i, "train") for i in range(n)})}
    if d.arithmetic_max_terms == 2 and d.arithmetic_max_operand <= 99:  # small enough to enumerate
        facts = {f"{a}{o}{b}" for a in range(d.arithmetic_max_operand + 1) for b in range(d.arithmetic_max_operand + 1)
                 for o in d.arithmetic_ops}
        out["split_facts"] = sum(task._in_test(e) == (d.arithmetic_eval_split == "test") for e in facts)
    return out


def make_prereg(args, current: dict, gains: dict, totals: dict, arms: list[str], coverage: dict) -> dict:
    g_cal = statistics.fmean(gains.values())
    fit = g_cal >= args.min_gain
    info = git_info()
    return {
        "study": "time_to_accuracy", "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "git_commit": info["commit"], "git_dirty": info["dirty"], "protocol": current,
        "metric": EVAL_LABEL, "eval_coverage": coverage,
        "calibration": {"seeds": [int(k) for k in gains], "gains": gains, "grpo_total_seconds": totals, "G_cal": g_cal,
                        "gain_rule": "smoothed (3-evaluation running mean) pass@1 at the last step minus the "
                                     "pre-RL pass@1 of the same run"},
        "fit": fit, "min_gain": args.min_gain,
        "reason": None if fit else f"G_cal = {g_cal:.4f} < {args.min_gain}: GRPO does not move in-distribution "
                                   "pass@1 enough on this task for a time-to-accuracy comparison",
        "g_star": RULES["g_star"] * g_cal, "g_star_rule": f"{RULES['g_star']} * G_cal",
        "T_star": RULES["T_star"] * statistics.fmean(totals.values()),
        "T_star_rule": f"{RULES['T_star']} * mean GRPO total RL {args.clock} seconds over the calibration seeds",
        "margin": RULES["margin"] * g_cal,
        "margin_rule": f"{RULES['margin']} * G_cal: a pruned arm may lose at most a quarter of GRPO's calibrated "
                       "gain in final accuracy and still be non-inferior",
        "arms": {a: METHODS[a] for a in arms}, "main_seeds": args.seeds, "clock": args.clock, "steps": args.steps,
        "eval": {"every": args.eval_every, "prompts": args.eval_prompts, "samples": args.eval_samples,
                 "label": EVAL_LABEL},
        "endpoints": {
            "1": "time to g* (smoothed, linearly interpolated gain curve); never reached = censored at the run's "
                 "total RL time; paired ratio arm/GRPO, geometric mean, 95% t CI and two-sided t test on log ratios",
            "2": "gain at T* (smoothed, interpolated; held after the run's end), paired difference arm - GRPO, "
                 "95% t CI, two-sided t test",
            "3": "final smoothed accuracy at the last step, arm - GRPO; non-inferior iff the lower 95% CI bound > "
                 "-margin (one-sided t test of H0: diff <= -margin at 0.025); plus total-RL-time ratio arm/GRPO",
            "4": "endpoints 1-3 with dapo-filter as the baseline (secondary)",
            "auc": "area under the smoothed gain curve over [0, T*] / T*, paired difference to GRPO (secondary)"},
        "multiple_comparisons": {
            "method": "Holm", "family_alpha": ALPHA, "family": DPPO_FAMILY,
            "rule": "one Holm family per endpoint 1, 2, 3: the DPPO arms vs GRPO; endpoints 1-2 two-sided at 0.05, "
                    "endpoint 3 one-sided at 0.025 (the level of the two-sided 95% CI); every other comparison "
                    "(cppo, dapo-filter, ablations, endpoint 4, AUC) is secondary, unadjusted"},
        "negative_control": "dapo-filter: with kl_coef = 0 the dropped groups have zero advantage, so its gradient "
                            "equals GRPO's; any difference it shows is noise",
    }


# ----------------------------------------------------------------------------------------------------------
# Reading one run and its endpoint values
# ----------------------------------------------------------------------------------------------------------
def read_run(path: Path, clock: str) -> dict:
    rl = sorted(read_metrics(path, "rl"), key=lambda r: r["step"])
    ev = sorted(read_metrics(path, "eval"), key=lambda r: r["step"])
    if not rl or not ev or ev[0]["step"] != -1:
        raise ValueError(f"{path}: needs RL records and a pre-RL evaluation (step -1)")
    key = CLOCK_KEYS[clock]
    if any(key not in r for r in rl):
        raise ValueError(f"{path}: RL records lack {key!r} (a trainer without it?); use --clock "
                         f"{'wall' if clock == 'cpu' else 'cpu'}")
    cum = {c: [] for c in CLOCK_KEYS}
    for c, k in CLOCK_KEYS.items():
        total = 0.0
        for r in rl:
            total += r.get(k, math.nan)
            cum[c].append(total)
    keys = [k for k in ev[0] if k.endswith("/pass@1")]  # one eval set, or several and their average
    eval_key = "eval/average/pass@1" if "eval/average/pass@1" in keys else keys[0]
    # an evaluation logged at step s follows RL step s (step -1: before the first RL step)
    steps = [e["step"] + 1 for e in ev]
    times = [cum[clock][e["step"]] if e["step"] >= 0 else 0.0 for e in ev]
    return {"eval_key": eval_key, "eval_steps": steps, "t": times, "acc": [e[eval_key] for e in ev],
            "steps": len(rl), "total": cum[clock][-1], "total_cpu": cum["cpu"][-1], "total_wall": cum["wall"][-1],
            "series": {k: [r.get(k, default) for r in rl] for k, default in (
                ("prune/prompt_kept_fraction", 1.0), ("prune/total_kept_fraction", 1.0),
                ("reward/zero_variance_groups", math.nan), ("tokens/trained_sequences", math.nan),
                ("tokens/generated", math.nan))}}


# ----------------------------------------------------------------------------------------------------------
# Phases
# ----------------------------------------------------------------------------------------------------------
def load_runs(work: Path, seeds: list[int], arms: list[str], steps: int, clock: str) -> dict:
    runs = {}
    for s in seeds:
        for a in arms:
            path = work / f"{a}_s{s}"
            if run_finished(path, steps):
                runs[(s, a)] = read_run(path, clock)
            elif path.exists():
                print(f"skipping unfinished run {path}", flush=True)
    return runs


def calibrate(args) -> dict:
    if args.prereg.exists() and not args.force:
        sys.exit(f"error: {args.prereg} exists (a preregistration is written once); pass --force to replace it")
    work, current = args.work_dir / "calibration", protocol(args)
    overrides = study_overrides(args)
    cfg = load_config(args.config, overrides + METHODS["grpo"])
    if not args.reuse:
        train_runs(args, work, args.calibration_seeds, ["grpo"], overrides)
    runs = load_runs(work, args.calibration_seeds, ["grpo"], cfg.train.steps, args.clock)
    missing = [s for s in args.calibration_seeds if (s, "grpo") not in runs]
    if missing:
        sys.exit(f"error: calibration runs missing or unfinished for seeds {missing} in {work}")
    gains = {str(s): S.gain_curve(runs[(s, "grpo")]["t"], runs[(s, "grpo")]["acc"])["final_gain"]
             for s in args.calibration_seeds}
    totals = {str(s): runs[(s, "grpo")]["total"] for s in args.calibration_seeds}
    coverage = {str(s): eval_coverage(cfg, s) for s in args.calibration_seeds + args.seeds}
    prereg = make_prereg(args, current, gains, totals, args.arms or DEFAULT_ARMS, coverage)
    write_json(args.prereg, prereg)
    print(f"calibration: gains {gains} -> G_cal {prereg['calibration']['G_cal']:.4f}; fit {prereg['fit']}; "
          f"g* {prereg['g_star']:.4f}, T* {prereg['T_star']:.1f} {args.clock}-s, margin {prereg['margin']:.4f}")
    if not prereg["fit"]:
        print(f"task unfit: {prereg['reason']}")
    return prereg


def main_phase(args) -> dict:
    try:
        prereg = load_prereg(args.prereg, protocol(args))
    except PreregError as err:
        sys.exit(f"error: {err}")
    arms, seeds = args.arms or list(prereg["arms"]), args.seeds if args.seeds_given else prereg["main_seeds"]
    deviations = []
    if arms != list(prereg["arms"]):
        deviations.append(f"arms {arms} instead of {list(prereg['arms'])}")
    if seeds != prereg["main_seeds"]:
        deviations.append(f"seeds {seeds} instead of {prereg['main_seeds']}")
    if prereg.get("min_gain", RULES["min_gain"]) < RULES["min_gain"]:
        deviations.append(f"fitness threshold lowered to G_cal >= {prereg['min_gain']} (protocol: {RULES['min_gain']})")
    if len(seeds) < 8:
        deviations.append(f"only {len(seeds)} seeds (the protocol asks for >= 8)")
    if set(seeds) & set(int(s) for s in prereg["calibration"]["seeds"]):
        sys.exit("error: main seeds overlap the calibration seeds")
    if "grpo" not in arms:
        sys.exit("error: the arms must include grpo (the baseline)")
    git = git_info()
    if git["commit"] != prereg["git_commit"]:
        deviations.append(f"commit {git['commit']} differs from the calibration's {prereg['git_commit']}")
    overrides = study_overrides(args)
    for arm in arms:  # fail fast on an arm the trainer does not know, before hours of training
        load_config(args.config, overrides + METHODS[arm])
    work, t0, process = args.work_dir / "main", time.time(), {}
    if not args.reuse:
        process = train_runs(args, work, seeds, arms, overrides)
    elif (work / "process.json").exists():
        process = json.loads((work / "process.json").read_text())
    runs = load_runs(work, seeds, arms, args.steps, args.clock)
    if not runs:
        sys.exit(f"error: no finished runs in {work}")
    rep = {"prereg": prereg, "deviations": deviations, "git": git, "machine": machine(),
           "config": {"arms": {a: METHODS[a] for a in arms}, "seeds": seeds, "parallel": args.parallel,
                      "overrides": overrides, "work_dir": str(work)},
           "study_wall_s": None if args.reuse else time.time() - t0, "process": process,
           "analysis": S.analyse(runs, arms, seeds, prereg, DPPO_FAMILY, ALPHA)}
    rep["posthoc"] = posthoc(rep["analysis"])
    return report(rep, args.out or work / "results.json", args.png or work / "tta")


def report(rep: dict, out: Path, png: Path) -> dict:
    """Plots, the markdown and the JSON of one study (``rep``) — also from a saved results JSON
    (``--from-results``), which re-renders without the run folders."""
    rep["png"] = plot(rep, png)
    text = markdown(rep)
    print(text + "\n\nplots: " + ", ".join(rep["png"]))
    write_json(out, rep)
    out.with_suffix(".md").write_text(text + "\n")
    return rep


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", action="store_true", help="phase 1: GRPO on the calibration seeds -> --prereg")
    ap.add_argument("--prereg", type=Path, default=REPO / "docs" / "benchmarks" / "tta_prereg.json")
    ap.add_argument("--force", action="store_true", help="--calibrate: replace an existing preregistration")
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "quickstart.yaml")
    ap.add_argument("--clock", choices=list(CLOCK_KEYS), default="cpu")
    ap.add_argument("--steps", type=int, default=150, help="RL steps per run")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-prompts", type=int, default=1024,
                    help="eval.max_prompts: fresh draws of the training split (180 facts at the quickstart's size)")
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--arms", nargs="+", choices=list(METHODS), default=None,
                    help=f"--calibrate: the arms to preregister (default {DEFAULT_ARMS}); main: default the "
                         "preregistered arms")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="main seeds (--calibrate records them; default 1..8; main: default the preregistered ones)")
    ap.add_argument("--calibration-seeds", type=int, nargs="+", default=[101, 102])
    ap.add_argument("--min-gain", type=float, default=RULES["min_gain"],
                    help="--calibrate: G_cal below this marks the task unfit")
    ap.add_argument("--parallel", type=int, default=1, help="CLI processes at a time")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every run (part of the protocol)")
    ap.add_argument("--work-dir", type=Path, default=REPO / "runs" / "time_to_accuracy")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per CLI run")
    ap.add_argument("--reuse", action="store_true", help="do not train: re-analyse the finished runs in --work-dir")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted phase: keep finished runs")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (+ .md); default <work-dir>/main/results.json")
    ap.add_argument("--png", type=Path, default=None, help="plot prefix; default <work-dir>/main/tta")
    ap.add_argument("--from-results", type=Path, default=None,
                    help="no training, no run folders: re-render the plots and markdown of a saved results JSON "
                         "(with the post-hoc checks) to --out/--png (default: next to it)")
    args = ap.parse_args(argv)
    args.seeds_given = args.seeds is not None
    args.seeds = args.seeds if args.seeds_given else list(range(1, 9))
    if args.calibrate and set(args.seeds) & set(args.calibration_seeds):
        ap.error("--seeds and --calibration-seeds must be disjoint")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.from_results:
        rep = json.loads(args.from_results.read_text())
        rep["posthoc"] = posthoc(rep["analysis"])
        return report(rep, args.out or args.from_results, args.png or args.from_results.with_suffix(""))
    return calibrate(args) if args.calibrate else main_phase(args)


if __name__ == "__main__":
    main()
