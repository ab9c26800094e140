"""Steps 5-12 of an RL step, the training side, in the order of the data flow: completion pruning, the surviving
batch with its fixed denominator, the PPO mini-batches, packing, old/reference log-probs, rollout correction, the
policy updates, the gradient audit; and :class:`TrainBatch`, the data they pass on. Each stage takes the
:class:`~megatron_dppo.run.state.TrainSide` (engine, loss, pruner) or less, never the whole run. Steps 1-4 are
``draw.py``; the metrics of a step are ``step_metrics.py``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dppo.algo.losses import LossConfig, loss_denominator, rollout_correction_weights, sequence_token_weights
from megatron_dppo.algo.minibatches import split_prompts
from megatron_dppo.algo.overlong import finished_denominator
from megatron_dppo.algo.pruning import PruneResult, combine, make_generator, zero_variance_filter
from megatron_dppo.data import Prompt
from megatron_dppo.distributed import collectives as D
from megatron_dppo.rollout.partial import offpolicy_mask
from megatron_dppo.run.state import TrainSide
from megatron_dppo.train.rollouts import Rollout, counted_episodes, filter_rewards


# ==============================================================================================================
# The data the training side passes on
# ==============================================================================================================
@dataclass
class TrainBatch:
    """The sequences that survive pruning, ready to pack, plus the fixed full-batch denominator D."""

    token_ids: list[list[int]]  # prompt + completion
    prompt_lengths: list[int]
    advantages: torch.Tensor  # [N] float32, the full-group advantage of each sequence
    token_weights: torch.Tensor  # [N] per-token loss factor (sequence_token_weights)
    seq_weights: torch.Tensor  # [N] pruning weight 1/P(keep)
    rewards: torch.Tensor  # [N]
    origin: list[tuple[int, int]]  # (kept-prompt row, completion index) of each sequence
    denominator: float
    loss_masks: list[list[int]] | None = None  # per completion token 1 = trained, 0 = observation (episodes)

    def __len__(self) -> int:
        return len(self.token_ids)

    def trained_lengths(self) -> list[int]:
        """Trained (loss-mask 1) tokens of each sequence: its completion, or an episode's sampled tokens."""
        if self.loss_masks is not None:
            return [sum(m) for m in self.loss_masks]
        return [len(t) - p for t, p in zip(self.token_ids, self.prompt_lengths)]


# ==============================================================================================================
# The stages, in the order of the data flow
# ==============================================================================================================
def select_completions(side: TrainSide, prompt_cut: PruneResult, rollout: Rollout, advantages: torch.Tensor,
                       step: int) -> tuple[PruneResult | None, PruneResult]:
    """The pruner's completion-level decision on rank 0 (broadcast), then the deterministic filters
    (algo.drop_zero_variance_groups, overlong.filter). Returns (decision over the kept prompts' completions
    [Bk, G], combined per-completion decision over all drawn prompts [B, G] with w = 1/(pi_q * pi_{i|q}))."""
    cfg, G = side.cfg, side.cfg.train.group_size
    decided = None
    if D.is_main() and len(rollout.prompts):
        # lengths: trained tokens (episodes: sampled ones); tokens: every token of a sequence (what it costs)
        decided = side.pruner.select_completions(advantages, make_generator(cfg.train.seed, step, "completions"),
                                                 prompt_prob=prompt_cut.probabilities()[prompt_cut.keep],
                                                 lengths=rollout.lengths(), tokens=rollout.total_tokens())
        if cfg.algo.drop_zero_variance_groups:  # (one reward for all among the generated slots)
            decided = _drop(decided, zero_variance_filter(generated_only(filter_rewards(side.cfg, rollout),
                                                                         rollout.slots)).keep)
        if cfg.overlong.filter:  # overlong filtering: truncated completions leave the loss (and D, see denominator)
            decided = _drop(decided, rollout.finished(advantages.shape[1]))
        counted = counted_episodes(cfg, rollout)
        if counted is not None:  # env_error episodes (env.errors=exclude) leave the loss; D keeps them as units
            decided = _drop(decided, counted)
    decided = D.broadcast_object(decided)
    if decided is None:  # no prompt survived prompt pruning
        B = len(prompt_cut.keep)
        empty = torch.zeros(B, G, dtype=torch.bool)
        return None, PruneResult(keep=empty, weight=empty.float(), keep_prob=torch.ones(B, G, dtype=torch.float64))
    return decided, combine(prompt_cut, decided)


