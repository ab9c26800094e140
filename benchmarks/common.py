"""What the benchmarks share: the repository, the overrides of a quiet run, launching the CLI as a subprocess, a pool
of such jobs, reading a run's ``metrics.jsonl``, the machine a report was measured on, and writing the report.

Only the standard library at import (a benchmark's ``--help`` and the TRL worker of ``vs_trl.py``, which runs in
another environment, import this module); torch and ``megatron_dppo`` are imported where they are used.
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]

QUIET = ["logging.progress_bar=false", "logging.plot=false", "logging.tensorboard=false"]
"""Overrides of a benchmark's training run: no progress bar, plots or TensorBoard events (its figures are read from
``metrics.jsonl``). Checkpointing and ``logging.print_every`` are each benchmark's own choice."""


# ----------------------------------------------------------------------------------------------------------
# Launching the CLI
# ----------------------------------------------------------------------------------------------------------
class RunFailed(RuntimeError):
    """A launched process exited non-zero or ran past its timeout (the message has the tail of its log)."""


def cli(*args: str, python: str = sys.executable, nproc: int = 1) -> list[str]:
    """The command line of ``megatron-dppo ARGS`` under ``python``; ``nproc > 1``: under ``torch.distributed.run``
    with that many processes on this host (a free rendezvous port)."""
    if nproc == 1:
        return [python, "-m", "megatron_dppo.cli", *args]
    from megatron_dppo.distributed.launch import free_port

    return [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "megatron_dppo.cli", *args]


def run(cmd: list[str], log: Path, timeout: Optional[float] = None, env: Optional[dict] = None) -> dict:
    """Run ``cmd`` from the repository, its output (after the command line) to ``log``; returns its wall seconds
    and CPU seconds (``wait4``: user + system of the process and its reaped children). The environment: this one
    without a launcher's rank variables, ``PYTHONPATH`` = the repository (this checkout's code runs),
    ``PYTHONWARNINGS=ignore``, a free ``MASTER_PORT`` (parallel runs must not share one), then ``env``. Raises
    :class:`RunFailed` on a non-zero exit or past ``timeout`` seconds (the process is killed)."""
    from megatron_dppo.distributed.launch import free_port

    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    full_env.update(PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()), **(env or {}))
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(map(str, cmd)) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=full_env)
        while True:  # wait4: the CPU seconds of the process tree; polled only to enforce a timeout
            pid, status, usage = os.wait4(proc.pid, 0 if timeout is None else os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > t0 + timeout:
                proc.kill()
                proc.wait()
                raise RunFailed(f"{' '.join(map(str, cmd))} timed out after {timeout} s; log {log}")
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait for it again)
    code = proc.returncode
    if code != 0:
        raise RunFailed(f"{' '.join(map(str, cmd))} failed with exit {code}; log {log}:\n{log.read_text()[-3000:]}")
    return {"wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime}


def train(config: Path | str, overrides: list[str], log: Path, timeout: Optional[float] = None,
          env: Optional[dict] = None) -> dict:
    """``megatron-dppo train --config config overrides`` through :func:`run`."""
    return run(cli("train", "--config", str(config), *overrides), log, timeout, env)


# ----------------------------------------------------------------------------------------------------------
# A pool of jobs
# ----------------------------------------------------------------------------------------------------------
def _print_failure(job, err: BaseException) -> None:
    print(f"FAILED {job}: {err}", flush=True)


def run_pool(jobs: list, worker: Callable, parallel: int, ready: Optional[Callable] = None,
             stop: Optional[Callable[[], bool]] = None, report: Callable = _print_failure) -> list:
    """Run ``worker(job)`` over ``jobs`` on ``parallel`` threads; returns the ``(job, error)`` pairs that failed.

    Each thread takes the first job in order for which ``ready(job)`` is true (default: every job; a job waits
    while its dependencies run) until no job is left or ``stop()`` is true. A job that raises does not stop the
    others: ``report(job, error)`` (default: a printed line) and it is in the result. When nothing runs and no
    job is ready, the jobs left can never run: they fail with "a dependency failed" (not reported). The calling
    thread waits in short joins, so a signal handler of the main thread runs while the pool works."""
    cond, queue, errors, running = threading.Condition(), list(jobs), [], [0]
    ready = ready or (lambda job: True)
    stop = stop or (lambda: False)

    def loop():
        while True:
            with cond:
                while True:
                    if stop():
                        return
                    job = next((j for j in queue if ready(j)), None)
                    if job is not None or not queue:
                        break
                    if running[0] == 0:  # nothing runs and nothing is ready: the rest can never run
                        errors.extend((j, RuntimeError("a dependency failed")) for j in queue)
                        queue.clear()
                        cond.notify_all()
                        return
                    cond.wait()
                if job is None:
                    return
                queue.remove(job)
                running[0] += 1
            try:
                worker(job)
            except Exception as err:  # noqa: BLE001 - one failed job must not stop the others; reported at the end
                report(job, err)
                errors.append((job, err))
            finally:
                with cond:
                    running[0] -= 1
                    cond.notify_all()

    threads = [threading.Thread(target=loop) for _ in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
    return errors


# ----------------------------------------------------------------------------------------------------------
# A run's metrics
# ----------------------------------------------------------------------------------------------------------
def read_metrics(output_dir: Path | str, phase: Optional[str] = None) -> list[dict]:
    """The records of ``<output_dir>/metrics.jsonl`` in file order, those of ``phase`` ("rl", "sft", "eval") only
    when given; none when the run has not logged yet. A line that is not JSON (a torn last line, from a kill
    mid-write) is skipped."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if phase is None or record.get("phase") == phase:
            out.append(record)
    return out


# ----------------------------------------------------------------------------------------------------------
# Machine / output
# ----------------------------------------------------------------------------------------------------------
def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(),
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def write_json(path: Path | None, report: dict, digits: int | None = None) -> None:
    """``digits``: round every float to that many significant digits and write without indentation (the large
    reports committed under docs/benchmarks)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if digits is None:
        path.write_text(json.dumps(report, indent=1, default=str))
    else:
        path.write_text(json.dumps(_rounded(report, digits), default=str, separators=(",", ":")))
    print(f"\nwrote {path}")


def _rounded(x, digits: int):
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v, digits) for v in x]
    return x


def quiet() -> None:
    """Library logging at ERROR and no warnings (a benchmark that runs the engine in its own process)."""
    import logging
    import warnings
    logging.basicConfig(level=logging.ERROR)
    for name in ("megatron", "megatron.core", "torch.distributed", "megatron_dppo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
