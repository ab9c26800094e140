"""Rollouts: G completions per prompt from the rollout engine, sharded over ranks and gathered on all, and their
rewards. The primitives of the rollout side, used by the step (``draw.py``), DAPO's refill rounds (``dapo.py``)
and evaluation (``evaluation.py``); each takes the :class:`~megatron_dppo.run.state.RolloutSide` or less.

Sampling seeds come from (seed, step, tag, shard), so a resumed run regenerates exactly what a straight run would
have; rewards are scored on shards and gathered, so every rank holds the same rewards.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dppo.algo.overlong import overlong_penalty
from megatron_dppo.data import Prompt
from megatron_dppo.dist import collectives as D
from megatron_dppo.rewards.scoring import TIMED_OUT
from megatron_dppo.run.build import rollout_tensor_parallel
from megatron_dppo.run.state import RolloutSide


@dataclass
class Rollout:
    """The G completions of every kept prompt, identical on every rank after the gather."""

    prompts: list[Prompt]
    completions: list[list[list[int]]]  # [Bk][G] token ids (stop token included)
    texts: list[list[str]]  # [Bk][G] decoded completions
    behaviour_logprobs: list[list[list[float]]]  # [Bk][G] log-probs of the sampled distribution (rollout/base.py)
    truncated: list[list[bool]]  # [Bk][G] finish_reason == "length"
    rewards: torch.Tensor | None = None  # [Bk, G] float32
    reward_failures: int = 0  # samples scored 0 because the reward function failed (all ranks)
    reward_timeouts: int = 0  # of which timed out (reward.timeout_s or reward.step_budget_s)

    @property
    def group_size(self) -> int:
        return len(self.completions[0]) if self.completions else 0

    def lengths(self) -> torch.Tensor:
        """[Bk, G] completion lengths in tokens (float64)."""
        return torch.tensor([[len(c) for c in comps] for comps in self.completions], dtype=torch.float64)

    def finished(self, group_size: int) -> torch.Tensor:
        """[Bk, G] bool: the completions that ended before rollout.max_new_tokens (the ones overlong.filter trains
        and counts in the denominators)."""
        return ~torch.tensor(self.truncated, dtype=torch.bool).view(-1, group_size)


def generate(side: RolloutSide, prompts: list[Prompt], n: int, step: int, temperature: float,
             tag: str = "generate") -> Rollout:
    """n completions per prompt; each rank generates a contiguous shard with a seed from (seed, step, shard)."""
    from megatron_dppo.rollout import SamplingParams

    cfg = side.cfg

    def generate_shard(shard: list[Prompt], shard_index: int) -> list[tuple]:
        sampling = SamplingParams(temperature=temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                  max_new_tokens=cfg.rollout.max_new_tokens,
                                  seed=D.derive_seed(cfg.train.seed, step, tag, shard_index) % (1 << 31))
        groups = side.engine.generate([p.token_ids for p in shard], n, sampling)
        out = []
        for group in groups:
            comps = group.completions
            out.append(([c.token_ids for c in comps],
                        [side.tokenizer.decode(_strip_stop(c.token_ids, side.eos_ids), skip_special_tokens=True)
                         for c in comps],
                        [c.logprobs for c in comps],
                        [c.finish_reason == "length" for c in comps]))
        return out

    shard_index, num_shards = generation_shards(cfg)
    with generation_window(side):  # wakes the rollout engine (GPU memory handover), sleeps it afterwards
        results = D.map_sharded(generate_shard, prompts, shard_index, num_shards)
    return Rollout(prompts=list(prompts), completions=[r[0] for r in results], texts=[r[1] for r in results],
                   behaviour_logprobs=[r[2] for r in results], truncated=[r[3] for r in results])


def score(scorer: Any, rollout: Rollout, group_size: int) -> torch.Tensor:
    """Rewards [Bk, G]: each rank scores a shard of the completions, results gathered on all ranks; a sample whose
    reward function failed scores 0 and is counted in ``rollout.reward_failures`` (and ``reward_timeouts``)."""
    items = [(text, p.gold, f"{p.id}#{i}") for p, texts in zip(rollout.prompts, rollout.texts)
             for i, text in enumerate(texts)]

    def score_shard(shard: list[tuple], _index: int) -> list[tuple[float, str | None]]:
        result = scorer.score([t for t, _, _ in shard], [g for _, g, _ in shard], ids=[i for _, _, i in shard])
        return list(zip(result.rewards, result.errors))

    scored = D.map_sharded(score_shard, items)
    errors = [e for _, e in scored if e is not None]
    rollout.reward_failures = len(errors)
    rollout.reward_timeouts = sum(e.startswith(TIMED_OUT) for e in errors)
    flat = [r for r, _ in scored]
    return torch.tensor(flat, dtype=torch.float32).view(len(rollout.prompts), rollout.group_size or 1) \
        if rollout.prompts else torch.zeros(0, group_size)


def filter_rewards(cfg, rollout: Rollout) -> torch.Tensor:
    """The rewards [Bk, G] whose spread decides whether a group has "one reward for all" (DAPO's dynamic sampling,
    algo.drop_zero_variance_groups): the task reward, or with dynamic_sampling.filter_metric=training the reward
    the advantages see (``training_rewards``)."""
    return training_rewards(cfg, rollout) if cfg.dynamic_sampling.filter_metric == "training" else rollout.rewards


def training_rewards(cfg, rollout: Rollout) -> torch.Tensor:
    """The rewards the advantages see [Bk, G]: the task reward plus, with overlong.buffer > 0, DAPO's soft overlong
    penalty of each completion's length (docs/algorithms.md, "Overlong completions"). The task reward alone stays in
    ``rollout.rewards`` and in the reward/* metrics."""
    if not cfg.overlong.buffer or not rollout.prompts:
        return rollout.rewards
    return rollout.rewards + overlong_penalty(rollout.lengths().long(), cfg.rollout.max_new_tokens,
                                              cfg.overlong.buffer, cfg.overlong.penalty)


# ==============================================================================================================
# Where generation runs
# ==============================================================================================================
def generation_shards(cfg) -> tuple[int, int]:
    """Who generates what: the HF engine shards over every rank; vLLM over its engines, the TP groups of
    ``rollout_tensor_parallel`` consecutive ranks (same prompts per group): colocated, the trainer's TP groups;
    on separate rollout workers, ``rollout.workers / rollout.tp`` engines."""
    if cfg.rollout.engine == "vllm":
        tp = rollout_tensor_parallel(cfg)
        return D.rank() // tp, D.world_size() // tp
    return D.rank(), D.world_size()


@contextlib.contextmanager
def generation_window(side: RolloutSide):
    """Around every generation: (offload the training state,) wake the KV cache; afterwards the rollout engine
    sleeps (``rollout.sleep_between_steps``) and the training state returns."""
    side.handover.before_generation()
    try:
        yield
    finally:
        side.handover.after_generation(sleep=side.cfg.rollout.sleep_between_steps)


def _strip_stop(ids: list[int], stops: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stops else ids
