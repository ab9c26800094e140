"""Time to held-out accuracy: GRPO vs DPPO (two rate settings) vs CPPO vs the DAPO zero-variance filter, several
seeds each, on the worked multi-step arithmetic task (examples/arithmetic_worked.yaml).

What is compared, and how
-------------------------
* The task: "3+4-2+6=" -> "7,5,11" (running totals; 2-4 single-digit operands, + and -). Short problems are
  solved by every sample and long ones by none, so many groups have one reward for all (zero advantage) and
  pruning has something to prune; completions range from 2 to 12 tokens. Accuracy = pass@1 on the HELD-OUT test
  split (expressions never trained on; ``eval.max_prompts`` prompts x ``eval.samples`` samples), measured
  before the first RL step and every ``eval.every`` steps. The training reward is never used to compare
  methods (a pruned run's training reward is an estimate; see docs/algorithms.md, "Metrics").
* Per seed, ONE supervised warm start (``train.steps=0``) is saved and copied for every method, which then
  resumes from it (``checkpoint.resume=must``): within a seed all methods start from the same weights,
  optimizer state, tokenizer, data order and evaluation prompts, so differences are paired.
* Runs are interleaved (seed-major, the method order rotated from seed to seed) and ``--parallel`` of them run
  at a time, so load from other users of the machine hits all methods alike.
* Time = the sum of the RL steps' wall-clock (``time/step``: prompt pruning + generation + reward + completion
  pruning + packing + old log-probs + update + weight sync); evaluation and start-up are excluded (they are
  the same for every method). "End-to-end" speed-up = GRPO seconds per step / method seconds per step, which
  includes generation (DPPO's pruned prompts are never generated). "Train-phase" speed-up = the same on
  ``time/logprob + time/train``; its bound = GRPO trained tokens / method trained tokens.
* Statistics over seeds: mean and a 95% Student-t confidence interval; speed-ups are per-seed paired ratios
  (geometric mean, CI on the log ratio). Time to an accuracy level: RL seconds until the first evaluation at or
  above the level (a run that never reaches it within the budget is counted as not reached, and the mean is
  over the seeds that reached it, shown as "n/N").

This measures the trainer as it is at the commit that produced the JSON (e.g. it recomputes old log-probs every
step); faster step code changes the seconds, not the comparison's method.

Run (takes ~1 h on a shared 2-core box at the default size):
    .venv/bin/python benchmarks/time_to_accuracy.py --out docs/benchmarks/time_to_accuracy.json \\
        --png docs/benchmarks/time_to_accuracy.png
Re-analyse finished runs without training: add ``--reuse``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine, write_json  # noqa: E402

from megatron_dppo.config import load_config  # noqa: E402

METHODS = {
    "grpo": ["algo.pruner=none"],
    "dppo-0.5": ["algo.pruner=dppo", "algo.r_q=0.5", "algo.r_o=0.5"],
    "dppo-0.7": ["algo.pruner=dppo", "algo.r_q=0.7", "algo.r_o=0.7"],
    "cppo-0.5": ["algo.pruner=cppo", "algo.cppo_rate=0.5"],
    "dapo-filter": ["algo.pruner=none", "algo.drop_zero_variance_groups=true"],
}
COMMON = ["logging.progress_bar=false", "logging.plot=false", "logging.tensorboard=false", "checkpoint.every=0",
          "logging.print_every=10"]
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


# ----------------------------------------------------------------------------------------------------------
# Running the CLI
# ----------------------------------------------------------------------------------------------------------
def cli(config: Path, overrides: list[str], log: Path, timeout: float) -> dict:
    """One CLI process; returns its wall seconds and CPU seconds (user + sys, from wait4)."""
    cmd = [sys.executable, "-m", "megatron_dppo.cli", "train", "--config", str(config), *overrides]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO), MASTER_PORT=str(free_port()))
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                raise RuntimeError(f"{' '.join(cmd)} timed out after {timeout} s; log {log}")
            time.sleep(0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
    return {"wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime}


def free_port() -> int:
    """A free TCP port for the run's (single-process) rendezvous: parallel runs must not share one."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def schedule(seeds: list[int], methods: list[str]) -> list[tuple[int, str]]:
    """Seed-major, the method order rotated by one from seed to seed (each method runs early and late)."""
    out = []
    for k, seed in enumerate(seeds):
        order = methods[k % len(methods):] + methods[:k % len(methods)]
        out += [(seed, m) for m in order]
    return out


