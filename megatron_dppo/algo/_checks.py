"""Input checks shared by the algorithm modules. Every failure is a ValueError naming the bad value."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def check_rate(name: str, value: float) -> float:
    """A pruning rate must be a finite number in [0, 1): rate 1 would keep a unit with probability 0 (no weight)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    value = float(value)
    if not (0.0 <= value < 1.0):  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


def check_choice(kind: str, value: str, valid: tuple[str, ...] | list[str]) -> str:
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}")
    return value


def first_bad_position(mask: Tensor) -> tuple[int, ...]:
    """Index tuple of the first True entry of ``mask`` (row-major)."""
    return tuple(int(i) for i in mask.nonzero()[0].tolist())


def check_finite(name: str, t: Tensor) -> None:
    """Raise ValueError naming the first NaN/inf position and value of ``t``."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        pos = first_bad_position(bad)
        raise ValueError(f"{name} must be finite; found {t[pos].item()} at position {pos} (shape {tuple(t.shape)})")


def check_float_tensor(name: str, t: object, min_dim: int) -> Tensor:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); an empty batch cannot be processed")
    return t if t.is_floating_point() else t.to(torch.float32)


def floor_with_tolerance(x: float) -> int:
    """floor(x), forgiving binary representation error just below an integer (0.9*10 = 8.999999999999998 -> 9)."""
    return int(math.floor(x + 1e-9))
