"""DAPO's sampling-side stages of a step: dynamic sampling with refill (``dynamic_sampling.*``) and the overlong
metrics (``overlong.*``). The rule of the refill is ``algo.dynamic_sampling``; this module draws, generates and
scores its rounds with the ordinary stages, and hands the step the kept groups as if they had been drawn
(docs/algorithms.md, "Dynamic sampling with refill" and "Overlong completions").

Resume and data parallelism: every round draws from the run's resumable sampler, the same count on every rank, so
the sampler's position after the step (what a checkpoint stores) is the same on every rank and in a resumed run;
round r's sampling seeds come from (seed, step, "generate/refill<r>", shard); and each round's rewards are rank 0's,
broadcast, so every rank takes the same keep / continue decisions.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from megatron_dppo.algo.dynamic_sampling import RefillResult, refill
from megatron_dppo.algo.overlong import overlong_penalty
from megatron_dppo.algo.pruning import PruneResult
from megatron_dppo.data import Prompt
from megatron_dppo.distributed import collectives as D
from megatron_dppo.run.metrics import PhaseTimer
from megatron_dppo.run.state import RolloutSide
from megatron_dppo.train.rollouts import Rollout, filter_rewards, generate, score
from megatron_dppo.train.step_metrics import rollout_metrics

logger = logging.getLogger("megatron_dppo.dynamic_sampling")


@dataclass
class Refilled:
    """The step's batch after dynamic sampling, and every group generated on the way."""

    prompts: list[Prompt]  # the kept groups' prompts: the batch, B of them (fewer when exhausted)
    rollout: Rollout  # their groups
    generated: Rollout  # every group of every round, in draw order
    result: RefillResult

    def metrics(self) -> dict[str, float]:
        """dynamic_sampling/* and, over EVERY generated group (all rounds), the reward/* and tokens/generated family:
        the kept batch alone has no group with one reward for all and would flatter the reward."""
        n = len(self.generated.prompts)
        everything = PruneResult(keep=torch.ones(n, dtype=torch.bool), weight=torch.ones(n),
                                 keep_prob=torch.ones(n, dtype=torch.float64))
        return {**rollout_metrics(everything, self.generated, self.generated.group_size or 1), **self.result.metrics()}


def refill_groups(side: RolloutSide, step: int, timer: PhaseTimer, first: Rollout) -> Refilled:
    """Dynamic sampling with refill from round 1's scored ``first`` rollout (the step's B drawn prompts): more rounds
    of prompts from the sampler, generated and scored, until B groups have non-zero reward variance
    (``rollouts.filter_rewards``: the task reward by default) or dynamic_sampling.max_rounds are spent (a warning,
    and a smaller batch)."""
    cfg = side.cfg
    rounds = [first]

    def draw_round(index: int, n: int) -> torch.Tensor:
        prompts = [side.train_prompts[i] for i in side.sampler.take(n)]
        with timer("generate"):
            rollout = generate(side, prompts, cfg.train.group_size, step, temperature=cfg.rollout.temperature,
                               tag=f"generate/refill{index}")
        with timer("reward"):
            rollout.rewards = score(side, rollout, step, tag=f"reward/refill{index}")
        rounds.append(rollout)
        return D.broadcast_object(filter_rewards(cfg, rollout))

    result = refill(D.broadcast_object(filter_rewards(cfg, first)), draw_round, cfg.train.prompts_per_step,
                    cfg.dynamic_sampling.max_rounds, cfg.dynamic_sampling.refill_prompts)
    generated = concat_rollouts(rounds)
    if result.exhausted and D.is_main():
        logger.warning("step %d: dynamic sampling spent dynamic_sampling.max_rounds=%d rounds (%d prompts drawn) and "
                       "found %d of %d groups with non-zero reward variance; training on those (raise max_rounds, "
                       "or the task is too easy or too hard for the policy)", step, result.rounds, result.drawn,
                       len(result.kept), cfg.train.prompts_per_step)
    batch = select_rows(generated, result.kept)
    return Refilled(prompts=batch.prompts, rollout=batch, generated=generated, result=result)


def concat_rollouts(rollouts: list[Rollout]) -> Rollout:
    """The groups of several scored rollouts, one after the other."""
    G = next((r.group_size for r in rollouts if r.prompts), 0)
    rewards = [r.rewards for r in rollouts if r.prompts]
    return Rollout(prompts=[p for r in rollouts for p in r.prompts],
                   completions=[c for r in rollouts for c in r.completions],
                   texts=[t for r in rollouts for t in r.texts],
                   behaviour_logprobs=[lp for r in rollouts for lp in r.behaviour_logprobs],
                   truncated=[t for r in rollouts for t in r.truncated],
                   rewards=torch.cat(rewards) if rewards else torch.zeros(0, G),
                   reward_failures=sum(r.reward_failures for r in rollouts),
                   reward_timeouts=sum(r.reward_timeouts for r in rollouts),
                   rule_rewards=_cat([r.rule_rewards for r in rollouts if r.prompts]),
                   model_rewards=_cat([r.model_rewards for r in rollouts if r.prompts]),
                   reward_model_seconds=sum(r.reward_model_seconds for r in rollouts),
                   reward_model_failed=sum(r.reward_model_failed for r in rollouts),
                   reward_model_unparsed=sum(r.reward_model_unparsed for r in rollouts),
                   episodes=None if any(r.episodes is None for r in rollouts)
                   else [e for r in rollouts for e in r.episodes])


def _cat(parts: list) -> torch.Tensor | None:
    """The rows of every part, or None when the parts carry none (no reward model)."""
    return torch.cat(parts) if parts and all(p is not None for p in parts) else None


def select_rows(rollout: Rollout, rows: list[int]) -> Rollout:
    """The groups ``rows`` of ``rollout``, in that order (reward failures are counted on the whole rollout)."""
    index = torch.tensor(rows, dtype=torch.long)
    return Rollout(prompts=[rollout.prompts[i] for i in rows], completions=[rollout.completions[i] for i in rows],
                   texts=[rollout.texts[i] for i in rows],
                   behaviour_logprobs=[rollout.behaviour_logprobs[i] for i in rows],
                   truncated=[rollout.truncated[i] for i in rows],
                   rewards=rollout.rewards[index] if rollout.rewards is not None else None,
                   rule_rewards=None if rollout.rule_rewards is None else rollout.rule_rewards[index],
                   model_rewards=None if rollout.model_rewards is None else rollout.model_rewards[index],
                   episodes=None if rollout.episodes is None else [rollout.episodes[i] for i in rows])


def overlong_metrics(cfg, rollout: Rollout) -> dict[str, float]:
    """overlong/* over the generated completions (raw means): the soft penalty's mean and the fraction it touched
    (overlong.buffer > 0), the completions overlong filtering removed from the loss (overlong.filter)."""
    m = {}
    lengths = rollout.lengths().long().flatten()  # (trained tokens: an episode's sampled ones)
    if cfg.overlong.buffer and lengths.numel():
        penalty = overlong_penalty(lengths, cfg.trained_token_limit, cfg.overlong.buffer, cfg.overlong.penalty)
        m["overlong/penalty_mean"] = float(penalty.mean())
        m["overlong/penalized_fraction"] = float((penalty < 0).float().mean())
    if cfg.overlong.filter:
        m["overlong/filtered"] = float(sum(t for ts in rollout.truncated for t in ts))
    return m
