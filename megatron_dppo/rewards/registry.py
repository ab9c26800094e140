"""A registry of reward functions, by name or by import path.

A reward function maps one completion and its gold answer to a float: ``fn(completion: str, gold) -> float``.

    get_reward("math")                       # a built-in: math | gsm8k | format | arithmetic
    get_reward("my_pkg.rewards:length_bonus")  # a user function, imported from "module.path:attribute"
    build_reward({"math": 1.0, "format": 0.1}) # a weighted sum, r = sum_i w_i * r_i(completion, gold)

Built-in rewards are *trusted* (pure Python, bounded time), so ``RewardScorer(isolation="auto")`` runs them in the
calling process; anything else runs in worker processes with a hard timeout (see ``scoring.py``).
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_dppo.rewards import math as math_rewards

RewardFn = Callable[[str, Any], float]


@dataclass(frozen=True)
class _Entry:
    fn: RewardFn
    trusted: bool


_REGISTRY: dict[str, _Entry] = {}


def register_reward(name: str, fn: RewardFn | None = None, *, trusted: bool = False):
    """Register ``fn`` under ``name`` (usable as a decorator). ``trusted=True`` lets the scorer run it in-process
    without hang protection; only mark functions whose running time is bounded. Re-registering a name replaces it.
    """
    if not name or ":" in name:
        raise ValueError(f"reward name {name!r} must be non-empty and contain no ':' (':' marks an import path)")

    def _register(f: RewardFn) -> RewardFn:
        if not callable(f):
            raise ValueError(f"reward {name!r} must be callable, got {type(f).__name__}")
        _REGISTRY[name] = _Entry(f, trusted)
        return f

    return _register(fn) if fn is not None else _register


def list_rewards() -> list[str]:
    """Names of the registered reward functions."""
    return sorted(_REGISTRY)


def _import_path(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward import path {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import module {module_name!r} of reward {spec!r}: {err}") from err
    except SyntaxError as err:  # the user's module does not parse: name the file and line
        raise ValueError(f"reward {spec!r}: {err.filename}:{err.lineno}: syntax error ({err.msg})") from err
    except Exception as err:
        where = _raising_frame(err, module_name)
        raise ValueError(f"reward {spec!r}: importing module {module_name!r} raised {type(err).__name__}: {err}"
                         f"{where}") from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (reward {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def _raising_frame(err: BaseException, module_name: str) -> str:
    """`` (at file:line)`` of the innermost traceback frame outside the import machinery, or ``""``."""
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def get_reward(spec: str | RewardFn) -> RewardFn:
    """The reward function for a registered name, an import path "pkg.module:func", or a callable (returned as is).

    Raises ValueError naming the valid names when ``spec`` is neither registered nor importable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"reward must be a name, an import path or a callable, got {type(spec).__name__}")
    if ":" in spec:
        return _import_path(spec)
    if spec not in _REGISTRY:
        raise ValueError(f"unknown reward {spec!r}; registered: {', '.join(list_rewards())}, "
                         "or give an import path 'package.module:function'")
    return _REGISTRY[spec].fn


def is_trusted(spec: Any) -> bool:
    """True when ``spec`` is a trusted registered reward (by name or function) or a WeightedReward of those."""
    if isinstance(spec, WeightedReward):
        return all(is_trusted(part) for part in spec.parts)
    if isinstance(spec, str):
        return spec in _REGISTRY and _REGISTRY[spec].trusted
    return any(entry.trusted and entry.fn is spec for entry in _REGISTRY.values())


@dataclass(frozen=True)
class WeightedReward:
    """r(completion, gold) = sum_i weight_i * reward_i(completion, gold).

    Parts are kept as given (names, import paths or module-level functions) and resolved on call, so the object
    pickles into reward worker processes by reference."""

    parts: tuple[str | RewardFn, ...]
    weights: tuple[float, ...]

    def __post_init__(self):
        if len(self.parts) != len(self.weights) or not self.parts:
            raise ValueError(f"WeightedReward needs one weight per part, got {len(self.parts)} parts and "
                             f"{len(self.weights)} weights")
        for part in self.parts:
            get_reward(part)  # fail early on unknown names

    def __call__(self, completion: str, gold: Any) -> float:
        return sum(w * float(get_reward(p)(completion, gold)) for p, w in zip(self.parts, self.weights))

    @property
    def name(self) -> str:
        return " + ".join(f"{w:g}*{getattr(p, '__name__', p)}" for p, w in zip(self.parts, self.weights))


def build_reward(spec: str | RewardFn | Mapping[str, float]) -> RewardFn:
    """A reward function from a config value: a name, an import path, a callable, or {name_or_path: weight}."""
    if isinstance(spec, Mapping):
        if not spec:
            raise ValueError("reward weights mapping is empty; give at least one {name: weight}")
        for name, weight in spec.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"reward weight of {name!r} is {weight!r}: expected a finite number")
        return WeightedReward(tuple(spec.keys()), tuple(float(w) for w in spec.values()))
    if isinstance(spec, str) and spec in _REGISTRY:
        return _REGISTRY[spec].fn
    return get_reward(spec)


def reward_name(fn: Any) -> str:
    """A readable name for logs."""
    if isinstance(fn, WeightedReward):
        return fn.name
    for name, entry in _REGISTRY.items():
        if entry.fn is fn:
            return name
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    return f"{module}:{qualname}" if module else qualname


register_reward("math", math_rewards.math_verify_reward, trusted=True)
register_reward("gsm8k", math_rewards.gsm8k_reward, trusted=True)
register_reward("format", math_rewards.format_reward, trusted=True)
register_reward("arithmetic", math_rewards.arithmetic_reward, trusted=True)
register_reward("arithmetic_worked", math_rewards.arithmetic_worked_reward, trusted=True)
register_reward("final_number", math_rewards.final_number_reward, trusted=True)
