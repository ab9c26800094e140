"""Preregistered time-to-accuracy study at EQUAL COMPUTE (study 2; docs/benchmarks.md, section 12): does the
prompt level earn its place once every arm gets the same CPU seconds? Primary baseline: the DAPO filter.

Why a second study. Study 1 (``time_to_accuracy.py``, section 6) ran every arm for 150 steps: a cheaper arm
stopped earlier, so its curve was censored where GRPO's went on, and half the pairs of its time endpoint compared
step costs, not learning. Here every arm of a seed runs to the SAME budget of RL CPU seconds, that seed's GRPO
run's 150-step total (``train.cpu_budget_s``), and is evaluated at the same CPU times (``eval.every_cpu_s``): no
arm is stopped early, and the smoothing window of every curve spans the same compute.

Design
------
* Task, accuracy, clock: as study 1 (``examples/quickstart.yaml``; in-distribution pass@1 from fresh samples,
  1024 draws of the training split x 4 samples; cumulative ``time/step_cpu``, the process CPU seconds of the RL
  steps summed over ranks, evaluation and start-up excluded). One warm start per seed, copied into every arm.
* Budget. Per seed, GRPO runs 150 RL steps; its total RL CPU seconds B_s is the budget of every other arm of that
  seed (``train.cpu_budget_s=B_s``, ``train.steps`` capped at 1000; an arm that hits the cap is flagged). So GRPO
  runs first in each seed; the other arms of the seed follow, in an order rotated from seed to seed.
* Evaluations at every multiple of E CPU seconds (E preregistered from the pilot: a sixth of the pilot's GRPO
  total) and after the last step; the curves are smoothed by a 3-evaluation running mean (identical windows in
  CPU seconds for every arm of a seed) and linear in CPU time between evaluations.
* Resumable. Every run checkpoints every 50 steps; a stopped study run again with the same command keeps the
  finished runs (``done.json``), resumes an unfinished one from its last checkpoint (the CPU seconds spent are in
  the checkpoint, so it stops where a straight run would), and starts the rest.

Phases
------
1. ``--pilot`` (calibration seeds 101 and 102, used for nothing else): GRPO 150 steps each, evaluated every 25
   steps as in study 1; G_cal = mean smoothed final gain (fit iff >= 0.10); B_pilot = mean GRPO total; E =
   B_pilot / 6; g* = 0.6 G_cal. Then every other arm once on seed 101 for a quarter of B_pilot WITHOUT any
   evaluation (nothing about its accuracy is measured): steps per CPU second, to check the arms run and size the
   study. Writes the preregistration (``--prereg``), which must be committed before the main phase.
2. main (default): refuses to run without a fit preregistration made for this protocol; runs every arm on the
   main seeds and analyses with the preregistered quantities only.

Endpoints (paired per seed; 95% Student-t intervals over seeds; docs/benchmarks.md section 12 and the
preregistration's text are the reference)
------------------------------------------------------------------------------------------------------------
P  (primary) final accuracy at the budget (smoothed), arm - filter, two-sided t; Holm over the three DPPO arms.
   An arm WINS iff its Holm-adjusted p < 0.05 and the mean difference is > 0; LOSES iff p < 0.05 and < 0.
Q  (pre-specified, the issue's question) posterior-zvf - completion-opt-zvf on P and on the AUC, two-sided,
   unadjusted: the prompt level "beats completion-only at equal cost" iff the P difference is > 0 at p < 0.05.
S  (secondary, unadjusted) time to g* (ratio to the filter; a run that never reaches g* is censored at the
   budget, the same for every arm of the seed); AUC = mean gain over [0, B_s]; every endpoint against GRPO;
   steps done within the budget.

Run (hours on a shared 2-core box; ``--parallel 2``):
    .venv/bin/python benchmarks/tta_equal_compute.py --pilot
    git add docs/benchmarks/tta2_prereg.json && git commit     # BEFORE the main phase
    .venv/bin/python benchmarks/tta_equal_compute.py --parallel 2
    .venv/bin/python benchmarks/tta_equal_compute.py --reuse   # re-analyse whatever has finished
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

if not __package__:  # `python benchmarks/tta_equal_compute.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _tta_stats as S
from benchmarks.common import QUIET, REPO, machine, read_metrics, run_pool, train, write_json
from benchmarks.time_to_accuracy import count_phase, eval_coverage, git_info, read_run
from megatron_dppo.config import load_config

ARMS = {  # nothing tuned per arm; the rates are pinned here and in the preregistration
    "grpo": ["algo.pruner=none"],
    "filter": ["algo.pruner=none", "algo.drop_zero_variance_groups=true"],
    # study 1's "dppo-0.5-zvf": the paper's rule at 0.5 / 0.5 with the filter
    "dppo-uniform-zvf": ["algo.pruner=dppo", "algo.r_q=0.5", "algo.r_o=0.5", "algo.drop_zero_variance_groups=true"],
    # the completion level alone, variance-optimal; r_o 0.7: modelled step cost 0.48 of GRPO's (generation share
    # 0.26, docs/benchmarks.md section 11)
    "completion-opt-zvf": ["algo.pruner=dppo", "algo.dppo_keep=optimal", "algo.r_q=0", "algo.r_o=0.7",
                           "algo.keep_floor=0.3", "algo.keep_length_exponent=0.0",
                           "algo.drop_zero_variance_groups=true"],
    # the posterior at the prompt level (r_q 0.3) + the optimal completion level (r_o 0.4): modelled cost 0.49
    "posterior-zvf": ["algo.pruner=dppo", "algo.dppo_keep=posterior", "algo.r_q=0.3", "algo.r_o=0.4",
                      "algo.keep_floor=0.3", "algo.keep_length_exponent=0.0", "algo.posterior_max_weight=20",
                      "algo.posterior_gamma=1.0", "algo.drop_zero_variance_groups=true"],
}
BASE, FAMILY, QUESTION = "filter", ["dppo-uniform-zvf", "completion-opt-zvf", "posterior-zvf"], \
    ("posterior-zvf", "completion-opt-zvf")
SCREENING = ("left out: the gradient measurement (docs/benchmarks.md section 11) found screening k = 2 of 8 at "
             "2.5x the completion level's error at the CPU regime's cost 0.5 (0.398 vs 0.158), and screening is "
             "not wired into the trainer")
CHECKPOINT_EVERY = 50
COMMON = [*QUIET, "logging.print_every=25",
          "data.arithmetic_eval_split=train", f"checkpoint.every={CHECKPOINT_EVERY}", "checkpoint.keep_last=1"]
RULES = {"g_star": 0.6, "eval_fraction": 1 / 6, "min_gain": 0.10, "smoke_fraction": 0.25}
ALPHA = 0.05


class PreregError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------
def eval_overrides(args, every_cpu_s: float | None, every_steps: int = 0) -> list[str]:
    return [f"eval.every={every_steps}", f"eval.every_cpu_s={'null' if every_cpu_s is None else every_cpu_s}",
            f"eval.max_prompts={args.eval_prompts}", f"eval.samples={args.eval_samples}",
            f"eval.pass_k={min(4, args.eval_samples)}"]


def arm_overrides(args, arm: str, budget: float | None) -> list[str]:
    """GRPO: --grpo-steps steps; every other arm: the seed's budget, steps capped at --max-steps."""
    if arm == "grpo" or budget is None:
        return ARMS[arm] + [f"train.steps={args.grpo_steps}"]
    return ARMS[arm] + [f"train.steps={args.max_steps}", f"train.cpu_budget_s={budget!r}"]


