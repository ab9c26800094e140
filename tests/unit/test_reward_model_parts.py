"""The pieces around a reward model (issue 33): Kendall's tau-b and the reward-hacking alarm, the arithmetic
preference pairs, Bradley-Terry training (it learns what it is taught, and nothing from shuffled labels), the
reward.model options."""
from __future__ import annotations

import logging
import math

import pytest
import torch
from _reward_models import TASK, arithmetic_tokenizer

from megatron_dppo.data.arithmetic import preference_pairs
from megatron_dppo.rewards.agreement import group_agreement, kendall_tau_b


# ----------------------------------------------------------------------------------------------------------------
# Agreement
# ----------------------------------------------------------------------------------------------------------------
def brute_tau_b(x, y):
    """tau-b from its definition, pair by pair."""
    n = len(x)
    c = d = tx = ty = 0
    for i in range(n):
        for j in range(i + 1, n):
            sx, sy = (x[i] > x[j]) - (x[i] < x[j]), (y[i] > y[j]) - (y[i] < y[j])
            c += sx * sy > 0
            d += sx * sy < 0
            tx += sx == 0
            ty += sy == 0
    n0 = n * (n - 1) / 2
    return (c - d) / math.sqrt((n0 - tx) * (n0 - ty))


def test_kendall_tau_b_with_ties_and_its_edge_cases():
    assert kendall_tau_b(torch.tensor([1., 2, 3, 4]), torch.tensor([1., 3, 2, 4])) == pytest.approx(4 / 6)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # binary rule rewards tie a lot; continuous scores sometimes tie too
        x = torch.randint(0, 2, (8,), generator=g).float()
        y = torch.randint(0, 4, (8,), generator=g).float()
        if x.std() > 0 and y.std() > 0:
            assert kendall_tau_b(x, y) == pytest.approx(brute_tau_b(x.tolist(), y.tolist()))
    assert math.isnan(kendall_tau_b(torch.ones(4), torch.arange(4.0)))  # a flat side has no order
    assert kendall_tau_b(torch.arange(5.0), -torch.arange(5.0)) == pytest.approx(-1.0)


def test_group_agreement_averages_the_groups_where_both_vary():
    rule = torch.tensor([[1., 0, 0, 0], [1., 1, 1, 1], [0., 1, 0, 1]])
    model = torch.tensor([[3., 1, 2, 0], [1., 2, 3, 4], [2., 1, 2, 1]])
    tau, groups = group_agreement(rule, model)
    assert groups == 2  # the second group (all correct) has no order to agree with
    assert tau == pytest.approx((kendall_tau_b(rule[0], model[0]) + kendall_tau_b(rule[2], model[2])) / 2)
    assert math.isnan(group_agreement(torch.ones(2, 3), torch.rand(2, 3))[0])


def test_the_alarm_fires_below_alarm_tau_with_a_warning(caplog, tmp_path):
    from megatron_dppo.algo.pruning import PruneResult
    from megatron_dppo.config import load_config
    from megatron_dppo.train.rollouts import Rollout
    from megatron_dppo.train.step_metrics import reward_model_metrics

    cfg = load_config("examples/quickstart.yaml", [f"reward.model.path={tmp_path}"])
    ones = torch.ones(2, dtype=torch.float64)
    cut = PruneResult(keep=torch.ones(2, dtype=torch.bool), weight=ones.float(), keep_prob=ones)
    rollout = Rollout(prompts=[None, None], completions=[[[1]] * 3] * 2, texts=[["a"] * 3] * 2,
                      behaviour_logprobs=[[None] * 3] * 2, truncated=[[False] * 3] * 2)
    rollout.rule_rewards = torch.tensor([[1., 0, 0], [0., 1, 0]])
    rollout.model_rewards = torch.tensor([[0., 1, 2], [2., 0, 1]])  # prefers what the rule rejects
    with caplog.at_level(logging.WARNING, logger="megatron_dppo.reward_model"):
        m = reward_model_metrics(cfg, cut, rollout)
    assert m["reward/rule_model_tau"] < 0 and m["reward/agreement_alarm"] == 1.0
    assert m["reward/rule_mean"] == pytest.approx(1 / 3) and m["reward/model_mean"] == pytest.approx(1.0)
    assert "reward-hacking alarm" in caplog.text
    rollout.model_rewards = rollout.rule_rewards * 2  # agrees
    assert reward_model_metrics(cfg, cut, rollout)["reward/agreement_alarm"] == 0.0
    rollout.model_rewards = None
    assert reward_model_metrics(cfg, cut, rollout) == {}  # no reward model, no metrics


