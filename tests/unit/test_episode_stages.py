"""Multi-turn episodes through the REAL training-side stages (``train/rollouts.py``, ``train/draw.py``,
``train/stages.py``): a ``Rollout`` of ``Episode`` objects (the episode loop's own type) goes through the prompt
decision (``draw.select_prompts``, costs from the prompt history), the completion decision
(``stages.select_completions``), ``build_train_batch``, ``split_mini_batches`` and Dense Prompt Packing (``pack``),
and the loss of the packed THD micro-batches is what the Megatron engine computes (``algo.losses.loss_numerator`` /
D, tests/megatron/test_loss_mask.py ties the two).

* The rollout: lengths are trained (sampled) tokens, total_tokens the whole sequence, reward = reward.fn of the
  last turn + the environment's reward, masks and finish reasons per episode.
* The batch: every episode's loss mask reaches its micro-batch (observation tokens: loss mask 0), token weights
  and D count trained tokens, L_max is the env's trained-token limit, an episode without a sampled token is not
  packed, and the behaviour log-probs line up with the trained positions.
* DPPO with episodes as units, cost-aware keep rule, both levels, through these stages: the Monte-Carlo mean of
  the pruned loss and gradient equals the unpruned batch's (same harness and thresholds as test_pruning.py); the
  negative control (kept episodes weighted 1 instead of 1/pi) fails the same test.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import test_pruning as TP
import torch

from megatron_dppo.algo.advantages import compute_advantages, group_advantages
from megatron_dppo.algo.losses import loss_numerator
from megatron_dppo.algo.prompt_history import PromptHistory
from megatron_dppo.config import load_config
from megatron_dppo.data import Prompt
from megatron_dppo.rollout.episodes import Episode
from megatron_dppo.run.build import build_loss, build_pruner
from megatron_dppo.run.state import RolloutSide, TrainSide
from megatron_dppo.train import stages
from megatron_dppo.train.dapo import select_rows
from megatron_dppo.train.draw import select_prompts, update_prompt_state
from megatron_dppo.train.rollouts import Rollout, counted_episodes

DT = torch.float64
B, G = 6, 4
LIMIT = 12  # env.max_assistant_tokens
NAN = float("nan")


class LocalTrainSide(TrainSide):
    """The training side of one process without Megatron's process groups (DP rank 0 of 1): the process layer is
    all it replaces."""

    dp_rank = 0
    dp_size = 1


def make_config(*extra: str):
    return load_config(None, ["model.hf_config.model_type=qwen2", "data.task=arithmetic", "env.name=noop",
                              "env.max_tokens=40", f"env.max_assistant_tokens={LIMIT}", "packing.capacity=64",
                              "packing.window=8", f"train.group_size={G}", f"train.prompts_per_step={B}",
                              "loss.kl_coef=0.1", "algo.pruner=dppo", *extra])


def make_rollout(seed: int = 0) -> Rollout:
    """B prompts x G episodes: 1-3 assistant turns of 1-3 tokens each, observations of 3-6 tokens between them,
    behaviour log-probs on the sampled tokens (0.0 on observations, as the episode loop writes them)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, groups = [], []
    for q in range(B):
        prompt = torch.randint(4, 60, (2 + q % 3,), generator=gen).tolist()
        prompts.append(Prompt(id=f"q{q}", token_ids=prompt, gold="0", text=f"q{q}"))
        episodes = []
        for i in range(G):
            turns, mask = 1 + (q + i) % 3, []
            for t in range(turns):
                mask += [1] * int(torch.randint(1, 4, (1,), generator=gen))
                if t < turns - 1:
                    mask += [0] * int(torch.randint(3, 7, (1,), generator=gen))
            ids = torch.randint(4, 60, (len(mask),), generator=gen).tolist()
            logprobs = [float(-torch.rand(1, generator=gen)) if m else 0.0 for m in mask]
            episodes.append(Episode(prompt_ids=prompt, token_ids=ids, loss_mask=mask, logprobs=logprobs,
                                    finish_reason=("stop", "length", "max_turns")[(q + i) % 3],
                                    reward=0.25 * ((q * G + i) % 3), turns=turns, texts=[str(i)]))
        groups.append(episodes)
    rollout = Rollout(prompts=prompts, completions=[[e.token_ids for e in eps] for eps in groups],
                      texts=[[e.final_text for e in eps] for eps in groups],
                      behaviour_logprobs=[[[lp for lp, m in zip(e.logprobs, e.loss_mask) if m] for e in eps]
                                          for eps in groups],
                      truncated=[[e.finish_reason == "length" for e in eps] for eps in groups], episodes=groups)
    rewards = torch.randn(B, G, generator=gen)
    rewards[0] = 1.0  # a zero-variance group: A = 0 (its KL term still matters)
    rollout.rewards = rewards
    return rollout


