"""Where the time of an RL step goes on a real model, and how far the train phase is from the machine's matmul peak.

    .venv/bin/python benchmarks/real_step_profile.py --out docs/benchmarks/real_step_profile.json

The work: ``examples/smollm2_list_max_cpu.yaml`` (SmolLM2-135M-Instruct, 8 prompts x 8 completions of <= 32
tokens, GRPO, one update per rollout, no KL term) for ``--steps`` RL steps after one warm-up step, through the
trainer's own ``rl_step``; no evaluation, no checkpoints. Measured in the same process, one after the other:

1. **The matmul peak**: ``torch.mm`` of fp32 ``[n, n]`` matrices (n = 512, 1024, 2048) with the run's torch threads;
   the best GFLOP per CPU-second and per wall-second over the repetitions. On a shared machine the wall clock is
   inflated by other users, the CPU seconds much less: the comparison that matters is FLOP per CPU-second of the
   train phase against FLOP per CPU-second of ``torch.mm``.
2. **The step by phase** (the trainer's phases: generate, reward, prune, pack, logprob, train, weight_sync), wall and
   process-CPU seconds, and inside ``train``: Megatron's forward steps (model + loss), backward steps and the
   optimizer step (CPU seconds; timed by wrapping ``schedules.forward_step`` / ``backward_step`` and the
   optimizer's ``step``).
3. **Train-phase FLOP** counted from the packed micro-batches: 6 x (the matmul parameters: attention and MLP
   projections of every layer, and the output layer) per position, plus the attention scores and values
   (12 x layers x heads x head_dim x n^2 per sequence of n positions, forward and backward, causal masking not
   discounted). ``model`` counts every position the model computes (the prompt too); with
   ``--restrict-output`` unset the output layer runs on every position, else only where a loss is taken.
4. **Operators** of one step (``torch.profiler``, self CPU time, the top ones).
5. **Generation: our engine against plain ``generate``** on the same rows (the step's prompts, each repeated G
   times), the same model and sampling, and the same number of decode steps (no EOS, ``max_new_tokens`` each):
   ``HFRolloutEngine.generate`` (behaviour log-prob recorder, seeded RNG, padding; with and without the shared
   prompt prefill) against ``model.generate(..., GenerationConfig(do_sample=True, disable_compile=True))`` as
   TRL's ``GRPOTrainer`` calls it; CPU seconds, interleaved, median over ``--reps``.
6. **What the two removals buy, side by side** (before = off, after = on, interleaved in this process on the same
   inputs, median CPU seconds over ``--reps``): the output layer at the loss positions only
   (``PolicyEngine.logits_at_loss_positions``; ``train_step`` on the last step's micro-batches) and the shared
   prompt prefill (``HFRolloutEngine.share_prompt_prefill``; ``generate`` of the last step's prompts, G samples,
   EOS on as in training, seeded alike so both sample the same completions).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/real_step_profile.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import QUIET, REPO, machine, write_json


# ----------------------------------------------------------------------------------------------------------
# 1. matmul peak
# ----------------------------------------------------------------------------------------------------------
def mm_peak(sizes=(512, 1024, 2048), reps: int = 5) -> dict:
    import torch

    out = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        per_cpu, per_wall = [], []
        for _ in range(reps):
            k = max(1, int(2e9 // (2 * n ** 3)))  # ~2 GFLOP per repetition
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(k):
                torch.mm(a, b)
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            per_cpu.append(2 * n ** 3 * k / cpu / 1e9)
            per_wall.append(2 * n ** 3 * k / wall / 1e9)
        out[str(n)] = {"gflop_per_cpu_s": max(per_cpu), "gflop_per_wall_s": max(per_wall)}
    out["best_gflop_per_cpu_s"] = max(v["gflop_per_cpu_s"] for v in out.values())
    out["best_gflop_per_wall_s"] = max(v["gflop_per_wall_s"] for k, v in out.items() if k.isdigit())
    return out


# ----------------------------------------------------------------------------------------------------------
# 3. FLOP of the train phase
# ----------------------------------------------------------------------------------------------------------
def matmul_params(arch) -> tuple[int, int]:
    """(parameters of the linear layers of the decoder, of the output layer)."""
    d, h, kv, hd, f = arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim, arch.ffn_hidden_size
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
    return arch.num_layers * per_layer, d * arch.vocab_size


def train_flop(arch, lengths: list[int], output_positions: int) -> float:
    body, head = matmul_params(arch)
    positions = sum(lengths)
    attention = 12 * arch.num_layers * arch.num_attention_heads * arch.head_dim * sum(n * n for n in lengths)
    return 6.0 * body * positions + 6.0 * head * output_positions + attention


# ----------------------------------------------------------------------------------------------------------
# 2. instrumentation of the train phase
# ----------------------------------------------------------------------------------------------------------
class Clock:
    """CPU seconds inside wrapped callables, by name."""

    def __init__(self):
        self.cpu: dict[str, float] = {}

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0
        return timed

    def take(self) -> dict[str, float]:
        out, self.cpu = self.cpu, {}
        return out


def instrument(run, clock: Clock, batches: list):
    from megatron.core.pipeline_parallel import schedules

    schedules.forward_step = clock.wrap("forward", schedules.forward_step)
    schedules.backward_step = clock.wrap("backward", schedules.backward_step)
    engine = run.train_side.engine
    engine.optimizer.step = clock.wrap("optimizer", engine.optimizer.step)
    train_step = engine.train_step

    def recording_train_step(micro_batches, denominator):
        batches.extend(micro_batches)
        return train_step(micro_batches, denominator)

    engine.train_step = recording_train_step


def sequence_lengths(micro_batches) -> tuple[list[int], int]:
    """True sequence lengths of the packed micro-batches and their loss positions."""
    lengths, loss_positions = [], 0
    for b in micro_batches:
        cu = b.cu_seqlens.tolist()
        lengths += [cu[i + 1] - cu[i] for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]
        loss_positions += int((b.loss_mask > 0).sum())
    return lengths, loss_positions


# ----------------------------------------------------------------------------------------------------------
# 5. generation: our engine vs plain generate
# ----------------------------------------------------------------------------------------------------------
def generation_overhead(run, reps: int) -> dict:
    import torch
    from transformers import GenerationConfig

    from megatron_dppo.rollout.base import SamplingParams
    from megatron_dppo.rollout.hf_engine import HFRolloutEngine

    cfg, side = run.cfg, run.rollout_side
    prompts = [p.token_ids for p in side.train_prompts[: cfg.train.prompts_per_step]]
    g, new = cfg.train.group_size, cfg.rollout.max_new_tokens
    model = side.engine.model
    engines = {share: HFRolloutEngine(model, eos_token_ids=[], pad_token_id=side.engine.pad_token_id,
                                      max_batch_size=len(prompts) * g, share_prompt_prefill=share)
               for share in (False, True)}  # no EOS: every row decodes max_new_tokens
    rows = [p for p in prompts for _ in range(g)]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), side.engine.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    plain_config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True,
                                    temperature=cfg.rollout.temperature, top_p=1.0, top_k=0,
                                    pad_token_id=side.engine.pad_token_id, eos_token_id=None, disable_compile=True)

    def ours(share):
        def run():
            out = engines[share].generate(prompts, g, SamplingParams(temperature=cfg.rollout.temperature,
                                                                     max_new_tokens=new, seed=0))
            return sum(len(c.token_ids) for grp in out for c in grp.completions)
        return run

    def run_plain():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=plain_config)
        return int((out.shape[1] - width) * out.shape[0])

    runs = (("plain", run_plain), ("ours_unshared", ours(False)), ("ours", ours(True)))
    times, tokens = {name: [] for name, _ in runs}, {}
    for _ in range(reps):
        for name, fn in runs:
            c0 = time.process_time()
            tokens[name] = fn()
            times[name].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rows": len(rows), "prompt_tokens_max": width, "new_tokens": new, "tokens": tokens, "cpu_s": times,
            "cpu_s_median": med, "ours_over_plain": med["ours"] / med["plain"],
            "ours_unshared_over_plain": med["ours_unshared"] / med["plain"]}


# ----------------------------------------------------------------------------------------------------------
# 6. before / after of the two removals, side by side
# ----------------------------------------------------------------------------------------------------------
def removals_ab(run, micro_batches: list, reps: int) -> dict:
    from megatron_dppo.rollout.base import SamplingParams

    cfg, side, engine = run.cfg, run.rollout_side, run.train_side.engine
    out = {}
    train_step = engine.train_step
    times = {False: [], True: []}
    for _ in range(reps):
        for flag in (False, True):
            engine.logits_at_loss_positions = flag
            for b in micro_batches:
                b.old_logprobs = None
            c0 = time.process_time()
            train_step(micro_batches, float(len(micro_batches)))
            times[flag].append(time.process_time() - c0)
    engine.logits_at_loss_positions = True
    out["train_step"] = {"before_cpu_s": statistics.median(times[False]), "after_cpu_s": statistics.median(times[True]),
                         "cpu_s": {"before": times[False], "after": times[True]}}
    prompts = [p.token_ids for p in side.train_prompts[: cfg.train.prompts_per_step]]
    sampling = SamplingParams(temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens, seed=3)
    times, tokens = {False: [], True: []}, {}
    for _ in range(reps):
        for share in (False, True):
            side.engine.share_prompt_prefill = share
            c0 = time.process_time()
            groups = side.engine.generate(prompts, cfg.train.group_size, sampling)
            times[share].append(time.process_time() - c0)
            tokens[share] = [c.token_ids for g in groups for c in g.completions]
    side.engine.share_prompt_prefill = True
    out["generate"] = {"before_cpu_s": statistics.median(times[False]), "after_cpu_s": statistics.median(times[True]),
                       "cpu_s": {"before": times[False], "after": times[True]},
                       "same_completions": tokens[False] == tokens[True]}
    for v in out.values():
        v["saved_fraction"] = 1 - v["after_cpu_s"] / v["before_cpu_s"]
    return out


# ----------------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "smollm2_list_max_cpu.yaml"))
    ap.add_argument("--steps", type=int, default=3, help="measured RL steps (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the side-by-side comparisons (5, 6)")
    ap.add_argument("--no-profiler", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    import torch

    from megatron_dppo.config import load_config
    from megatron_dppo.run.setup import setup, teardown
    from megatron_dppo.train.loop import rl_step

    load_before = machine()["load_avg_1m"]
    work = Path(tempfile.mkdtemp(prefix="real_step_profile-"))
    cfg = load_config(args.config, [f"train.output_dir={work}", "eval.every=0", "checkpoint.every=0", *QUIET,
                                    "logging.print_every=0", f"train.cpu_threads={args.threads}",
                                    *args.overrides])
    run = setup(cfg, resume=False)
    torch.set_num_threads(args.threads)
    peak = mm_peak()
    print(f"torch.mm peak ({args.threads} thread(s)): {peak['best_gflop_per_cpu_s']:.1f} GFLOP per CPU-second, "
          f"{peak['best_gflop_per_wall_s']:.1f} per wall-second", flush=True)
    clock, batches, steps = Clock(), [], []
    instrument(run, clock, batches)
    try:
        for step in range(args.steps + 1):
            batches.clear()
            profile = step == 1 and not args.no_profiler
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile \
                else contextlib.nullcontext()
            with prof:
                m = rl_step(run, step)
            inner = clock.take()
            lengths, loss_positions = sequence_lengths(batches)
            at_loss = run.train_side.engine.logits_at_loss_positions and not cfg.parallel.sp
            output_positions = loss_positions if at_loss else sum(lengths)  # where the output layer ran
            flop = train_flop(run.arch, lengths, output_positions)
            rec = {"step": step, "wall": {k[5:]: v for k, v in m.items() if k.startswith("time/")},
                   "cpu": {k[9:]: v for k, v in m.items() if k.startswith("time_cpu/")}, "train_inner_cpu": inner,
                   "positions": sum(lengths), "loss_positions": loss_positions, "sequences": len(lengths),
                   "micro_batches": len(batches), "generated_tokens": m.get("tokens/generated"),
                   "train_flop": flop, "train_flop_every_position": train_flop(run.arch, lengths, sum(lengths)),
                   "reward": m.get("reward/mean")}
            rec["train_gflop_per_cpu_s"] = flop / rec["cpu"]["train"] / 1e9 if rec["cpu"].get("train") else None
            rec["train_gflop_per_wall_s"] = flop / rec["wall"]["train"] / 1e9 if rec["wall"].get("train") else None
            if profile:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
                rec["profiler_top"] = table
                print(table, flush=True)
            steps.append(rec)
            print(f"step {step}: " + " ".join(f"{k}={v:.2f}" for k, v in rec["cpu"].items()) + " (CPU s) | train: "
                  + " ".join(f"{k}={v:.2f}" for k, v in inner.items()) + f" | {rec['positions']} positions, "
                  f"{rec['loss_positions']} loss | {flop / 1e12:.2f} TFLOP, "
                  f"{rec['train_gflop_per_cpu_s'] or 0:.1f} GFLOP/CPU-s", flush=True)
        last_batches = list(batches)
        gen = generation_overhead(run, args.reps)
        print(f"generation, same rows and decode steps: ours {gen['cpu_s_median']['ours']:.2f} CPU s (prefill not "
              f"shared: {gen['cpu_s_median']['ours_unshared']:.2f}), plain generate {gen['cpu_s_median']['plain']:.2f} "
              f"({gen['ours_over_plain']:.2f}x; unshared {gen['ours_unshared_over_plain']:.2f}x)", flush=True)
        ab = removals_ab(run, last_batches, args.reps)
        for name, v in ab.items():
            print(f"{name}: before {v['before_cpu_s']:.2f} CPU s, after {v['after_cpu_s']:.2f} "
                  f"({100 * v['saved_fraction']:.0f}% saved)", flush=True)
    finally:
        teardown(run)
    measured = steps[1:]
    summary = {
        "cpu_s_median": {k: statistics.median(s["cpu"].get(k, 0.0) for s in measured)
                         for k in sorted({k for s in measured for k in s["cpu"]})},
        "train_inner_cpu_s_median": {k: statistics.median(s["train_inner_cpu"].get(k, 0.0) for s in measured)
                                     for k in sorted({k for s in measured for k in s["train_inner_cpu"]})},
        "train_gflop_per_cpu_s_median": statistics.median(s["train_gflop_per_cpu_s"] for s in measured),
        "mm_peak_gflop_per_cpu_s": peak["best_gflop_per_cpu_s"],
    }
    summary["train_fraction_of_peak"] = summary["train_gflop_per_cpu_s_median"] / peak["best_gflop_per_cpu_s"]
    print(f"train phase: {summary['train_gflop_per_cpu_s_median']:.1f} GFLOP per CPU-second = "
          f"{100 * summary['train_fraction_of_peak']:.0f}% of the torch.mm peak")
    write_json(args.out, {"machine": machine(), "load_avg_1m_before": load_before, "config": args.config,
                          "overrides": args.overrides, "threads": args.threads, "mm_peak": peak, "steps": steps,
                          "generation": gen, "removals": ab, "summary": summary})


if __name__ == "__main__":
    main()
