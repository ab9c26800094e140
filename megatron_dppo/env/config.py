"""``EnvConfig``: the ``env`` section of a run (multi-turn episodes). No ``env`` section = single-turn completions,
as before. Every field is documented here, once (its ``help``; ``megatron-dppo train --help-config`` prints it)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

TOKEN_CHECKS = ("strict", "warn", "off")
ERROR_MODES = ("exclude", "score")


def _opt(default: Any, help: str) -> Any:  # noqa: A002 - the config sections' spelling (config/fields.opt)
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class EnvConfig:
    """Multi-turn episodes with an environment (docs/environments.md); absent = single-turn completions."""

    name: str = _opt("", "The environment: a built-in (calculator, python, openenv, noop) or an import path "
                         "'pkg.module:Factory' of a callable returning a fresh Environment (called once per episode).")
    kwargs: dict = _opt({}, "Keyword arguments of the factory (e.g. {timeout_s: 5} for python).")
    max_turns: int = _opt(4, "Assistant turns per episode (>= 1); an environment that wants more after the last one "
                             "ends the episode with finish reason max_turns.")
    max_tokens: int = _opt(1024, "Tokens after the prompt per episode, assistant and observation tokens together: the "
                                 "bound of the trained sequence (prompt + this <= packing.capacity) and of every "
                                 "turn's generation (rollout.max_new_tokens is then the bound of one turn).")
    max_assistant_tokens: Optional[int] = _opt(None, "Sampled (trained, loss-mask 1) tokens per episode; null = "
                                                     "env.max_tokens. The L_max of seq_mean_token_sum_norm and of "
                                                     "the overlong penalty under multi-turn episodes.")
    step_timeout_s: float = _opt(30.0, "Wall-clock limit of one reset/step call; past it the episode ends with "
                                       "env_error (tools should enforce their own, shorter limits: python does).")
    max_parallel_steps: int = _opt(32, "Environment calls running at once (threads; a python tool call is a "
                                       "subprocess each, so this also bounds the sandboxes alive at a time).")
    token_check: str = _opt("strict", "Render audit of every episode: strict (raise on a chat-template mismatch of "
                                      "the rendered conversation), warn (log it once per process) or off. The token-"
                                      "identity checks (sampled ids verbatim, each turn's context = the episode so "
                                      "far) always run.")
    chat_template_kwargs: dict = _opt({}, "Extra keyword arguments of apply_chat_template (e.g. {tools: [...]}).")
    errors: str = _opt("exclude", "Episodes that end with env_error (a reset or step that raised, timed out or was "
                                  "malformed: the infrastructure failed, not the policy): exclude = out of their "
                                  "group's advantage statistics (mean, std over the other episodes), the loss and the "
                                  "prompt state, counted in env/errors_excluded; a group left with fewer than 2 "
                                  "episodes gets advantage 0 and leaves the prompt state as it was "
                                  "(env/groups_without_signal). score = the old behaviour: scored like any episode "
                                  "(the rule of its last turn + its step rewards so far), as a failed task.")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every field in range (called at construction and again by ``Config.validate``: a loader or a test may
        set a field after construction)."""
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
        if self.errors not in ERROR_MODES:
            raise ValueError(f"env.errors must be one of {ERROR_MODES}, got {self.errors!r}")
        if self.token_check not in TOKEN_CHECKS:
            raise ValueError(f"env.token_check must be one of {TOKEN_CHECKS}, got {self.token_check!r}")

    @property
    def assistant_token_limit(self) -> int:
        """The bound on sampled (trained) tokens per episode."""
        return self.max_tokens if self.max_assistant_tokens is None else self.max_assistant_tokens
