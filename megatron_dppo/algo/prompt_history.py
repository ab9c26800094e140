"""Prompt history for DPPO's prompt level: h_q = mean |A| of the prompt's last group (or an EMA over visits),
NaN for a prompt never seen (docs/algorithms.md, "DPPO"). Checkpointable as plain Python types."""

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

    def __len__(self) -> int:
        return len(self._scores)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._scores

    def update(self, ids: Sequence[PromptId] | Tensor, advantages: Tensor) -> None:
        """Record mean_i |A_qi| of each full group; advantages [len(ids), G]."""
        ids = _normalize_ids(ids)
        advantages = check_float_tensor("advantages", advantages, min_dim=2)
        if advantages.dim() != 2 or advantages.shape[0] != len(ids):
            raise ValueError(
                f"advantages must have shape [{len(ids)}, G] for {len(ids)} ids, got {tuple(advantages.shape)}"
            )
        check_finite("advantages", advantages)
        new = advantages.detach().double().abs().mean(dim=1).tolist()
        for prompt_id, value in zip(ids, new):
            old = self._scores.get(prompt_id)
            if old is None or self.ema_alpha is None:
                self._scores[prompt_id] = float(value)
            else:
                self._scores[prompt_id] = self.ema_alpha * float(value) + (1.0 - self.ema_alpha) * old

    def scores(self, ids: Sequence[PromptId] | Tensor) -> Tensor:
        """h for each id (float64), NaN for prompts never seen."""
        ids = _normalize_ids(ids)
        return torch.tensor([self._scores.get(i, math.nan) for i in ids], dtype=torch.float64)

    def state_dict(self) -> dict:
        ids = list(self._scores)
        return {
            "format": self.FORMAT,
            "ema_alpha": self.ema_alpha,
            "ids": ids,
            "scores": [self._scores[i] for i in ids],
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != self.FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a PromptHistory state (format {got!r}, expected {self.FORMAT!r})")
        ids, scores = _normalize_ids(state["ids"]), [float(s) for s in state["scores"]]
        if len(ids) != len(scores):
            raise ValueError(f"PromptHistory state has {len(ids)} ids but {len(scores)} scores")
        self._scores = dict(zip(ids, scores))
