"""DAPO's sampling-side options as config sections of their own: dynamic sampling with refill
(``dynamic_sampling.*``) and the handling of completions that hit the length limit (``overlong.*``).

Every option is documented here, once, in its ``help`` (``megatron-dppo train --help-config``); the algorithms are
in docs/algorithms.md, "Dynamic sampling with refill" and "Overlong completions". The rules that span sections
(the refusal of refill with a pruner, the buffer against ``rollout.max_new_tokens``) are in ``Config.validate``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_dppo.config.fields import _check, opt


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling with refill: a batch of B groups with non-zero reward variance (a filter, not an
    unbiased estimator; docs/algorithms.md, "Dynamic sampling with refill")."""

    enable: bool = opt(False, "Drop every group whose G rewards are all equal (its advantages are 0) and draw and "
                              "generate more prompts until the step has train.prompts_per_step groups with non-zero "
                              "reward variance; surplus groups of the last round are discarded (in draw order). "
                              "Changes the sampling distribution: needs algo.pruner=none. verl: algorithm."
                              "filter_groups.enable; slime: dynamic sampling with check_reward_nonzero_std.")
    max_rounds: int = opt(10, "Most generation rounds per step, the first included (verl max_num_gen_batches). "
                              "When they are spent the step trains on the groups found so far (fewer than B, possibly "
                              "none) with a warning, instead of verl's error.")
    filter_metric: Literal["task", "training"] = opt(
        "task", "The reward whose spread within a group decides 'one reward for all' for this filter and for algo."
                "drop_zero_variance_groups: task = the task reward, before DAPO's soft overlong penalty (verl's DAPO "
                "recipe: algorithm.filter_groups.metric=acc, the score before its reward manager adds the penalty), "
                "so an all-correct group whose lengths differ inside overlong.buffer is still dropped; training = the "
                "reward the advantages see, penalty included (verl metric=reward / seq_final_reward). The same "
                "unless overlong.buffer > 0.")
    refill_prompts: Optional[int] = opt(None, "Prompts drawn per refill round (rounds 2, 3, ...); null = the "
                                              "shortfall, B minus the groups kept so far (no surplus). A larger fixed "
                                              "number needs fewer rounds and discards more (verl gen_batch_size, "
                                              "slime over_sampling_batch_size).")

    def validate(self) -> None:
        _check(self.max_rounds >= 1, "dynamic_sampling.max_rounds", self.max_rounds, "an integer >= 1")
        _check(self.refill_prompts is None or self.refill_prompts >= 1, "dynamic_sampling.refill_prompts",
               self.refill_prompts, "null or an integer >= 1")


@dataclass
class OverlongConfig:
    """Completions that reach rollout.max_new_tokens: DAPO's soft overlong punishment (reward shaping) and overlong
    filtering (truncated completions leave the loss; docs/algorithms.md, "Overlong completions")."""

    buffer: int = opt(0, "L_cache of DAPO's soft overlong punishment: a completion of L tokens (stop token "
                         "included) longer than L_max - L_cache, L_max = rollout.max_new_tokens, gets the reward "
                         "penalty -overlong.penalty * (L - (L_max - L_cache)) / L_cache, reaching -penalty at L_max; "
                         "shorter ones get 0. Shapes the reward the advantages, dynamic sampling and algo."
                         "drop_zero_variance_groups see; reward/* metrics stay the task reward. 0 = off. verl "
                         "reward_model.overlong_buffer.len.")
    penalty: float = opt(1.0, "Largest soft overlong penalty (at L_max), >= 0 (verl overlong_buffer.penalty_factor).")
    filter: bool = opt(False, "Overlong filtering: completions cut at the length limit (finish reason 'length') are "
                              "removed from the loss, from its numerator and from every denominator (D counts only "
                              "the completions that finished). Advantages still use the whole group. TRL "
                              "mask_truncated_completions.")

    def validate(self) -> None:
        _check(self.buffer >= 0, "overlong.buffer", self.buffer, "an integer >= 0 (0 = no overlong penalty)")
        _check(math.isfinite(self.penalty) and self.penalty >= 0, "overlong.penalty", self.penalty,
               "a finite number >= 0")
