"""The metrics of an RL step (docs/algorithms.md, "Metrics"): rewards as Horvitz-Thompson estimates over every
drawn prompt (a pruned prompt was never generated, so raw means over the generated ones flatter), kept fractions
and ESS per pruning level, tokens, the rollout engine's log-prob mismatch against the trainer's, and for multi-turn
episodes their env/* family (docs/environments.md, "Metrics")."""
from __future__ import annotations

import logging

import torch

from megatron_dppo.algo.pruning import PruneResult, pruning_stats
from megatron_dppo.distributed import collectives as D
from megatron_dppo.rewards.agreement import group_agreement
from megatron_dppo.train.rollouts import Rollout
from megatron_dppo.train.stages import TrainBatch, behaviour_logprobs_at

logger = logging.getLogger("megatron_dppo.reward_model")


def step_metrics(prompt_cut: PruneResult, completion_cut: PruneResult | None, total_cut: PruneResult,
                 rollout: Rollout, batch: TrainBatch, group_size: int) -> dict[str, float]:
    """Rewards (unbiased estimates over all drawn prompts; raw means over generated and over kept sequences), kept
    fractions per level, ESS, tokens (docs/algorithms.md, "Metrics")."""
    m = rollout_metrics(prompt_cut, rollout, group_size)
    if len(batch):
        m["reward/mean_kept"] = float(batch.rewards.mean())
        solved = solved_rewards(rollout)
        m["reward/pass_rate_kept"] = sum(float(solved[row, i] > 0) for row, i in batch.origin) / len(batch)
        m["reward/mean_kept_weighted"] = float((batch.rewards * batch.seq_weights).sum() / batch.seq_weights.sum())
    # kept fraction and ESS per level: prompt (of drawn prompts), completion (of generated completions), total
    # (trained sequences of the B*G drawn units)
    m.update(pruning_stats(prompt_cut, completion_cut, total_cut))
    m.setdefault("prune/completion_kept_fraction", 0.0)
    m["tokens/trained_sequences"] = float(sum(len(t) for t in batch.token_ids))
    m["tokens/trained_completion"] = float(sum(batch.trained_lengths()))  # loss-mask 1 tokens
    m["loss/denominator"] = float(batch.denominator)
    return m


def rollout_metrics(prompt_cut: PruneResult, rollout: Rollout, group_size: int) -> dict[str, float]:
    """The reward/* estimates over the drawn prompts and the generated-token counts of ``rollout`` (the part of
    ``step_metrics`` that describes what was generated, not what was trained)."""
    m: dict[str, float] = {}
    r = rollout.rewards if rollout.rewards is not None else torch.zeros(0, group_size)
    slots = rollout.slots if rollout.slots is not None else torch.ones(r.shape, dtype=torch.bool)
    flat = r[slots]  # (adaptive group sizes: the generated slots only, never the placeholders)
    n = slots.sum(dim=1).clamp(min=1).float()
    if prompt_cut.keep.numel():
        # Headline rates are Horvitz-Thompson estimates over ALL B drawn prompts (docs/algorithms.md, "Metrics"):
        # a generated prompt counts 1/pi_q, a pruned one (never generated) 0, divided by B. Without prompt
        # pruning every pi_q = 1 and this is the plain mean. reward/mean_generated and reward/std are raw over the
        # generated completions, reward/mean_kept over the trained sequences.
        m["reward/mean"] = ht_prompt_mean(prompt_cut, (r * slots).sum(dim=1) / n)
        solved = (solved_rewards(rollout) > 0) & slots  # the rule's verdict, not the training reward's sign
        m["reward/pass_rate"] = ht_prompt_mean(prompt_cut, solved.float().sum(dim=1) / n)
        m["reward/prompt_solve_rate"] = ht_prompt_mean(prompt_cut, solved.any(dim=1).float())
        first = r.gather(1, slots.long().argmax(dim=1, keepdim=True)) if r.numel() else r[:, :1]
        constant = ((r == first) | ~slots).all(dim=1)
        m["reward/zero_variance_groups"] = ht_prompt_mean(prompt_cut, constant.float())
    if flat.numel():
        m["reward/mean_generated"] = float(flat.mean())
        m["reward/std"] = float(flat.std()) if flat.numel() > 1 else 0.0
        m["reward/failed"] = float(rollout.reward_failures)  # scored 0: the reward function raised, hung, ...
        m["reward/timeouts"] = float(rollout.reward_timeouts)  # ... of which ran out of time
    # generated = sampled tokens (an episode's observation tokens were not generated; its stream is tokens/episode_*)
    comp_lengths = ([len(c) for comps, row in zip(rollout.completions, slots.tolist()) for c, g in zip(comps, row)
                     if g] if rollout.episodes is None else [e.num_trained for eps in rollout.episodes for e in eps])
    m["tokens/generated"] = float(sum(comp_lengths))
    m["tokens/completion_mean"] = sum(comp_lengths) / len(comp_lengths) if comp_lengths else 0.0
    m["tokens/truncated_fraction"] = (sum(t for ts in rollout.truncated for t in ts) / len(comp_lengths)
                                      if comp_lengths else 0.0)
    if rollout.episodes is not None:  # env/*: turns, tool calls/errors/timeouts, finish shares; episode time p50/p99
        from megatron_dppo.rollout.episodes import episode_metrics

        episodes = [e for eps in rollout.episodes for e in eps]
        m.update(episode_metrics(episodes))
        m["tokens/episode_mean"] = sum(len(e.token_ids) for e in episodes) / len(episodes) if episodes else 0.0
    return m


