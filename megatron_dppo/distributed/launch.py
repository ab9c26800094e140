"""Who am I in the job? Rank, world size and rendezvous address from the launcher's environment.

Launchers, checked in this order (the first that matches wins):

1. ``torchrun`` (also ``srun ... torchrun``): ``TORCHELASTIC_RUN_ID`` is set and torchrun exports ``RANK``,
   ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` itself.
2. MPI: ``mpirun``/``mpiexec`` (Open MPI ``OMPI_COMM_WORLD_*``, MPICH/Hydra ``PMI_RANK``/``PMI_SIZE``/
   ``MPI_LOCALRANKID``) and Slurm direct launch ``srun --mpi=pmix`` (``PMIX_RANK``) or ``--mpi=pmi2``
   (``PMI_RANK``/``PMI_SIZE``). MPI comes BEFORE Slurm: ``mpirun`` inside an allocation starts its daemons with
   ``srun`` (one task per node), so its ranks inherit that daemon step's ``SLURM_PROCID``/``SLURM_NTASKS`` (the
   node index and the node count; measured with Open MPI 4.1 on Slurm 22.05), which are NOT the MPI rank/size.
3. Slurm ``srun`` with one task per GPU: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``,
   ``SLURM_GTIDS``, only inside a job step (``SLURM_STEP_ID`` set). The batch script itself (Slurm 22.05: it has
   ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS`` but no ``SLURM_STEP_ID``) is not a rank of the job: a process
   started there is treated as a single process, and :func:`check_single_world` rejects it when the job asked for
   more tasks.
4. ``RANK``/``WORLD_SIZE`` already exported (a manual ``env://`` launch, or a previous ``discover_launch``).
5. A single process.

``MASTER_ADDR`` under Slurm is the first host of the step's node list (``scontrol show hostnames``), and
``MASTER_PORT`` is derived from ``SLURM_JOB_ID`` (:func:`slurm_master_port`, the same formula as
``slurm/train.sbatch``) so that concurrent jobs on one node do not collide; exported values always win.

``discover_launch`` exports the torch.distributed variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) so that ``init_process_group(init_method="env://")`` works
unchanged, plus ``DPPO_LAUNCHER`` so that a second call reports the same launcher.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

DEFAULT_PORT = 29500
LAUNCHERS = ("torchrun", "slurm", "mpi", "single")


class LaunchError(ValueError):
    """The launch environment is inconsistent or would silently train N separate models."""


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "slurm" | "mpi" | "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(env: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set and non-empty, as an int (``None`` when none is set)."""
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as err:
                raise LaunchError(f"environment variable {name}={value!r} is not an integer") from err
    return None


# ----------------------------------------------------------------------------------------------- Slurm helpers
def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def parse_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compact host list syntax without Slurm: ``gpu[01-03,07],login1`` -> 4 + 1 hosts.

    Zero padding follows the lower bound (``n[08-10]`` -> ``n08 n09 n10``); several bracket groups in one name
    (``rack[1-2]-n[1-2]``) expand as a cartesian product, in Slurm's order. Raises :class:`LaunchError` on
    unbalanced brackets or a bad range.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_host_pattern(part))
    return hosts


def _expand_host_pattern(pattern: str) -> list[str]:
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise LaunchError(f"unbalanced ']' in Slurm node list {pattern!r}")
        return [pattern]
    close_at = pattern.find("]", open_at)
    if close_at < 0:
        raise LaunchError(f"unbalanced '[' in Slurm node list {pattern!r}")
    prefix, ranges, rest = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    items: list[str] = []
    for item in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match:
            raise LaunchError(f"bad range {item!r} in Slurm node list {pattern!r}; expected N or N-M")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise LaunchError(f"descending range {item!r} in Slurm node list {pattern!r}")
        items.extend(f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    suffixes = _expand_host_pattern(rest) if rest else [""]
    return [f"{prefix}{item}{suffix}" for item in items for suffix in suffixes]


def expand_slurm_nodelist(nodelist: str, use_scontrol: bool = True) -> list[str]:
    """Expand a Slurm node list such as ``gpu[01-03,07],login1`` into host names.

    Uses ``scontrol show hostnames`` when it is on PATH (the authoritative expansion; it needs no controller),
    else :func:`parse_slurm_nodelist`.
    """
    if not nodelist:
        return []
    if use_scontrol and shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=10, check=True).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    return parse_slurm_nodelist(nodelist)


