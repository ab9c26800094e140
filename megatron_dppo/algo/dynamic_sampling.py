"""DAPO dynamic sampling with refill (docs/algorithms.md, "Dynamic sampling with refill"): draw rounds of prompts,
keep the groups whose rewards are not all equal, until B are kept or ``max_rounds`` rounds are spent. Plain torch;
the trainer supplies the rounds (draw, generate, score) as a function.

The rule, stated once: round 1 is the step's B drawn prompts; each later round draws ``refill_prompts`` prompts
(None = the shortfall, B minus the groups kept so far). Groups are taken in draw order; a group with one reward for
all is discarded; once B groups are kept, the remaining non-degenerate groups of that round are surplus and
discarded too. The result is a filter (the batch is conditioned on non-zero variance), not an unbiased estimator of
the gradient over the prompt distribution."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor


def nonzero_variance(rewards: Tensor) -> Tensor:
    """[rows] bool: the groups (rows of ``rewards`` [rows, G], G >= 2) whose rewards are not all equal."""
    if not isinstance(rewards, Tensor) or rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be a tensor [rows, G] with G >= 2, got "
                         f"{tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")
    return ~(rewards == rewards[:, :1]).all(dim=1)


@dataclass
class RefillResult:
    """What the rounds produced: ``kept`` indexes the concatenation of every round's groups, in draw order."""

    kept: list[int] = field(default_factory=list)  # rows of the concatenated rounds that form the batch
    rounds: int = 0
    drawn: int = 0  # prompts drawn (and generated) over all rounds
    discarded: int = 0  # groups with one reward for all
    surplus: int = 0  # non-degenerate groups past the B-th, discarded
    exhausted: bool = False  # max_rounds spent before B groups were kept

    def metrics(self) -> dict[str, float]:
        return {"dynamic_sampling/rounds": float(self.rounds), "dynamic_sampling/prompts_drawn": float(self.drawn),
                "dynamic_sampling/kept_groups": float(len(self.kept)),
                "dynamic_sampling/discarded_groups": float(self.discarded),
                "dynamic_sampling/surplus_groups": float(self.surplus),
                "dynamic_sampling/exhausted": float(self.exhausted)}


def refill(first_rewards: Tensor, draw_round: Callable[[int, int], Tensor], batch_groups: int, max_rounds: int,
           refill_prompts: int | None = None) -> RefillResult:
    """Run the rounds. ``first_rewards`` [B0, G] are round 1's (training) rewards; ``draw_round(round, n)`` draws n
    more prompts, generates and scores them and returns their rewards [n, G] (round counts from 2). Stops as soon as
    ``batch_groups`` groups are kept or after ``max_rounds`` rounds (then ``exhausted`` if short)."""
    for name, value in (("batch_groups", batch_groups), ("max_rounds", max_rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if refill_prompts is not None and (isinstance(refill_prompts, bool) or not isinstance(refill_prompts, int)
                                       or refill_prompts < 1):
        raise ValueError(f"refill_prompts must be None or an integer >= 1, got {refill_prompts!r}")
    out = RefillResult()
    rewards = first_rewards
    while True:
        out.rounds += 1
        for row, ok in enumerate(nonzero_variance(rewards).tolist()):
            if not ok:
                out.discarded += 1
            elif len(out.kept) < batch_groups:
                out.kept.append(out.drawn + row)
            else:
                out.surplus += 1
        out.drawn += rewards.shape[0]
        if len(out.kept) >= batch_groups:
            return out
        if out.rounds >= max_rounds:
            out.exhausted = True
            return out
        n = refill_prompts or batch_groups - len(out.kept)
        rewards = draw_round(out.rounds + 1, n)
        if not isinstance(rewards, Tensor) or rewards.dim() != 2 or rewards.shape[0] != n:
            raise ValueError(f"round {out.rounds + 1} asked for {n} groups and got rewards of shape "
                             f"{tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__}")