def sides(cfg, rollout: Rollout):
    loss_cfg, estimator = build_loss(cfg)
    pruner = build_pruner(cfg, loss_cfg, estimator)
    rollout_side = RolloutSide(cfg=cfg, tokenizer=None, engine=None, handover=None, eos_ids=[], scorer=None,
                               train_prompts=rollout.prompts, sampler=None, pruner=pruner)
    train_side = LocalTrainSide(cfg=cfg, engine=None, loss_cfg=loss_cfg, estimator=estimator, pruner=pruner)
    return rollout_side, train_side


# --------------------------------------------------------------------------------------------------------------
# The rollout and the batch
# --------------------------------------------------------------------------------------------------------------
def test_rollout_of_episodes_counts_trained_tokens_and_adds_the_environment_reward():
    from megatron_dppo.rewards import RewardScorer
    from megatron_dppo.train.rollouts import score, score_rule

    rollout = make_rollout()
    trained = torch.tensor([[sum(e.loss_mask) for e in eps] for eps in rollout.episodes], dtype=DT)
    torch.testing.assert_close(rollout.lengths(), trained)
    assert bool((rollout.lengths() < torch.tensor([[len(c) for c in cs] for cs in rollout.completions])).any())
    total = torch.tensor([[len(p.token_ids) + len(c) for c in cs] for p, cs in zip(rollout.prompts,
                                                                                    rollout.completions)], dtype=DT)
    torch.testing.assert_close(rollout.total_tokens(), total)
    assert rollout.loss_masks[2][1] == rollout.episodes[2][1].loss_mask
    assert rollout.finish_reasons[1] == ["length", "max_turns", "stop", "length"]
    scorer = RewardScorer("arithmetic", isolation="inline")
    try:
        rule = score_rule(scorer, rollout, G)  # texts "0".."3" against gold "0": 1 for i = 0
        side, _ = sides(make_config(), rollout)
        side.scorer = scorer
        rewards = score(side, rollout, step=0)
    finally:
        scorer.close()
    task = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * B)
    torch.testing.assert_close(rule, task)  # the rule reward alone: what correctness (evaluation) reads
    torch.testing.assert_close(rewards, task + rollout.env_rewards())  # the training reward adds the env's
    torch.testing.assert_close(rollout.rule_rewards, task)


