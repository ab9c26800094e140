"""The command line of one sandboxed call under bubblewrap (``bwrap``), and the start-up check that it works here.

bubblewrap is the unprivileged sandbox of Flatpak and of several coding agents' command sandboxes: a small C
program that sets up Linux namespaces and then executes one command inside them. What each flag buys:

    --unshare-all --unshare-user   new user, pid, network, IPC, UTS and cgroup namespaces: the code sees only its
                                   own processes (it is pid 2 under bwrap's init), only a loopback interface that
                                   leads nowhere, and no host uid (it runs as 65534 inside)
    --disable-userns               no further user namespace inside (closes the usual route to new capabilities)
    --cap-drop ALL                 no capabilities, whoever started the trainer
    --die-with-parent              the sandbox dies with the process that started it; when bwrap's init dies, the
                                   kernel kills every process of the pid namespace (double-forked daemons too)
    --new-session                  a new session: the code cannot push input into the trainer's terminal
    --ro-bind                      read-only views of the interpreter, its libraries and (``site_packages``) the
                                   trainer's installed packages, at the same paths; nothing else of the host (no
                                   repository, run folder, checkpoints, data, home, /etc, /sys)
    --proc /proc --dev /dev        a /proc of the new pid namespace only (no /proc/<trainer>/environ or /mem) and a
                                   minimal /dev (null, zero, random, urandom, tty)
    --size N --tmpfs /tmp          a private scratch folder of at most N bytes, the working directory, gone with the
                                   call
    --clearenv --setenv ...        a minimal environment (no secrets of the trainer's environment)
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig

SANDBOX_UID = 65534  # "nobody": the uid the code runs as inside its user namespace
CODE_PATH = "/run/tool/code.py"  # where the call's code is mounted (read-only) inside the sandbox
SCRATCH = "/tmp"
_ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


def _interpreter_dirs(python: str) -> list[str]:
    """Folders outside /usr the interpreter needs: its real executable's prefix and the base prefix (stdlib)."""
    real = os.path.realpath(python)
    dirs = [os.path.dirname(os.path.dirname(real))]
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        dirs.append(os.path.realpath(sys.base_prefix))
    return [d for d in dict.fromkeys(dirs) if not _under(d, "/usr") and d != "/"]


def site_package_dirs() -> list[str]:
    """The trainer's installed packages (its venv or prefix): mounted read-only and put on the code's sys.path
    when ``site_packages`` is on, so the code can import numpy or sympy as it could before."""
    paths = sysconfig.get_paths()
    return [p for p in dict.fromkeys(os.path.realpath(paths[k]) for k in ("purelib", "platlib")) if os.path.isdir(p)]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def command(python: str, *, scratch_bytes: int, extra_ro: list[str], code_file: str, prelude: str) -> list[str]:
    """The full ``bwrap ... python -I -c <prelude> /run/tool/code.py`` argument list of one call."""
    bwrap = find_bwrap()
    if bwrap is None:
        raise FileNotFoundError("bwrap (bubblewrap) is not installed")
    argv = [bwrap, "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--disable-userns", "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr"]
    for name in _ROOT_LINKS:
        path = "/" + name
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in dict.fromkeys(_interpreter_dirs(python) + list(extra_ro)):
        argv += ["--ro-bind", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(int(scratch_bytes)), "--tmpfs", SCRATCH,
             "--dir", "/run/tool", "--ro-bind", code_file, CODE_PATH, "--chdir", SCRATCH,
             "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", SCRATCH,
             "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONIOENCODING", "utf-8", "--setenv", "OMP_NUM_THREADS",
             "1"]
    return argv + ["--", os.path.realpath(python), "-I", "-c", prelude, CODE_PATH]


@functools.lru_cache(maxsize=8)
def probe(python: str, site_packages: bool) -> str | None:
    """None when a sandboxed interpreter starts here with every flag of :func:`command`, else why not (one
    sentence naming the missing piece). Run once per process and interpreter, before the first episode."""
    if find_bwrap() is None:
        return ("bubblewrap is not installed (no `bwrap` on PATH): install it (Debian/Ubuntu: apt-get install "
                "bubblewrap; RHEL/Fedora: dnf install bubblewrap)")
    import tempfile
    with tempfile.TemporaryDirectory(prefix="dppo-probe-") as work:
        code = os.path.join(work, "code.py")
        with open(code, "w", encoding="utf-8") as f:
            f.write("print('ok')\n")
        extra = site_package_dirs() if site_packages else []
        argv = command(python, scratch_bytes=1 << 20, extra_ro=extra, code_file=code,
                       prelude="import runpy, sys; runpy.run_path(sys.argv[1])")
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                                  env={"PATH": os.defpath})
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bubblewrap could not be run ({e})"
    if done.returncode == 0 and done.stdout.strip() == b"ok":
        return None
    err = done.stderr.decode("utf-8", "replace").strip().splitlines()
    reason = err[-1] if err else f"exit status {done.returncode}"
    if "namespace" in reason.lower() or "permission" in reason.lower() or "operation not permitted" in reason.lower():
        reason += (" (user namespaces look disabled or restricted here: sysctl user.max_user_namespaces, "
                   "kernel.unprivileged_userns_clone or an AppArmor/seccomp policy such as Docker's default one)")
    elif "unknown option" in reason.lower():
        reason += " (bubblewrap >= 0.8 is needed for --disable-userns and --size)"
    return f"bubblewrap cannot start a sandboxed interpreter: {reason}"
