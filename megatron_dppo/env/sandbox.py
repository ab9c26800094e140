"""Run untrusted Python code, one call at a time: the engine of the ``python`` tool.

Two isolation modes (``isolation``):

``bwrap`` (default): a security boundary. The code runs under bubblewrap (env/bubblewrap.py: new user, pid, network,
IPC, mount namespaces; uid 65534 without capabilities; read-only views of the interpreter and, with
``site_packages``, the installed packages; a private size-limited tmpfs as its scratch and working folder; a /proc of
its own). It cannot see or signal the trainer or any other host process, read the run folder, checkpoints, data or
the trainer's environment, reach the network, or outlive the call (the kernel kills the whole pid namespace with it).
The call's limits hold for the call as a whole, not for each of its processes: a control group per call
(env/cgroup.py) caps the memory of all its processes together (``memory_mb``) and how many exist at once
(``max_processes``, threads included). Where no control group can be made (a non-root trainer without a delegated
group), the closest bound is used and said: ``RLIMIT_NPROC`` counts the call's processes (its user namespace is its
own) and ``RLIMIT_AS`` bounds each one, so memory is bounded by ``memory_mb * max_processes``. As root without a
control group there is no process bound at all (the kernel exempts root's uid from ``RLIMIT_NPROC``, in a user
namespace too), and the sandbox refuses to start.

``none``: the old, unsafe mode, for machines where bubblewrap cannot run: ``python -I`` in a temporary folder, in
its own process group, with rlimits only. The code runs as the trainer's user with its view of the machine: it can
kill the trainer, delete checkpoints, read the trainer's memory and secrets, open connections and leave daemons
behind. Only an explicit ``isolation: none`` selects it; a missing bubblewrap is an error, never a silent fallback.

Per process in both modes (a short prelude sets ``resource`` limits before the code runs):

    RLIMIT_AS      address space (``memory_mb``): one oversized allocation raises MemoryError in the code
    RLIMIT_CPU     CPU seconds (``cpu_s``, default: the wall-clock timeout rounded up): SIGXCPU past it
    RLIMIT_FSIZE   bytes per written file (``max_output_bytes``): stdout and stderr go to files the caller opened, so
                   endless printing ends with ``OSError: File too large`` in the code (Python ignores SIGXFSZ)
    RLIMIT_NOFILE  open files (64)
    RLIMIT_CORE    0 (no core dumps)

The caller waits at most ``timeout_s`` of wall-clock time, then kills the call (its process group, and under
``bwrap`` its control group and pid namespace). What the code does is never raised: the outcome is a
:class:`SandboxResult`. Only a sandbox that cannot START raises (:class:`SandboxError`, an OSError: the interpreter
is missing, bubblewrap failed to set up), which the episode loop turns into an ``env_error`` finish.
"""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from megatron_dppo.env import bubblewrap, cgroup

ISOLATIONS = ("bwrap", "none")
_cpu_lock = threading.Lock()
_cpu_total = [0.0]


def cpu_seconds_total() -> float:
    """CPU seconds of every sandboxed call this process made so far (where known: ``SandboxResult.cpu_s``). The
    processes of a call under bubblewrap are reaped inside its pid namespace, so they never reach this process's
    RUSAGE_CHILDREN; a CPU budget that charges tools reads this."""
    with _cpu_lock:
        return _cpu_total[0]

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
sys.path.extend({paths!r})
_started = {started_fd}
if _started is not None:  # tell the caller the code is about to run (set-up done), then close the pipe
    import os
    os.write(_started, b"1")
    os.close(_started)
    del os
del _started
with open(sys.argv[1], encoding="utf-8") as _f:
    _code = _f.read()
del _limit, resource, _f
_globals = {{"__name__": "__main__", "__builtins__": __builtins__}}
if {print_last}:  # a notebook cell: the value of a final expression is printed (its repr; None is not)
    import ast as _ast
    _tree = _ast.parse(_code, "<tool>")
    _last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], _ast.Expr) else None
    exec(compile(_tree, "<tool>", "exec"), _globals)
    if _last is not None:
        _value = eval(compile(_ast.Expression(_last.value), "<tool>", "eval"), _globals)
        if _value is not None:
            print(repr(_value))
else:
    exec(compile(_code, "<tool>", "exec"), _globals)