class Study:
    """The run folders of one phase under ``work`` and the jobs that fill them (module docstring)."""

    def __init__(self, args, work: Path, base_overrides: list[str]):
        self.args, self.work, self.base = args, work, base_overrides
        work.mkdir(parents=True, exist_ok=True)
        self.lock, self.cond = threading.Lock(), threading.Condition()
        path = work / "process.json"
        self.process = json.loads(path.read_text()) if path.exists() else {}

    def record(self, key: str, value: dict) -> None:
        with self.lock:
            self.process.setdefault(key, []).append(value)
            (self.work / "process.json").write_text(json.dumps(self.process, indent=1))

    def warm(self, seed: int) -> Path:
        out = self.work / f"warm{seed}"
        if (out / "done.json").exists():
            return out
        shutil.rmtree(out, ignore_errors=True)
        sft = load_config(self.args.config, self.base).train.sft_steps
        print(f"[{time.strftime('%H:%M:%S')}] warm start seed {seed}", flush=True)
        self.record(f"{seed}:warm", train(self.args.config, self.base + [
            f"train.seed={seed}", "train.steps=0", "eval.every=0", "eval.every_cpu_s=null",
            f"train.output_dir={out}"], self.work / f"warm{seed}.log", self.args.timeout))
        if count_phase(out, "sft") < sft:
            raise RuntimeError(f"warm start {out} did not finish its {sft} steps")
        (out / "done.json").write_text(json.dumps({"seed": seed}))
        return out

    def train(self, seed: int, arm: str, overrides: list[str], name: str | None = None) -> Path:
        """One run from the seed's warm start; resumed from its last checkpoint if a previous call was stopped."""
        name = name or f"{arm}_s{seed}"
        out = self.work / name
        if (out / "done.json").exists():
            return out
        if not (out / "checkpoints" / "latest").exists():
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(self.work / f"warm{seed}", out)
            (out / "done.json").unlink()
            resumed = False
        else:
            resumed = True
        print(f"[{time.strftime('%H:%M:%S')}] {name}{' (resumed)' if resumed else ''}", flush=True)
        self.record(f"{seed}:{name}", train(self.args.config, self.base + overrides + [
            f"train.seed={seed}", "checkpoint.resume=must", f"train.output_dir={out}"],
            self.work / f"{name}.log", self.args.timeout))
        cpu, steps = rl_cpu(out)
        (out / "done.json").write_text(json.dumps({"seed": seed, "arm": arm, "rl_cpu_s": cpu, "steps": steps,
                                                   "overrides": overrides}))
        print(f"[{time.strftime('%H:%M:%S')}]   {name}: {steps} steps, {cpu:.1f} CPU s", flush=True)
        return out


