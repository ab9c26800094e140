"""One control group per sandboxed call: the memory and process limits of the whole call, not of each process.

rlimits bound each process: four processes of 250 MB each fit under a 512 MB ``RLIMIT_AS``, and ``RLIMIT_NPROC``
counts every process of the user (and is not enforced at all for root, even inside a user namespace, because
the sandbox's uid maps to the host's root). A control group bounds the call as one thing: every process the call
starts (children, daemons, a fork bomb) is in it, ``memory`` caps their resident memory together (tmpfs pages of
the scratch folder included), ``pids`` caps how many exist at once.

Two layouts, found from ``/proc/self/mounts`` and ``/proc/self/cgroup``:
- cgroup v2 (unified): a child of this process's own group, with ``memory.max``, ``memory.swap.max`` = 0 and
  ``pids.max``; needs the ``memory`` and ``pids`` controllers enabled for children (``cgroup.subtree_control``),
  which a systemd-delegated or container-delegated group usually has.
- cgroup v1 (the legacy or hybrid layout of many clusters' nodes): one child in the ``memory`` hierarchy
  (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes`` where swap accounting exists) and one in ``pids``.

Where neither can be created (not root and not delegated, a read-only ``/sys/fs/cgroup``), :func:`probe` says why;
the sandbox then falls back to rlimits or refuses (env/sandbox.py decides). Groups are named
``dppo-tool-<pid>-<n>`` and removed after each call; :func:`probe` also removes empty ones left by a trainer that
was killed mid-call.
"""
from __future__ import annotations

import functools
import itertools
import os
import re
import signal
import time

_PREFIX = "dppo-tool-"
_counter = itertools.count()


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, options) of every cgroup mount."""
    out = []
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                    out.append((parts[1].replace("\\040", " "), parts[2], set(parts[3].split(","))))
    except OSError:
        pass
    return out


def _own_paths() -> dict[str, str]:
    """This process's group in each hierarchy: {"": v2 path, "memory": v1 path, "pids": v1 path, ...}."""
    paths: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for name in controllers.split(",") if controllers else [""]:
                    paths[name.removeprefix("name=")] = path
    except OSError:
        pass
    return paths


@functools.lru_cache(maxsize=1)
def _parent_dirs() -> tuple[str, dict[str, str]] | str:
    """("v1" | "v2", {controller: the directory new groups are made in}) or the reason there is none. On v1 the
    ``cpuacct`` hierarchy is used too where it is mounted (the call's CPU seconds; optional). Read once per process
    (the mounts and the trainer's own group do not change under it), not once per call."""
    mounts, own = _mounts(), _own_paths()
    v1 = {}
    for controller in ("memory", "pids", "cpuacct"):
        point = next((m for m, kind, opts in mounts if kind == "cgroup" and controller in opts), None)
        if point is not None and controller in own:
            v1[controller] = point + own[controller].rstrip("/")
    if "memory" in v1 and "pids" in v1:
        return "v1", v1
    point = next((m for m, kind, _ in mounts if kind == "cgroup2"), None)
    if point is not None and "" in own:
        base = point + own[""].rstrip("/")
        try:
            with open(os.path.join(base, "cgroup.subtree_control"), encoding="utf-8") as f:
                enabled = set(f.read().split())
        except OSError as e:
            return f"cannot read {base}/cgroup.subtree_control ({e.strerror})"
        missing = {"memory", "pids"} - enabled
        if missing:
            return (f"the cgroup v2 group {base} does not delegate the {' and '.join(sorted(missing))} controller(s) "
                    "to its children (cgroup.subtree_control)")
        return "v2", {"memory": base, "pids": base, "cpuacct": base}
    if v1:
        return f"only the {', '.join(v1)} cgroup v1 hierarchy is mounted (memory and pids are both needed)"
    return "no cgroup hierarchy with the memory and pids controllers is mounted"


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


def _read_int_fields(path: str) -> dict[str, int]:
    out = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if value.strip().lstrip("-").isdigit():
                    out[key] = int(value)
    except OSError:
        pass
    return out