"""


class SandboxError(OSError):
    """The sandbox could not start the call (not something the code did)."""


class SandboxUnavailable(ValueError):
    """The requested isolation cannot be had on this machine (raised at start-up, before any episode; a ValueError
    so that the CLI prints it as one line and exits 2)."""


@dataclass
class SandboxResult:
    """stdout/stderr: decoded (UTF-8, errors replaced), at most ``max_output_bytes`` each; returncode: the exit
    status (None when killed on timeout); signal_name: the signal that ended the process (SIGKILL, SIGXCPU,
    SIGXFSZ, SIGSEGV, ...) or None; timed_out: killed after ``timeout_s``; seconds: wall-clock time;
    memory_exceeded: the call's memory limit killed a process (control group only); processes_refused: forks the
    call's process limit refused (control group only); limits: where the memory and process limits held: "cgroup"
    (the whole call), "rlimit" (each process) or "none"; cpu_s: CPU seconds of all the call's processes (control
    group with CPU accounting, or isolation=none: the interpreter's own; None where unknown)."""

    stdout: str
    stderr: str
    returncode: int | None
    signal_name: str | None
    timed_out: bool
    seconds: float
    memory_exceeded: bool = False
    processes_refused: int = 0
    limits: str = "rlimit"
    cpu_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def limits_scope(isolation: str, python: str | None = None, site_packages: bool = True) -> str:
    """Check once, before the first call, that ``isolation`` works here, and say how the call's limits will hold:
    "cgroup" (memory and processes of the whole call), "rlimit" (per process; the process count still per call)
    or "none" (``isolation: none``). Raises :class:`SandboxUnavailable` with the missing piece and the opt-out.
    ``python``: the sandbox's interpreter (None: this one); checked once per process and argument set."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"python tool isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "none":
        return "none"
    return _checked_scope(python or sys.executable, bool(site_packages))


@functools.lru_cache(maxsize=8)
def _checked_scope(python: str, site_packages: bool) -> str:
    optout = ("; to run model-written code WITHOUT isolation (it can then kill the trainer, delete checkpoints and "
              "read secrets) set env.kwargs.isolation=none explicitly")
    reason = bubblewrap.probe(python, site_packages)
    if reason is not None:
        raise SandboxUnavailable(f"the python tool's sandbox cannot start: {reason}{optout}")
    why_not = cgroup.probe()
    if why_not is None:
        return "cgroup"
    if os.geteuid() == 0:
        raise SandboxUnavailable(
            "the python tool's sandbox cannot bound the processes of a call: running as root, only a control group "
            f"can (the kernel exempts root's uid from RLIMIT_NPROC), and none can be made here: {why_not}. Run the "
            "trainer as a non-root user, or give it a writable cgroup (v2 with the memory and pids controllers "
            f"delegated, or v1 memory and pids hierarchies){optout}")
    return "rlimit"


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int | None = 512, cpu_s: int | None = None,
               max_output_bytes: int = 16384, max_processes: int | None = 32, scratch_mb: int = 64,
               isolation: str = "bwrap", site_packages: bool = True, print_last: bool = False,
               python: str | None = None) -> SandboxResult:
    """Run ``code`` under ``isolation`` (module docstring) and return what happened. ``print_last``: print the
    value of a final expression statement, as a notebook cell does (``48*97`` prints 4656)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if max_output_bytes < 1:
        raise ValueError(f"max_output_bytes must be >= 1, got {max_output_bytes}")
    if max_processes is not None and max_processes < 4 and isolation == "bwrap":
        raise ValueError(f"max_processes must be >= 4 under bwrap (its own two processes, the interpreter and one "
                         f"child), got {max_processes}")
    python = python or sys.executable
    if not os.path.isfile(os.path.realpath(python)):
        raise SandboxError(f"the sandbox's interpreter {python!r} does not exist")
    scope = limits_scope(isolation, python, site_packages)
    memory = None if memory_mb is None else int(memory_mb) * 1024 * 1024
    rlimits = {"memory": memory, "cpu": int(cpu_s) if cpu_s is not None else int(timeout_s) + 1,
               "fsize": int(max_output_bytes) + 1, "nproc": None if scope == "cgroup" else max_processes,
               "print_last": bool(print_last)}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dppo-tool-", ignore_cleanup_errors=True) as work:
        out_path, err_path = os.path.join(work, ".stdout"), os.path.join(work, ".stderr")
        code_path = os.path.join(work, ".code.py")
        with open(code_path, "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            if isolation == "none":
                timed_out, status, events = _run_unisolated(python, rlimits, code_path, work, out, err,
                                                            start + timeout_s)
            else:
                group = cgroup.CallCgroup(memory, max_processes) if scope == "cgroup" else None
                try:
                    timed_out, status = _run_bwrap(python, rlimits, site_packages, code_path, scratch_mb, out, err,
                                                   group, start + timeout_s)
                    events = group.events() if group is not None else {}
                    if group is not None:
                        events["cpu_s"] = group.cpu_seconds()
                finally:
                    if group is not None:
                        group.remove()
        stdout, stderr = _read(out_path, max_output_bytes), _read(err_path, max_output_bytes)
    if status is None:
        raise SandboxError(f"bubblewrap did not start the call: {stderr.strip() or 'no message'}")
    killed = status < 0
    if events.get("cpu_s") is not None and isolation != "none":  # (isolation=none: already in RUSAGE_CHILDREN)
        with _cpu_lock:
            _cpu_total[0] += events["cpu_s"]
    return SandboxResult(stdout=stdout, stderr=stderr, returncode=None if timed_out else status,
                         signal_name=_signal_name(-status) if killed and not timed_out else
                         ("SIGKILL" if timed_out else None),
                         timed_out=timed_out, seconds=time.monotonic() - start,
                         memory_exceeded=events.get("oom_kills", 0) > 0,
                         processes_refused=events.get("pids_refused", 0), limits=scope, cpu_s=events.get("cpu_s"))


_ENV = {"PATH": os.defpath, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}


def _run_unisolated(python, rlimits, code_path, work, out, err, deadline):
    """isolation=none: ``python -I`` in the call's temporary folder, its own process group, rlimits only."""
    prelude = _PRELUDE.format(**rlimits, paths=[], started_fd=None)
    proc = subprocess.Popen([python, "-I", "-c", prelude, code_path], stdin=subprocess.DEVNULL, stdout=out,
                            stderr=err, cwd=work, env=_ENV, start_new_session=True)
    timed_out = not _wait_unreaped(proc.pid, deadline)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # still unreaped: its group id cannot have been reused
    except (ProcessLookupError, PermissionError):
        pass
    _, status, usage = os.wait4(proc.pid, 0)  # reaped here, with the interpreter's CPU seconds
    proc.returncode = os.waitstatus_to_exitcode(status)
    return timed_out, proc.returncode, {"cpu_s": usage.ru_utime + usage.ru_stime}


def _run_bwrap(python, rlimits, site_packages, code_path, scratch_mb, out, err, group, deadline):
    """Start the call under bubblewrap, inside ``group`` before any of its code runs; wait; kill what is left.
    Returns (timed_out, exit status) where the exit status is None when bubblewrap exited without getting as far as
    the code (a set-up failure: the prelude, first thing inside, writes one byte to the ``started`` pipe and closes
    it, so the code itself cannot fake it)."""
    paths = bubblewrap.site_package_dirs() if site_packages else []
    started_r, started_w = os.pipe()
    try:
        prelude = _PRELUDE.format(**rlimits, paths=paths, started_fd=started_w)
        argv = bubblewrap.command(python, scratch_bytes=int(scratch_mb) * 1024 * 1024, extra_ro=paths,
                                  code_file=code_path, prelude=prelude)
        if group is not None:
            # The wrapper shell waits on its stdin until it has been moved into the group, then becomes bwrap:
            # every process of the call starts inside the group.
            argv = ["/bin/sh", "-c", 'read -r _ && exec "$@"', "sh"] + argv
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if group is not None else subprocess.DEVNULL,
                                stdout=out, stderr=err, env=_ENV, start_new_session=True, pass_fds=(started_w,))
    except OSError as e:
        os.close(started_r)
        raise SandboxError(f"bubblewrap could not be started: {e}") from e
    finally:
        os.close(started_w)
    with os.fdopen(started_r, "rb") as started:
        if group is not None:
            try:
                group.add(proc.pid)
            finally:
                proc.stdin.write(b"go\n")
                proc.stdin.close()
        timed_out = _wait_and_kill(proc, deadline, group)
        began = started.read(1) == b"1"
    # A call killed at its deadline before its code began (a slow start on a loaded machine) is a timeout, not a
    # set-up failure: bubblewrap's own failures end it quickly with an error of its own.
    return timed_out, _bwrap_status(proc.returncode) if began or timed_out else None


def _bwrap_status(code: int) -> int:
    """The code's exit status: bwrap reports a death by signal N as 128 + N; negated here as subprocess does (an
    exit status of 129-159 chosen by the code itself reads as that signal too)."""
    if 128 < code < 128 + 32:
        return -(code - 128)
    return code


def _wait_and_kill(proc: subprocess.Popen, deadline: float, group) -> bool:
    """Wait for the call until ``deadline``; then kill its process group (and its control group), reap it. True
    when it ran past the deadline."""
    timed_out = not _wait_unreaped(proc.pid, deadline)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if group is not None:
        group.kill()
    proc.wait()
    return timed_out


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


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit)
    return data.decode("utf-8", errors="replace")
