"""Over-provisioning with abort (APRIL, ``rollout.overprovision``): a rollout worker generates for more prompts than
the step trains, ships the first groups to finish, and keeps the rest, partial completions included, for the next
step, where they continue under the newer weights (docs/async.md, "Over-provisioning").

The step trains N drawn prompts (N = what the pruner draws for a step, ``prompts_to_draw``). The worker keeps the
drawn prompts not yet shipped in a pending pool; each step it tops the pool up with newly drawn prompts (their
prompt-level decision made now, as in ``draw.draw_batch``) to ceil(N (1 + overprovision)), generates the unfinished
groups in chunks of ``rollout.interrupt_chunk_tokens`` tokens until N pending prompts are complete, and ships N of
them: a prompt the pruner did not keep is complete when drawn, a kept one when its G completions have ended.

Two rules keep the gradient what it was and the run within its staleness bound:

* No drawn prompt is ever dropped. Every one ships exactly once, with the keep probability pi_q recorded when it
  was drawn, so E[keep_q / pi_q] = 1 holds per drawn prompt as in the loop without over-provisioning; what changes
  is the step at which a long group trains (later, partly with newer weights) and the weights that sampled its
  tokens, which the per-token behaviour log-probs correct (docs/algorithms.md, "Partial rollouts").
* A token must train within ``train.max_staleness`` (k) versions of the step, so a group whose oldest token could
  not wait for the next step (version < t + 1 - k at step t) must finish in this one: generation goes on until
  every such group is complete, and they ship first; the rest ship oldest drawn first. When the worker's weights
  are themselves too old for any token to wait (version < t + 1 - k), the pool is only topped up to N and everything
  ships. With k = 1 that is always the case, hence k >= 2.

The pool is part of the sampler's state (``rollout.pending.PendingPrompts``: the prompt sampler and the pending
prompts with their decisions and partial completions), so it travels with every batch to the trainer, is saved in
its checkpoints, and a resumed run repositions the worker with it: the prompts pending at the checkpoint are
continued, not lost.
"""
from __future__ import annotations

import math

import torch

from megatron_dppo.algo.pruning import PruneResult
from megatron_dppo.distributed import collectives as D
from megatron_dppo.rollout.partial import PartialRow, continue_rows
from megatron_dppo.rollout.pending import Pending, PendingPrompts
from megatron_dppo.run.metrics import PhaseTimer
from megatron_dppo.run.state import RolloutSide
from megatron_dppo.train.draw import DrawnBatch, select_prompts
from megatron_dppo.train.rollouts import Rollout, generation_window, score, strip_stop

_DECISION = ("keep", "weight", "keep_prob", "candidate", "score")  # the PruneResult fields of a decision


def draw_overprovisioned(side: RolloutSide, step: int, timer: PhaseTimer, version: int, partial=None) -> DrawnBatch:
    """The batch of RL ``step`` with over-provisioning (module docstring), generated from weights ``version``;
    ``partial`` (the worker's ``rollout.partial.InterruptibleEngine`` with rollout.max_interruptions, else None) lets
    newer versions in between chunks. The batch is stamped with the version of its oldest token (``version`` when it
    has none), as the staleness gate reads it."""
    cfg, pool = side.cfg, side.sampler
    n_ship, k, G = side.pruner.prompts_to_draw(), cfg.train.max_staleness, cfg.train.group_size
    can_wait = version >= step + 1 - k  # whether this version's tokens may train at the next step
    target = math.ceil(n_ship * (1 + cfg.rollout.overprovision)) if can_wait else n_ship
    top_up(side, pool, step, version, max(0, target - len(pool.pending)), G)

    def must_finish(p: Pending) -> bool:
        oldest = p.oldest
        return oldest is not None and oldest < step + 1 - k

    def enough() -> bool:
        complete = [p for p in pool.pending if p.complete]
        return len(complete) >= n_ship and all(p.complete for p in pool.pending if must_finish(p))

    params = sampling(cfg, step)
    with timer("generate"), generation_window(side):
        end_version, _ = continue_rows(side.engine if partial is None else partial.engine,
                                       [p.rows for p in pool.pending if p.rows], params, version,
                                       cfg.rollout.interrupt_chunk_tokens, enough,
                                       None if partial is None else partial.source, cfg.rollout.max_interruptions)
    if partial is not None:
        partial.version = end_version
    order = sorted((p for p in pool.pending if p.complete), key=lambda p: (not must_finish(p), p.drawn_step))
    shipped = order[:n_ship]  # (at least N: generation ran until N were complete or every row had ended)
    chosen = {id(p) for p in shipped}
    carried = sum(p.drawn_step < step for p in shipped)
    pool.pending = [p for p in pool.pending if id(p) not in chosen]
    drawn = shipped_batch(side, shipped, step, timer)
    oldest = [p.oldest for p in shipped if p.oldest is not None]
    drawn.version = min(oldest) if oldest else version
    drawn.metrics = {"async/carried_prompts": float(carried), "async/pending_prompts": float(len(pool.pending)),
                     "async/pending_rows_started": float(sum(bool(r.tokens) for p in pool.pending for r in p.rows))}
    return drawn


