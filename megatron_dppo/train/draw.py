"""Steps 1-4 of an RL step, the rollout side: draw prompts, decide the prompt level, generate, score.

``draw_batch`` is what ``train.loop.rl_step`` calls first: prompts from the sampler, DPPO's prompt-level decision
(pi recorded with the batch), G completions for every kept prompt and their rewards (``rollouts.py``), and DAPO's
refill rounds (``dapo.py``). In the synchronous loop the trainer calls it itself; with
``rollout.placement=separate`` the rollout workers call it (``worker.py``) and send the result, stamped with the
version of the weights that generated it. It takes the :class:`~megatron_dppo.run.state.RolloutSide`, never the
whole run, so a rollout worker runs exactly this code without a Megatron engine.

The prompt-level draw is the pruner's (``algo.pruner.Pruner``, whatever the rule), made on rank 0 with a generator
seeded from (seed, step, "prompts") and broadcast, so every rank takes the same decision. The per-prompt state it
reads (the pruner's own: the history of mean |A|, or the prompt posterior with ``algo.dppo_keep=posterior``) is
updated by the trainer after every step (``update_prompt_state``) with the same groups on every rank, so every
rank holds the same state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_dppo.algo.pruner import Groups
from megatron_dppo.algo.pruning import PruneResult, keep_all, make_generator
from megatron_dppo.data import Prompt
from megatron_dppo.distributed import collectives as D
from megatron_dppo.run.metrics import PhaseTimer
from megatron_dppo.run.state import RolloutSide
from megatron_dppo.train.dapo import refill_groups
from megatron_dppo.train.rollouts import Rollout, counted_episodes, counted_groups, generate, generate_slots, score
from megatron_dppo.train.screen import Screens, screen_and_continue


@dataclass
class DrawnBatch:
    """What the rollout side hands the trainer for one RL step."""

    step: int
    prompts: list[Prompt]  # the drawn prompts (after a refill: the kept groups' prompts)
    prompt_cut: PruneResult  # keep and pi of every drawn prompt, decided when drawn (screening: kept = continued,
    # pi = pi_q pi_c)
    kept: list[Prompt]
    rollout: Rollout  # with rewards and the behaviour log-probs of the engine
    refilled: Any = None  # dapo.Refilled (dynamic_sampling.enable), else None
    version: int = 0  # weight version that generated it
    sampler_state: dict | None = None  # the sampler's position after drawing it
    metrics: dict[str, float] = field(default_factory=dict)  # the rollout side's timings (separate placement)
    screens: Any = None  # screen.Screens (algo.screen_k > 0): every screen of the step, continued or not


# ==============================================================================================================
# Steps 1-4
# ==============================================================================================================
def draw_batch(side: RolloutSide, step: int, timer: PhaseTimer, version: int | None = None) -> DrawnBatch:
    """Steps 1-4 of an RL step (``train.loop.rl_step`` explains each) with the weights of ``version`` (default:
    ``step``, the synchronous loop's; a rollout worker passes the version it loaded)."""
    cfg = side.cfg
    version = step if version is None else version
    prompts = [side.train_prompts[i] for i in side.sampler.take(prompts_to_draw(side))]
    with timer("prune"):
        prompt_cut, slots = select_prompts(side, prompts, step, version, with_slots=True)
    screens = None
    if cfg.algo.screens:  # a screen of k for every kept prompt, then G - k more for those continued
        prompt_cut, kept, rollout, screens = screen_and_continue(side, prompts, prompt_cut, step, version, timer)
    elif slots is not None:  # adaptive group sizes: n_q completions in the slots the pruner chose
        kept = [p for p, k in zip(prompts, prompt_cut.keep.tolist()) if k]
        rollout = generate_slots(side, kept, slots[prompt_cut.keep], step, timer)
    else:
        kept = [p for p, k in zip(prompts, prompt_cut.keep.tolist()) if k]
        with timer("generate"):
            rollout = generate(side, kept, cfg.train.group_size, step, temperature=cfg.rollout.temperature)
        with timer("reward"):
            rollout.rewards = score(side, rollout, step)
    refilled = refill_groups(side, step, timer, rollout) if cfg.dynamic_sampling.enable else None
    if refilled is not None:
        prompts = kept = refilled.prompts
        rollout = refilled.rollout
        prompt_cut = keep_all(len(prompts))
    return DrawnBatch(step, prompts, prompt_cut, kept, rollout, refilled, version=version, screens=screens)


def prompts_to_draw(side: RolloutSide) -> int:
    """The pruner's count: B prompts, or with CPPO's dynamic completion allocation enough to prune back to B*G."""
    return side.pruner.prompts_to_draw()


def select_prompts(side: RolloutSide, prompts: list[Prompt], step: int, version: int | None = None,
                   with_slots: bool = False):
    """The pruner's prompt-level decision on rank 0, broadcast (a rule without one keeps every prompt with
    probability 1). Its per-prompt state is read at ``version`` (default ``step``): the optimizer step of the
    weights that will generate. ``with_slots``: also the completion slots each prompt generates ([B, G] bool, the
    pruner's ``completion_slots``; None = all G), as (decision, slots)."""
    result = None
    if D.is_main():
        decision = side.pruner.select_prompts([p.id for p in prompts], step if version is None else version,
                                              make_generator(side.cfg.train.seed, step, "prompts"))
        result = (decision, side.pruner.completion_slots())
    decision, slots = D.broadcast_object(result)
    return (decision, slots) if with_slots else decision


def update_prompt_state(side: RolloutSide, rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor,
                        version: int, screens: Screens | None = None) -> None:
    """After the step's advantages: the generated groups of ``rollout`` into the pruner's per-prompt state, with
    the raw training ``rewards`` [Bk, G], the ``advantages``, the completion lengths and tokens, dated by the
    ``version`` of the weights that generated them; then the k rewards of the ``screens`` that were not continued
    (the posterior reads them; the history, whose score is a full group's, skips them). Episodes that ended with
    env_error (env.errors=exclude) are left out: a group is observed over its other episodes, and a group left
    with fewer than 2 is not observed (the prompt keeps its state). Every rank calls it with the same groups."""
    prompts = rollout.prompts
    lengths, tokens = (rollout.lengths(), rollout.total_tokens()) if prompts else (None, None)
    for rows, pick in counted_groups(counted_episodes(side.cfg, rollout), len(prompts)):
        side.pruner.observe(Groups([prompts[r].id for r in rows], pick(rewards), pick(lengths), version,
                                   advantages=pick(advantages), tokens=pick(tokens)))
    if screens is not None:
        stopped, screen_rewards, screen_lengths = screens.not_continued()
        if stopped:
            side.pruner.observe(Groups([p.id for p in stopped], screen_rewards, screen_lengths, version))


def prompt_state_metrics(side: RolloutSide) -> dict[str, float]:
    """The pruner's own metrics: history/prompts_seen, and the posterior's (discount, prior, fit)."""
    return side.pruner.metrics()
