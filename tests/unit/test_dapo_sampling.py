"""DAPO's sampling-side options (docs/algorithms.md, "Dynamic sampling with refill", "Overlong completions"): the
refill rule (B groups with non-zero variance, surplus, max_rounds), the soft overlong penalty at its boundaries,
overlong filtering's denominators, and the stages that apply them: a filtered step trains exactly the finished
completions, with the per-token factors of the unfiltered step, over a D that counts exactly those."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_dppo.algo.dynamic_sampling import nonzero_variance, refill
from megatron_dppo.algo.losses import loss_denominator
from megatron_dppo.algo.overlong import finished_denominator, overlong_penalty
from megatron_dppo.config import load_config

QUICKSTART = "examples/quickstart.yaml"


# --------------------------------------------------------------------------------------------------------------
# Soft overlong punishment
# --------------------------------------------------------------------------------------------------------------
def test_overlong_penalty_at_its_boundaries():
    L_max, L_cache, p = 10, 4, 0.5
    pen = overlong_penalty(torch.tensor([0, 5, 6, 7, 8, 9, 10, 11]), L_max, L_cache, p).tolist()
    # free up to L_max - L_cache = 6; then -p/L_cache per token; exactly -p at L_max; never below -p
    assert pen == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5, -0.5]
    for L in range(0, L_max + 1):  # verl's overlong_buffer formula: min(-(L - expected_len) / len * factor, 0)
        verl = min(-(L - (L_max - L_cache)) / L_cache * p, 0.0)
        assert math.isclose(overlong_penalty(torch.tensor([L]), L_max, L_cache, p).item(), verl, abs_tol=1e-7)


def test_overlong_penalty_off_and_whole_range():
    assert overlong_penalty(torch.tensor([3, 10]), 10, 0).tolist() == [0.0, 0.0]  # buffer 0: off
    full = overlong_penalty(torch.tensor([0, 1, 5, 10]), 10, 10, 1.0).tolist()  # L_cache = L_max: from token 1
    assert full == pytest.approx([0.0, -0.1, -0.5, -1.0])


@pytest.mark.parametrize("kwargs,match", [({"buffer": 11}, "buffer"), ({"buffer": -1}, "buffer"),
                                          ({"penalty": -1.0}, "penalty"), ({"max_len": 0}, "max_len")])
def test_overlong_penalty_rejects_bad_arguments(kwargs, match):
    args = {"max_len": 10, "buffer": 4, "penalty": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        overlong_penalty(torch.tensor([3]), **args)


# --------------------------------------------------------------------------------------------------------------
# Overlong filtering: the denominators
# --------------------------------------------------------------------------------------------------------------
def test_finished_denominator_counts_only_finished_completions():
    finished = torch.tensor([[True, False, True], [False, False, True]])
    lengths = torch.tensor([[3.0, 8.0, 5.0], [8.0, 8.0, 2.0]])
    assert finished_denominator("seq_mean_token_mean", finished, lengths, None, 8) == 3.0
    assert finished_denominator("seq_mean_token_sum", finished, lengths, None, 8) == 3.0
    assert finished_denominator("seq_mean_token_sum_norm", finished, lengths, None, 8) == 24.0
    assert finished_denominator("token_mean", finished, lengths, None, 8) == 10.0
    # nothing truncated: the ordinary full-batch denominators, bit for bit
    everything = torch.ones(2, 3, dtype=torch.bool)
    for agg in ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_mean"):
        assert finished_denominator(agg, everything, lengths, None, 8) == loss_denominator(agg, 2, 3, lengths, None, 8)
    # prompt pruning: each generated row counts 1/pi_q (Horvitz-Thompson), as token_mean does
    pi = torch.tensor([0.5, 1.0])
    assert finished_denominator("seq_mean_token_mean", finished, lengths, pi, 8) == 2 / 0.5 + 1
    assert finished_denominator("token_mean", finished, lengths, pi, 8) == 8 / 0.5 + 2
    with pytest.raises(ValueError, match="aggregation"):
        finished_denominator("mean", finished, lengths, None, 8)


# --------------------------------------------------------------------------------------------------------------
# Dynamic sampling with refill: the rule
# --------------------------------------------------------------------------------------------------------------
def _groups(pattern: str, G: int = 4) -> torch.Tensor:
    """One group per character: 'v' has non-zero variance, '0' / '1' all rewards equal."""
    rows = {"v": [0.0, 1.0, 0.0, 0.0], "0": [0.0] * G, "1": [1.0] * G}
    return torch.tensor([rows[c] for c in pattern]) if pattern else torch.zeros(0, G)


def test_refill_reaches_b_groups_with_non_zero_variance():
    rounds = {2: "0v1", 3: "v"}  # round 1 keeps 2 of 4; the shortfall (2) is drawn, then 1
    calls = []

    def draw_round(index, n):
        calls.append((index, n))
        return _groups(rounds[index])[:n]

    first = _groups("v01v")
    out = refill(first, draw_round, batch_groups=4, max_rounds=5)
    assert calls == [(2, 2), (3, 1)]
    assert out.kept == [0, 3, 5, 6] and len(out.kept) == 4  # rows of the concatenated rounds, in draw order
    batch = torch.cat([first, _groups("0v"), _groups("v")])[out.kept]
    assert bool(nonzero_variance(batch).all())
    assert (out.rounds, out.drawn, out.discarded, out.surplus, out.exhausted) == (3, 7, 3, 0, False)
    assert out.metrics()["dynamic_sampling/kept_groups"] == 4.0


def test_refill_with_a_fixed_round_size_discards_the_surplus_in_draw_order():
    out = refill(_groups("0v0"), lambda i, n: _groups("vvv0v")[:n], batch_groups=3, max_rounds=3, refill_prompts=5)
    assert out.kept == [1, 3, 4] and out.surplus == 2 and out.discarded == 3 and out.drawn == 8


def test_refill_stops_at_max_rounds_short_of_b():
    out = refill(_groups("00"), lambda i, n: _groups("1" * n), batch_groups=2, max_rounds=3)
    assert (out.rounds, out.kept, out.exhausted, out.drawn, out.discarded) == (3, [], True, 6, 6)
    assert out.metrics()["dynamic_sampling/exhausted"] == 1.0
    one = refill(_groups("v0"), lambda i, n: pytest.fail("max_rounds=1 must not draw"), 2, max_rounds=1)
    assert one.kept == [0] and one.exhausted


def test_refill_needs_no_round_when_the_first_is_full_and_checks_its_inputs():
    out = refill(_groups("vvv"), lambda i, n: pytest.fail("no refill needed"), batch_groups=2, max_rounds=4)
    assert out.kept == [0, 1] and out.surplus == 1 and out.rounds == 1
    with pytest.raises(ValueError, match="asked for 2 groups"):
        refill(_groups("00"), lambda i, n: _groups("v"), batch_groups=2, max_rounds=2)
    with pytest.raises(ValueError, match="max_rounds"):
        refill(_groups("v"), lambda i, n: _groups("v"), batch_groups=1, max_rounds=0)


# --------------------------------------------------------------------------------------------------------------
# Config: options, refusals
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,fragments", [
    (["dynamic_sampling.enable=true"], ["dynamic_sampling.enable=true needs algo.pruner=none", "'dppo'"]),
    (["dynamic_sampling.enable=true", "algo.pruner=cppo"], ["needs algo.pruner=none", "'cppo'"]),
    (["dynamic_sampling.max_rounds=0"], ["dynamic_sampling.max_rounds=0 is invalid", ">= 1"]),
    (["dynamic_sampling.refill_prompts=0"], ["dynamic_sampling.refill_prompts=0 is invalid"]),
    (["overlong.buffer=7"], ["overlong.buffer=7 is invalid", "rollout.max_new_tokens=6"]),
    (["overlong.penalty=-0.5"], ["overlong.penalty=-0.5 is invalid", ">= 0"]),
])
def test_config_refuses_bad_combinations_with_a_clear_error(overrides, fragments):
    with pytest.raises(ValueError) as err:
        load_config(QUICKSTART, overrides)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_config_accepts_refill_without_a_pruner_and_the_overlong_options():
    cfg = load_config(QUICKSTART, ["dynamic_sampling.enable=true", "algo.pruner=none", "overlong.buffer=6",
                                   "overlong.filter=true", "overlong.penalty=0.5"])
    assert cfg.dynamic_sampling.enable and cfg.overlong.buffer == 6 and cfg.overlong.filter
    assert cfg.dynamic_sampling.max_rounds == 10 and cfg.dynamic_sampling.refill_prompts is None


# --------------------------------------------------------------------------------------------------------------
# The stages: overlong filtering removes exactly the truncated completions, from numerator and denominator
# --------------------------------------------------------------------------------------------------------------
def _train_side(overrides):
    from megatron_dppo.run.build import build_loss, build_pruner
    from megatron_dppo.run.state import TrainSide

    cfg = load_config(QUICKSTART, ["train.group_size=3", "rollout.max_new_tokens=5", *overrides])
    loss_cfg, estimator = build_loss(cfg)
    pruner = build_pruner(cfg, loss_cfg, estimator)
    # what the selection and batch stages read (no engine is touched by them)
    return TrainSide(cfg=cfg, engine=None, loss_cfg=loss_cfg, estimator=estimator, pruner=pruner)


def _rollout():
    from megatron_dppo.data import Prompt
    from megatron_dppo.train.rollouts import Rollout

    lengths = [[2, 5, 3], [5, 5, 1], [4, 2, 5]]  # 5 = max_new_tokens: the truncated ones (no stop token)
    truncated = [[n == 5 for n in row] for row in lengths]
    prompts = [Prompt(id=f"q{q}", token_ids=[1, 2, 3 + q], gold="0", text="") for q in range(3)]
    return Rollout(prompts=prompts, completions=[[[7] * n for n in row] for row in lengths],
                   texts=[["x"] * 3 for _ in range(3)],
                   behaviour_logprobs=[[[-1.0] * n for n in row] for row in lengths],
                   truncated=truncated, rewards=torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))


def _step(side, rollout):
    from megatron_dppo.algo.advantages import compute_advantages
    from megatron_dppo.algo.pruning import keep_all
    from megatron_dppo.train.rollouts import training_rewards
    from megatron_dppo.train.stages import build_train_batch, select_completions

    prompt_cut = keep_all(3)
    advantages = compute_advantages(training_rewards(side.cfg, rollout), side.estimator, side.loss_cfg.advantage_eps)
    _, total_cut = select_completions(side, prompt_cut, rollout, advantages, step=0)
    return build_train_batch(side, rollout.prompts, prompt_cut, rollout, advantages, total_cut)


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"])
def test_overlong_filter_trains_exactly_the_finished_completions_over_their_own_denominator(aggregation):
    base = ["algo.pruner=none", f"loss.aggregation={aggregation}"]
    rollout = _rollout()
    plain, filtered = _step(_train_side(base), rollout), _step(_train_side([*base, "overlong.filter=true"]), rollout)
    finished = {(q, i) for q in range(3) for i in range(3) if not rollout.truncated[q][i]}
    assert set(plain.origin) == {(q, i) for q in range(3) for i in range(3)}
    assert set(filtered.origin) == finished  # numerator: exactly the truncated completions are gone ...
    same = [plain.origin.index(o) for o in filtered.origin]  # ... and each remaining term is unchanged
    assert torch.equal(filtered.token_weights, plain.token_weights[same])
    assert torch.equal(filtered.advantages, plain.advantages[same])  # advantages of the whole group
    lengths = {(q, i): len(rollout.completions[q][i]) for q in range(3) for i in range(3)}
    expected = {"seq_mean_token_mean": len(finished), "token_mean": sum(lengths[o] for o in finished),
                "seq_mean_token_sum_norm": len(finished) * 5}[aggregation]
    assert filtered.denominator == expected  # denominator: exactly the finished ones
    assert plain.denominator == {"seq_mean_token_mean": 9, "token_mean": sum(lengths.values()),
                                 "seq_mean_token_sum_norm": 45}[aggregation]


def test_overlong_filter_composes_with_dppo_completion_pruning():
    side = _train_side(["algo.pruner=dppo", "algo.r_q=0", "algo.r_o=0.5", "overlong.filter=true"])
    rollout = _rollout()
    batch = _step(side, rollout)
    assert all(not rollout.truncated[q][i] for q, i in batch.origin)  # never a truncated one, whatever the draw
    assert batch.denominator == 5  # every drawn prompt generated: the exact count of finished completions


def test_soft_penalty_shapes_the_training_reward_not_the_task_reward():
    from megatron_dppo.train.rollouts import training_rewards

    rollout = _rollout()
    shaped = training_rewards(_train_side(["algo.pruner=none", "overlong.buffer=2", "overlong.penalty=1.0"]).cfg,
                              rollout)
    lengths = torch.tensor([[len(c) for c in row] for row in rollout.completions])
    assert torch.equal(shaped, rollout.rewards + overlong_penalty(lengths, 5, 2, 1.0))
    assert shaped[0].tolist() == [1.0, -1.0, 0.0] and shaped[2].tolist() == [0.5, 1.0, -1.0]
    assert training_rewards(_train_side(["algo.pruner=none"]).cfg, rollout) is rollout.rewards  # off: untouched


def _all_correct_group_of_different_lengths():
    """Group 0 all correct with lengths 2, 4, 5 (inside a buffer of 2 below L_max = 5: penalties 0, -0.5, -1), group 1
    mixed, group 2 all wrong at one length: one reward for all in the task reward for groups 0 and 2, in the training
    reward (task + soft overlong penalty) for group 2 only."""
    from megatron_dppo.data import Prompt
    from megatron_dppo.train.rollouts import Rollout

    lengths = [[2, 4, 5], [2, 2, 3], [3, 3, 3]]
    prompts = [Prompt(id=f"q{q}", token_ids=[1, 2, 3 + q], gold="0", text="") for q in range(3)]
    return Rollout(prompts=prompts, completions=[[[7] * n for n in row] for row in lengths],
                   texts=[["x"] * 3 for _ in range(3)],
                   behaviour_logprobs=[[[-1.0] * n for n in row] for row in lengths],
                   truncated=[[n == 5 for n in row] for row in lengths],
                   rewards=torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("metric, kept_groups", [("task", {1}), ("training", {0, 1})])
def test_the_zero_variance_filter_looks_at_the_task_reward_before_the_overlong_penalty(metric, kept_groups):
    """As verl's DAPO recipe (filter_groups.metric=acc: the score before its reward manager adds the overlong
    penalty), an all-correct group whose lengths differ inside the buffer has one task reward for all and is dropped
    by algo.drop_zero_variance_groups (it was kept: the filter looked at task + penalty); with
    dynamic_sampling.filter_metric=training it is kept, as verl's metric=reward keeps it. Dynamic sampling's refill
    reads the same rewards (rollouts.filter_rewards)."""
    from megatron_dppo.train.rollouts import filter_rewards, training_rewards

    rollout = _all_correct_group_of_different_lengths()
    side = _train_side(["algo.pruner=none", "algo.drop_zero_variance_groups=true", "overlong.buffer=2",
                        f"dynamic_sampling.filter_metric={metric}"])
    assert training_rewards(side.cfg, rollout)[0].tolist() == [1.0, 0.5, 0.0]  # the penalty does differ in group 0
    expected = rollout.rewards if metric == "task" else training_rewards(side.cfg, rollout)
    assert torch.equal(filter_rewards(side.cfg, rollout), expected)
    batch = _step(side, rollout)
    assert {q for q, _ in batch.origin} == kept_groups
