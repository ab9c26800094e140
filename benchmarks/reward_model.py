"""Reward models on the CPU quickstart (issue 33), one seed, every run through the CLI:

1. ``megatron-dppo rm train`` (or ``--rm DIR``): a Bradley-Terry classifier on arithmetic preference pairs; its
   pairwise accuracy on held-out pairs (test-split problems) and its CPU seconds.
2. One warm start (``train.sft_steps``, ``train.steps=0``), copied for every run (as ``time_to_reward.py``), so the
   runs start from the same weights, optimizer state, tokenizer and data order.
3. Runs (``--runs``): ``rule`` (GRPO on the rule reward), ``rm`` (GRPO on the reward model alone,
   reward.model.rule_weight=0, with the audit log), ``rm_dppo`` (DPPO on the reward model; the prompt history
   ``algo.history_score=auto`` = reward_std), ``rm_dppo_absadv`` (the same with the paper's mean |A| history).
4. Reported:
   * time to a rule-accuracy level: RL steps and seconds (sum of ``time/step``: generation, reward INCLUDING the
     reward model, update, sync; evaluation and start-up excluded) until the evaluation pass@1 (the rule's
     correctness on fresh samples of the training facts) reaches ``--eval-target``: ``rm`` vs ``rule``;
   * DPPO's step time with the reward model's cost included: median ``time/step`` and ``time/reward_model`` of
     ``rm`` (no pruning) vs ``rm_dppo``, their ratio, the kept fractions;
   * which prompt-history score predicts the next visit's |A|: from ``rm``'s audit log (no pruning: every prompt
     is generated at every visit), over consecutive visits (v, v+1) of a prompt, the Spearman correlation of each
     score at v (mean |A| of the std-normalized advantages; the std of the raw rewards) with the next visit's
     mean |A| (std-normalized, what GRPO's loss weighs) and mean |r - mean r| (the unnormalized advantage, the
     scale of the signal); the same on the ``rule`` run's audit log (binary rewards) for contrast;
   * agreement: mean reward/rule_model_tau of the ``rm`` run.

Run: ``.venv/bin/python benchmarks/reward_model.py [--quick] [--out results.json]`` (``--quick``: 60 warm-start and
40 RL steps of 32 prompts).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/reward_model.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import QUIET, REPO, cli, read_metrics, run, train, write_json
from benchmarks.time_to_reward import summarize

RUNS = {"rule": ["algo.pruner=none", "logging.audit_log=true"],
        "rm": ["algo.pruner=none", "logging.audit_log=true", "{rm}"],
        "rm_dppo": ["algo.pruner=dppo", "{rm}"],
        "rm_dppo_absadv": ["algo.pruner=dppo", "algo.history_score=mean_abs_adv", "{rm}"]}


def train_rm(args, out: Path) -> dict:
    seconds = run(cli("rm", "train", "--config", str(args.config), "--out", str(out), *args.rm_args),
                  out.with_suffix(".log"), args.timeout)["wall_s"]
    record = json.loads((out / "reward_model.json").read_text())
    record["process_seconds"] = seconds
    return record


# ----------------------------------------------------------------------------------------------------------------
# Which history score predicts the next visit's |A|
# ----------------------------------------------------------------------------------------------------------------
def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def history_prediction(audit: Path) -> dict:
    """Spearman of each score at visit v with each target at visit v + 1, over every prompt's consecutive visits."""
    visits: dict[str, list[dict]] = {}
    for line in audit.read_text().splitlines():
        rec = json.loads(line)
        if "rewards" in rec:
            visits.setdefault(rec["prompt_id"], []).append(rec)

    def stats(rec):
        r, a = rec["rewards"], rec["advantages"]
        mean = statistics.fmean(r)
        return {"mean_abs_adv": statistics.fmean(abs(x) for x in a), "reward_std": statistics.pstdev(r),
                "raw_abs_adv": statistics.fmean(abs(x - mean) for x in r)}

    pairs = [(stats(v[i]), stats(v[i + 1])) for v in visits.values() for i in range(len(v) - 1)]
    out = {"pairs": len(pairs)}
    for score in ("mean_abs_adv", "reward_std"):
        for target in ("mean_abs_adv", "raw_abs_adv"):
            out[f"{score}->next_{target}"] = spearman([p[score] for p, _ in pairs], [n[target] for _, n in pairs])
    out["mean_abs_adv_mean"] = statistics.fmean(p["mean_abs_adv"] for p, _ in pairs) if pairs else float("nan")
    out["mean_abs_adv_sd"] = statistics.pstdev(p["mean_abs_adv"] for p, _ in pairs) if pairs else float("nan")
    return out


