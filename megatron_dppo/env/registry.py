"""Environment factories by name: the built-ins, or any ``pkg.module:Factory`` import path.

A factory is a callable ``factory(**env.kwargs) -> Environment``; the episode loop calls it once per episode, so
every episode gets a fresh environment (state never leaks between episodes, and episodes may run concurrently).
A class with ``reset``/``step`` methods is such a factory.
"""
from __future__ import annotations

import importlib
from typing import Any

from megatron_dppo.env.protocol import EnvFactory

#: built-in name -> "module:attribute" (imported on first use)
BUILTIN_ENVS = {
    "noop": "megatron_dppo.env.noop:NoOpEnv",
    "calculator": "megatron_dppo.env.calculator:CalculatorEnv",
    "python": "megatron_dppo.env.python_tool:PythonToolEnv",
    "openenv": "megatron_dppo.env.openenv_adapter:OpenEnvAdapter",
}


def import_object(spec: str, what: str = "object") -> Any:
    """The attribute named by ``"pkg.module:attr"`` (``attr`` may be dotted); ValueError naming the bad part."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{what} {spec!r} is not an import path 'pkg.module:Name'")
    module_name, attr = spec.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({err})") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_env_factory(name: str) -> EnvFactory:
    """The factory for ``env.name``: a built-in (``BUILTIN_ENVS``) or ``pkg.module:Factory``."""
    if name in BUILTIN_ENVS:
        return import_object(BUILTIN_ENVS[name], "built-in environment")
    if ":" not in name:
        raise ValueError(f"unknown environment {name!r}: use a built-in ({', '.join(BUILTIN_ENVS)}) or an import "
                         "path 'pkg.module:Factory'")
    factory = import_object(name, "environment factory")
    if not callable(factory):
        raise ValueError(f"environment factory {name!r} is a {type(factory).__name__}, not a callable")
    return factory


def make_env_factory(name: str, kwargs: dict | None = None) -> EnvFactory:
    """A zero-argument callable building one fresh environment with ``kwargs``; the first one is built here to
    check the kwargs early (a TypeError names the factory and the arguments)."""
    factory = resolve_env_factory(name)
    kwargs = dict(kwargs or {})

    def build():
        return factory(**kwargs)

    try:
        probe = build()
    except TypeError as err:
        raise ValueError(f"environment {name!r} rejects env.kwargs {kwargs}: {err}") from err
    for method in ("reset", "step"):
        if not callable(getattr(probe, method, None)):
            raise ValueError(f"environment {name!r} built an object without a {method}() method "
                             f"({type(probe).__name__}); see megatron_dppo.env.protocol.Environment")
    close = getattr(probe, "close", None)
    if callable(close):
        close()
    return build