def slurm_master_port(job_id: int | None) -> int:
    """``20000 + job_id % 20000``: a port in [20000, 40000) that differs between concurrent jobs.

    ``slurm/train.sbatch`` computes the same number in bash. ``None`` (no job) gives :data:`DEFAULT_PORT`.
    """
    if job_id is None:
        return DEFAULT_PORT
    return 20000 + job_id % 20000


def parse_slurm_tasks_per_node(spec: str) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (Slurm's ``SLURM_*TASKS_PER_NODE`` syntax)."""
    counts: list[int] = []
    for item in _split_top_level(spec):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise LaunchError(f"cannot parse tasks-per-node item {item!r} in {spec!r}; expected N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    return env.get("SLURM_STEP_ID") not in (None, "") or env.get("SLURM_STEPID") not in (None, "")


def _slurm_local_world_size(env: Mapping[str, str]) -> int | None:
    """Tasks of this step on this node: ``SLURM_GTIDS`` (global ids on this node) when set, else the step's
    tasks-per-node list at ``SLURM_NODEID`` (valid when the step spans the whole allocation)."""
    gtids = env.get("SLURM_GTIDS", "")
    if gtids:
        return len([g for g in gtids.split(",") if g])
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    if spec:
        counts = parse_slurm_tasks_per_node(spec)
        node = _int_env(env, "SLURM_NODEID")
        if len(set(counts)) == 1:
            return counts[0]
        if (node is not None and node < len(counts)
                and len(counts) == _int_env(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")):
            return counts[node]
    return _int_env(env, "SLURM_NTASKS_PER_NODE")


def _slurm_master_addr(env: Mapping[str, str]) -> str | None:
    hosts = expand_slurm_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                  or env.get("SLURM_NODELIST") or "")
    return hosts[0] if hosts else None


def _slurm_port(env: Mapping[str, str]) -> int:
    port = _int_env(env, "MASTER_PORT")
    return port if port is not None else slurm_master_port(_int_env(env, "SLURM_JOB_ID", "SLURM_JOBID"))


# --------------------------------------------------------------------------------------------- per launcher
def _from_torchrun(env: Mapping[str, str]) -> LaunchInfo | None:
    if env.get("TORCHELASTIC_RUN_ID") is None:
        return None
    rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
    if rank is None or world is None:
        raise LaunchError("TORCHELASTIC_RUN_ID is set but RANK/WORLD_SIZE are not: not a torchrun worker?")
    return LaunchInfo(rank, world, _int_env(env, "LOCAL_RANK") or 0, _int_env(env, "LOCAL_WORLD_SIZE") or 1,
                      env.get("MASTER_ADDR") or "127.0.0.1", _int_env(env, "MASTER_PORT") or DEFAULT_PORT,
                      "torchrun")


def _from_slurm(env: Mapping[str, str]) -> LaunchInfo | None:
    if env.get("SLURM_PROCID") in (None, "") or not _in_slurm_step(env):
        return None
    world = _int_env(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if world is None:
        raise LaunchError("SLURM_PROCID is set inside a job step but neither SLURM_STEP_NUM_TASKS nor "
                          "SLURM_NTASKS is")
    return LaunchInfo(
        rank=_int_env(env, "SLURM_PROCID") or 0,
        world_size=world,
        local_rank=_int_env(env, "SLURM_LOCALID") or 0,
        local_world_size=_slurm_local_world_size(env) or 1,
        master_addr=env.get("MASTER_ADDR") or _slurm_master_addr(env) or "127.0.0.1",
        master_port=_slurm_port(env),
        launcher="slurm",
    )


def _mpi4py_world() -> tuple[int, int, str]:
    """(rank, size, rank 0's host name) from mpi4py; importing ``mpi4py.MPI`` initializes MPI."""
    from mpi4py import MPI  # type: ignore[import-not-found]

    comm = MPI.COMM_WORLD
    return comm.Get_rank(), comm.Get_size(), comm.bcast(socket.gethostname(), root=0)


def _from_mpi(env: Mapping[str, str], use_mpi4py: bool) -> LaunchInfo | None:
    rank = _int_env(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    if rank is None:
        return None
    size = _int_env(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    local_rank = _int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
    local_size = _int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    # Direct launch by srun (--mpi=pmix exports PMIX_RANK only, --mpi=pmi2 PMI_RANK/PMI_SIZE): the step's Slurm
    # variables describe the same world. Under mpirun they describe mpirun's daemon step and disagree.
    slurm = _from_slurm(env)
    direct = slurm is not None and slurm.rank == rank and (size is None or size == slurm.world_size)
    if direct:
        size = slurm.world_size
        local_rank = slurm.local_rank if local_rank is None else local_rank
        local_size = slurm.local_world_size if local_size is None else local_size
    mpi_master = None
    if size is None:
        if not use_mpi4py:
            raise LaunchError(f"MPI rank {rank} is set (PMIX_RANK) but no world size is: launch with srun "
                              f"--mpi=pmix inside a Slurm job, with mpirun, or install mpi4py")
        try:
            mpi_rank, size, mpi_master = _mpi4py_world()
        except (ImportError, RuntimeError, OSError) as err:  # no mpi4py, or no MPI library for it to load
            raise LaunchError(f"MPI rank {rank} is set (PMIX_RANK) but no world size is, and mpi4py cannot "
                              f"ask MPI ({err})") from err
        if mpi_rank != rank:
            raise LaunchError(f"MPI says rank {mpi_rank} but the environment says rank {rank}")
    master = env.get("MASTER_ADDR") or (slurm.master_addr if direct else None) or mpi_master
    if not master and use_mpi4py and size > 1:
        try:
            master = _mpi4py_world()[2]  # rank 0's host: authoritative whatever the mapping
        except (ImportError, RuntimeError, OSError):
            master = None
    if not master and env.get("SLURM_JOB_NODELIST"):
        master = _slurm_master_addr(env)  # mpirun fills the allocation's first node first
    if not master:
        if local_size is not None and local_size == size:
            master = "127.0.0.1"
        else:
            raise LaunchError(f"MPI launch of {size} ranks over several hosts without MASTER_ADDR: export it "
                              f"(mpirun -x MASTER_ADDR=<rank 0 host>) or install mpi4py")
    port = _int_env(env, "MASTER_PORT")
    if port is None:
        port = _slurm_port(env) if env.get("SLURM_JOB_ID") else DEFAULT_PORT
    return LaunchInfo(rank, size, local_rank or 0, local_size or 1, master, port, "mpi")


def _from_env(env: Mapping[str, str]) -> LaunchInfo | None:
    rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
    if rank is None or world is None:
        return None
    launcher = env.get("DPPO_LAUNCHER", "torchrun")
    return LaunchInfo(rank, world, _int_env(env, "LOCAL_RANK") or 0, _int_env(env, "LOCAL_WORLD_SIZE") or 1,
                      env.get("MASTER_ADDR") or "127.0.0.1", _int_env(env, "MASTER_PORT") or DEFAULT_PORT,
                      launcher if launcher in LAUNCHERS else "torchrun")


def discover_launch(env: MutableMapping[str, str] | None = None, export: bool = True,
                    use_mpi4py: bool | None = None) -> LaunchInfo:
    """Read rank, world size and rendezvous address from the launcher's environment (module docstring).

    ``env`` defaults to ``os.environ``; with ``export`` the torch.distributed ``env://`` variables are written
    back into it. ``use_mpi4py`` (default: only when ``env`` is ``os.environ``) allows asking MPI itself for
    the world size / rank 0's host when the environment does not say; importing mpi4py initializes MPI.
    Raises :class:`LaunchError` (a ``ValueError``) when the environment is inconsistent.
    """
    env = os.environ if env is None else env
    if use_mpi4py is None:
        use_mpi4py = env is os.environ
    info = (_from_torchrun(env) or _from_mpi(env, use_mpi4py) or _from_slurm(env) or _from_env(env)
            or LaunchInfo(0, 1, 0, 1, env.get("MASTER_ADDR") or "127.0.0.1",
                          _int_env(env, "MASTER_PORT") or DEFAULT_PORT, "single"))

    if info.world_size < 1 or not 0 <= info.rank < info.world_size:
        raise LaunchError(f"rank {info.rank} is outside the world of size {info.world_size} "
                          f"(launcher {info.launcher}); valid ranks are 0..{info.world_size - 1}")
    if not 1 <= info.local_world_size <= info.world_size or not 0 <= info.local_rank < info.local_world_size:
        raise LaunchError(f"local rank {info.local_rank} of {info.local_world_size} processes on this node is "
                          f"impossible in a world of {info.world_size} (launcher {info.launcher})")
    if not 0 < info.master_port < 65536:
        raise LaunchError(f"MASTER_PORT={info.master_port} is not a TCP port (1..65535)")
    if export:
        env.update({
            "RANK": str(info.rank), "WORLD_SIZE": str(info.world_size), "LOCAL_RANK": str(info.local_rank),
            "LOCAL_WORLD_SIZE": str(info.local_world_size), "MASTER_ADDR": info.master_addr,
            "MASTER_PORT": str(info.master_port), "DPPO_LAUNCHER": info.launcher,
        })
    return info


def expected_world_size(env: Mapping[str, str] | None = None) -> int | None:
    """The task count Slurm promised: the step's inside ``srun``, the job's in the batch script or salloc."""
    env = os.environ if env is None else env
    if _in_slurm_step(env):
        return _int_env(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    return _int_env(env, "SLURM_NTASKS", "SLURM_NPROCS")


def check_single_world(info: LaunchInfo, env: Mapping[str, str] | None = None) -> None:
    """Fail fast when a launch produced N separate worlds instead of one world spanning all processes.

    Caught here, before any process group exists (each process would otherwise train its own model, silently):

    - a process started in the batch script itself, or in an ``salloc`` shell, of a job that asked for N > 1
      tasks (it is alone: the other N - 1 tasks were never started; use ``srun``);
    - ``srun -N M torchrun --standalone ...`` (or any torchrun without a shared rendezvous): each of the M agents
      builds its own world of its ``--nproc-per-node`` workers;
    - MPI already initialized (``mpi4py.MPI`` imported) with a world that differs from the one discovered, e.g.
      ``srun --mpi=none`` giving every MPI process a singleton world.
    """
    env = os.environ if env is None else env
    expected = expected_world_size(env)
    if info.launcher == "torchrun" and env.get("TORCHELASTIC_RUN_ID") is not None:
        agents = expected if _in_slurm_step(env) else None
        if agents is not None and agents > 1 and info.world_size <= info.local_world_size:
            raise LaunchError(
                f"srun started {agents} torchrun agents (SLURM_STEP_NUM_TASKS={agents}) but this world has only "
                f"the {info.world_size} local worker(s): every agent built its own world. Give torchrun one "
                f"rendezvous: --nnodes={agents} --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT "
                f"--rdzv-id=$SLURM_JOB_ID (not --standalone).")
        return  # torchrun builds its own world (nnodes x nproc-per-node); Slurm's task count is per agent
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi_size = mpi.COMM_WORLD.Get_size()
        if mpi_size != info.world_size:
            raise LaunchError(
                f"MPI's world has {mpi_size} process(es) but the launch says {info.world_size} "
                f"(launcher {info.launcher}): with srun use --mpi=pmix (Open MPI) so MPI joins Slurm's step.")
    if info.world_size == 1 and expected is not None and expected > 1:
        where = "this srun step" if _in_slurm_step(env) else "this job (the batch script / salloc shell)"
        raise LaunchError(
            f"this process sees a world of size 1, but {where} has {expected} tasks (SLURM_NTASKS={expected}): "
            f"the launch would create {expected} separate worlds or leave {expected - 1} tasks unstarted. Launch "
            f"with `srun python -m ...` (one task per GPU; rank from SLURM_PROCID), `srun --mpi=pmix` for MPI, or "
            f"`srun torchrun --nnodes ... --nproc-per-node ...` with one task per node.")


STOP_FILE_ENV = "DPPO_STOP_FILE"


def stop_requested(env: Mapping[str, str] | None = None) -> bool:
    """Has the job script asked this run to checkpoint and stop? True when the file ``$DPPO_STOP_FILE`` exists.

    ``slurm/train.sbatch`` creates that file when Slurm warns of the time limit (``--signal=B:USR1@<s>``, or
    ``scancel --signal=USR1 --batch``), then requeues the job once the ranks have exited. It does not signal the
    ranks: a signal sent to a job step reaches every process of the step and kills those without a handler (the
    trainer's own helpers survive it: checkpoints are written in-process, reward workers run in sessions of
    their own; a user's program started from a reward function may not). Ranks may see the file at different steps
    (network file systems cache attributes), so call this on every rank at a step boundary and agree collectively
    (all-reduce MAX) before checkpointing and exiting with status 0.
    """
    env = os.environ if env is None else env
    path = env.get(STOP_FILE_ENV)
    return bool(path) and os.path.exists(path)


def free_port() -> int:
    """An unused TCP port on this host (for tests and single-node runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------- process lifetime
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_AT_IMPORT = os.getppid()  # the launcher, read as early as possible (it may legitimately be pid 1)


def die_with_parent(expected_parent: int | None = None, sig: int | None = None) -> bool:
    """Ask Linux to send this process ``sig`` (default SIGKILL) when its parent dies (``prctl(PR_SET_PDEATHSIG)``
    through ctypes). Returns False where that is not available (not Linux, no libc).

    A parent that died before the call is not covered by the kernel (the process was already re-parented), so
    the process kills itself with ``sig`` when its parent is no longer ``expected_parent`` (default: the parent
    when this module was imported). The kernel signals when the parent *thread* that forked the
    process exits; torchrun, srun and the reward-worker pool start their children from their main thread.
    """
    import ctypes
    import ctypes.util
    import signal

    sig = signal.SIGKILL if sig is None else sig
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != (PARENT_AT_IMPORT if expected_parent is None else expected_parent):
        os.kill(os.getpid(), sig)  # the parent is already gone
    return True


def bind_to_launcher(info: LaunchInfo, env: Mapping[str, str] | None = None) -> bool:
    """Make a torchrun worker die (SIGKILL) with its torchrun agent.

    torchrun starts every worker in a session of its own (``start_new_session``), so a SIGKILLed agent (OOM
    killer, ``kill -9``, a node agent that gives up) leaves its workers training and writing checkpoints with
    nobody to stop them. SIGKILL, not SIGTERM: without the agent the other ranks are going away too, and a
    checkpoint would wait in a collective for ranks that no longer exist; the last completed checkpoint stays.
    Slurm's step daemon and MPI's daemons kill their tasks themselves; a single process started from a shell is
    left alone (``nohup`` users expect it to outlive the shell). Returns True when the binding is in place.
    """
    env = os.environ if env is None else env
    if info.launcher != "torchrun" or env.get("TORCHELASTIC_RUN_ID") is None:
        return False
    return die_with_parent()
