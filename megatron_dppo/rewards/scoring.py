"""Scoring a batch of completions so that a broken reward function costs one sample, never the run.

For every sample i the scorer returns r_i = reward_fn(completion_i, gold_i) when the call returns a finite float
within ``timeout_s`` seconds, and r_i = 0 with a logged warning when it raises, returns NaN/inf or something that is
not a number, runs past the timeout, or kills its process. With process isolation a batch also has a wall-clock
``budget_s``: when it runs out, the samples not yet scored score 0 as timed out (``RewardResult.num_timed_out``).

Two isolation modes:
- ``"inline"``: calls run in the calling thread. Exceptions and non-finite values are caught; a hang is NOT
  interrupted (math-verify still applies its own signal timeouts in the main thread). Cost: the reward itself.
- ``"process"``: calls run in ``num_workers`` persistent worker processes (``python -m
  megatron_dppo.rewards._worker``, a fresh interpreter: no fork of a threaded trainer, no re-import of its main
  module). A sample past its deadline gets its worker killed (with its whole process group) and replaced.
  Cost: a one-time worker start (~0.1-0.3 s, plus importing the reward's module) and an IPC round trip per chunk
  of samples (tens of microseconds per sample, measured in tests/unit/test_rewards.py).
- ``"auto"`` (default): inline for the trusted built-ins (math, gsm8k, format, arithmetic and sums of them),
  process for everything else.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from megatron_dppo.rewards.registry import build_reward, is_trusted, reward_name

logger = logging.getLogger("megatron_dppo.rewards")

ISOLATION_MODES = ("auto", "inline", "process")


TIMED_OUT = "timed out"  # how the errors of samples past their time limit (or the batch budget) begin


@dataclass
class RewardResult:
    """Per-sample rewards of one batch; ``errors[i]`` is None when sample i was scored normally."""

    rewards: list[float]
    errors: list[str | None]
    seconds: float = 0.0

    @property
    def num_failed(self) -> int:
        return sum(e is not None for e in self.errors)

    @property
    def num_timed_out(self) -> int:
        """Samples past ``timeout_s`` or left unscored when the batch's ``budget_s`` ran out."""
        return sum(e is not None and e.startswith(TIMED_OUT) for e in self.errors)


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    queue: deque = field(default_factory=deque)  # indices sent, not yet answered; queue[0] is running
    running_since: float = 0.0


