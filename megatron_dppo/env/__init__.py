"""Multi-turn episodes with environments and tools (docs/environments.md).

``protocol``: the Environment a user implements (reset, step) and its data types; ``config``: ``EnvConfig`` (the
``env`` section); ``registry``: factories by name or import path; ``tokens``: token-in-token-out streams and
their checks; built-ins: ``noop``, ``calculator``, ``python`` (``python_tool`` + ``sandbox``), ``openenv``
(``openenv_adapter``). The episode loop itself runs on a rollout engine: ``megatron_dppo.rollout.episodes``.

Layering: this package imports nothing else of megatron_dppo (plain Python, transformers tokenizers duck-typed).
"""
from megatron_dppo.env.config import EnvConfig
from megatron_dppo.env.protocol import FINISH_REASONS, EnvFactory, Environment, Step, Task, Turn
from megatron_dppo.env.registry import BUILTIN_ENVS, make_env_factory, resolve_env_factory
from megatron_dppo.env.tokens import ChatTokens, TokenDriftError, Trajectory

__all__ = ["BUILTIN_ENVS", "ChatTokens", "EnvConfig", "EnvFactory", "Environment", "FINISH_REASONS", "Step", "Task",
           "TokenDriftError", "Trajectory", "Turn", "make_env_factory", "resolve_env_factory"]