def top_up(side: RolloutSide, pool: PendingPrompts, step: int, version: int, count: int, group_size: int) -> None:
    """Draw ``count`` new prompts into the pool with their prompt-level decision (``draw.select_prompts``, at
    ``version``); a kept one gets G empty rows."""
    if count == 0:
        return
    indices = pool.take(count)
    prompts = [side.train_prompts[i] for i in indices]
    cut = select_prompts(side, prompts, step, version)
    for j, (i, prompt) in enumerate(zip(indices, prompts)):
        decision = {name: None if getattr(cut, name) is None else getattr(cut, name)[j].item() for name in _DECISION}
        rows = [PartialRow(j, list(prompt.token_ids)) for _ in range(group_size)] if decision["keep"] else []
        pool.pending.append(Pending(i, step, decision, rows))


def sampling(cfg, step: int):
    """The sampling parameters of the step's chunks: the rollout's, seeded from (seed, step, "overprovision")."""
    from megatron_dppo.rollout import SamplingParams

    return SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                          max_new_tokens=cfg.rollout.max_new_tokens,
                          seed=D.derive_seed(cfg.train.seed, step, "overprovision", 0) % (1 << 31))


def shipped_batch(side: RolloutSide, shipped: list[Pending], step: int, timer: PhaseTimer) -> DrawnBatch:
    """The ``DrawnBatch`` of the shipped prompts: their decisions as one ``PruneResult``, the kept ones' G
    completions (with per-token versions) as the rollout, scored now."""
    prompts = [side.train_prompts[p.index] for p in shipped]
    cut = decisions(shipped)
    kept_pending = [p for p in shipped if p.decision["keep"]]
    kept = [side.train_prompts[p.index] for p in kept_pending]
    completions = [[r.completion() for r in p.rows] for p in kept_pending]
    rollout = Rollout(prompts=kept, completions=[[c.token_ids for c in g] for g in completions],
                      texts=[[side.tokenizer.decode(strip_stop(c.token_ids, side.eos_ids), skip_special_tokens=True)
                              for c in g] for g in completions],
                      behaviour_logprobs=[[c.logprobs for c in g] for g in completions],
                      truncated=[[c.finish_reason == "length" for c in g] for g in completions],
                      token_versions=[[c.versions for c in g] for g in completions],
                      mask_offpolicy=side.cfg.rollout.mask_offpolicy)
    with timer("reward"):
        rollout.rewards = score(side, rollout, step)
    return DrawnBatch(step, prompts, cut, kept, rollout)


def decisions(shipped: list[Pending]) -> PruneResult:
    """The prompt-level decisions of ``shipped`` as one ``PruneResult`` (each as it was drawn)."""
    def column(name: str, dtype: torch.dtype):
        values = [p.decision[name] for p in shipped]
        return None if any(v is None for v in values) else torch.tensor(values, dtype=dtype)

    return PruneResult(keep=column("keep", torch.bool), weight=column("weight", torch.float32),
                       keep_prob=column("keep_prob", torch.float64), candidate=column("candidate", torch.bool),
                       score=column("score", torch.float64))