def test_pass_rates_count_the_rule_never_the_environments_step_rewards():
    """reward/pass_rate, reward/prompt_solve_rate and reward/pass_rate_kept are the rule's verdict: a shaping
    reward (here +0.25 or +0.5 on most wrong answers) does not make a wrong answer a pass, and a penalty (-1.5 on the
    right ones) does not make a right one a failure."""
    from megatron_dppo.algo.pruning import keep_all
    from megatron_dppo.rewards import RewardScorer
    from megatron_dppo.train.rollouts import score
    from megatron_dppo.train.step_metrics import step_metrics

    rollout = make_rollout()
    for q, eps in enumerate(rollout.episodes):
        eps[0].reward = -1.5  # the right answer ("0") penalized; the wrong ones keep their 0, 0.25, 0.5
    side, train_side = sides(make_config("algo.pruner=none"), rollout)
    side.scorer = RewardScorer("arithmetic", isolation="inline")
    try:
        rollout.rewards = score(side, rollout, step=0)
    finally:
        side.scorer.close()
    assert bool((rollout.rewards[:, 1:] > 0).any()) and bool((rollout.rewards[:, 0] < 0).all())
    prompt_cut = keep_all(B)
    advantages = compute_advantages(rollout.rewards, "grpo")
    completion_cut, total_cut = stages.select_completions(train_side, prompt_cut, rollout, advantages, 0)
    batch = stages.build_train_batch(train_side, rollout.prompts, prompt_cut, rollout, advantages, total_cut)
    m = step_metrics(prompt_cut, completion_cut, total_cut, rollout, batch, G)
    assert m["reward/pass_rate"] == 0.25 and m["reward/prompt_solve_rate"] == 1.0
    assert m["reward/pass_rate_kept"] == 0.25 and len(batch) == B * G


def test_episodes_train_and_cost_the_prompt_their_reset_messages_made():
    """Each episode was sampled from its own prompt (the task's re-rendered with the messages its environment's
    reset returned; the G episodes of one prompt differ): the trained sequences start with it (token ids, prompt
    lengths, the packed labels and loss mask), the cost-aware keep rule counts its tokens, and the reward model
    reads it, never the data set's prompt."""
    rollout = make_rollout()
    for q, eps in enumerate(rollout.episodes):
        for i, e in enumerate(eps):
            e.prompt_ids = rollout.prompts[q].token_ids + [61 + i] * (1 + i)  # + the reset message, per episode
            e.reset_messages = [{"role": "user", "content": f"hint {i}"}]
    total = torch.tensor([[len(e.prompt_ids) + len(e.token_ids) for e in eps] for eps in rollout.episodes], dtype=DT)
    torch.testing.assert_close(rollout.total_tokens(), total)
    cfg = make_config("algo.pruner=none")
    rollout_side, side = sides(cfg, rollout)
    prompt_cut = select_prompts(rollout_side, rollout.prompts, 0)
    advantages = compute_advantages(rollout.rewards, "grpo")
    _, total_cut = stages.select_completions(side, prompt_cut, rollout, advantages, 0)
    batch = stages.build_train_batch(side, rollout.prompts, prompt_cut, rollout, advantages, total_cut)
    episodes = [rollout.episodes[r][i] for r, i in batch.origin]
    assert batch.token_ids == [e.prompt_ids + e.token_ids for e in episodes]
    assert batch.prompt_lengths == [len(e.prompt_ids) for e in episodes]
    for mb in stages.pack(side, batch)[0]:  # the loss positions are the sampled tokens after the episode's prompt
        for sid, a in zip(mb.sample_ids.tolist(), mb.cu_seqlens_padded.tolist()[:-1]):
            e = episodes[sid]
            labels = torch.arange(len(e.loss_mask)) + a + len(e.prompt_ids) - 1
            assert mb.labels[labels].tolist() == e.token_ids
            assert mb.loss_mask[labels].tolist() == [float(m) for m in e.loss_mask]
    from megatron_dppo.train.rollouts import reward_model_samples

    samples = reward_model_samples(rollout)
    for q, (eps, group) in enumerate(zip(rollout.episodes, samples)):
        for i, (e, sample) in enumerate(zip(eps, group)):
            assert list(sample.prompt_ids) == e.prompt_ids
            assert sample.prompt_text == f"q{q}\n\nhint {i}"