class RewardScorer:
    """Applies one reward function to batches of (completion, gold) pairs; see the module docstring.

    Args:
        reward: a registered name ("math"), an import path ("pkg.module:func"), a callable, or {name: weight}.
        timeout_s: per-sample limit in seconds (process isolation only).
        isolation: "auto" | "inline" | "process".
        num_workers: worker processes for process isolation.
        max_warnings: failures logged one by one per batch; the rest are summarised in one line.
        budget_s: wall-clock limit of one ``score`` call (process isolation only; None = none). When it runs out,
            the samples still running or waiting score 0 as timed out, so a hanging reward function costs a step
            at most ``budget_s`` instead of ``samples * timeout_s / num_workers``.
    """

    def __init__(self, reward: str | Callable | Mapping[str, float], *, timeout_s: float = 10.0,
                 isolation: str = "auto", num_workers: int = 1, max_warnings: int = 5,
                 budget_s: float | None = None):
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"reward isolation {isolation!r} is not one of {ISOLATION_MODES}")
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"reward timeout_s must be a finite number of seconds > 0, got {timeout_s}")
        if num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1, got {num_workers}")
        if budget_s is not None and not 0 < budget_s < math.inf:
            raise ValueError(f"reward budget_s must be None or a finite number of seconds > 0, got {budget_s}")
        self.budget_s = None if budget_s is None else float(budget_s)
        self.fn = build_reward(reward)
        self.name = reward if isinstance(reward, str) else reward_name(self.fn)
        self.timeout_s = float(timeout_s)
        self.num_workers = int(num_workers)
        self.max_warnings = max_warnings
        if isolation == "auto":
            isolation = "inline" if is_trusted(reward if isinstance(reward, str) else self.fn) else "process"
        self.isolation = isolation
        self._payload = b""
        if isolation == "process":
            try:
                self._payload = pickle.dumps(self.fn)
            except Exception as err:
                raise ValueError(f"reward {self.name!r} cannot be sent to a worker process ({err}); define it at "
                                 "module level (importable as 'pkg.module:func') or use isolation='inline'") from err
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown_workers, self._workers)

    # ------------------------------------------------------------------------------------------------------------
    def score(self, completions: Sequence[str], golds: Sequence[Any],
              ids: Sequence[Any] | None = None) -> RewardResult:
        """Rewards of ``completions[i]`` against ``golds[i]``; ``ids`` only label the warnings."""
        if len(completions) != len(golds):
            raise ValueError(f"got {len(completions)} completions but {len(golds)} gold answers")
        if ids is not None and len(ids) != len(completions):
            raise ValueError(f"got {len(ids)} ids for {len(completions)} completions")
        start = time.perf_counter()
        if self.isolation == "inline":
            rewards, errors = self._score_inline(completions, golds)
        else:
            rewards, errors = self._score_in_workers(completions, golds)
        result = RewardResult(rewards, errors, time.perf_counter() - start)
        self._warn(result, ids)
        return result

    def close(self) -> None:
        """Stop the worker processes (idempotent; also runs at garbage collection and interpreter exit)."""
        _shutdown_workers(self._workers)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------------------
    def _score_inline(self, completions, golds) -> tuple[list[float], list[str | None]]:
        rewards, errors = [], []
        for completion, gold in zip(completions, golds):
            try:
                value = float(self.fn(completion, gold))
                error = None if math.isfinite(value) else f"non-finite reward {value}"
            except (Exception, SystemExit) as err:  # noqa: BLE001 - a reward must never take the run down
                value, error = 0.0, f"{type(err).__name__}: {err}"
            rewards.append(value if error is None else 0.0)
            errors.append(error)
        return rewards, errors

    def _score_in_workers(self, completions, golds) -> tuple[list[float], list[str | None]]:
        n = len(completions)
        rewards: list[float] = [0.0] * n
        errors: list[str | None] = [None] * n
        pending = deque(range(n))
        chunk = max(1, min(64, math.ceil(n / (4 * self.num_workers))))
        budget_end = math.inf if self.budget_s is None else time.perf_counter() + self.budget_s
        while pending or any(w.queue for w in self._workers):
            if time.perf_counter() >= budget_end:  # fail what is left; free the workers still running a sample
                self._spend_budget(pending, errors)
                break
            # 1. hand chunks to idle workers (starting workers as needed)
            while pending and (idle := self._idle_worker()) is not None:
                if isinstance(idle, str):  # the worker could not load the reward function
                    while pending:
                        errors[pending.popleft()] = idle
                    break
                items = [pending.popleft() for _ in range(min(chunk, len(pending)))]
                try:
                    idle.conn.send([(i, completions[i], golds[i]) for i in items])
                except OSError:  # the worker died while idle: replace it, keep the samples
                    pending.extendleft(reversed(items))
                    self._kill(idle)
                    continue
                idle.queue.extend(items)
                idle.running_since = time.perf_counter()
            busy = [w for w in self._workers if w.queue]
            if not busy:
                continue
            # 2. wait for replies until the earliest deadline
            now = time.perf_counter()
            next_deadline = min(min(w.running_since + self.timeout_s for w in busy), budget_end)
            ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - now))
            for worker in busy:
                if worker.conn in ready:
                    self._drain(worker, rewards, errors, pending)
            # 3. kill workers whose running sample is past its deadline
            now = time.perf_counter()
            for worker in list(self._workers):
                if worker.queue and now - worker.running_since > self.timeout_s:
                    index = worker.queue.popleft()
                    errors[index] = f"{TIMED_OUT} after {self.timeout_s:g}s (reward.timeout_s)"
                    pending.extendleft(reversed(worker.queue))
                    worker.queue.clear()
                    self._kill(worker)
        return rewards, errors

    def _spend_budget(self, pending: deque, errors: list) -> None:
        message = f"{TIMED_OUT}: the batch's scoring budget of {self.budget_s:g}s (reward.step_budget_s) ran out"
        left = list(pending)
        pending.clear()
        for worker in [w for w in self._workers if w.queue]:
            left.extend(worker.queue)
            worker.queue.clear()
            self._kill(worker)
        for index in left:
            errors[index] = message
        logger.warning("reward %r: scoring budget of %gs spent, %d samples left unscored score 0 (raise "
                       "reward.step_budget_s if the reward function is slow but working)", self.name,
                       self.budget_s, len(left))

    def _drain(self, worker: _Worker, rewards, errors, pending) -> None:
        """Read every reply the worker has ready; on a dead worker fail its running sample, requeue the rest."""
        try:
            while worker.queue and worker.conn.poll():
                index, status, value = worker.conn.recv()
                expected = worker.queue.popleft()
                assert index == expected, (index, expected)
                if status == "ok":
                    rewards[index] = value
                else:
                    errors[index] = value
                worker.running_since = time.perf_counter()
        except (EOFError, OSError):
            code = worker.proc.poll()
            index = worker.queue.popleft()
            errors[index] = f"reward worker died (exit code {code})"
            pending.extendleft(reversed(worker.queue))
            worker.queue.clear()
            self._kill(worker)

    def _idle_worker(self) -> _Worker | str | None:
        for worker in self._workers:
            if not worker.queue:
                return worker
        if len(self._workers) < self.num_workers:
            return self._start_worker()
        return None

    def _start_worker(self) -> _Worker | str:
        """Start one worker and wait for it to load the reward; an error string when it cannot."""
        parent_sock, child_sock = socket.socketpair()
        child_fd = child_sock.fileno()
        proc = subprocess.Popen([sys.executable, "-m", "megatron_dppo.rewards._worker", str(child_fd)],
                                pass_fds=[child_fd], start_new_session=True, cwd=os.getcwd())
        child_sock.close()
        conn = Connection(parent_sock.detach())
        conn.send(("init", list(sys.path), self._payload))
        startup_limit = max(60.0, self.timeout_s)
        if not conn.poll(startup_limit):
            _terminate(proc, conn)
            return f"reward worker did not start within {startup_limit:g}s"
        try:
            status, message = conn.recv()
        except EOFError:
            _terminate(proc, conn)
            return f"reward worker exited during start-up (exit code {proc.wait()})"
        if status != "ready":
            _terminate(proc, conn)
            return f"reward worker cannot load {self.name!r}: {message}"
        worker = _Worker(proc, conn)
        self._workers.append(worker)
        return worker

    def _kill(self, worker: _Worker) -> None:
        _terminate(worker.proc, worker.conn)
        self._workers.remove(worker)

    def _warn(self, result: RewardResult, ids) -> None:
        failed = [i for i, e in enumerate(result.errors) if e is not None]
        for i in failed[: self.max_warnings]:
            label = f" (id {ids[i]})" if ids is not None else ""
            logger.warning("reward %r failed on sample %d%s, scored 0: %s", self.name, i, label, result.errors[i])
        if len(failed) > self.max_warnings:
            logger.warning("reward %r failed on %d more samples of this batch, all scored 0",
                           self.name, len(failed) - self.max_warnings)


def _terminate(proc: subprocess.Popen, conn: Connection) -> None:
    """Kill a worker and its process group (it leads its own session), reap it, close the pipe."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
    conn.close()


def _shutdown_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        try:
            worker.conn.send(None)
        except OSError:
            pass
    for worker in workers:
        try:
            worker.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        _terminate(worker.proc, worker.conn)
    workers.clear()


def score_batch(reward: str | Callable | Mapping[str, float], completions: Sequence[str], golds: Sequence[Any],
                *, ids: Sequence[Any] | None = None, timeout_s: float = 10.0, isolation: str = "auto",
                num_workers: int = 1, budget_s: float | None = None) -> RewardResult:
    """One-shot ``RewardScorer(...).score(...)``. A trainer scoring every step should keep one RewardScorer alive
    instead, so process-isolated workers start once."""
    with RewardScorer(reward, timeout_s=timeout_s, isolation=isolation, num_workers=num_workers,
                      budget_s=budget_s) as scorer:
        return scorer.score(completions, golds, ids)
