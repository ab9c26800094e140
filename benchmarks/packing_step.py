"""Megatron train-step time by packing method: Dense Prompt Packing (window-greedy) vs padded batches vs FFD vs
verl-style Karmarkar-Karp, on real GSM8K length distributions.

Workload: ``benchmarks/_engine.py`` (GSM8K prompts in the Qwen chat template and reference-answer-based
completion lengths, tokenized with the offline Qwen tokenizer, then SCALED by ``--scale`` = 1/4 by default so
sequences fit the tiny model's context: prompt ~ 1/4 of its real token count, completion ~ 1/4 of its sampled
length, capped at ``--max-completion``). Optionally a DPPO-like random completion keep (``--keep``) so sequence
counts stop being round. ``--dp d > 1`` is SIMULATED in one process: the plan is made for d ranks, each rank's
micro-batches are timed in turn (logprob + train), and the step time is the SLOWEST rank's (a data-parallel step
waits for it).

For each method the kept sequences become micro-batches of capacity ``--capacity`` tokens:
* ``dpp``: ``pack_sequences`` (window-greedy best fit) -> THD micro-batches.
* ``ffd``: ``pack_ffd`` -> THD.  ``verl-kk``: ``pack_verl_kk`` -> THD (bins may exceed C, counted).
* ``padded``: ``pack_padded`` (C // max(l) sequences per micro-batch, in order), every sequence padded to the
  micro-batch's longest: the compute of the classic ``[n, L]`` layout, run through the same THD path.

Timed: ``PolicyEngine.fill_logprobs`` + ``PolicyEngine.train_step`` (the two engine phases of a step), process
CPU time (median over ``--reps``, interleaved) and wall clock (min). Density = real tokens / allocated tokens
(``packing_stats``: bins * C for THD, sum n_b * max l_b for padded). ``time ratio`` = method / dpp.

Run: ``.venv/bin/python benchmarks/packing_step.py [--quick] [--out results.json]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/packing_step.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from benchmarks import _engine as E
from benchmarks import common as C

METHODS = {"dpp": "dpp", "padded": "padded", "ffd": "ffd", "verl-kk": "kk"}


def run(args) -> dict:
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.packing import pack_ffd, pack_padded, pack_sequences, pack_verl_kk, packing_stats

    C.quiet()
    torch.set_num_threads(args.threads)
    questions = E.load_gsm8k(limit=args.questions, seed=args.seed)
    arch = E.bench_arch(args.model)
    loss_cfg = LossConfig(kl_coef=0.0).resolved()
    planners = {"dpp": lambda L, d: pack_sequences(L, args.capacity, d),
                "padded": lambda L, d: pack_padded(L, args.capacity, d),
                "ffd": lambda L, d: pack_ffd(L, args.capacity, d),
                "verl-kk": lambda L, d: pack_verl_kk(L, args.capacity, d)}
    work = {}
    for keep_p in args.keep:
        for s in range(args.steps):
            r = E.make_rollouts(questions, args.prompts, args.group, arch.vocab_size, seed=args.seed + s,
                                scale=args.scale, max_completion=args.max_completion)
            g = torch.Generator().manual_seed(args.seed + 100 + s)
            keep = torch.rand(r.B, r.G, generator=g) < keep_p
            keep[:, 0] = True
            weight = torch.where(keep, 1.0 / keep_p, 0.0)
            for d in args.dp:
                for m, packer in METHODS.items():
                    ranks, lengths = E.plan_micro_batches(r, keep, weight, loss_cfg.aggregation, args.capacity,
                                                          packer, dp=d)
                    stats = packing_stats(planners[m](lengths, d), lengths, args.capacity,
                                          layout="padded" if m == "padded" else "thd")
                    work[keep_p, s, d, m] = {
                        "ranks": ranks, "tokens": sum(lengths), "density": stats.density,
                        "micro_batches": max(len(x) for x in ranks), "equal_counts": stats.equal_counts,
                        "overfilled": stats.overfilled_bins, "imbalance": stats.rank_cost_imbalance,
                        "positions": sum(int(b.tokens.numel()) for x in ranks for b in x),
                        "times": [[] for _ in ranks]}
    D = float(args.prompts * args.group)
    with E.engine_world(arch, loss_cfg, lr=1e-4, seed=args.seed) as engine:
        first = next(iter(work.values()))["ranks"][0]
        engine.fill_logprobs(first)
        engine.train_step(first, D)
        for rep in range(args.reps):
            for key, w in work.items():
                for k, mbs in enumerate(w["ranks"]):  # the DP ranks' shares, one after the other
                    for b in mbs:
                        b.old_logprobs = None
                    wl, cl, _ = E.timed2(engine.fill_logprobs, mbs)
                    wt, ct, _ = E.timed2(engine.train_step, mbs, D)
                    w["times"][k].append((wl + wt, cl + ct, ct))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    results = []
    for keep_p in args.keep:
        for d in args.dp:
            for m in METHODS:
                rows = [work[keep_p, s, d, m] for s in range(args.steps)]
                # a data-parallel step lasts as long as its slowest rank
                cpu = sum(max(E.median([t[1] for t in ts]) for ts in w["times"]) for w in rows) / len(rows)
                train_cpu = sum(max(E.median([t[2] for t in ts]) for ts in w["times"]) for w in rows) / len(rows)
                total_cpu = sum(sum(E.median([t[1] for t in ts]) for ts in w["times"]) for w in rows) / len(rows)
                wall = sum(max(min(t[0] for t in ts) for ts in w["times"]) for w in rows) / len(rows)
                results.append({"keep": keep_p, "dp": d, "method": m,
                                "tokens": sum(w["tokens"] for w in rows) / len(rows),
                                "positions": sum(w["positions"] for w in rows) / len(rows),
                                "density": sum(w["density"] for w in rows) / len(rows),
                                "micro_batches": sum(w["micro_batches"] for w in rows) / len(rows),
                                "equal_counts": all(w["equal_counts"] for w in rows),
                                "imbalance": sum(w["imbalance"] for w in rows) / len(rows),
                                "overfilled": sum(w["overfilled"] for w in rows), "cpu_s": cpu,
                                "train_cpu_s": train_cpu, "all_ranks_cpu_s": total_cpu, "wall_s": wall})
    for r in results:
        base = next(x for x in results if x["keep"] == r["keep"] and x["dp"] == r["dp"] and x["method"] == "dpp")
        r["time_ratio"] = r["cpu_s"] / base["cpu_s"]
        r["wall_ratio"] = r["wall_s"] / base["wall_s"]
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": C.machine(), "arch": arch.__dict__, "results": results}


def markdown(rep: dict) -> str:
    c, a = rep["config"], rep["arch"]
    lines = [f"Megatron engine, 1 process, CPU, {c['threads']} thread(s); qwen2 hidden {a['hidden_size']} x "
             f"{a['num_layers']} layers; B={c['prompts']} x G={c['group']} GSM8K sequences, lengths x {c['scale']}, "
             f"capacity C={c['capacity']}; {c['steps']} steps x {c['reps']} reps. Time = logprob + train phases "
             f"(CPU s, median; wall s, min); ratio = method / dpp.", "",
             "| keep | dp | method | tokens | computed positions | density | micro-batches/rank | rank cost "
             "imbalance | overfilled bins | step CPU s (slowest rank) | train CPU s | time ratio | all ranks CPU s | "
             "wall s | wall ratio |", "|---" * 15 + "|"]
    for r in rep["results"]:
        mb = f"{r['micro_batches']:.1f}" + ("" if r["equal_counts"] else " (unequal)")
        lines.append(f"| {r['keep']:g} | {r['dp']} | {r['method']} | {r['tokens']:.0f} | {r['positions']:.0f} | "
                     f"{r['density']:.3f} | {mb} | {r['imbalance']:.3f} | {r['overfilled']} | {r['cpu_s']:.3f} | "
                     f"{r['train_cpu_s']:.3f} | {r['time_ratio']:.2f} | {r['all_ranks_cpu_s']:.3f} | "
                     f"{r['wall_s']:.3f} | {r['wall_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes for a shared 2-core CPU")
    ap.add_argument("--model", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 4],
                    help="data-parallel sizes: each rank's micro-batches are timed in turn, the step = slowest rank")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--max-completion", type=int, default=96)
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.steps, args.reps, args.questions, args.keep = 16, 1, 2, 400, [1.0, 0.5]
    rep = run(args)
    print(markdown(rep))
    C.write_json(args.out, rep)


if __name__ == "__main__":
    main()