def test_the_reward_model_reads_the_last_assistant_turn_under_every_template():
    """One meaning for every template: the reward model scores an episode's prompt and its LAST assistant turn
    (the answer the rule judges). ``tokens`` takes that turn's sampled ids (stop token included), not the whole
    stream with the observations; ``chat``/``text``/judges its decoded text."""
    from megatron_dppo.train.rollouts import reward_model_samples

    rollout = make_rollout()
    multi = [e for eps in rollout.episodes for e in eps if e.turns > 1]
    assert multi
    for eps, group in zip(rollout.episodes, reward_model_samples(rollout)):
        for e, sample in zip(eps, group):
            last = max(k for k, m in enumerate(e.loss_mask) if m)
            first = max((k + 1 for k, m in enumerate(e.loss_mask[:last]) if not m), default=0)
            assert list(sample.completion_ids) == e.token_ids[first:last + 1]
            assert sample.completion_text == e.final_text and list(sample.prompt_ids) == e.prompt_ids
            if e.turns > 1:
                assert len(sample.completion_ids) < len(e.token_ids)  # the observations and earlier turns are not in


def test_the_batch_carries_each_episodes_mask_and_counts_trained_tokens():
    cfg = make_config("algo.pruner=none", "loss.aggregation=seq_mean_token_sum_norm")
    rollout = make_rollout()
    rollout_side, side = sides(cfg, rollout)
    prompt_cut = select_prompts(rollout_side, rollout.prompts, 0)
    advantages = compute_advantages(rollout.rewards, "grpo")
    _, total_cut = stages.select_completions(side, prompt_cut, rollout, advantages, 0)
    batch = stages.build_train_batch(side, rollout.prompts, prompt_cut, rollout, advantages, total_cut)
    assert batch.loss_masks == [rollout.episodes[r][i].loss_mask for r, i in batch.origin]
    assert batch.trained_lengths() == [sum(m) for m in batch.loss_masks]
    # seq_mean_token_sum_norm: D = B * G * L_max with L_max the env's trained-token limit (not max_new_tokens)
    assert batch.denominator == B * G * LIMIT and cfg.rollout.max_new_tokens != LIMIT
    micro_batches, _ = stages.pack(side, batch)
    assert sum(float(mb.loss_mask.sum()) for mb in micro_batches) == sum(batch.trained_lengths())
    for mb in micro_batches:  # observation tokens are never loss positions; engine log-probs on the trained ones
        bounds = mb.cu_seqlens_padded.tolist()
        engine = stages.behaviour_logprobs_at(mb, torch.zeros(mb.tokens.shape[0]), batch, rollout)
        for sid, a in zip(mb.sample_ids.tolist(), bounds[:-1]):
            row, i = batch.origin[sid]
            e, p = rollout.episodes[row][i], len(rollout.prompts[row].token_ids)
            labels = torch.arange(len(e.loss_mask)) + a + p - 1
            assert mb.loss_mask[labels].tolist() == [float(m) for m in e.loss_mask]
            assert mb.labels[labels].tolist() == e.token_ids
            kept = labels[torch.tensor(e.loss_mask, dtype=torch.bool)]
            torch.testing.assert_close(engine[kept], torch.tensor(rollout.behaviour_logprobs[row][i]))
    # seq_mean_token_mean: 1/|o| with |o| the trained tokens
    cfg = make_config("algo.pruner=none", "loss.aggregation=seq_mean_token_mean")
    _, side = sides(cfg, rollout)
    batch = stages.build_train_batch(side, rollout.prompts, prompt_cut, rollout, advantages, total_cut)
    torch.testing.assert_close(batch.token_weights, 1.0 / torch.tensor(batch.trained_lengths(), dtype=torch.float32))
    # mini-batches keep each sequence's mask
    cfg = make_config("algo.pruner=none", "train.mini_batches=2")
    _, side = sides(cfg, rollout)
    parts = stages.split_mini_batches(side, rollout.prompts, prompt_cut, rollout, total_cut, batch, 0)
    assert sorted(m for part in parts for m in map(tuple, part.loss_masks)) == sorted(map(tuple, batch.loss_masks))