class CallCgroup:
    """The control group(s) of one call: create, :meth:`add` the call's first process (before it runs any code),
    :meth:`kill` everything in it, read :meth:`events`, :meth:`remove`. Raises OSError where the host refuses."""

    def __init__(self, memory_bytes: int | None, max_pids: int | None):
        found = _parent_dirs()
        if isinstance(found, str):
            raise OSError(found)
        self.layout, parents = found
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.dirs: dict[str, str] = {}
        try:
            for controller in parents:
                path = os.path.join(parents[controller], name)
                if path not in self.dirs.values():
                    os.mkdir(path, 0o755)
                self.dirs[controller] = path
            self._limit(memory_bytes, max_pids)
        except OSError:
            self.remove()
            raise

    def _limit(self, memory_bytes: int | None, max_pids: int | None) -> None:
        mem, pids = self.dirs["memory"], self.dirs["pids"]
        if self.layout == "v2":
            if memory_bytes is not None:
                _write(os.path.join(mem, "memory.max"), str(memory_bytes))
                if os.path.exists(os.path.join(mem, "memory.swap.max")):
                    _write(os.path.join(mem, "memory.swap.max"), "0")
            if max_pids is not None:
                _write(os.path.join(pids, "pids.max"), str(max_pids))
            return
        if memory_bytes is not None:
            _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
            memsw = os.path.join(mem, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # swap accounting: memory + swap together, so the call cannot page out
                _write(memsw, str(memory_bytes))
        if max_pids is not None:
            _write(os.path.join(pids, "pids.max"), str(max_pids))

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and so everything it starts afterwards) into the group(s)."""
        for path in dict.fromkeys(self.dirs.values()):
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def pids(self) -> list[int]:
        out: set[int] = set()
        for path in dict.fromkeys(self.dirs.values()):
            try:
                with open(os.path.join(path, "cgroup.procs"), encoding="ascii") as f:
                    out.update(int(x) for x in f.read().split())
            except OSError:
                pass
        return sorted(out)

    def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the group until it is empty (``cgroup.kill`` on v2; a loop on v1, where a
        process may fork while the list is read: the pids limit bounds how long that can go on)."""
        kill_file = os.path.join(self.dirs["pids"], "cgroup.kill")
        if self.layout == "v2" and os.path.exists(kill_file):
            try:
                _write(kill_file, "1")
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while (members := self.pids()) and time.monotonic() < deadline:
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.005)

    def cpu_seconds(self) -> float | None:
        """CPU seconds used by every process of the call (v2 ``cpu.stat``, v1 ``cpuacct.usage``); None where the
        host gives no CPU accounting. The call's processes are not the caller's children once bubblewrap's pid
        namespace reaps them, so the caller's RUSAGE_CHILDREN does not see this."""
        if "cpuacct" not in self.dirs:
            return None
        if self.layout == "v2":
            usec = _read_int_fields(os.path.join(self.dirs["cpuacct"], "cpu.stat")).get("usage_usec")
            return None if usec is None else usec / 1e6
        try:
            with open(os.path.join(self.dirs["cpuacct"], "cpuacct.usage"), encoding="ascii") as f:
                return int(f.read().strip()) / 1e9
        except (OSError, ValueError):
            return None

    def events(self) -> dict[str, int]:
        """{"oom_kills": processes the memory limit killed, "memory_hits": times the limit was reached,
        "pids_refused": forks the process limit refused}."""
        mem, pids = self.dirs["memory"], self.dirs["pids"]
        pid_events = _read_int_fields(os.path.join(pids, "pids.events"))
        if self.layout == "v2":
            events = _read_int_fields(os.path.join(mem, "memory.events"))
            return {"oom_kills": events.get("oom_kill", 0), "memory_hits": events.get("max", 0),
                    "pids_refused": pid_events.get("max", 0)}
        oom = _read_int_fields(os.path.join(mem, "memory.oom_control"))
        try:
            with open(os.path.join(mem, "memory.failcnt"), encoding="ascii") as f:
                hits = int(f.read().strip() or 0)
        except (OSError, ValueError):
            hits = 0
        return {"oom_kills": oom.get("oom_kill", 0), "memory_hits": hits, "pids_refused": pid_events.get("max", 0)}

    def remove(self) -> None:
        """Remove the (emptied) group(s); a group that still has a process is retried briefly, then left."""
        for path in dict.fromkeys(self.dirs.values()):
            for _ in range(200):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)
        self.dirs = {k: v for k, v in self.dirs.items() if os.path.isdir(v)}


def probe() -> str | None:
    """None when a per-call group can be made here (one is made and removed to be sure), else the reason. Also
    removes empty ``dppo-tool-*`` groups whose trainer process is gone."""
    found = _parent_dirs()
    if isinstance(found, str):
        return found
    _, parents = found
    for parent in set(parents.values()):
        _remove_stale(parent)
    try:
        group = CallCgroup(64 * 1024 * 1024, 8)
    except OSError as e:
        return f"cannot create a control group under {', '.join(sorted(set(parents.values())))}: {e}"
    group.remove()
    return None


def _remove_stale(parent: str) -> None:
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match = re.fullmatch(re.escape(_PREFIX) + r"(\d+)-\d+", name)
        if match is None or int(match.group(1)) == os.getpid() or os.path.exists(f"/proc/{match.group(1)}"):
            continue
        try:
            os.rmdir(os.path.join(parent, name))
        except OSError:
            pass
