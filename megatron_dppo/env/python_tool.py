"""``python``: a code-execution tool. The assistant writes ``<python>code</python>``; each call runs in a fresh
sandbox (``env/sandbox.py``: bubblewrap namespaces and a control group per call by default) and its output comes
back as one ``tool`` message; a turn without a call ends the episode. The sandbox is checked when the tool is built
(at start-up, before step 0): a machine without bubblewrap or user namespaces stops the run there with one line
naming what is missing, unless ``isolation: none`` is set explicitly.

What the model sees per call: the standard output, then the standard error if any (a traceback is information),
each cut to ``max_output_chars``. A call past ``timeout_s`` is killed and answered ``TimeoutError: ...`` (counted
in ``tool_timeouts``); a call that exits with an error or dies from a signal (a segfault, the CPU or output limit)
is answered with what it printed plus the cause (counted in ``tool_errors``). None of this ends the episode; only
a sandbox that cannot start a call (the interpreter is missing, bubblewrap fails to set up) raises, which the
episode loop turns into an ``env_error`` finish.
"""
from __future__ import annotations

from megatron_dppo.env.protocol import Step, Task, Turn
from megatron_dppo.env.sandbox import ISOLATIONS, SandboxResult, limits_scope, run_python
from megatron_dppo.env.tool_calls import find_calls

_SIGNAL_CAUSES = {"SIGXCPU": "CPU time limit exceeded", "SIGXFSZ": "output limit exceeded",
                  "SIGSEGV": "segmentation fault", "SIGKILL": "killed", "SIGABRT": "aborted"}


def describe(result: SandboxResult, max_chars: int, timeout_s: float) -> str:
    """The observation text of one sandbox run."""
    parts = []
    if result.stdout:
        parts.append(_cut(result.stdout, max_chars))
    if result.stderr:
        parts.append(_cut(result.stderr, max_chars))
    if result.memory_exceeded:
        parts.append("MemoryError: the code's processes together exceeded the memory limit and were killed")
    elif result.processes_refused and result.returncode not in (0, None):
        parts.append("Error: the process limit was reached (a fork or thread was refused)")
    if result.timed_out:
        parts.append(f"TimeoutError: the code ran longer than {timeout_s:g} s and was stopped")
    elif result.signal_name is not None and not result.memory_exceeded:
        cause = _SIGNAL_CAUSES.get(result.signal_name, "terminated")
        parts.append(f"Error: the process died from {result.signal_name} ({cause})")
    elif result.returncode not in (0, None) and not result.stderr:
        parts.append(f"Error: exit status {result.returncode}")
    return "\n".join(parts) if parts else "(no output)"


def _cut(text: str, max_chars: int) -> str:
    text = text.rstrip("\n")
    return text if len(text) <= max_chars else text[:max_chars] + f"\n... ({len(text) - max_chars} more characters)"


class PythonToolEnv:
    """Args (``env.kwargs``): tag (call tag, "python"), role (observation role, "tool"), max_calls (calls run per
    turn), timeout_s (wall clock per call), memory_mb (memory of the whole call), cpu_s (CPU seconds per process),
    max_processes (processes and threads of the whole call at once), scratch_mb (the call's private scratch
    folder), max_output_chars (per stream in the observation), isolation ("bwrap": a security boundary, the
    default; "none": no isolation, unsafe, an explicit opt-in for machines where bubblewrap cannot run),
    site_packages (the trainer's installed packages importable, read-only; False = the standard library only),
    print_last (print the value of a final expression, as a notebook cell does: ``<python>48*97</python>`` is
    answered 4656).
    docs/environments.md says what the boundary promises and what it does not."""

    def __init__(self, tag: str = "python", role: str = "tool", max_calls: int = 2, timeout_s: float = 5.0,
                 memory_mb: int | None = 512, cpu_s: int | None = None, max_processes: int | None = 32,
                 max_output_chars: int = 2000, scratch_mb: int = 64, isolation: str = "bwrap",
                 site_packages: bool = True, print_last: bool = False):
        if role not in ("tool", "user"):
            raise ValueError(f"python tool role must be 'tool' or 'user', got {role!r}")
        if max_calls < 1 or max_output_chars < 1 or not timeout_s > 0:
            raise ValueError(f"python tool needs max_calls >= 1, max_output_chars >= 1 and timeout_s > 0, got "
                             f"{max_calls}, {max_output_chars}, {timeout_s}")
        self.tag, self.role, self.max_calls = tag, role, int(max_calls)
        self.timeout_s, self.memory_mb, self.cpu_s = float(timeout_s), memory_mb, cpu_s
        self.max_processes, self.max_output_chars = max_processes, int(max_output_chars)
        if isolation not in ISOLATIONS:
            raise ValueError(f"python tool isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if isinstance(scratch_mb, bool) or not isinstance(scratch_mb, int) or scratch_mb < 1:
            raise ValueError(f"python tool scratch_mb must be an integer >= 1, got {scratch_mb!r}")
        self.isolation, self.site_packages, self.scratch_mb = isolation, bool(site_packages), scratch_mb
        self.print_last = bool(print_last)
        find_calls("", tag)  # validates the tag
        self.limits = limits_scope(isolation, None, self.site_packages)  # once per process: refuses here, early

    def reset(self, task: Task, seed: int) -> list[dict]:
        return []

    def step(self, turn: Turn) -> Step:
        calls = find_calls(turn.text, self.tag)
        if not calls:
            return Step(done=True)
        outputs, errors, timeouts = [], 0, 0
        for i, code in enumerate(calls):
            if i >= self.max_calls:
                outputs.append(f"Error: at most {self.max_calls} code blocks run per turn")
                errors += 1
                continue
            result = run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb, cpu_s=self.cpu_s,
                                max_output_bytes=4 * self.max_output_chars + 4, max_processes=self.max_processes,
                                scratch_mb=self.scratch_mb, isolation=self.isolation,
                                site_packages=self.site_packages, print_last=self.print_last)
            outputs.append(describe(result, self.max_output_chars, self.timeout_s))
            timeouts += result.timed_out
            errors += not result.ok and not result.timed_out
        return Step(messages=[{"role": self.role, "content": "\n\n".join(outputs)}], tool_calls=len(calls),
                    tool_errors=errors, tool_timeouts=timeouts)
