"""Prompt history for DPPO's prompt level: a score h_q per prompt from its last group (or an EMA over visits), NaN
for a prompt never seen (docs/algorithms.md, "DPPO"); optionally the mean cost (tokens) of the prompt's last group,
the prompt-level cost of the cost-aware keep rule. Checkpointable as plain Python types.

Two scores (``algo.history_score``, ``make_history``):

``mean_abs_adv`` (:class:`PromptHistory`)  h_q = mean |A| of the group: the paper's. With GRPO's std-normalized
    advantages it is scale-free: 0 for a group with one reward for all, and otherwise about 0.7-0.9 whatever the
    rewards' spread, so under continuous rewards (a reward model's scores: no group is exactly flat) every seen
    prompt gets nearly the same score and the prompt level cannot tell the informative prompts apart.
``reward_std`` (:class:`RewardSpreadHistory`)  h_q = the standard deviation of the group's raw training rewards:
    0 for a flat group as before, and under continuous rewards the scale of the group's signal (the advantages'
    size before normalization). Chosen by ``algo.history_score=auto`` when a reward model is set
    (docs/reward_models.md, "Pruning under continuous rewards", and benchmarks/history_score.py).

Both are states with the same interface, ``update(ids, advantages, rewards, costs)`` (``observe(groups)`` for the
pruner), ``scores(ids)``, ``state_dict()``,
``load_state_dict()``: another per-prompt state (e.g. a posterior over the pass rate) can take their place.
A checkpoint of one score refuses to load into the other (its ``FORMAT``).
"""

from __future__ import annotations

import math
from typing import Hashable, Iterable, Sequence

import torch
from torch import Tensor

from ._checks import check_finite, check_float_tensor

PromptId = Hashable


def _normalize_ids(ids: Iterable[PromptId] | Tensor) -> list[int | str]:
    if isinstance(ids, Tensor):
        ids = ids.tolist()
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, str)):
            raise ValueError(f"prompt ids must be int or str (checkpointable), got {i!r} of type {type(i).__name__}")
        out.append(i)
    return out