def rl_cpu(path: Path) -> tuple[float, int]:
    """(total RL CPU seconds, RL steps) of a run folder, from its metrics."""
    rl = read_metrics(path, "rl")
    return math.fsum(r["time/step_cpu"] for r in rl), len(rl)


def schedule(seeds: list[int], arms: list[str]) -> list[tuple[int, str]]:
    """Seed-major; GRPO first in each seed (its total is the budget), the other arms rotated from seed to seed."""
    others = [a for a in arms if a != "grpo"]
    out = []
    for k, seed in enumerate(seeds):
        order = others[k % len(others):] + others[:k % len(others)] if others else []
        out += [(seed, "grpo")] * ("grpo" in arms) + [(seed, a) for a in order]
    return out


# ----------------------------------------------------------------------------------------------------------
# Protocol and preregistration
# ----------------------------------------------------------------------------------------------------------
def protocol(args) -> dict:
    config = Path(args.config).resolve()
    return {"config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config),
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest(), "clock": "cpu",
            "grpo_steps": args.grpo_steps, "max_steps": args.max_steps, "overrides": COMMON + list(args.extra),
            "eval_prompts": args.eval_prompts, "eval_samples": args.eval_samples, "arms": ARMS}


def load_prereg(path: Path, current: dict) -> dict:
    if not Path(path).exists():
        raise PreregError(f"no preregistration at {path}: run the pilot first (--pilot --prereg {path})")
    prereg = json.loads(Path(path).read_text())
    if not prereg.get("fit", False):
        raise PreregError(f"task unfit ({path}): {prereg.get('reason')}")
    registered = prereg.get("protocol", {})
    diff = [f"{k}: preregistered {registered.get(k)!r}, now {current.get(k)!r}" for k in current
            if registered.get(k) != current.get(k)]
    if diff:
        raise PreregError(f"{path} was made for another protocol:\n  " + "\n  ".join(diff))
    return prereg