def run_pool(jobs: list, worker, parallel: int) -> None:
    """Run ``worker(job)`` over ``jobs`` in order with ``parallel`` threads (each starts a CLI process); returns the
    (job, error) of the runs that failed."""
    lock, queue, errors = threading.Lock(), list(jobs), []

    def loop():
        while True:
            with lock:
                if not queue:
                    return
                job = queue.pop(0)
            try:
                worker(job)
            except Exception as err:  # noqa: BLE001 - one failed run must not stop the others; reported at the end
                print(f"FAILED {job}: {err}", flush=True)
                errors.append((job, err))

    threads = [threading.Thread(target=loop) for _ in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


# ----------------------------------------------------------------------------------------------------------
# Reading one run
# ----------------------------------------------------------------------------------------------------------
def read_run(path: Path) -> dict:
    with open(path / "metrics.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    rl = sorted((r for r in records if r.get("phase") == "rl"), key=lambda r: r["step"])
    ev = sorted((r for r in records if r.get("phase") == "eval"), key=lambda r: r["step"])
    seconds, total = [], 0.0
    for r in rl:
        total += r["time/step"]
        seconds.append(total)
    key = next(k for k in ev[0] if k.endswith("/pass@1"))
    # an evaluation logged at step s follows RL step s (step -1: before the first RL step)
    evals = [{"step": e["step"] + 1, "seconds": seconds[e["step"]] if e["step"] >= 0 else 0.0,
              "pass@1": e[key]} for e in ev]

    def mean(k, default=0.0):
        return statistics.fmean(r.get(k, default) for r in rl)

    return {"eval_key": key, "evals": evals, "steps": len(rl), "rl_seconds": total,
            "s_per_step": total / len(rl), "generate_s_per_step": mean("time/generate"),
            "train_s_per_step": mean("time/train") + mean("time/logprob"),
            "tokens_trained_per_step": mean("tokens/trained_sequences"),
            "tokens_generated_per_step": mean("tokens/generated"),
            "prompt_kept_fraction": mean("prune/prompt_kept_fraction", 1.0),
            "total_kept_fraction": mean("prune/total_kept_fraction", 1.0),
            "total_ess": mean("prune/total_ess", float("nan")),
            "zero_variance_groups": mean("reward/zero_variance_groups"),
            "skipped_steps": sum(r.get("train/skipped", 0.0) for r in rl),
            "grad_norm": mean("train/grad_norm", float("nan")),
            "grad_norm_std": statistics.pstdev(r.get("train/grad_norm", 0.0) for r in rl),
            "reward_mean": mean("reward/mean"), "reward_mean_generated": mean("reward/mean_generated", float("nan"))}


# ----------------------------------------------------------------------------------------------------------
# Statistics over seeds
# ----------------------------------------------------------------------------------------------------------
def ci(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% Student-t interval); half-width nan for fewer than 2 values."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def ratio_ci(nums: list[float], dens: list[float]) -> tuple[float, float, float]:
    """Paired ratios num/den: geometric mean and its 95% interval (t on the log ratios)."""
    logs = [math.log(n / d) for n, d in zip(nums, dens) if n and d and n > 0 and d > 0]
    m, h = ci(logs)
    if math.isnan(m):
        return float("nan"), float("nan"), float("nan")
    h = 0.0 if math.isnan(h) else h
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def time_to_level(run: dict, level: float, gain: bool = False) -> tuple[float | None, int | None]:
    """(RL seconds, steps) to the first evaluation at or above ``level`` (with ``gain``: at or above the run's own
    pre-RL accuracy + ``level``, i.e. a gain over the warm start, which differs from seed to seed)."""
    target = level + (run["evals"][0]["pass@1"] if gain else 0.0)
    hit = next((e for e in run["evals"][1:] if e["pass@1"] >= target - 1e-12), None) if gain else \
        next((e for e in run["evals"] if e["pass@1"] >= target), None)
    return (None, None) if hit is None else (hit["seconds"], hit["step"])


def accuracy_at(run: dict, t: float) -> float:
    """Accuracy of the last evaluation at or before RL time t (what a user stopping at t would have)."""
    ev = [e for e in run["evals"] if e["seconds"] <= t + 1e-9]
    return ev[-1]["pass@1"] if ev else float("nan")


def analyse(runs: dict, methods: list[str], seeds: list[int], levels: list[float], gain: bool = False) -> dict:
    base = "grpo" if "grpo" in methods else methods[0]
    out = {"methods": {}, "levels": levels, "baseline": base, "levels_are_gains": gain}
    for m in methods:
        rs = [runs[(s, m)] for s in seeds if (s, m) in runs and (s, base) in runs]
        bs = [runs[(s, base)] for s in seeds if (s, m) in runs and (s, base) in runs]
        if not rs:
            continue
        steps = [e["step"] for e in rs[0]["evals"]]
        acc_by_step = [ci([r["evals"][i]["pass@1"] for r in rs if i < len(r["evals"])]) for i in range(len(steps))]
        # the same minus each seed's own pre-RL accuracy: removes the warm starts' seed-to-seed spread
        gain_by_step = [ci([r["evals"][i]["pass@1"] - r["evals"][0]["pass@1"] for r in rs if i < len(r["evals"])])
                        for i in range(len(steps))]
        final = [r["evals"][-1]["pass@1"] for r in rs]
        gain_final = [r["evals"][-1]["pass@1"] - r["evals"][0]["pass@1"] for r in rs]
        last_half = [statistics.fmean(e["pass@1"] for e in r["evals"][len(r["evals"]) // 2:]) for r in rs]
        base_last_half = [statistics.fmean(e["pass@1"] for e in b["evals"][len(b["evals"]) // 2:]) for b in bs]
        diff = [r["evals"][-1]["pass@1"] - b["evals"][-1]["pass@1"] for r, b in zip(rs, bs)]
        reach = {}
        for level in levels:
            secs = [time_to_level(r, level, gain)[0] for r in rs]
            stp = [time_to_level(r, level, gain)[1] for r in rs]
            base_secs = [time_to_level(b, level, gain)[0] for b in bs]
            paired = [(b, s) for b, s in zip(base_secs, secs) if b is not None and s is not None]
            reach[str(level)] = {"reached": sum(s is not None for s in secs), "of": len(rs),
                                 "seconds": ci([s for s in secs if s is not None]),
                                 "steps": ci([s for s in stp if s is not None]),
                                 "speedup_vs_base": ratio_ci([b for b, _ in paired], [s for _, s in paired])}
        out["methods"][m] = {
            "seeds": len(rs), "eval_steps": steps, "accuracy_by_step": acc_by_step, "gain_by_step": gain_by_step,
            "final_accuracy": ci(final), "final_accuracy_minus_base": ci(diff), "final_gain": ci(gain_final),
            "second_half_accuracy": ci(last_half),
            "second_half_minus_base": ci([a - b for a, b in zip(last_half, base_last_half)]),
            "wins_vs_base_at_equal_steps": sum(d > 0 for d in diff),
            "s_per_step": ci([r["s_per_step"] for r in rs]),
            "end_to_end_speedup": ratio_ci([b["s_per_step"] for b in bs], [r["s_per_step"] for r in rs]),
            "generate_speedup": ratio_ci([b["generate_s_per_step"] for b in bs], [r["generate_s_per_step"] for r in rs]),
            "train_phase_speedup": ratio_ci([b["train_s_per_step"] for b in bs], [r["train_s_per_step"] for r in rs]),
            "train_phase_bound": ratio_ci([b["tokens_trained_per_step"] for b in bs],
                                          [r["tokens_trained_per_step"] for r in rs]),
            "generate_bound": ratio_ci([b["tokens_generated_per_step"] for b in bs],
                                       [r["tokens_generated_per_step"] for r in rs]),
            "prompt_kept_fraction": ci([r["prompt_kept_fraction"] for r in rs]),
            "total_kept_fraction": ci([r["total_kept_fraction"] for r in rs]),
            "total_ess": ci([r["total_ess"] for r in rs]),
            "zero_variance_groups": ci([r["zero_variance_groups"] for r in rs]),
            "grad_norm_std": ci([r["grad_norm_std"] for r in rs]),
            "skipped_steps": ci([r["skipped_steps"] for r in rs]),
            "time_to_level": reach,
            "process_cpu_s": ci([r.get("process", {}).get("cpu_s", float("nan")) for r in rs]),
        }
        # accuracy on a common RL-time grid, up to the shortest run of this method
        horizon = min(r["rl_seconds"] for r in rs)
        grid = [horizon * i / 40 for i in range(41)]
        out["methods"][m]["accuracy_by_time"] = {"seconds": grid,
                                                  "acc": [ci([accuracy_at(r, t) for r in rs]) for t in grid],
                                                  "gain": [ci([accuracy_at(r, t) - r["evals"][0]["pass@1"]
                                                               for r in rs]) for t in grid]}
    return out


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------
def _pm(mh, fmt="{:.3f}") -> str:
    m, h = mh
    if math.isnan(m):
        return "-"
    return fmt.format(m) + ("" if math.isnan(h) else " ± " + fmt.format(h))


def _ratio(r) -> str:
    g, lo, hi = r
    return "-" if math.isnan(g) else f"{g:.2f}x [{lo:.2f}, {hi:.2f}]"


def markdown(rep: dict) -> str:
    a, c = rep["analysis"], rep["config"]
    base = a["baseline"]
    lines = [f"Task {c['config']} ({c['steps']} RL steps, B={c['prompts_per_step']} x G={c['group_size']}); "
             f"{len(c['seeds'])} seeds {c['seeds']}; held-out pass@1 on {c['eval_prompts']} test prompts x "
             f"{c['eval_samples']} samples every {c['eval_every']} steps. ± = 95% t-interval over seeds; speed-ups "
             f"are paired per seed vs {base} (geometric mean [95% CI]).", "",
             "**Accuracy at equal steps and the cost of a step**", "",
             "| method | pass@1 before RL | final pass@1 | final - before | final - grpo | seeds better than grpo | "
             "mean pass@1 over the 2nd half - grpo | s/step | end-to-end speed-up | generate speed-up (bound) | "
             "train-phase speed-up (bound) | kept prompts | kept units | ESS | zero-var groups |", "|---" * 15 + "|"]
    for m, r in a["methods"].items():
        lines.append(
            f"| {m} | {_pm(r['accuracy_by_step'][0])} | {_pm(r['final_accuracy'])} | {_pm(r['final_gain'], '{:+.3f}')} | "
            f"{_pm(r['final_accuracy_minus_base'], '{:+.3f}')} | {r['wins_vs_base_at_equal_steps']}/{r['seeds']} | "
            f"{_pm(r['second_half_minus_base'], '{:+.3f}')} | "
            f"{_pm(r['s_per_step'], '{:.2f}')} | {_ratio(r['end_to_end_speedup'])} | "
            f"{_ratio(r['generate_speedup'])} ({r['generate_bound'][0]:.2f}x) | {_ratio(r['train_phase_speedup'])} "
            f"({r['train_phase_bound'][0]:.2f}x) | {_pm(r['prompt_kept_fraction'], '{:.2f}')} | "
            f"{_pm(r['total_kept_fraction'], '{:.2f}')} | {_pm(r['total_ess'], '{:.0f}')} | "
            f"{_pm(r['zero_variance_groups'], '{:.2f}')} |")
    what = "gain over the warm start >= +{}" if a.get("levels_are_gains") else "pass@1 >= {}"
    lines += ["", "**Time to reach a held-out accuracy level** (RL seconds, eval excluded; n/N = seeds that reached "
              "it within the budget; speed-up = paired ratio to grpo over the seeds where both reached it)", "",
              "| method | " + " | ".join(what.format(lv) + ": s | steps | speed-up" for lv in a["levels"]) + " |",
              "|---" * (1 + 3 * len(a["levels"])) + "|"]
    for m, r in a["methods"].items():
        cells = []
        for lv in a["levels"]:
            t = r["time_to_level"][str(lv)]
            cells += [f"{_pm(t['seconds'], '{:.0f}')} ({t['reached']}/{t['of']})", _pm(t["steps"], "{:.0f}"),
                      _ratio(t["speedup_vs_base"])]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "**Accuracy by step** (mean ± 95% CI)", "",
              "| method | " + " | ".join(f"step {s}" for s in next(iter(a["methods"].values()))["eval_steps"]) + " |",
              "|---" * (1 + len(next(iter(a["methods"].values()))["eval_steps"])) + "|"]
    for m, r in a["methods"].items():
        lines.append(f"| {m} | " + " | ".join(_pm(x) for x in r["accuracy_by_step"]) + " |")
    return "\n".join(lines)


def plot(rep: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = rep["analysis"]
    gain = a.get("levels_are_gains", False)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for m, r in a["methods"].items():
        xs = r["eval_steps"]
        by_step = r["gain_by_step"] if gain else r["accuracy_by_step"]
        ys = [x[0] for x in by_step]
        hs = [0.0 if math.isnan(x[1]) else x[1] for x in by_step]
        (line,) = axes[0].plot(xs, ys, marker="o", ms=3, label=m)
        axes[0].fill_between(xs, [y - h for y, h in zip(ys, hs)], [y + h for y, h in zip(ys, hs)],
                             color=line.get_color(), alpha=0.15)
        t = r["accuracy_by_time"]
        ys = [x[0] for x in t["gain" if gain else "acc"]]
        hs = [0.0 if math.isnan(x[1]) else x[1] for x in t["gain" if gain else "acc"]]
        axes[1].step(t["seconds"], ys, where="post", color=line.get_color(), label=m)
        axes[1].fill_between(t["seconds"], [y - h for y, h in zip(ys, hs)], [y + h for y, h in zip(ys, hs)],
                             step="post", color=line.get_color(), alpha=0.15)
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("RL wall-clock seconds (generation + training; eval excluded)")
    for ax in axes:
        ax.set_ylabel(("held-out pass@1 - the seed's pre-RL pass@1" if gain else "held-out pass@1")
                      + "\n(mean, 95% CI over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    c = rep["config"]
    fig.suptitle(f"Worked arithmetic, {len(c['seeds'])} seeds: held-out accuracy vs steps and vs wall time")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "arithmetic_worked.yaml")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    ap.add_argument("--levels", type=float, nargs="+", default=None,
                    help="held-out pass@1 levels for time-to-accuracy (default: 3 levels between the warm start's "
                         "accuracy and the best final one)")
    ap.add_argument("--gains", action="store_true",
                    help="--levels are gains over each seed's own pre-RL accuracy (the warm starts differ by seed)")
    ap.add_argument("--parallel", type=int, default=2, help="CLI processes at a time")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every run, e.g. eval.max_prompts=64")
    ap.add_argument("--work-dir", type=Path, default=REPO / "runs" / "time_to_accuracy")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--reuse", action="store_true", help="do not train: re-analyse the runs in --work-dir")
    ap.add_argument("--resume", action="store_true",
                    help="continue an interrupted study in --work-dir: keep finished warm starts and runs")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None, help="default: <work-dir>/time_to_accuracy.png")
    args = ap.parse_args(argv)

    common = COMMON + ([f"train.steps={args.steps}"] if args.steps else []) + args.extra
    work = args.work_dir
    process: dict = {}
    t_start = time.time()
    if not args.reuse:
        if work.exists() and not args.resume:
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        if args.resume and (work / "process.json").exists():
            saved = json.loads((work / "process.json").read_text())
            process.update({(int(k.split(":")[0]), k.split(":")[1]): v for k, v in saved.items()})

        def finished(path: Path) -> bool:
            if not (path / "metrics.jsonl").exists():
                return False
            with open(path / "metrics.jsonl", encoding="utf-8") as f:
                steps = sum(json.loads(line).get("phase") == "rl" for line in f if line.strip())
            return steps >= load_config(args.config, common).train.steps

        def warm_done(seed: int) -> bool:  # a stop signal also leaves a checkpoint: check the step count too
            path = work / f"warm{seed}"
            if not (path / "checkpoints" / "latest").exists():
                return False
            with open(path / "metrics.jsonl", encoding="utf-8") as f:
                steps = sum(json.loads(line).get("phase") == "sft" for line in f if line.strip())
            return steps >= load_config(args.config, common).train.sft_steps

        def warm(seed):
            if args.resume and warm_done(seed):
                return
            print(f"[{time.strftime('%H:%M:%S')}] warm start seed {seed}", flush=True)
            if (work / f"warm{seed}").exists():
                shutil.rmtree(work / f"warm{seed}")
            process[(seed, "warm")] = cli(args.config, common + [f"train.seed={seed}", "train.steps=0",
                                                                 "eval.every=0", f"train.output_dir={work / f'warm{seed}'}"],
                                          work / f"warm{seed}.log", args.timeout)
            (work / "process.json").write_text(json.dumps({f"{k[0]}:{k[1]}": v for k, v in process.items()}))

        def train(job):
            seed, m = job
            out = work / f"{m}_s{seed}"
            if args.resume and finished(out):
                return
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(work / f"warm{seed}", out)
            print(f"[{time.strftime('%H:%M:%S')}] {m} seed {seed}", flush=True)
            process[job] = cli(args.config, common + METHODS[m] + [f"train.seed={seed}", "checkpoint.resume=must",
                                                                    f"train.output_dir={out}"],
                               work / f"{m}_s{seed}.log", args.timeout)
            (work / "process.json").write_text(json.dumps({f"{k[0]}:{k[1]}": v for k, v in process.items()}))
            r = read_run(out)
            print(f"[{time.strftime('%H:%M:%S')}]   {m} seed {seed}: {r['steps']} steps, {r['s_per_step']:.2f} s/step, "
                  f"pass@1 {r['evals'][0]['pass@1']:.3f} -> {r['evals'][-1]['pass@1']:.3f}", flush=True)

        failed = run_pool(args.seeds, warm, args.parallel)
        warmed = [s for s in args.seeds if warm_done(s)]
        failed += run_pool(schedule(warmed, args.methods), train, args.parallel)
        if failed:
            print(f"{len(failed)} run(s) failed: {[job for job, _ in failed]} (left out of the analysis)", flush=True)
        (work / "process.json").write_text(json.dumps({f"{k[0]}:{k[1]}": v for k, v in process.items()}))
    else:
        saved = json.loads((work / "process.json").read_text()) if (work / "process.json").exists() else {}
        process = {(int(k.split(":")[0]), k.split(":")[1]): v for k, v in saved.items()}

    runs = {}
    for seed in args.seeds:
        for m in args.methods:
            if (work / f"{m}_s{seed}" / "metrics.jsonl").exists():
                runs[(seed, m)] = read_run(work / f"{m}_s{seed}")
                runs[(seed, m)]["process"] = process.get((seed, m), {})
    if args.levels is None:
        start = statistics.fmean(r["evals"][0]["pass@1"] for r in runs.values())
        best = max(statistics.fmean(runs[(s, m)]["evals"][-1]["pass@1"] for s in args.seeds if (s, m) in runs)
                   for m in args.methods)
        args.levels = [round(start + (best - start) * f, 2) for f in (0.25, 0.5, 0.75)]
    cfg = load_config(args.config, common)
    rep = {"config": {"config": str(args.config.relative_to(REPO)) if args.config.is_relative_to(REPO) else str(args.config),
                      "methods": {m: METHODS[m] for m in args.methods}, "common": common, "seeds": args.seeds,
                      "steps": cfg.train.steps, "prompts_per_step": cfg.train.prompts_per_step,
                      "group_size": cfg.train.group_size, "eval_prompts": cfg.eval.max_prompts,
                      "eval_samples": cfg.eval.samples, "eval_every": cfg.eval.every, "parallel": args.parallel,
                      "levels": args.levels, "levels_are_gains": args.gains},
           "machine": machine(), "study_wall_s": None if args.reuse else time.time() - t_start,
           "runs": {f"{m}_s{s}": r for (s, m), r in runs.items()},
           "analysis": analyse(runs, args.methods, args.seeds, args.levels, args.gains)}
    png = args.png or work / "time_to_accuracy.png"
    plot(rep, png)
    rep["png"] = str(png)
    print(markdown(rep))
    print(f"\nplot: {png}")
    write_json(args.out, rep)
    if args.out:
        args.out.with_suffix(".md").write_text(markdown(rep) + "\n")


if __name__ == "__main__":
    main()
