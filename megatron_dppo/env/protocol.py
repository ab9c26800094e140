"""The environment protocol of multi-turn episodes (docs/environments.md).

An episode alternates assistant turns, sampled by the rollout engine, with observations from an environment:

    messages = env.reset(task, seed)          # extra messages after the task's prompt, usually []
    loop:  the engine samples an assistant turn (token ids, kept verbatim)
           step = env.step(Turn(index, token_ids, text, finish_reason))
           if step.done: stop                 # else step.messages (role "tool" or "user") become observation tokens

A user implements ``reset`` and ``step`` in a few lines; one fresh environment object serves one episode, built by
a factory (``env.name``: a built-in name or ``pkg.module:Factory``, called with ``env.kwargs``). Everything an
environment returns is plain data: chat messages, a float reward, flags and counters. It never sees or returns
token ids of its own: observation tokens come from the chat template (``env/tokens.py``), sampled tokens are never
re-tokenized.

Failure semantics: an exception in ``reset``/``step``, a step past ``env.step_timeout_s`` or a malformed ``Step``
ends that episode with finish reason ``env_error`` (the run goes on); a tool that fails INSIDE a working
environment (a crash, a timeout of the code it runs) is an observation the model sees, counted in
``tool_errors`` / ``tool_timeouts``.

Finish reasons of an episode (``FINISH_REASONS``):
    stop        the environment ended the episode (``done``) after a complete assistant turn
    length      a token bound ended the episode: its last turn was cut (per-turn, episode or trained-token bound),
                or the trained-token bound was spent by complete turns while the environment wanted more
    max_turns   ``env.max_turns`` assistant turns were sampled and the environment wanted more
    context     the next observation did not fit into ``env.max_tokens``
    env_error   the environment raised, timed out or returned a malformed step
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

FINISH_REASONS = ("stop", "length", "max_turns", "context", "env_error")
OBSERVATION_ROLES = ("tool", "user", "system")


@dataclass(frozen=True)
class Task:
    """What an episode starts from: one prompt of the data set.

    ``messages`` are the chat messages the prompt was rendered from (system and user turns; empty when the prompt
    is not a chat, e.g. a raw template); ``text`` the question as written; ``gold`` the reference answer."""

    id: str
    text: str = ""
    gold: Any = None
    messages: tuple[dict, ...] = ()


@dataclass(frozen=True)
class Turn:
    """One sampled assistant turn as the environment sees it.

    token_ids:     the engine's sampled ids, stop token included (verbatim; never re-encoded)
    text:          those ids decoded without special tokens
    finish_reason: "stop" (ended at a stop token) or "length" (cut by a token bound)"""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str


@dataclass
class Step:
    """The environment's answer to a turn.

    messages:      observation messages to append, each {"role": "tool" | "user" | "system", "content": str}
                   (extra keys such as "name" or "tool_call_id" pass to the chat template); ignored when done
    reward:        added to the episode's reward (the trajectory reward is the sum over its steps)
    done:          end the episode after this turn
    tool_calls / tool_errors / tool_timeouts: counters for the metrics (calls made in this step, calls that
                   failed, calls that ran out of time)"""

    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. ``close()`` is optional and called once when the episode ends."""

    def reset(self, task: Task, seed: int) -> list[dict]:
        """Start an episode for ``task``; ``seed`` derives from (run seed, step, prompt, sample), so a resumed run
        replays the same episodes. Returns extra messages placed after the task's prompt messages (usually [])."""
        ...

    def step(self, turn: Turn) -> Step:
        """React to an assistant turn."""
        ...


EnvFactory = Callable[..., Environment]


class MalformedStep(ValueError):
    """An environment returned something that is not a valid ``Step`` / message list."""


def check_messages(messages: Any, where: str) -> list[dict]:
    """The observation messages as a list of dicts with a valid role and string content, else MalformedStep."""
    if not isinstance(messages, (list, tuple)):
        raise MalformedStep(f"{where} must return a list of messages, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise MalformedStep(f"{where}: message {i} is {type(m).__name__}, not a dict")
        if m.get("role") not in OBSERVATION_ROLES:
            raise MalformedStep(f"{where}: message {i} has role {m.get('role')!r}; valid: {OBSERVATION_ROLES}")
        if not isinstance(m.get("content"), str):
            raise MalformedStep(f"{where}: message {i} content must be a string, got "
                                f"{type(m.get('content')).__name__}")
        out.append(dict(m))
    return out


def check_step(step: Any) -> Step:
    """``step`` validated: a Step with a finite reward, valid messages and non-negative counters."""
    if not isinstance(step, Step):
        raise MalformedStep(f"Environment.step must return a Step, got {type(step).__name__}")
    if isinstance(step.reward, bool) or not isinstance(step.reward, (int, float)) or not math.isfinite(step.reward):
        raise MalformedStep(f"Step.reward must be a finite number, got {step.reward!r}")
    for name in ("tool_calls", "tool_errors", "tool_timeouts"):
        value = getattr(step, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MalformedStep(f"Step.{name} must be an integer >= 0, got {value!r}")
    messages = [] if step.done else check_messages(step.messages, "Environment.step")
    if not step.done and not messages:
        raise MalformedStep("Environment.step returned done=False without observation messages; an episode "
                            "continues only with something new for the model to read")
    return Step(messages=messages, reward=float(step.reward), done=bool(step.done), tool_calls=step.tool_calls,
                tool_errors=step.tool_errors, tool_timeouts=step.tool_timeouts)