def generated_only(rewards: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:
    """``rewards`` [Bk, G] with each placeholder slot (adaptive group sizes) given its row's first generated reward,
    so that a group is "one reward for all" iff its generated completions are."""
    if slots is None or not len(rewards):
        return rewards
    first = rewards.gather(1, slots.long().argmax(1, keepdim=True))
    return torch.where(slots, rewards, first)


def _drop(decided: PruneResult, allowed: torch.Tensor) -> PruneResult:
    """Also drop (deterministically, probability 1) every completion outside ``allowed`` [Bk, G]: the groups whose
    rewards are all equal (algo.drop_zero_variance_groups), the truncated completions (overlong.filter)."""
    keep = decided.keep & allowed
    prob = decided.probabilities().double()
    return PruneResult(keep=keep, weight=torch.where(keep, decided.weight, torch.zeros_like(decided.weight)),
                       keep_prob=prob, candidate=decided.candidate, score=decided.score)


def build_train_batch(side: TrainSide, prompts: list[Prompt], prompt_cut: PruneResult, rollout: Rollout,
                      advantages: torch.Tensor, total_cut: PruneResult) -> TrainBatch:
    """Flatten the kept (prompt, completion) pairs; per-token weights and the full-batch denominator D. An episode's
    loss mask travels with its sequence, and its trained tokens are its length in every count."""
    G, agg = total_cut.keep.shape[1], side.loss_cfg.aggregation
    kept_rows = prompt_cut.keep.nonzero().flatten().tolist()  # drawn-prompt index of each generated row
    token_ids, prompt_lengths, adv, weight, rewards, origin, comp_lengths = [], [], [], [], [], [], []
    masks, trained = rollout.loss_masks, rollout.lengths()
    for row, q in enumerate(kept_rows):
        for i in range(G):
            if not bool(total_cut.keep[q, i]):
                continue
            if masks is not None and not trained[row, i]:  # an episode whose environment failed at reset: no
                continue  # sampled token, no loss term (its reward still counts in its group's advantages)
            completion, prompt_ids = rollout.completions[row][i], rollout.prompt_ids(row, i)  # (an episode's own)
            token_ids.append(prompt_ids + completion)
            prompt_lengths.append(len(prompt_ids))
            adv.append(float(advantages[row, i]))
            weight.append(float(total_cut.weight[q, i]))
            rewards.append(float(rollout.rewards[row, i]))
            origin.append((row, i))
            comp_lengths.append(len(completion) if masks is None else sum(masks[row][i]))  # (episodes: trained)
    seq_w = torch.tensor(weight, dtype=torch.float32)
    lengths = torch.tensor(comp_lengths, dtype=torch.float32)
    return TrainBatch(
        token_ids=token_ids, prompt_lengths=prompt_lengths, advantages=torch.tensor(adv, dtype=torch.float32),
        token_weights=sequence_token_weights(agg, seq_w, lengths), seq_weights=seq_w,
        rewards=torch.tensor(rewards, dtype=torch.float32), origin=origin,
        denominator=denominator(side, prompts, prompt_cut, rollout, total_cut, comp_lengths) if token_ids else 1.0,
        loss_masks=None if masks is None else [masks[row][i] for row, i in origin])


def denominator(side: TrainSide, prompts: list[Prompt], prompt_cut: PruneResult, rollout: Rollout,
                total_cut: PruneResult, kept_lengths: list[int], subset: list[int] | None = None) -> float:
    """D (docs/algorithms.md, "Denominators"): a constant of the full drawn batch (B x G), independent of the draw.
    A pruner with ``kept_denominator`` (CPPO, PODS) instead averages over the kept completions (their authors'
    choice; biased by design). The prompts' pi_q enter D where it counts generated rows (token_mean, overlong
    filtering): 1 for every prompt when the pruner has no prompt level, which is the full batch's D exactly.

    ``subset``: the drawn-prompt indices of one PPO mini-batch; D is then that mini-batch's D_m, computed from its
    own un-pruned units in the same way (B_m = len(subset) drawn prompts; ``kept_lengths`` its kept completions).
    Every length is a count of trained tokens (an episode's sampled ones), L_max their bound (Config.
    trained_token_limit)."""
    agg, G, L_max = side.loss_cfg.aggregation, side.cfg.train.group_size, side.cfg.trained_token_limit
    if side.pruner.kept_denominator:
        kept = torch.tensor(kept_lengths, dtype=torch.float64).view(-1, 1)
        return loss_denominator(agg, len(kept_lengths), 1, kept, None, L_max)
    lengths = rollout.lengths()
    pi_q = prompt_cut.probabilities()[prompt_cut.keep].double()
    num_prompts = len(prompts)
    finished = rollout.finished(G)
    if subset is not None:  # the generated rows (kept prompts) that belong to this mini-batch
        members = set(subset)
        rows = [row for row, q in enumerate(prompt_cut.keep.nonzero().flatten().tolist()) if q in members]
        lengths, finished = lengths.view(-1, G)[rows], finished[rows]
        pi_q = pi_q[rows]
        num_prompts = len(subset)
    if side.cfg.overlong.filter:  # truncated completions count in no denominator (docs/algorithms.md, "Overlong")
        return finished_denominator(agg, finished, lengths.view(-1, G), pi_q, L_max) or 1.0
    return loss_denominator(agg, num_prompts, G, lengths.view(-1, G), pi_q, L_max)


# ==============================================================================================================
# Several updates per rollout: PPO mini-batches, old log-probs once, rollout correction, the updates
# ==============================================================================================================
def several_updates_per_rollout(cfg) -> bool:
    """More than one optimizer update per rollout batch (train.mini_batches * train.epochs > 1): the PPO ratio is
    live after the first update, so the old log-probs must come from the trainer, computed once per rollout
    before the first update (whatever train.recompute_old_logprobs says)."""
    return cfg.train.mini_batches * cfg.train.epochs > 1


def split_mini_batches(side: TrainSide, prompts: list[Prompt], prompt_cut: PruneResult, rollout: Rollout,
                       total_cut: PruneResult, batch: TrainBatch, step: int) -> list[TrainBatch]:
    """The surviving batch split into train.mini_batches PPO mini-batches BY DRAWN PROMPT, the split drawn from
    (train.seed, step) alone (``algo.minibatches``), each with its own draw-independent denominator D_m. One
    mini-batch (the default) returns ``[batch]`` itself. A mini-batch whose units were all pruned is empty."""
    M = min(side.cfg.train.mini_batches, len(prompts))  # (fewer prompts than M: a refill that ran out of rounds)
    if M <= 1:  # one mini-batch, or a step with no prompt at all (a refill that found no group with signal)
        return [batch]
    groups = split_prompts(len(prompts), M, make_generator(side.cfg.train.seed, step, "mini_batches"))
    kept_rows = prompt_cut.keep.nonzero().flatten().tolist()
    drawn = [kept_rows[row] for row, _ in batch.origin]  # drawn-prompt index of each surviving sequence
    out = []
    for group in groups:
        members = set(group)
        idx = [k for k, q in enumerate(drawn) if q in members]
        trained = batch.trained_lengths()
        lengths = [trained[k] for k in idx]
        d = (denominator(side, prompts, prompt_cut, rollout, total_cut, lengths, subset=group) if idx else 1.0)
        out.append(_select(batch, idx, d))
    return out


def _select(batch: TrainBatch, idx: list[int], denominator_m: float) -> TrainBatch:
    """The sequences ``idx`` of ``batch`` (in order) with the denominator ``denominator_m``."""
    t = torch.tensor(idx, dtype=torch.long)
    return TrainBatch(token_ids=[batch.token_ids[k] for k in idx],
                      prompt_lengths=[batch.prompt_lengths[k] for k in idx],
                      advantages=batch.advantages[t], token_weights=batch.token_weights[t],
                      seq_weights=batch.seq_weights[t], rewards=batch.rewards[t],
                      origin=[batch.origin[k] for k in idx], denominator=denominator_m,
                      loss_masks=None if batch.loss_masks is None else [batch.loss_masks[k] for k in idx])


def pack_mini_batches(side: TrainSide, mini_batches: list[TrainBatch]) -> tuple[list[list], dict[str, float]]:
    """Each mini-batch packed separately (``pack``: equal micro-batch count per DP rank), and the packing metrics
    (one mini-batch: its own; several: mean density, summed micro-batches, worst fill and imbalance)."""
    packed, stats = [], []
    for mb in mini_batches:
        micro_batches, s = pack(side, mb) if len(mb) else ([], None)
        packed.append(micro_batches)
        if s is not None:
            stats.append(s)
    if len(stats) == 1:
        return packed, stats[0]
    return packed, {"packing/density": sum(s["packing/density"] for s in stats) / len(stats),
                    "packing/micro_batches": sum(s["packing/micro_batches"] for s in stats),
                    "packing/max_bin_fill": max(s["packing/max_bin_fill"] for s in stats),
                    "packing/rank_cost_imbalance": max(s["packing/rank_cost_imbalance"] for s in stats)}


def old_logprobs_needed(cfg: Any, loss_cfg: Any) -> bool:
    """Whether the step runs the forward-only old-policy log-prob pass before the update.

    With exactly one optimizer update per rollout batch the weights being trained ARE the weights the old
    log-probs would be computed with, so the PPO/GSPO ratio exp(logp - old) is identically 1. The pass is then
    skipped and the loss uses old = logp.detach() from the train forward itself (as TRL's GRPOTrainer does):
    the same value (bit for bit on CPU, tests/megatron/test_train_step.py) and the same gradient, one forward
    pass less. It is needed when the ratio can differ from 1 (several updates per rollout: live after the first),
    for rollout correction (its weights compare the rollout engine with these old log-probs before the update),
    or when forced with ``train.recompute_old_logprobs``. MoE routing replay (``model.moe_routing_replay``) needs
    it too: the pass records the experts the update replays. A KL term needs the REFERENCE pass, not this one
    (``fill_logprobs`` decides that from ``loss_cfg.kl_coef``)."""
    return bool(cfg.train.recompute_old_logprobs or several_updates_per_rollout(cfg)
                or loss_cfg.rollout_correction != "none" or cfg.model.moe_routing_replay)


def fill_old_and_reference_logprobs(side: TrainSide, packed: list[list]) -> None:
    """Old-policy (and, with a KL term, reference) log-probs of every mini-batch, forward only, ONCE per rollout
    and before the first update. The old pass runs only when ``old_logprobs_needed``; otherwise the ratio is 1 by
    construction and the loss uses the train forward's own detached log-probs."""
    old = old_logprobs_needed(side.cfg, side.loss_cfg)
    if old or side.loss_cfg.kl_coef > 0:
        side.engine.fill_logprobs([b for micro_batches in packed for b in micro_batches], old=old)


def whole_batch_micro_batches(side: TrainSide, batch: TrainBatch, packed: list[list]) -> list:
    """This rank's micro-batches of the whole surviving batch (for the gradient audit, which measures pruning over
    the step's batch): the single mini-batch's own, or the batch packed anew with its reference log-probs."""
    if len(packed) == 1:
        return packed[0]
    micro_batches, _ = pack(side, batch)
    if side.loss_cfg.kl_coef > 0:
        side.engine.fill_logprobs(micro_batches, old=False)
    return micro_batches


def correct_rollout_mismatch(loss_cfg: LossConfig, rollout: Rollout, mini_batches: list[TrainBatch],
                             packed: list[list]) -> dict[str, float]:
    """loss.rollout_correction: set each micro-batch's per-token factor u' of the policy-gradient term from the
    trainer's old log-probs and the rollout engine's behaviour log-probs (``algo.losses.rollout_correction_weights``;
    a sequence without them is an error, ``behaviour_logprobs_at``). Returns the mismatch metrics over all DP ranks
    (rollout/is_ratio: mean u before correction, rollout/is_corrected_fraction: tokens truncated or masked,
    rollout/kl_k1 and rollout/kl_k3: KL(behaviour || trainer) per token: engine numerics, staleness and, with top-k /
    top-p, the truncation). No-op (no metrics) when off."""
    if loss_cfg.rollout_correction == "none":
        return {}
    sums = torch.zeros(5, dtype=torch.float64)
    for batch, micro_batches in zip(mini_batches, packed):
        for mb in micro_batches:
            if mb.is_dummy or mb.old_logprobs is None:
                continue
            engine_logp = behaviour_logprobs_at(mb, mb.old_logprobs, batch, rollout)
            weight, m = rollout_correction_weights(mb.old_logprobs, engine_logp, mb.loss_mask, loss_cfg)
            mb.rollout_weight = weight.to(mb.old_logprobs.dtype)
            sums += torch.stack([m[k].double().cpu() for k in ("tokens", "ratio_sum", "corrected_tokens", "k1_sum",
                                                             "k3_sum")])
    tokens, ratio, corrected, k1, k3 = (sum(t) for t in zip(*D.all_gather_objects(sums.tolist())))
    if not tokens:
        return {}
    return {"rollout/is_ratio": ratio / tokens, "rollout/is_corrected_fraction": corrected / tokens,
            "rollout/kl_k1": k1 / tokens, "rollout/kl_k3": k3 / tokens}


def behaviour_logprobs_at(mb, like: torch.Tensor, batch: TrainBatch, rollout: Rollout) -> torch.Tensor:
    """The rollout engine's behaviour log-probs laid out as ``like`` (a per-position tensor of ``mb``): each
    sequence's at its completion positions, ``like``'s values elsewhere. A sequence the engine returned no log-probs
    for, or a different number of them, raises ValueError naming it: a trainer log-prob in its place would make the
    correction 1 and the KL 0 there, a stale or truncated sample passing for on-policy."""
    out = like.detach().clone()
    mask = mb.loss_mask > 0
    bounds = mb.cu_seqlens_padded.tolist()
    for sid, a, b in zip(mb.sample_ids.tolist(), bounds[:-1], bounds[1:]):
        row, i = batch.origin[sid]
        ref = rollout.behaviour_logprobs[row][i]
        if ref is not None and rollout.mask_offpolicy and rollout.token_versions is not None:  # the last segment
            ref = [lp for lp, m in zip(ref, offpolicy_mask(rollout.token_versions[row][i])) if m]
        positions = mask[a:b].nonzero().flatten() + a
        if ref is None or len(ref) != positions.numel():
            raise ValueError(f"completion {i} of prompt {rollout.prompts[row].id!r}: the rollout engine returned "
                             f"{'no' if ref is None else len(ref)} behaviour log-probs for its {positions.numel()} "
                             "tokens; the rollout correction and the mismatch metrics need one per sampled token "
                             "(rollout/base.py, Completion.logprobs)")
        out[positions] = torch.tensor(ref, dtype=out.dtype, device=out.device)
    return out


def update_policy(side: TrainSide, mini_batches: list[TrainBatch], packed: list[list]) -> dict[str, float]:
    """The policy updates of one rollout batch: for epoch (train.epochs): for mini-batch: one optimizer update with
    its fixed denominator D_m (an empty mini-batch is skipped). Returns the merged train/* metrics."""
    updates = []
    for _epoch in range(side.cfg.train.epochs):
        for mini_batch, micro_batches in zip(mini_batches, packed):
            if len(mini_batch):
                updates.append(side.engine.train_step(micro_batches, mini_batch.denominator))
    return {f"train/{k}": v for k, v in merge_update_metrics(updates).items()}


def merge_update_metrics(updates: list[dict[str, float]]) -> dict[str, float]:
    """The step's train/* metrics from its updates: one update's own, or over several the mean of each (sums of
    tokens/sequences/micro_batches, min of update_ok) plus ``updates``, their count."""
    if len(updates) == 1:
        return updates[0]
    summed, lowest = ("tokens", "sequences", "micro_batches"), ("update_ok",)
    out = {k: (sum(u[k] for u in updates) if k in summed else min(u[k] for u in updates) if k in lowest
               else sum(u[k] for u in updates) / len(updates)) for k in updates[0]}
    out["updates"] = float(len(updates))
    return out


def pack(side: TrainSide, batch: TrainBatch) -> tuple[list, dict[str, float]]:
    """This DP rank's THD micro-batches (Dense Prompt Packing) and the packing metrics of the whole plan."""
    from megatron_dppo.packing import build_rank_micro_batches, pack_sequences, packing_stats, thd_pad_multiple

    cfg = side.cfg
    pad = thd_pad_multiple(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.sp)
    lengths = [len(t) for t in batch.token_ids]
    plan = pack_sequences(lengths, cfg.packing.capacity, side.dp_size, cfg.packing.window, pad_multiple=pad,
                          micro_batch_multiple=cfg.parallel.pp if cfg.parallel.vpp else 1)
    stats = packing_stats(plan, lengths, cfg.packing.capacity, pad_multiple=pad)
    micro_batches = build_rank_micro_batches(plan[side.dp_rank], batch.token_ids, batch.prompt_lengths,
                                             batch.advantages, batch.token_weights, pad_multiple=pad,
                                             pad_token_id=side.pad_id, loss_masks=batch.loss_masks)
    return micro_batches, {"packing/density": stats.density, "packing/micro_batches": float(stats.num_micro_batches),
                           "packing/max_bin_fill": stats.max_bin_fill,
                           "packing/rank_cost_imbalance": stats.rank_cost_imbalance}


def gradient_audit(side: TrainSide, prompts: list[Prompt], prompt_cut: PruneResult, rollout: Rollout,
                   advantages: torch.Tensor, batch: TrainBatch, micro_batches: list) -> dict[str, float]:
    """audit/*: cosine and relative error of this step's pruned gradient vs the gradient of every generated
    completion (weighted 1/pi_q), both at the current weights (megatron_dppo.train.audit)."""
    from megatron_dppo.train.audit import full_completion_cut, pruning_audit

    full_cut = full_completion_cut(prompt_cut, side.cfg.train.group_size)
    if side.cfg.overlong.filter:  # the full batch of the filtered loss: every FINISHED completion
        full_cut.keep[prompt_cut.keep] &= rollout.finished(side.cfg.train.group_size)
        full_cut.weight[~full_cut.keep] = 0.0
    full = build_train_batch(side, prompts, prompt_cut, rollout, advantages, full_cut)
    full_micro_batches, _ = pack(side, full)
    return pruning_audit(side.engine, full_micro_batches, micro_batches, full.denominator, batch.denominator,
                         weights=batch.seq_weights).as_metrics()


def write_audit(audit, step: int, prompts: list[Prompt], prompt_cut: PruneResult, rollout: Rollout,
                advantages: torch.Tensor, total_cut: PruneResult, screens: Any = None) -> None:
    """logging.audit_log: one JSON line per drawn prompt with every completion's reward, advantage, keep, weight,
    trained length (episodes also: their tokens, turns, finish reasons), written to the open file ``audit`` (None:
    off, or not the main rank); with screening (``screens``, a ``screen.Screens``) each screened prompt's screen
    rewards, lengths and continuation probability."""
    if audit is None:
        return
    row_of = {q: row for row, q in enumerate(prompt_cut.keep.nonzero().flatten().tolist())}
    screened = {} if screens is None else {q: i for i, q in enumerate(screens.rows)}
    for q, prompt in enumerate(prompts):
        rec: dict[str, Any] = {"step": step, "prompt_id": prompt.id, "prompt_kept": bool(prompt_cut.keep[q]),
                               "prompt_weight": float(prompt_cut.weight[q]),
                               "prompt_prob": float(prompt_cut.probabilities()[q])}
        if q in screened:
            i = screened[q]
            rec.update(screen_rewards=screens.rewards[i].tolist(), screen_lengths=screens.lengths[i].tolist(),
                       continue_prob=float(screens.prob[i]))
        if q in row_of:
            row = row_of[q]
            rec.update(rewards=rollout.rewards[row].tolist(), advantages=advantages[row].tolist(),
                       keep=total_cut.keep[q].tolist(), weight=total_cut.weight[q].tolist(),
                       lengths=[len(c) for c in rollout.completions[row]], completions=rollout.texts[row])
            if rollout.slots is not None:  # adaptive group sizes: which slots were generated (the others: placeholders)
                rec["generated"] = rollout.slots[row].tolist()
            if rollout.episodes is not None:  # lengths: the whole streams; trained: their sampled tokens
                episodes = rollout.episodes[row]
                rec.update(trained=[e.num_trained for e in episodes], turns=[e.turns for e in episodes],
                           finish_reasons=[e.finish_reason for e in episodes],
                           env_rewards=[e.reward for e in episodes])
        audit.write(json.dumps(rec) + "\n")
    audit.flush()