# ----------------------------------------------------------------------------------------------------------------
# Preference pairs and Bradley-Terry
# ----------------------------------------------------------------------------------------------------------------
def test_preference_pairs_say_what_they_prefer():
    correct = preference_pairs(TASK, 200, prefer="correct")
    assert all(p["chosen"] == TASK.record(i).gold != p["rejected"] for i, p in enumerate(correct))
    assert correct == preference_pairs(TASK, 200, prefer="correct")  # a pure function of the seed
    closer = preference_pairs(TASK, 200, prefer="closer")
    for i, p in enumerate(closer):
        gold = int(TASK.record(i).gold)
        distance = [abs(int(p[k]) - gold) if p[k].lstrip("-").isdigit() else math.inf for k in ("chosen", "rejected")]
        assert distance[0] < distance[1]
    assert any(p["chosen"] != TASK.record(i).gold for i, p in enumerate(closer))  # wrong-vs-wrong pairs too
    assert all(len(p["chosen"]) > len(p["rejected"]) for p in preference_pairs(TASK, 200, prefer="longer"))
    with pytest.raises(ValueError, match="prefer"):
        preference_pairs(TASK, 2, prefer="shorter")


def _pairs(tok, rows):
    def ids(prompt, completion):
        return (list(tok(prompt)["input_ids"]) + list(tok(completion, add_special_tokens=False)["input_ids"])
                + [tok.eos_token_id])

    return [(ids(r["prompt"], r["chosen"]), ids(r["prompt"], r["rejected"])) for r in rows]


def test_bradley_terry_learns_what_it_is_taught_and_nothing_from_shuffled_labels(tmp_path):
    from megatron_dppo.rewards.bradley_terry import BTConfig, small_classifier_config, train_bradley_terry

    tok = arithmetic_tokenizer(tmp_path / "tok")
    train = _pairs(tok, preference_pairs(TASK, 600, prefer="longer"))
    heldout = _pairs(tok, preference_pairs(TASK, 200, "test", prefer="longer"))
    bt = BTConfig(hidden_size=32, intermediate_size=64, steps=80, lr=3e-3)
    config = small_classifier_config(64, 64, tok, bt)
    record = train_bradley_terry(train, config, tmp_path / "rm", tok, bt=bt, heldout=heldout)
    assert record["heldout_accuracy"] > 0.9
    assert (tmp_path / "rm" / "config.json").is_file() and (tmp_path / "rm" / "reward_model.json").is_file()
    g = torch.Generator().manual_seed(0)
    shuffled = [p if torch.rand(1, generator=g) < 0.5 else (p[1], p[0]) for p in train]
    noise = train_bradley_terry(shuffled, config, tmp_path / "noise", tok, bt=bt, heldout=heldout)
    assert 0.25 < noise["heldout_accuracy"] < 0.75


# ----------------------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["reward.model.engine=megatron", "rollout.placement=separate", "train.max_staleness=1"], "rollout workers"),
    (["reward.model.engine=megatron", "reward.model.kind=judge"], "serves classifiers"),
    (["reward.model.weight=0", "reward.model.rule_weight=0"], "not both 0"),
    (["reward.model.judge_tokens=[ok]"], "two non-empty strings"),
    (["reward.model.timeout_s=0"], "seconds > 0"),
])
def test_bad_reward_model_options_name_the_option(tmp_path, overrides, message):
    from megatron_dppo.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config("examples/quickstart.yaml", [f"reward.model.path={tmp_path}", *overrides])


def test_the_reward_model_path_must_be_a_model_folder(tmp_path):
    from megatron_dppo.config import load_config
    from megatron_dppo.run.reward_model import build_reward_model

    cfg = load_config("examples/quickstart.yaml", [f"reward.model.path={tmp_path}"])
    with pytest.raises(ValueError, match="no config.json"):
        build_reward_model(cfg, None)
    assert build_reward_model(load_config("examples/quickstart.yaml", []), None) is None