def pilot(args) -> dict:
    if args.prereg.exists() and not args.force:
        sys.exit(f"error: {args.prereg} exists (a preregistration is written once); --force replaces it")
    study = Study(args, args.work_dir / "pilot", COMMON + list(args.extra))
    seeds = args.calibration_seeds
    errors = run_pool(seeds, study.warm, args.parallel)
    errors += run_pool(seeds, lambda s: study.train(
        s, "grpo", arm_overrides(args, "grpo", None)
        + eval_overrides(args, None, every_steps=max(1, args.grpo_steps // 6))),
        args.parallel)
    if errors:
        sys.exit(f"error: pilot GRPO runs failed: {errors}")
    runs = {s: read_run(study.work / f"grpo_s{s}", "cpu") for s in seeds}
    gains = {str(s): S.gain_curve(r["t"], r["acc"])["final_gain"] for s, r in runs.items()}
    totals = {str(s): r["total"] for s, r in runs.items()}
    b_pilot = statistics.fmean(totals.values())
    every = float(f"{RULES['eval_fraction'] * b_pilot:.2g}")
    smoke = {}

    def smoke_run(arm: str) -> None:
        budget = float(f"{RULES['smoke_fraction'] * b_pilot:.2g}")
        out = study.train(seeds[0], arm, arm_overrides(args, arm, budget) + eval_overrides(args, None),
                          name=f"smoke-{arm}_s{seeds[0]}")
        cpu, steps = rl_cpu(out)
        smoke[arm] = {"budget_cpu_s": budget, "steps": steps, "cpu_s": cpu, "cpu_s_per_step": cpu / max(steps, 1)}

    errors = run_pool([a for a in ARMS if a != "grpo"], smoke_run, args.parallel)
    if errors:
        sys.exit(f"error: pilot arm runs failed: {errors}")
    g_cal = statistics.fmean(gains.values())
    fit = g_cal >= args.min_gain
    cfg = load_config(args.config, COMMON + list(args.extra) + eval_overrides(args, None))  # (eval.max_prompts)
    info = git_info()
    prereg = {
        "study": "time_to_accuracy_equal_compute", "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "git_commit": info["commit"], "git_dirty": info["dirty"], "protocol": protocol(args),
        "metric": "in-distribution pass@1 from fresh samples",
        "eval_coverage": {str(s): eval_coverage(cfg, s) for s in seeds + args.seeds},
        "pilot": {"seeds": seeds, "grpo_final_gain": gains, "grpo_total_cpu_s": totals, "G_cal": g_cal,
                  "B_pilot": b_pilot, "arm_step_costs_seed": seeds[0], "arm_step_costs": smoke,
                  "grpo_cpu_s_per_step": {str(s): r["total"] / r["steps"] for s, r in runs.items()},
                  "note": "the arms' pilot runs had no evaluation: nothing about their accuracy was measured"},
        "fit": fit, "min_gain": args.min_gain, "reason": None if fit else f"G_cal = {g_cal:.4f} < {args.min_gain}",
        "g_star": RULES["g_star"] * g_cal, "g_star_rule": f"{RULES['g_star']} * G_cal",
        "eval_every_cpu_s": every, "eval_rule": "B_pilot / 6, to 2 significant digits",
        "budget_rule": f"per seed: the GRPO run's total RL CPU seconds over {args.grpo_steps} steps; every other "
                       f"arm of the seed runs to it (train.cpu_budget_s; train.steps capped at {args.max_steps}, a "
                       "run that hits the cap is flagged)",
        "arms": ARMS, "primary_base": BASE, "family": FAMILY, "question": list(QUESTION), "screening": SCREENING,
        "main_seeds": args.seeds,
        "endpoints": {
            "P": "primary: final smoothed (3-evaluation running mean) accuracy at the budget, arm - filter, paired "
                 "over seeds, two-sided Student t; Holm over the family (dppo-uniform-zvf, completion-opt-zvf, "
                 "posterior-zvf) at family-wise 0.05. Win: Holm p < 0.05 and mean difference > 0; loss: Holm p < "
                 "0.05 and < 0; otherwise no difference shown.",
            "Q": "pre-specified, unadjusted: posterior-zvf - completion-opt-zvf, on P's quantity and on the AUC, "
                 "two-sided t. The prompt level beats completion-only at equal compute iff the final-accuracy "
                 "difference is > 0 with p < 0.05; if not, the library's defaults and docs recommend r_q = 0 on "
                 "a CPU-like regime (generation at most ~1/3 of the step).",
            "S1": "secondary: time to g* (smoothed, interpolated gain curve; never reached = censored at the budget, "
                  "the same for every arm of a seed), paired ratio to the filter, geometric mean and t on logs",
            "S2": "secondary: AUC = mean smoothed gain over [0, B_s], paired difference to the filter",
            "S3": "secondary: P, S1 and S2 against GRPO; steps done within the budget",
        },
        "note": "rates pinned at registration: completion-opt-zvf and posterior-zvf at the same modelled step cost "
                "(0.48 and 0.49 of GRPO's with generation at 0.26 of the step, section 11); dppo-uniform-zvf as "
                "registered in study 1. With the budget every arm gets the same compute whatever its step cost.",
    }
    write_json(args.prereg, prereg)
    print(json.dumps({k: prereg[k] for k in ("fit", "g_star", "eval_every_cpu_s")}, indent=1),
          json.dumps(prereg["pilot"], indent=1))
    return prereg


# ----------------------------------------------------------------------------------------------------------
# Main phase
# ----------------------------------------------------------------------------------------------------------
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
    git = git_info()
    if git["commit"] != prereg["git_commit"]:
        deviations.append(f"commit {git['commit']} differs from the pilot's {prereg['git_commit']}")
    base = COMMON + list(args.extra) + eval_overrides(args, prereg["eval_every_cpu_s"])
    study = Study(args, args.work_dir / "main", base)
    budgets: dict[int, float] = {}

    def budget(seed: int) -> float | None:
        if seed not in budgets and (study.work / f"grpo_s{seed}" / "done.json").exists():
            budgets[seed] = rl_cpu(study.work / f"grpo_s{seed}")[0]
        return budgets.get(seed)

    if not args.reuse:
        for arm in arms:  # fail fast on an arm the trainer does not know
            load_config(args.config, base + arm_overrides(args, arm, 1.0))
        warm_errors = run_pool(seeds, study.warm, args.parallel)
        warmed = [s for s in seeds if (study.work / f"warm{s}" / "done.json").exists()]
        errors = run_pool(schedule(warmed, arms),
                          lambda j: study.train(j[0], j[1], arm_overrides(args, j[1], budget(j[0]))), args.parallel,
                          ready=lambda j: j[1] == "grpo" or budget(j[0]) is not None)
        if warm_errors or errors:
            print(f"{len(warm_errors) + len(errors)} job(s) failed: {[j for j, _ in warm_errors + errors]}")
    runs = {}
    for s in seeds:
        for a in arms:
            path = study.work / f"{a}_s{s}"
            if (path / "done.json").exists():
                runs[(s, a)] = {**read_run(path, "cpu"), "budget": budget(s)}
    rep = {"prereg": prereg, "deviations": deviations, "git": git, "machine": machine(),
           "config": {"arms": {a: ARMS[a] for a in arms}, "seeds": seeds, "parallel": args.parallel,
                      "work_dir": str(study.work)},
           "process": study.process, "analysis": analyse(runs, arms, seeds, prereg)}
    out = args.out or study.work / "results.json"
    write_json(out, rep)
    text = markdown(rep)
    out.with_suffix(".md").write_text(text + "\n")
    rep["png"] = plot(rep, args.png or out.with_suffix(""))
    print(text)
    return rep


# ----------------------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------------------
def summarize(run: dict, g_star: float, max_steps: int) -> dict:
    c = S.gain_curve(run["t"], run["acc"])
    horizon = run["budget"] if run.get("budget") else run["total"]
    t_g, censored = S.time_to_target(c["t"], c["gain"], g_star, run["total"])
    return {"pre": c["pre"], "final": c["final"], "final_gain": c["final_gain"], "final_raw": run["acc"][-1],
            "total": run["total"], "total_wall": run["total_wall"], "steps": run["steps"],
            "budget": run.get("budget"), "hit_cap": run["steps"] >= max_steps, "time_to_g": t_g,
            "censored": censored, "auc": S.area_mean(c["t"], c["gain"], horizon),
            "evals": len(run["t"]), "curve": c}


def compare(summ: dict, arm: str, base: str, seeds: list[int]) -> dict:
    both = [s for s in seeds if (s, arm) in summ and (s, base) in summ]
    a, b = [summ[(s, arm)] for s in both], [summ[(s, base)] for s in both]
    return {"seeds": both,
            "final": S.paired_test([x["final"] - y["final"] for x, y in zip(a, b)]),
            "auc": S.paired_test([x["auc"] - y["auc"] for x, y in zip(a, b)]),
            "time_to_g": {**S.ratio_test([x["time_to_g"] for x in a], [y["time_to_g"] for y in b]),
                          "censored_arm": [s for s, x in zip(both, a) if x["censored"]],
                          "censored_base": [s for s, y in zip(both, b) if y["censored"]]},
            "steps_ratio": S.ratio_test([x["steps"] for x in a], [y["steps"] for y in b]),
            "cpu_ratio": S.ratio_test([x["total"] for x in a], [y["total"] for y in b])}


def verdict(res: dict, p: float) -> str:
    if p is None or math.isnan(p):
        return "n/a"
    if p >= ALPHA:
        return "no difference shown"
    return "WIN (higher)" if res["mean"] > 0 else "LOSS (lower)"


def analyse(runs: dict, arms: list[str], seeds: list[int], prereg: dict) -> dict:
    summ = {k: summarize(r, prereg["g_star"], prereg["protocol"]["max_steps"]) for k, r in runs.items()}
    out = {"g_star": prereg["g_star"], "eval_every_cpu_s": prereg["eval_every_cpu_s"],
           "per_run": {f"{a}_s{s}": {"seed": s, "arm": a, **{k: v for k, v in x.items() if k != "curve"}}
                       for (s, a), x in summ.items()},
           "seeds_complete": [s for s in seeds if all((s, a) in summ for a in arms)], "arms": {}, "vs": {}}
    for base in (BASE, "grpo"):
        if base in arms:
            out["vs"][base] = {a: compare(summ, a, base, seeds) for a in arms if a != base}
    primary = out["vs"].get(BASE, {})
    for a, p in S.holm({a: primary[a]["final"]["p"] for a in FAMILY if a in primary}).items():
        primary[a]["final"]["p_holm"] = p
        primary[a]["final"]["verdict"] = verdict(primary[a]["final"], p)
    if all(a in arms for a in QUESTION):
        out["question"] = compare(summ, QUESTION[0], QUESTION[1], seeds)
        q = out["question"]["final"]
        q["verdict"] = ("the prompt level beats completion-only" if q["p"] < ALPHA and q["mean"] > 0 else
                        "the prompt level does not beat completion-only") if not math.isnan(q["p"]) else "n/a"
    for a in arms:
        rs = [summ[(s, a)] for s in seeds if (s, a) in summ]
        if not rs:
            continue
        grid = [i / 30 for i in range(31)]  # fractions of each run's budget
        out["arms"][a] = {
            "n": len(rs), "reached": sum(not r["censored"] for r in rs), "hit_cap": sum(r["hit_cap"] for r in rs),
            "pre": S.mean_ci([r["pre"] for r in rs]), "final": S.mean_ci([r["final"] for r in rs]),
            "final_gain": S.mean_ci([r["final_gain"] for r in rs]), "auc": S.mean_ci([r["auc"] for r in rs]),
            "steps": S.mean_ci([r["steps"] for r in rs]), "total": S.mean_ci([r["total"] for r in rs]),
            "gain_by_budget_fraction": {"f": grid, "gain": [S.mean_ci([S.interp(
                [t / (r["budget"] or r["total"]) for t in r["curve"]["t"]], r["curve"]["gain"], f) for r in rs])
                for f in grid]}}
    return out


def _ci(r: dict, digits: int = 3, signed: bool = True) -> str:
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    if r.get("n", 0) < 2:
        return f.format(r.get("mean", math.nan)) if r.get("n") else "-"
    return f"{f.format(r['mean'])} [{f.format(r['lo'])}, {f.format(r['hi'])}]"


def _ratio(r: dict) -> str:
    return "-" if not r.get("n") else f"{r['geo_mean']:.2f}x [{r['lo']:.2f}, {r['hi']:.2f}]"


def markdown(rep: dict) -> str:
    an, pre = rep["analysis"], rep["prereg"]
    lines = ["# Time to accuracy at equal compute (study 2)", "",
             f"g* = {pre['g_star']:.4f} (0.6 G_cal, G_cal {pre['pilot']['G_cal']:.4f}); evaluations every "
             f"{pre['eval_every_cpu_s']} CPU s and at the budget; seeds complete: {an['seeds_complete']}; "
             f"commit {rep['git']['commit']}{' (dirty)' if rep['git']['dirty'] else ''}.", ""]
    if rep["deviations"]:
        lines += ["**Deviations:** " + "; ".join(rep["deviations"]), ""]
    lines += ["| arm | n | steps in the budget | RL CPU s | pre-RL | final (smoothed) | AUC (mean gain) | reached g* |",
              "|---|---|---|---|---|---|---|---|"]
    for a, r in an["arms"].items():
        cap = f" (cap hit {r['hit_cap']})" if r["hit_cap"] else ""
        lines.append(f"| {a} | {r['n']} | {r['steps']['mean']:.0f}{cap} | {r['total']['mean']:.1f} | "
                     f"{r['pre']['mean']:.3f} | {_ci(r['final'], signed=False)} | {_ci(r['auc'])} | "
                     f"{r['reached']}/{r['n']} |")
    for base, title in ((BASE, "Against the DAPO filter (P primary, Holm over the DPPO arms)"),
                        ("grpo", "Against GRPO (secondary, unadjusted)")):
        if base not in an["vs"]:
            continue
        lines += ["", f"**{title}**", "",
                  "| arm | seeds | final accuracy - base | p (Holm) | verdict | AUC - base | time to g*, ratio | "
                  "steps ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for a, c in an["vs"][base].items():
            f = c["final"]
            p = f"{f['p']:.3g}" + (f" ({f['p_holm']:.3g})" if f.get("p_holm") is not None else "")
            v = f.get("verdict", verdict(f, f["p"]) + " (unadjusted)")
            lines.append(f"| {a} | {len(c['seeds'])} | {_ci(f)} | {p} | {v} "
                         f"| {_ci(c['auc'])} | {_ratio(c['time_to_g'])} | {_ratio(c['steps_ratio'])} |")
    if "question" in an:
        q = an["question"]
        lines += ["", f"**The question (pre-specified): {QUESTION[0]} - {QUESTION[1]}**: final accuracy "
                  f"{_ci(q['final'])} (p {q['final']['p']:.3g}), AUC {_ci(q['auc'])} (p {q['auc']['p']:.3g}), "
                  f"over seeds {q['seeds']}: {q['final']['verdict']}."]
    lines += ["", f"Screening: {SCREENING}.", "", "Every run:", "",
              "| run | steps | RL CPU s | budget | pre | final | AUC | time to g* |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(an["per_run"].items(), key=lambda kv: (kv[1]["seed"], kv[1]["arm"])):
        tg = "never" if r["censored"] else f"{r['time_to_g']:.1f}"
        budget = "-" if r["budget"] is None else f"{r['budget']:.1f}"
        lines.append(f"| {name} | {r['steps']} | {r['total']:.1f} | {budget} | {r['pre']:.3f} | {r['final']:.3f} | "
                     f"{r['auc']:+.3f} | {tg} |")
    return "\n".join(lines)


def plot(rep: dict, prefix: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    an = rep["analysis"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a, r in an["arms"].items():
        g = r["gain_by_budget_fraction"]
        mean = [x["mean"] for x in g["gain"]]
        ax.plot(g["f"], mean, label=f"{a} (n={r['n']}, {r['steps']['mean']:.0f} steps)")
        lo = [x["lo"] for x in g["gain"]]
        hi = [x["hi"] for x in g["gain"]]
        if all(math.isfinite(v) for v in lo + hi):
            ax.fill_between(g["f"], lo, hi, alpha=0.12)
    ax.set_xlabel("RL CPU seconds / the seed's budget (GRPO's 150-step total)")
    ax.set_ylabel("gain in pass@1 (smoothed)")
    ax.set_title("Equal compute: gain vs CPU seconds (mean, 95% CI over seeds)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path = Path(f"{prefix}_curves.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pilot", action="store_true", help="phase 1: the calibration seeds -> --prereg")
    ap.add_argument("--prereg", type=Path, default=REPO / "docs" / "benchmarks" / "tta2_prereg.json")
    ap.add_argument("--force", action="store_true", help="--pilot: replace an existing preregistration")
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "quickstart.yaml")
    ap.add_argument("--grpo-steps", type=int, default=150, help="GRPO's RL steps: their CPU seconds are the budget")
    ap.add_argument("--max-steps", type=int, default=1000, help="cap of train.steps under the budget")
    ap.add_argument("--eval-prompts", type=int, default=1024)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=None, help="main: default the preregistered")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="main seeds (default 1..8)")
    ap.add_argument("--calibration-seeds", type=int, nargs="+", default=[101, 102])
    ap.add_argument("--min-gain", type=float, default=RULES["min_gain"], help="--pilot: G_cal below it: unfit")
    ap.add_argument("--parallel", type=int, default=1, help="CLI processes at a time")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every run (part of the protocol)")
    ap.add_argument("--work-dir", type=Path, default=REPO / "runs" / "tta_equal_compute")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per CLI run")
    ap.add_argument("--reuse", action="store_true", help="no training: analyse the finished runs in --work-dir")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (+ .md); default <work-dir>/main/results.json")
    ap.add_argument("--png", type=Path, default=None, help="plot prefix; default next to --out")
    args = ap.parse_args(argv)
    args.seeds_given = args.seeds is not None
    args.seeds = args.seeds if args.seeds_given else list(range(1, 9))
    if set(args.seeds) & set(args.calibration_seeds):
        ap.error("--seeds and --calibration-seeds must be disjoint")
    return args


def main(argv=None):
    args = parse_args(argv)
    return pilot(args) if args.pilot else main_phase(args)


if __name__ == "__main__":
    main()
