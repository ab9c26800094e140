"""The learning-rate schedule of the policy's optimizer (the optim section, ``config/sections.OptimConfig``):
warmup, then constant or cosine. Pure math: the engine applies it every update, and the RL loop reads it to restart
the schedule at the first RL step. ``cfg`` is the optim section, read for ``scheduler`` and ``warmup_steps`` only
(the algo layer imports no other package)."""
from __future__ import annotations

import math
from typing import Any


def lr_at_step(cfg: Any, step: int, max_lr: float, min_lr: float, total_steps: int | None = None) -> float:
    """The learning rate of update number ``step`` (0-based) for a group with ``max_lr``/``min_lr`` under
    ``cfg``'s schedule (the optim section, config/sections.py); ``total_steps``: the cosine's horizon.

    With ``step`` = optimizer steps already taken (0 for the first update):
        warmup (step < warmup_steps):  max_lr * (step + 1) / warmup_steps
        constant:                      max_lr
        cosine:                        min_lr + (max_lr - min_lr) * (1 + cos(pi * p)) / 2,
                                       p = min(1, (step - warmup_steps) / (total_steps - warmup_steps))
    The first update of a warmup therefore already uses a non-zero rate (Megatron's own scheduler starts at 0).
    """
    check_schedule(cfg, total_steps)
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if step < cfg.warmup_steps:
        return max_lr * (step + 1) / cfg.warmup_steps
    if cfg.scheduler == "constant":
        return max_lr
    progress = min(1.0, (step - cfg.warmup_steps) / (total_steps - cfg.warmup_steps))
    return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_schedule(cfg: Any, total_steps: int | None) -> None:
    if cfg.scheduler == "cosine" and (total_steps is None or total_steps <= cfg.warmup_steps):
        raise ValueError(f"optim.scheduler='cosine' needs total_steps > warmup_steps={cfg.warmup_steps}, "
                         f"got total_steps={total_steps}")
