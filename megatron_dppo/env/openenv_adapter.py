"""``openenv``: any OpenEnv environment (``openenv-core`` on PyPI) as an episode environment.

OpenEnv environments follow the Gym API with pydantic types: ``reset(seed=..., episode_id=...) -> Observation``,
``step(Action) -> Observation`` whose ``reward`` and ``done`` fields end the turn. The adapter maps one assistant
turn to one ``Action`` (its text in ``action_field``), and the returned observation to one message (the field
``observation_field``, or every field of the observation other than done/reward/metadata as JSON). The
observation's reward is added to the episode's reward, its ``done`` ends the episode.

``environment`` is an ``Environment`` subclass or its import path ``pkg.module:Class`` (run in-process, one
instance per episode, built with ``env_kwargs``), or a factory returning an OpenEnv client (``EnvClient``: its
``step`` returns a ``StepResult(observation, reward, done)``, which the adapter reads the same way).

Example (the echo environment of OpenEnv's template)::

    env: {name: openenv, kwargs: {environment: "echo_env.server.echo_env_environment:EchoEnvironment",
                                  action: "echo_env.models:EchoAction", action_field: message,
                                  observation_field: echoed_message}}
"""
from __future__ import annotations

import inspect
import json
from typing import Any

from megatron_dppo.env.protocol import Step, Task, Turn
from megatron_dppo.env.registry import import_object

_STANDARD_FIELDS = ("done", "reward", "metadata")


def _resolve(value: Any, what: str) -> Any:
    return import_object(value, what) if isinstance(value, str) else value


class OpenEnvAdapter:
    """Args: environment (class, import path or client factory), action (Action class or import path),
    action_field (the Action field that receives the assistant's text), observation_field (the Observation
    field shown to the model; None = all non-standard fields as JSON), role (of the observation message, "user"),
    env_kwargs (constructor arguments of the environment), show_reset (put the reset observation after the
    prompt as a message)."""

    def __init__(self, environment: Any, action: Any, action_field: str = "message",
                 observation_field: str | None = None, role: str = "user", env_kwargs: dict | None = None,
                 show_reset: bool = False):
        if role not in ("tool", "user"):
            raise ValueError(f"openenv observation role must be 'tool' or 'user', got {role!r}")
        factory = _resolve(environment, "OpenEnv environment")
        self.action_cls = _resolve(action, "OpenEnv action class")
        fields = getattr(self.action_cls, "model_fields", None)
        if fields is not None and action_field not in fields:
            raise ValueError(f"OpenEnv action {self.action_cls.__name__} has no field {action_field!r}; its "
                             f"fields: {sorted(fields)}")
        self.env = factory(**(env_kwargs or {}))
        self.action_field, self.observation_field, self.role = action_field, observation_field, role
        self.show_reset = bool(show_reset)

    def reset(self, task: Task, seed: int) -> list[dict]:
        reset = self.env.reset
        params = inspect.signature(reset).parameters
        kwargs = {k: v for k, v in (("seed", seed), ("episode_id", task.id)) if k in params
                  or any(p.kind is p.VAR_KEYWORD for p in params.values())}
        observation, _, _ = self._unpack(reset(**kwargs))
        return [{"role": self.role, "content": self.render(observation)}] if self.show_reset else []

    def step(self, turn: Turn) -> Step:
        observation, reward, done = self._unpack(self.env.step(self.action_cls(**{self.action_field: turn.text})))
        if done:
            return Step(reward=reward, done=True)
        return Step(messages=[{"role": self.role, "content": self.render(observation) or "(empty observation)"}],
                    reward=reward)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    @staticmethod
    def _unpack(result: Any) -> tuple[Any, float, bool]:
        """(observation, reward, done) of an in-process Observation or a client's StepResult."""
        if hasattr(result, "observation"):  # client StepResult
            observation, reward, done = result.observation, result.reward, result.done
        else:
            observation, reward, done = result, getattr(result, "reward", None), getattr(result, "done", False)
        return observation, float(reward or 0.0), bool(done)

    def render(self, observation: Any) -> str:
        """The message text of an observation (class docstring)."""
        if self.observation_field is not None:
            return str(getattr(observation, self.observation_field))
        if hasattr(observation, "model_dump"):
            data = {k: v for k, v in observation.model_dump().items() if k not in _STANDARD_FIELDS}
            return json.dumps(data, ensure_ascii=False, sort_keys=True, default=str)
        return str(observation)
