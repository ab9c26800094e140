"""Rewards: built-in math rewards, a registry (names or "pkg.module:func" import paths), fault-tolerant scoring.

    from megatron_dppo.rewards import RewardScorer
    scorer = RewardScorer({"math": 1.0, "format": 0.1}, timeout_s=5)
    result = scorer.score(completions, golds)   # result.rewards, result.errors, result.num_failed
"""
from megatron_dppo.rewards.math import (
    arithmetic_reward,
    arithmetic_worked_reward,
    extract_gsm8k_gold,
    extract_gsm8k_prediction,
    final_number_reward,
    format_reward,
    gsm8k_reward,
    last_boxed,
    math_verify_reward,
)
from megatron_dppo.rewards.registry import (
    RewardFn,
    WeightedReward,
    build_reward,
    get_reward,
    list_rewards,
    register_reward,
)
from megatron_dppo.rewards.scoring import RewardResult, RewardScorer, score_batch

__all__ = [
    "RewardFn", "RewardResult", "RewardScorer", "WeightedReward", "arithmetic_reward", "arithmetic_worked_reward",
    "build_reward", "extract_gsm8k_gold", "extract_gsm8k_prediction", "final_number_reward", "format_reward",
    "get_reward", "gsm8k_reward", "last_boxed", "list_rewards", "math_verify_reward", "register_reward", "score_batch",
]
