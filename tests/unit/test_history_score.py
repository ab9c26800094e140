"""DPPO's prompt history under continuous rewards (issue 33): with GRPO's std-normalized advantages the paper's
score, mean |A| of the last group, has no scale (about 0.8 at reward spreads 0.01, 1 and 10 alike), so under a
reward model's scores the prompt level cannot tell low-signal prompts from the rest; the reward-spread score keeps
the scale, and is what ``algo.history_score=auto`` picks when a reward model is set."""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.prompt_history import PromptHistory, RewardSpreadHistory, make_history
from megatron_dppo.algo.pruning import DPPOPruner, make_generator, prompt_candidates


def gaussian_groups(scales, G=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor(scales, dtype=torch.float64)
    return torch.randn(len(scales), G, generator=g, dtype=torch.float64) * scales[:, None] + 3.0


def test_mean_abs_advantage_loses_the_scale_the_reward_spread_keeps():
    n = 3000
    for scale in (0.01, 1.0, 10.0):
        rewards = gaussian_groups([scale] * n, seed=int(scale * 100))
        adv = compute_advantages(rewards, "grpo")
        mean_abs = PromptHistory().group_scores(adv, rewards)
        spread = RewardSpreadHistory().group_scores(adv, rewards)
        assert sum(mean_abs) / n == pytest.approx(0.78, abs=0.03)  # the same at every scale
        assert sum(spread) / n == pytest.approx(scale * 0.93, rel=0.05)  # E[population std of 8] = 0.93 sigma


def test_under_mixed_spreads_only_the_reward_spread_makes_the_low_signal_prompts_candidates():
    """A batch where half the prompts have a tiny reward spread (a reward model's noise) and half a large one: the
    DPPO candidate rule (below the batch mean) picks every tiny-spread prompt from reward_std (and at most a few of
    the others, whose sample spread fell low), and about half of each from mean |A| (no better than chance)."""
    scales = [0.01] * 32 + [1.0] * 32
    rewards = gaussian_groups(scales, seed=1)
    adv = compute_advantages(rewards, "grpo")
    ids = list(range(64))
    spread, mean_abs = RewardSpreadHistory(), PromptHistory()
    spread.update(ids, adv, rewards)
    mean_abs.update(ids, adv, rewards)
    low = torch.tensor([s < 0.5 for s in scales])
    by_spread = prompt_candidates(spread.scores(ids))
    by_mean_abs = prompt_candidates(mean_abs.scores(ids))
    assert bool(by_spread[low].all()) and int(by_spread[~low].sum()) <= 3
    assert 0.2 < (by_mean_abs & low).sum() / low.sum() < 0.8
    # and the pruner takes it as a history (>= 0, NaN for unseen)
    result = DPPOPruner(0.5, 0.5).select_prompts(spread.scores(ids + [999]), make_generator(0, 0, "prompts"))
    assert result.keep[-1] and torch.equal(result.candidate[:-1], by_spread)


def test_a_flat_group_scores_zero_under_both_and_binary_rewards_keep_their_zeros():
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    adv = compute_advantages(rewards, "grpo")
    assert RewardSpreadHistory().group_scores(adv, rewards)[0] == 0.0
    assert RewardSpreadHistory().group_scores(adv, rewards)[2] == 0.0
    assert PromptHistory().group_scores(adv, rewards)[0] == 0.0
    assert RewardSpreadHistory().group_scores(adv, rewards)[1] == pytest.approx(math.sqrt(0.25 * 0.75))


def test_reward_spread_history_ema_checkpoint_and_refusals(tmp_path):
    h = RewardSpreadHistory(ema_alpha=0.5)
    h.update(["a"], torch.zeros(1, 2), torch.tensor([[0.0, 2.0]]))
    h.update(["a"], torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]))
    assert h.scores(["a", "b"])[0] == 0.5 and math.isnan(h.scores(["b"])[0])
    state = json.loads(json.dumps(h.state_dict()))
    again = RewardSpreadHistory(ema_alpha=0.5)
    again.load_state_dict(state)
    assert again.state_dict() == h.state_dict()
    with pytest.raises(ValueError, match="PromptHistory"):  # a checkpoint of the other score is refused
        PromptHistory().load_state_dict(state)
    with pytest.raises(ValueError, match="raw rewards"):
        RewardSpreadHistory().update(["a"], torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"rewards must have shape \[1, G\]"):
        RewardSpreadHistory().update(["a"], torch.zeros(1, 2), torch.zeros(2, 2))
    assert isinstance(make_history("reward_std"), RewardSpreadHistory)
    with pytest.raises(ValueError, match="history score"):
        make_history("posterior")


def test_auto_picks_the_reward_spread_when_a_reward_model_is_set(tmp_path):
    from megatron_dppo.config import load_config
    from megatron_dppo.run.build import build_loss, build_pruner

    def build_history(cfg):
        return build_pruner(cfg, build_loss(cfg)[0], "grpo").state

    rule = load_config("examples/quickstart.yaml", [])
    model = load_config("examples/quickstart.yaml", [f"reward.model.path={tmp_path}"])
    forced = load_config("examples/quickstart.yaml", [f"reward.model.path={tmp_path}",
                                                      "algo.history_score=mean_abs_adv", "algo.history_ema=0.5"])
    assert type(build_history(rule)) is PromptHistory
    assert type(build_history(model)) is RewardSpreadHistory
    assert type(build_history(forced)) is PromptHistory and build_history(forced).ema_alpha == 0.5
