"""Environments of the end-to-end multi-turn tests (``env.name: tests.e2e._envs:<Name>``), for the tiny arithmetic
runs: observations are digits, which the run's SentencePiece tokenizer (trained on the arithmetic corpus) encodes
without an unknown piece, so the render audit stays strict.

* ``Talk``: every episode goes on for ``turns`` assistant turns (each observation the user message ``"1"``), with
  a reward of ``per_turn`` for each turn that has text. With ``DPPO_TEST_KILL_WHEN=<file>`` in the environment the
  process SIGKILLs itself in the first ``step`` after that file appears (a checkpoint's ``latest`` pointer): a
  kill -9 of the run in the middle of an episode (environments stepping, turns in flight).
* ``Briefed``: ``Talk`` whose ``reset`` returns a user message of digits, different between the G episodes of a
  prompt: the prompt every turn is sampled from is the task's re-rendered with it; ``per_turn`` for every turn.
* ``Faulty``: the failures a tool-using run meets, chosen per episode from its seed: a ``step`` that hangs past
  ``env.step_timeout_s``, a ``step`` that raises, a ``reset`` that raises, and tool calls run for real in the
  ``python`` sandbox (``megatron_dppo.env.python_tool``): an endless loop (killed at its timeout) and a process
  that aborts. The sandbox's observation is passed on as its length in digits (its text holds letters the tiny
  tokenizer does not have), its tool_errors / tool_timeouts counters as they are.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from megatron_dppo.env import Step
from megatron_dppo.env.protocol import Turn
from megatron_dppo.env.python_tool import PythonToolEnv


class Talk:
    def __init__(self, turns: int = 3, per_turn: float = 0.0):
        self.turns, self.per_turn = int(turns), float(per_turn)

    def reset(self, task, seed):
        self.done = 0
        return []

    def step(self, turn):
        kill_when = os.environ.get("DPPO_TEST_KILL_WHEN")
        if kill_when and Path(kill_when).exists():
            print(f"[_envs.Talk] SIGKILL mid-episode (turn {turn.index})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.done += 1
        reward = self.per_turn if turn.text.strip() else 0.0
        if self.done >= self.turns:
            return Step(done=True, reward=reward)
        return Step(messages=[{"role": "user", "content": "1"}], reward=reward)


class Briefed(Talk):
    """``Talk`` whose ``reset`` shows the task a message of its own (as an OpenEnv environment does): a user
    message of digits that differs between the episodes of one prompt (drawn from the episode's seed), and a
    reward of ``per_turn`` for every turn (a shaping reward, text or not)."""

    def reset(self, task, seed):
        super().reset(task, seed)
        return [{"role": "user", "content": str(seed % 10) * (1 + seed % 3)}]

    def step(self, turn):  # a shaping reward for every turn, text or not
        step = super().step(turn)
        step.reward = self.per_turn
        return step


FAULTS = ("hang", "raise", "tool_hang", "tool_crash", "ok")
TOOL_CODE = {"tool_hang": "while True:\n    pass", "tool_crash": "import os\nos.abort()"}


class Faulty:
    def __init__(self, hang_s: float = 60.0, tool_timeout_s: float = 1.0):
        self.hang_s = float(hang_s)
        self.tool = PythonToolEnv(timeout_s=tool_timeout_s, memory_mb=256)

    def reset(self, task, seed):
        if seed % 7 == 6:
            raise RuntimeError("the environment could not start (injected)")
        self.fault = FAULTS[seed % len(FAULTS)]
        self.turns = 0
        return []

    def step(self, turn):
        self.turns += 1
        if self.fault == "hang":
            time.sleep(self.hang_s)  # past env.step_timeout_s: the episode ends with env_error, the run goes on
        if self.fault == "raise":
            raise ValueError("the environment failed (injected)")
        if self.turns >= 3:
            return Step(done=True)
        if self.fault in TOOL_CODE:  # the real sandbox: a hung or crashing tool is an observation, not an error
            code = TOOL_CODE[self.fault]
            result = self.tool.step(Turn(turn.index, turn.token_ids, f"<python>{code}</python>", "stop"))
            return Step(messages=[{"role": "user", "content": str(len(result.messages[0]["content"]))}],
                        tool_calls=result.tool_calls, tool_errors=result.tool_errors,
                        tool_timeouts=result.tool_timeouts)
        return Step(messages=[{"role": "user", "content": "2"}])
