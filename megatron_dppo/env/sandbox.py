"""Run untrusted Python code in a fresh, limited subprocess: the engine of the ``python`` tool.

Each call starts ``python -I`` (isolated: no user site, no PYTHON* variables) in a new empty temporary directory,
in its own session (process group), with a minimal environment. A short prelude sets ``resource`` limits before
the code runs:

    RLIMIT_AS      address space (``memory_mb``): an allocation past it raises MemoryError in the code
    RLIMIT_CPU     CPU seconds (``cpu_s``, default: the wall-clock timeout rounded up): SIGXCPU past it
    RLIMIT_FSIZE   bytes per written file (``max_output_bytes``): stdout and stderr go to files in the temporary
                   directory, so endless printing ends with ``OSError: File too large`` in the code (Python ignores
                   SIGXFSZ) instead of filling the parent's memory
    RLIMIT_NOFILE  open files (64)
    RLIMIT_NPROC   processes of the user (``max_processes``; off by default because Linux counts every process of
                   the user, on a shared machine included)
    RLIMIT_CORE    0 (no core dumps)

The parent waits at most ``timeout_s`` of wall-clock time, then kills the whole process group (SIGKILL), so a
hang, a sleep or a child process left behind cannot outlive the call. Nothing here raises for anything the code
does: the outcome is a :class:`SandboxResult` (output, exit status, signal, timeout). Only a failure to START the
interpreter raises (OSError), which the episode loop turns into an ``env_error`` finish.

Not a security boundary against a determined attacker (no namespaces, no seccomp, the network is whatever the
host allows); it bounds time, memory and output of code a policy writes, which is what training needs.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

_PRELUDE = r"""
import resource, sys
def _limit(name, value):
    if value is not None and value >= 0:
        resource.setrlimit(getattr(resource, name), (value, value))
_limit("RLIMIT_CORE", 0)
_limit("RLIMIT_AS", {memory})
_limit("RLIMIT_CPU", {cpu})
_limit("RLIMIT_FSIZE", {fsize})
_limit("RLIMIT_NOFILE", 64)
_limit("RLIMIT_NPROC", {nproc})
with open(sys.argv[1], encoding="utf-8") as _f:
    _code = _f.read()
del _limit, resource, _f
_globals = {{"__name__": "__main__", "__builtins__": __builtins__}}
exec(compile(_code, "<tool>", "exec"), _globals)
"""


@dataclass
class SandboxResult:
    """stdout/stderr: decoded (UTF-8, errors replaced), at most ``max_output_bytes`` each; returncode: the exit
    status (None when killed on timeout); signal_name: the signal that ended the process (SIGKILL, SIGXCPU,
    SIGXFSZ, SIGSEGV, ...) or None; timed_out: killed after ``timeout_s``; seconds: wall-clock time."""

    stdout: str
    stderr: str
    returncode: int | None
    signal_name: str | None
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int | None = 512, cpu_s: int | None = None,
               max_output_bytes: int = 16384, max_processes: int | None = None,
               python: str | None = None) -> SandboxResult:
    """Run ``code`` in a limited subprocess (module docstring) and return what happened."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if max_output_bytes < 1:
        raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes}")
    cpu = int(cpu_s) if cpu_s is not None else int(timeout_s) + 1
    memory = None if memory_mb is None else int(memory_mb) * 1024 * 1024
    prelude = _PRELUDE.format(memory=memory, cpu=cpu, fsize=int(max_output_bytes) + 1, nproc=max_processes)
    env = {"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dppo-tool-", ignore_cleanup_errors=True) as work:
        out_path, err_path = os.path.join(work, ".stdout"), os.path.join(work, ".stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            code_path = os.path.join(work, ".code.py")
            with open(code_path, "w", encoding="utf-8", errors="replace") as f:
                f.write(code)
            proc = subprocess.Popen([python or sys.executable, "-I", "-c", prelude, code_path],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=work, env=env,
                                    start_new_session=True)
            try:
                timed_out = not _wait_unreaped(proc.pid, start + timeout_s)
            finally:
                _kill_group(proc)
        stdout, stderr = _read(out_path, max_output_bytes), _read(err_path, max_output_bytes)
    code_ = proc.returncode
    killed = code_ is not None and code_ < 0
    return SandboxResult(stdout=stdout, stderr=stderr, returncode=None if timed_out else code_,
                         signal_name=_signal_name(-code_) if killed and not timed_out else
                         ("SIGKILL" if timed_out else None),
                         timed_out=timed_out, seconds=time.monotonic() - start)


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until the process exits or ``deadline`` passes, WITHOUT reaping it (WNOWAIT): until it is reaped its
    pid, which is also its process group's id, cannot be reused, so the group kill that follows cannot hit an
    unrelated process. True when it exited in time."""
    delay = 0.001
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.02)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the call's whole process group (children left behind included), then reap the interpreter."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit)
    return data.decode("utf-8", errors="replace")