# ----------------------------------------------------------------------------------------------------------------
def step_costs(records: list[dict]) -> dict:
    rl = [r for r in records if r.get("phase") == "rl"][1:]  # (the first step warms up)

    def med(key):
        values = [r[key] for r in rl if key in r]
        return statistics.median(values) if values else float("nan")

    return {"step_s": med("time/step"), "step_cpu_s": med("time/step_cpu"), "reward_cpu_s": med("time_cpu/reward"),
            "reward_model_s": med("time/reward_model"), "reward_s": med("time/reward"),
            "generate_s": med("time/generate"), "train_s": med("time/train"),
            "prompt_kept": med("prune/prompt_kept_fraction"), "total_kept": med("prune/total_kept_fraction"),
            "tau": statistics.fmean(r["reward/rule_model_tau"] for r in rl if "reward/rule_model_tau" in r)
            if any("reward/rule_model_tau" in r for r in rl) else float("nan")}


def markdown(rep: dict) -> str:
    rm = rep["reward_model"]
    lines = [f"Reward model: {rm['pairs']} training pairs, held-out pairwise accuracy {rm['heldout_accuracy']:.3f} "
             f"({rm['heldout_pairs']} pairs of test-split problems), train {rm['train_accuracy']:.3f}, "
             f"{rm['cpu_seconds']:.0f} CPU s ({rm['seconds']:.0f} s wall).", "",
             f"Target: evaluation pass@1 (the rule's correctness) >= {rep['eval_target']}.", "",
             "| run | steps | steps to target | s to target | final pass@1 | median s/step | median reward-model "
             "s/step | prompt kept | total kept | mean tau(rule, model) |", "|---" * 10 + "|"]
    for r in rep["results"]:
        c = r["costs"]
        st = "not reached" if r["eval_steps_to_target"] is None else str(r["eval_steps_to_target"])
        ss = "-" if r["eval_seconds_to_target"] is None else f"{r['eval_seconds_to_target']:.1f}"
        lines.append(f"| {r['name']} | {r['steps']} | {st} | {ss} | {r['final_eval_pass@1']:.3f} | {c['step_s']:.3f} "
                     f"| {c['reward_model_s']:.3f} | {c['prompt_kept']:.2f} | {c['total_kept']:.2f} | "
                     f"{c['tau']:.3f} |")
    for name, h in rep["history"].items():
        lines += ["", f"History scores, {name} run ({h['pairs']} consecutive visits; mean |A| at a visit: "
                      f"{h['mean_abs_adv_mean']:.3f} +- {h['mean_abs_adv_sd']:.3f}), Spearman with the next visit's:",
                  "", "| score at visit v | next mean abs(A) (normalized) | next mean abs(r - mean r) |",
                  "|---|---|---|"]
        for score in ("mean_abs_adv", "reward_std"):
            lines.append(f"| {score} | {h[f'{score}->next_mean_abs_adv']:.3f} "
                         f"| {h[f'{score}->next_raw_abs_adv']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "quickstart.yaml")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's)")
    ap.add_argument("--eval-target", type=float, default=0.3)
    ap.add_argument("--rm", type=Path, default=None, help="an existing reward model (default: train one)")
    ap.add_argument("--rm-args", nargs="*", default=[], help="arguments of `megatron-dppo rm train`")
    ap.add_argument("--work-dir", type=Path, default=REPO / "runs" / "reward_model")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every run")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    common = [*QUIET, "checkpoint.every=0", "logging.print_every=10"]
    if args.quick:
        common += ["train.sft_steps=60", "eval.max_prompts=50", "eval.every=10", "train.prompts_per_step=32"]
        args.steps = args.steps or 40
    if args.steps:
        common.append(f"train.steps={args.steps}")
    common += args.extra
    work = args.work_dir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    rm_dir = args.rm or work / "reward_model"
    record = json.loads((rm_dir / "reward_model.json").read_text()) if args.rm else train_rm(args, rm_dir)
    print(f"reward model {rm_dir}: held-out pairwise accuracy {record['heldout_accuracy']:.3f}", flush=True)
    warm = work / "warm"
    train(args.config, common + ["train.steps=0", "eval.every=0", f"train.output_dir={warm}"], work / "warm.log",
          args.timeout)
    results, history = [], {}
    for name in args.runs:
        out = work / name
        shutil.copytree(warm, out)
        overrides = [o.format(rm=f"reward.model.path={rm_dir}") for o in RUNS[name]]
        s = train(args.config, common + overrides + ["checkpoint.resume=must", f"train.output_dir={out}"],
                  work / f"{name}.log", args.timeout)["wall_s"]
        records = read_metrics(out)
        result = summarize(name, records, s, args.eval_target)
        result["costs"] = step_costs(records)
        results.append(result)
        if (out / "audit.jsonl").is_file():
            history[name] = history_prediction(out / "audit.jsonl")
        print(f"  {name}: final pass@1 {result['final_eval_pass@1']:.3f}, median step {result['costs']['step_s']:.3f}"
              f" s", flush=True)
    rep = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "common": common,
           "eval_target": args.eval_target, "reward_model": record, "results": results, "history": history}
    print(markdown(rep))
    write_json(args.out, rep)


if __name__ == "__main__":
    main()
