"""Train-step time per token against the micro-batch capacity ``packing.capacity`` (the curve that chose its
default, documented in ``megatron_dppo/config/sections.py``).

Workload: the quickstart's step shape, 64 prompts x G=8 = 512 sequences, prompt 4-6 tokens, completion 1-6 tokens
(uniform; the warm-started quickstart policy answers in 2-3), the quickstart's model shape (``bench_arch
("small")``), fp32, one torch thread, one process. The SAME sequences are packed with Dense Prompt Packing at each
capacity and trained (``PolicyEngine.train_step``, one update per rollout: no old-log-prob pass); capacities are
interleaved within each repetition. Reported: process CPU seconds per step (median over ``--reps``; far less
sensitive than the wall clock to other processes on a shared machine) and microseconds per token.

Run: ``.venv/bin/python benchmarks/capacity.py [--reps 5] [--capacities 128,256,...] [--out results.json]``
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/capacity.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from benchmarks import _engine as E
from benchmarks import common as C


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacities", default="64,128,256,512,1024,2048,4096")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sequences", type=int, default=512)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from megatron_dppo.algo.losses import LossConfig, sequence_token_weights
    from megatron_dppo.packing import build_rank_micro_batches, pack_sequences

    C.quiet()
    torch.set_num_threads(1)
    arch = E.bench_arch("small")
    g = torch.Generator().manual_seed(0)
    n = args.sequences
    prompt_len = torch.randint(4, 7, (n,), generator=g)
    comp_len = torch.randint(1, 7, (n,), generator=g)
    tokens = [torch.randint(4, arch.vocab_size, (int(a + b),), generator=g).tolist()
              for a, b in zip(prompt_len, comp_len)]
    adv = torch.randn(n, generator=g)
    tw = sequence_token_weights("seq_mean_token_mean", torch.ones(n), comp_len.float())
    lengths = [len(t) for t in tokens]
    caps = [int(c) for c in args.capacities.split(",")]
    plans = {c: build_rank_micro_batches(pack_sequences(lengths, c, 1)[0], tokens, prompt_len.tolist(), adv, tw)
             for c in caps}
    times: dict[int, list[float]] = {c: [] for c in caps}
    with E.engine_world(arch, LossConfig(kl_coef=0.0).resolved(), lr=1e-4) as engine:
        engine.train_step(plans[caps[0]], float(n))  # warm-up
        for rep in range(args.reps):
            for c in caps:
                _, cpu, _ = E.timed2(engine.train_step, plans[c], float(n))
                times[c].append(cpu)
            print(f"rep {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
    total = sum(lengths)
    rows = [{"capacity": c, "micro_batches": len(plans[c]), "cpu_s": E.median(times[c]),
             "us_per_token": 1e6 * E.median(times[c]) / total} for c in caps]
    print(f"{n} sequences, {total} tokens; train_step process CPU s (median of {args.reps}), 1 thread\n")
    print("| capacity | micro-batches | train CPU s | us / token |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['capacity']} | {r['micro_batches']} | {r['cpu_s']:.3f} | {r['us_per_token']:.1f} |")
    C.write_json(args.out, {"machine": C.machine(), "tokens": total, "rows": rows})


if __name__ == "__main__":
    main()