def test_an_episode_without_a_sampled_token_is_not_packed():
    cfg = make_config("algo.pruner=none")
    rollout = make_rollout()
    failed = rollout.episodes[3][2]
    failed.token_ids, failed.loss_mask, failed.logprobs, failed.finish_reason = [], [], [], "env_error"
    rollout.completions[3][2], rollout.behaviour_logprobs[3][2] = [], []
    rollout_side, side = sides(cfg, rollout)
    prompt_cut = select_prompts(rollout_side, rollout.prompts, 0)
    advantages = compute_advantages(rollout.rewards, "grpo")
    _, total_cut = stages.select_completions(side, prompt_cut, rollout, advantages, 0)
    batch = stages.build_train_batch(side, rollout.prompts, prompt_cut, rollout, advantages, total_cut)
    assert (3, 2) not in batch.origin and len(batch) == B * G - 1
    assert batch.denominator == B * G  # the unit still counts in the full-batch denominator


def test_env_error_episodes_leave_the_group_statistics_the_loss_and_the_prompt_state():
    """env.errors=exclude (the default): an env_error episode takes no part in its group's mean and std (the other
    episodes' advantages are those of their group without it), is not trained, and the prompt state records the
    group without it; a group left with one episode gets advantage 0 and leaves the prompt state as it was.
    env.errors=score keeps the old behaviour: the error scored as a failed task, everywhere."""
    from megatron_dppo.algo.advantages import group_advantages
    from megatron_dppo.train.draw import update_prompt_state
    from megatron_dppo.train.rollouts import counted_episodes, error_metrics

    rollout = with_errors(make_rollout())
    cfg = make_config("algo.pruner=none")
    assert cfg.env.errors == "exclude"
    counted = counted_episodes(cfg, rollout)
    advantages = group_advantages(rollout.rewards, counted, "grpo")
    for q in range(B):
        members = counted[q].nonzero().flatten()
        expected = (compute_advantages(rollout.rewards[q, members].view(1, -1), "grpo").flatten()
                    if len(members) >= 2 else torch.zeros(len(members)))
        torch.testing.assert_close(advantages[q, members], expected)
        assert bool((advantages[q, ~counted[q]] == 0).all())
    assert error_metrics(cfg, rollout) == {"env/errors_excluded": 6.0, "env/groups_without_signal": 1.0}
    rollout_side, side = sides(cfg, rollout)
    prompt_cut = select_prompts(rollout_side, rollout.prompts, 0)
    _, total_cut = stages.select_completions(side, prompt_cut, rollout, advantages, 0)
    batch = stages.build_train_batch(side, rollout.prompts, prompt_cut, rollout, advantages, total_cut)
    assert sorted(batch.origin) == sorted((q, i) for q in range(B) for i in range(G) if (q, i) not in ERRORS)
    assert batch.denominator == B * G  # the drawn batch's constant: every unit counts, errors included
    rollout_side.pruner.state.update(["q4"], torch.full((1, G), 7.0))  # q4's earlier score: kept (one episode left)
    update_prompt_state(rollout_side, rollout, rollout.rewards, advantages, version=0)
    scores = rollout_side.pruner.state.scores([p.id for p in rollout.prompts])
    for q in (0, 1, 2, 3, 5):
        members = counted[q]
        assert float(scores[q]) == pytest.approx(float(advantages[q, members].abs().mean()))
    assert float(scores[4]) == 7.0
    # env.errors=score: the old behaviour
    old = make_config("algo.pruner=none", "env.errors=score")
    assert counted_episodes(old, rollout) is None and error_metrics(old, rollout) == {}
    with pytest.raises(ValueError, match="env.errors"):
        make_config("env.errors=drop")