class PromptHistory:
    """Per prompt id: h = mean |A| of its last group, or an EMA over visits h <- alpha*new + (1-alpha)*h.

    ``scores(ids)`` gives h as a float64 tensor with NaN for never-seen prompts (the DPPO prompt-level input).
    ``state_dict()`` holds only plain Python types (ints/strs/floats in lists), so it survives torch.save, JSON and
    YAML checkpoints; ``load_state_dict`` restores the scores (the configured ema_alpha is kept).
    """

    FORMAT = "megatron_dppo.PromptHistory/1"

    def __init__(self, ema_alpha: float | None = None) -> None:
        if ema_alpha is not None:
            if isinstance(ema_alpha, bool) or not isinstance(ema_alpha, (int, float)) or not (0.0 < ema_alpha <= 1.0):
                raise ValueError(f"ema_alpha must be in (0, 1] or None, got {ema_alpha!r}")
            ema_alpha = float(ema_alpha)
        self.ema_alpha = ema_alpha
        self._scores: dict[int | str, float] = {}
        self._costs: dict[int | str, float] = {}  # mean tokens of an episode of the prompt's last group

    def __len__(self) -> int:
        return len(self._scores)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._scores

    def update(self, ids: Sequence[PromptId] | Tensor, advantages: Tensor, rewards: Tensor | None = None,
               costs: Tensor | None = None) -> None:
        """Record the score of each full group: advantages [len(ids), G]; rewards [len(ids), G], the raw training
        rewards (unused by mean |A|, which reads the advantages). ``costs`` [len(ids)] (optional): the mean cost
        of one completion of each group (the last visit's; ``costs(ids)`` reads it back)."""
        ids = _normalize_ids(ids)
        new = self.group_scores(_checked_groups("advantages", advantages, len(ids)),
                                None if rewards is None else _checked_groups("rewards", rewards, len(ids)))
        if costs is not None:
            costs = check_float_tensor("costs", costs, min_dim=1)
            if tuple(costs.shape) != (len(ids),):
                raise ValueError(f"costs must have shape [{len(ids)}] for {len(ids)} ids, got {tuple(costs.shape)}")
            check_finite("costs", costs)
            self._costs.update(zip(ids, (float(c) for c in costs.detach().double().tolist())))
        for prompt_id, value in zip(ids, new):
            old = self._scores.get(prompt_id)
            if old is None or self.ema_alpha is None:
                self._scores[prompt_id] = float(value)
            else:
                self._scores[prompt_id] = self.ema_alpha * float(value) + (1.0 - self.ema_alpha) * old

    def group_scores(self, advantages: Tensor, rewards: Tensor | None) -> list[float]:
        """The new score of each group: mean_i |A_qi|."""
        return advantages.detach().double().abs().mean(dim=1).tolist()

    def observe(self, groups, record_costs: bool = False) -> None:
        """The full groups of ``groups`` (``algo.pruner.Groups``): their score, and with ``record_costs`` (the
        cost-aware keep rule) the mean tokens of one sequence of each. Screens (no advantages) are not groups the
        score is defined on: skipped."""
        if groups.advantages is None:
            return
        costs = groups.tokens.mean(dim=1) if record_costs else None
        self.update(list(groups.ids), groups.advantages, groups.rewards, costs=costs)

    def scores(self, ids: Sequence[PromptId] | Tensor, version: int | None = None) -> Tensor:
        """h for each id (float64), NaN for prompts never seen. ``version`` (the weights that will generate) is
        accepted for the posterior's interface and unused: the history is not dated."""
        ids = _normalize_ids(ids)
        return torch.tensor([self._scores.get(i, math.nan) for i in ids], dtype=torch.float64)

    def costs(self, ids: Sequence[PromptId] | Tensor) -> Tensor:
        """The recorded mean cost of one completion of each prompt's last group (float64), NaN where none is."""
        ids = _normalize_ids(ids)
        return torch.tensor([self._costs.get(i, math.nan) for i in ids], dtype=torch.float64)

    def stats(self) -> dict[str, float]:
        """What the history reports besides its size (``len``): nothing."""
        return {}

    def state_dict(self) -> dict:
        ids = list(self._scores)
        state = {
            "format": self.FORMAT,
            "ema_alpha": self.ema_alpha,
            "ids": ids,
            "scores": [self._scores[i] for i in ids],
        }
        if self._costs:  # (only when recorded: the state of a run without costs is what it always was)
            state["cost_ids"] = list(self._costs)
            state["costs"] = [self._costs[i] for i in state["cost_ids"]]
        return state

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != self.FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a {type(self).__name__} state (format {got!r}, expected {self.FORMAT!r}; "
                             "algo.history_score picks the score, and a checkpoint keeps the score it was written "
                             "with)")
        ids, scores = _normalize_ids(state["ids"]), [float(s) for s in state["scores"]]
        if len(ids) != len(scores):
            raise ValueError(f"PromptHistory state has {len(ids)} ids but {len(scores)} scores")
        self._scores = dict(zip(ids, scores))
        cost_ids, costs = _normalize_ids(state.get("cost_ids", [])), [float(c) for c in state.get("costs", [])]
        if len(cost_ids) != len(costs):
            raise ValueError(f"PromptHistory state has {len(cost_ids)} cost ids but {len(costs)} costs")
        self._costs = dict(zip(cost_ids, costs))


class RewardSpreadHistory(PromptHistory):
    """Per prompt id: h = the standard deviation (over the G completions, population form) of the raw training
    rewards of its last group, or an EMA over visits; see the module docstring. ``update`` needs ``rewards``."""

    FORMAT = "megatron_dppo.RewardSpreadHistory/1"

    def group_scores(self, advantages: Tensor, rewards: Tensor | None) -> list[float]:
        if rewards is None:
            raise ValueError("RewardSpreadHistory.update needs the group's raw rewards (rewards=[B, G])")
        return rewards.detach().double().std(dim=1, unbiased=False).tolist()


HISTORY_SCORES = {"mean_abs_adv": PromptHistory, "reward_std": RewardSpreadHistory}


def make_history(score: str, ema_alpha: float | None = None) -> PromptHistory:
    """The prompt history of ``score`` (mean_abs_adv | reward_std)."""
    if score not in HISTORY_SCORES:
        raise ValueError(f"history score {score!r} is invalid: expected one of {sorted(HISTORY_SCORES)}")
    return HISTORY_SCORES[score](ema_alpha)


def _checked_groups(name: str, values: Tensor, n: int) -> Tensor:
    values = check_float_tensor(name, values, min_dim=2)
    if values.dim() != 2 or values.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}, G] for {n} ids, got {tuple(values.shape)}")
    check_finite(name, values)
    return values
