"""``EnvConfig``: the ``env`` section of a run (multi-turn episodes). No ``env`` section = single-turn completions,
as before. Every field is documented here, once."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

TOKEN_CHECKS = ("strict", "warn", "off")


@dataclass
class EnvConfig:
    """Multi-turn episodes with an environment (docs/environments.md).

    name:                 the environment: a built-in (``calculator``, ``python``, ``openenv``, ``noop``) or an
                          import path ``pkg.module:Factory`` of a callable returning a fresh Environment.
    kwargs:               keyword arguments of the factory (e.g. ``{timeout_s: 5}`` for ``python``).
    max_turns:            assistant turns per episode (>= 1); an environment that wants more after the last one
                          ends the episode with finish reason ``max_turns``.
    max_tokens:           tokens after the prompt per episode, assistant and observation tokens together: the
                          bound of the trained sequence's length (prompt + this) and of every turn's generation.
    max_assistant_tokens: sampled (trained, loss-mask 1) tokens per episode; None = ``max_tokens``. The L_max of
                          ``seq_mean_token_sum_norm`` under multi-turn episodes.
    step_timeout_s:       wall-clock limit of one ``reset``/``step`` call; past it the episode ends with
                          ``env_error`` (tools should enforce their own, shorter limits: ``python`` does).
    max_parallel_steps:   environment calls running at once (threads; a ``python`` tool call is a subprocess
                          each, so this also bounds the sandboxes alive at a time).
    token_check:          ``strict`` (raise on a chat-template mismatch of the rendered conversation), ``warn``
                          (log it once per process) or ``off``. The token-identity checks of the episode builder
                          (sampled ids verbatim, each turn's context = the episode so far) always run.
    chat_template_kwargs: extra keyword arguments of ``apply_chat_template`` (e.g. ``{tools: [...]}``).
    """

    name: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_tokens: int = 1024
    max_assistant_tokens: int | None = None
    step_timeout_s: float = 30.0
    max_parallel_steps: int = 32
    token_check: str = "strict"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("env.name must name an environment: a built-in (calculator, python, openenv, noop) or "
                             f"'pkg.module:Factory', got {self.name!r}")
        if not isinstance(self.kwargs, dict):
            raise ValueError(f"env.kwargs must be a mapping of factory keyword arguments, got {self.kwargs!r}")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(f"env.chat_template_kwargs must be a mapping, got {self.chat_template_kwargs!r}")
        for key in ("max_turns", "max_tokens", "max_parallel_steps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"env.{key} must be an integer >= 1, got {value!r}")
        limit = self.max_assistant_tokens
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"env.max_assistant_tokens must be None or an integer >= 1, got {limit!r}")
        if limit is not None and limit > self.max_tokens:
            raise ValueError(f"env.max_assistant_tokens={limit} exceeds env.max_tokens={self.max_tokens} (sampled "
                             "tokens are part of the episode's tokens)")
        t = self.step_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"env.step_timeout_s must be a finite number of seconds > 0, got {t!r}")
        if self.token_check not in TOKEN_CHECKS:
            raise ValueError(f"env.token_check must be one of {TOKEN_CHECKS}, got {self.token_check!r}")

    @property
    def assistant_token_limit(self) -> int:
        """The bound on sampled (trained) tokens per episode."""
        return self.max_tokens if self.max_assistant_tokens is None else self.max_assistant_tokens