def solved_rewards(rollout: Rollout) -> torch.Tensor:
    """[Bk, G] the reward whose sign says "solved": the rule reward (reward.fn) alone, without an environment's step
    rewards (a shaping reward would turn a wrong answer into a pass, a penalty a right one into a failure) or a
    reward model's score. A rollout scored without ``rollouts.score`` (no rule reward recorded) uses its rewards."""
    return rollout.rule_rewards if rollout.rule_rewards is not None else rollout.rewards


def reward_model_metrics(cfg, prompt_cut: PruneResult, rollout: Rollout) -> dict[str, float]:
    """With a reward model (``reward.model``): its scores and the rule reward (Horvitz-Thompson means over the drawn
    prompts, as reward/mean), their agreement (reward/rule_model_tau: mean within-group Kendall tau-b,
    ``rewards.agreement``; over the groups where both vary, counted in reward/rule_model_tau_groups) and the
    reward-hacking alarm (reward/agreement_alarm = 1, and a warning, when the tau is below reward.model.alarm_tau),
    the groups a failing model cost (on_error=zero), unparsed judge verdicts, and the model's scoring time
    (time/reward_model, part of time/reward). Empty without a reward model."""
    if rollout.model_rewards is None:
        return {}
    m = {"reward/model_failed": float(rollout.reward_model_failed),
         "reward/model_unparsed": float(rollout.reward_model_unparsed),
         "time/reward_model": float(rollout.reward_model_seconds)}
    rule, model = rollout.rule_rewards, rollout.model_rewards
    if not rule.numel():
        return m
    m["reward/model_mean"] = ht_prompt_mean(prompt_cut, model.mean(dim=1))
    m["reward/rule_mean"] = ht_prompt_mean(prompt_cut, rule.mean(dim=1))
    m["reward/rule_pass_rate"] = ht_prompt_mean(prompt_cut, (rule > 0).float().mean(dim=1))
    tau, groups = group_agreement(rule, model)
    m["reward/rule_model_tau_groups"] = float(groups)
    if groups:
        m["reward/rule_model_tau"] = tau
        alarm = tau < cfg.reward.model.alarm_tau
        m["reward/agreement_alarm"] = float(alarm)
        if alarm and D.is_main():
            logger.warning("reward-hacking alarm: the reward model agrees with the rule reward at Kendall tau %.3f "
                           "(mean over %d groups) < reward.model.alarm_tau=%g; the policy may be learning what "
                           "the model likes and the rule does not (reward/rule_mean %.3f)", tau, groups,
                           cfg.reward.model.alarm_tau, m["reward/rule_mean"])
    return m


def ht_prompt_mean(prompt_cut: PruneResult, per_prompt: torch.Tensor) -> float:
    """Horvitz-Thompson estimate of the mean of a per-prompt quantity over every drawn prompt, from the generated
    ones: sum over generated prompts of value / pi_q, divided by the number drawn. ``per_prompt`` has one value per
    generated (kept) prompt, in drawn order. Unbiased over the prompt-pruning draw; equal to the plain mean when
    nothing is pruned (pi_q = 1)."""
    weight = prompt_cut.weight[prompt_cut.keep].double()  # 1/pi_q of each generated prompt
    return float((weight * per_prompt.double()).sum() / max(1, prompt_cut.keep.numel()))


def logprob_mismatch(rollout: Rollout, mini_batches: list[TrainBatch], packed: list[list],
                     train_logprobs: list | None = None) -> dict[str, float]:
    """Mean |behaviour log-prob - Megatron log-prob| over completion tokens (weight-sync health check);
    ``mini_batches`` and ``packed`` are the PPO mini-batches and their micro-batches (one of each by default).
    The Megatron side is the old-policy pass (``mb.old_logprobs``) when it ran, else (one update per rollout, the
    pass skipped) the train forward's own log-probs at the same weights (``train_logprobs``, one per micro-batch
    of that single update: ``PolicyEngine.last_logprobs``, None on ranks that hold no output layer); the two are
    the same numbers, both at the sampling temperature. Without top-k / top-p and at staleness 0 it is numerics
    only (~1e-6 in fp32); top-k / top-p add the truncation gap -log Z_K (docs/algorithms.md). A sequence without
    behaviour log-probs raises (``behaviour_logprobs_at``)."""
    diff, count = 0.0, 0
    for batch, micro_batches in zip(mini_batches, packed):
        for m, mb in enumerate(micro_batches):
            values_all = mb.old_logprobs
            if values_all is None and train_logprobs is not None and m < len(train_logprobs):
                values_all = train_logprobs[m]
            if values_all is None or mb.is_dummy:
                continue
            values_all = values_all.to(mb.loss_mask.device)
            engine = behaviour_logprobs_at(mb, values_all, batch, rollout)
            mask = mb.loss_mask > 0
            diff += float((values_all.double() - engine.double())[mask].abs().sum())
            count += int(mask.sum())
    totals = D.all_gather_objects((diff, count))
    diff, count = sum(t[0] for t in totals), sum(t[1] for t in totals)
    return {"rollout/logprob_abs_diff": diff / count} if count else {}