def test_history_records_episode_costs_only_for_the_cost_aware_rule():
    rollout = make_rollout()
    advantages = compute_advantages(rollout.rewards, "grpo")
    ids = [p.id for p in rollout.prompts]
    for extra, recorded in ((("algo.dppo_keep=optimal", "algo.dppo_keep_cost=tokens"), True), ((), False)):
        side, _ = sides(make_config(*extra), rollout)
        update_prompt_state(side, rollout, rollout.rewards, advantages, version=0)
        assert ("costs" in side.pruner.state_dict()) == recorded
    torch.testing.assert_close(side.pruner.state.costs(ids), torch.full((B,), NAN, dtype=DT), equal_nan=True)
    side, _ = sides(make_config("algo.dppo_keep=optimal", "algo.dppo_keep_cost=tokens"), rollout)
    update_prompt_state(side, rollout, rollout.rewards, advantages, version=0)
    torch.testing.assert_close(side.pruner.state.costs(ids), rollout.total_tokens().mean(1))
    restored = PromptHistory()
    restored.load_state_dict(side.pruner.state_dict())
    torch.testing.assert_close(restored.costs(ids + ["new"])[:B], rollout.total_tokens().mean(1))
    assert math.isnan(float(restored.costs(["new"])[0]))
    with pytest.raises(ValueError, match="algo.dppo_keep_cost"):
        make_config("algo.dppo_keep_cost=tokens")  # needs the optimal rule


# --------------------------------------------------------------------------------------------------------------
# DPPO with episodes as units through the stages: Monte Carlo
# --------------------------------------------------------------------------------------------------------------
DRAWS = 600  # ~18 ms of CPU per draw (both decisions water-fill anew, as a step does): ~11 s per test


def tables(rollout: Rollout, seed: int = 1):
    """Trainer log-probs (the leaf), old and reference log-probs per (prompt, episode, completion token)."""
    gen = torch.Generator().manual_seed(seed)
    L = max(len(c) for cs in rollout.completions for c in cs)
    logp = torch.randn(B, G, L, generator=gen, dtype=DT) * 0.5 - 1.0
    old = logp + torch.randn(B, G, L, generator=gen, dtype=DT) * 0.3
    ref = logp + torch.randn(B, G, L, generator=gen, dtype=DT) * 0.2
    mask = torch.zeros(B, G, L, dtype=torch.bool)
    for q, eps in enumerate(rollout.episodes):
        for i, e in enumerate(eps):
            mask[q, i, : len(e.loss_mask)] = torch.tensor(e.loss_mask, dtype=torch.bool)
    return logp, old, ref, mask


def step_value(rollout_side, side, rollout, advantages, step, logp, old, ref, mask):
    """[loss, gradient w.r.t. the trained log-probs] of one step's pruned batch, through the stages."""
    prompt_cut = select_prompts(rollout_side, rollout.prompts, step)
    rows = prompt_cut.keep.nonzero().flatten().tolist()
    kept = select_rows(rollout, rows)
    _, total_cut = stages.select_completions(side, prompt_cut, kept, advantages[rows], step)
    batch = stages.build_train_batch(side, rollout.prompts, prompt_cut, kept, advantages[rows], total_cut)
    leaf = logp.clone().requires_grad_()
    loss = torch.zeros((), dtype=DT)
    if len(batch):
        micro_batches, _ = stages.pack(side, batch)
        L = logp.shape[-1]
        for mb in micro_batches:
            if mb.is_dummy:
                continue
            T, bounds = mb.tokens.shape[0], mb.cu_seqlens_padded.tolist()
            pos, idx = [], []
            for sid, a in zip(mb.sample_ids.tolist(), bounds[:-1]):
                row, i = batch.origin[sid]
                q, p = rows[row], len(rollout.prompts[rows[row]].token_ids)
                n = len(rollout.completions[q][i])
                pos += range(a + p - 1, a + p - 1 + n)
                idx += range((q * G + i) * L, (q * G + i) * L + n)
            pos_t, idx_t = torch.tensor(pos), torch.tensor(idx)

            def at(table):
                return torch.zeros(T, dtype=DT).index_put((pos_t,), table.reshape(-1)[idx_t])

            num, _ = loss_numerator(at(leaf), at(old), mb.advantages.to(DT), mb.token_weight.to(DT), mb.loss_mask,
                                    mb.seq_index, side.loss_cfg, at(ref))
            loss = loss + num
        loss = loss / batch.denominator
    (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True) if loss.requires_grad else (None,)
    grad = torch.zeros_like(logp) if grad is None else grad
    assert bool((grad[~mask] == 0).all())  # observation tokens (and padding) get no gradient
    return torch.cat([loss.detach().view(1), grad[mask]])


ERRORS = ((1, 0), (2, 1), (2, 3), (4, 2), (4, 0), (4, 1))  # (prompt, episode) that end with env_error


def with_errors(rollout: Rollout, errors=ERRORS) -> Rollout:
    for q, i in errors:
        rollout.episodes[q][i].finish_reason = "env_error"
        rollout.truncated[q][i] = False
    return rollout


def monte_carlo(extra, weight_one=False, monkeypatch=None, draws=DRAWS, errors=()):
    rollout = with_errors(make_rollout(), errors)
    logp, old, ref, mask = tables(rollout)
    advantages = group_advantages(rollout.rewards, counted_episodes(make_config(*extra), rollout), "grpo")
    cfg = make_config("algo.dppo_keep=optimal", "algo.dppo_keep_cost=tokens", "algo.r_q=0.4", "algo.r_o=0.5",
                      "algo.keep_floor=0.1", *extra)
    rollout_side, side = sides(cfg, rollout)
    history_adv = advantages[1:].clone()
    history_adv[1] = 0.0  # a prompt whose last group had no signal: a candidate at the floor
    # prompts 1..B-1 seen (prompt 0 never seen: kept with probability 1)
    update_prompt_state(rollout_side, select_rows(rollout, range(1, B)), rollout.rewards[1:], history_adv, version=0)
    full_cfg = make_config("algo.pruner=none", *extra)
    full_rollout_side, full_side = sides(full_cfg, rollout)
    full = step_value(full_rollout_side, full_side, rollout, advantages, 0, logp, old, ref, mask)
    if weight_one:  # the negative control: kept episodes weighted 1 instead of 1/(pi_q pi_i|q)
        real = stages.combine

        def unweighted(prompt, completion):
            out = real(prompt, completion)
            return dataclasses.replace(out, weight=out.keep.float())

        monkeypatch.setattr(stages, "combine", unweighted)
    samples = torch.stack([step_value(rollout_side, side, rollout, advantages, step, logp, old, ref, mask)
                           for step in range(draws)])
    return samples, full


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean",
                                         pytest.param("seq_mean_token_sum_norm", marks=pytest.mark.slow)])
def test_dppo_with_cost_aware_episodes_is_unbiased_through_the_stages(aggregation):
    samples, full = monte_carlo((f"loss.aggregation={aggregation}",))
    losses = samples[:, 0]
    assert float((losses != losses[0]).double().mean()) > 0.5  # the draws differ: pruning acts at both levels
    z = TP.mc_z(samples, full)
    assert z.max() < TP.Z_OK, f"max z {z.max():.2f} at statistic {int(z.argmax())} (0 = loss, then gradient)"


def test_dppo_with_env_errors_left_out_is_unbiased_through_the_stages():
    """env.errors=exclude: the env_error episodes leave the loss (deterministically, given the rollout) and their
    group's advantage statistics; D stays the full drawn batch's constant. The pruned loss and gradient are then
    unbiased for the unpruned batch's, errors left out the same way."""
    samples, full = monte_carlo(("loss.aggregation=seq_mean_token_mean",), errors=ERRORS)
    assert TP.mc_z(samples, full).max() < TP.Z_OK


def test_negative_control_unweighted_survivors_fail_the_same_test(monkeypatch):
    samples, full = monte_carlo(("loss.aggregation=seq_mean_token_mean",), weight_one=True, monkeypatch=monkeypatch,
                                draws=300)
    z = TP.mc_z(samples, full)
    assert z.max() > TP.Z_BIASED, f"bias not detected: max z {z.max():.2f}"
