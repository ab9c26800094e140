"""Who am I in the job? Rank, world size and rendezvous address from the launcher's environment.

Supported launchers, checked in this order:

- ``torchrun`` (and ``srun ... torchrun``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT`` are set by torchrun itself.
- Slurm ``srun`` with one task per GPU: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
  ``SLURM_NTASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE``; ``MASTER_ADDR`` is the first host of
  ``SLURM_JOB_NODELIST`` (expanded with ``scontrol show hostnames`` when available), ``MASTER_PORT`` is derived
  from ``SLURM_JOB_ID`` so concurrent jobs on one node do not collide.
- ``mpirun`` / ``srun --mpi=pmix``: OpenMPI (``OMPI_COMM_WORLD_*``), PMI/PMIx (``PMI_RANK``, ``PMIX_RANK``,
  ``PMI_SIZE``), MPICH/Hydra (``PMI_RANK``/``PMI_SIZE``, ``MPI_LOCALRANKID``), or mpi4py when installed.
  ``MASTER_ADDR`` must be exported by the job script (or is the local host for a single-node job).

``discover_launch`` also exports the torch.distributed variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) so that ``init_process_group(init_method="env://")`` works unchanged.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass

DEFAULT_PORT = 29500


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


def _int_env(env, *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as err:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from err
    return None


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``gpu[01-03,07],login1`` into host names.

    Uses ``scontrol show hostnames`` when it is on PATH (the authoritative expansion), else a parser for the
    common bracket syntax.
    """
    if not nodelist:
        return []
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=10, check=True).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    hosts: list[str] = []
    # split on commas that are not inside brackets
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return hosts


def slurm_master_port(job_id: int | None) -> int:
    """A port derived from the job id, in [20000, 40000), so that two jobs sharing a node do not collide."""
    if job_id is None:
        return DEFAULT_PORT
    return 20000 + job_id % 20000


def _slurm_tasks_per_node(env) -> int | None:
    n = _int_env(env, "SLURM_NTASKS_PER_NODE")
    if n is not None:
        return n
    spec = env.get("SLURM_TASKS_PER_NODE", "")  # e.g. "2(x3),1"
    match = re.match(r"(\d+)", spec)
    return int(match.group(1)) if match else None


def _mpi_rank_size(env) -> tuple[int, int, int | None, int | None] | None:
    rank = _int_env(env, "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
    size = _int_env(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
    local_rank = _int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK")
    local_size = _int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE")
    if rank is not None and size is None:
        try:  # PMIx does not always export the size; ask MPI itself when mpi4py is there
            from mpi4py import MPI  # type: ignore

            size = MPI.COMM_WORLD.Get_size()
        except ImportError:
            size = None
    if rank is None or size is None:
        return None
    return rank, size, local_rank, local_size


def discover_launch(env=None, export: bool = True) -> LaunchInfo:
    """Read rank, world size and rendezvous address from the launcher's environment.

    ``env`` defaults to ``os.environ``; with ``export`` the torch.distributed ``env://`` variables are set.
    Raises ``ValueError`` when the environment is inconsistent (e.g. a rank outside the world).
    """
    env = os.environ if env is None else env

    if env.get("TORCHELASTIC_RUN_ID") is not None or (
        env.get("RANK") is not None and env.get("WORLD_SIZE") is not None
    ):
        info = LaunchInfo(
            rank=_int_env(env, "RANK") or 0,
            world_size=_int_env(env, "WORLD_SIZE") or 1,
            local_rank=_int_env(env, "LOCAL_RANK") or 0,
            local_world_size=_int_env(env, "LOCAL_WORLD_SIZE") or 1,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_env(env, "MASTER_PORT") or DEFAULT_PORT,
            launcher="torchrun",
        )
    elif env.get("SLURM_PROCID") is not None and env.get("SLURM_NTASKS") is not None and (
        env.get("SLURM_STEP_ID") is not None or env.get("SLURM_STEPID") is not None
    ):
        job_id = _int_env(env, "SLURM_JOB_ID", "SLURM_JOBID")
        master = env.get("MASTER_ADDR")
        if not master:
            hosts = expand_slurm_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
            master = hosts[0] if hosts else "127.0.0.1"
        info = LaunchInfo(
            rank=_int_env(env, "SLURM_PROCID") or 0,
            world_size=_int_env(env, "SLURM_NTASKS") or 1,
            local_rank=_int_env(env, "SLURM_LOCALID") or 0,
            local_world_size=_slurm_tasks_per_node(env) or 1,
            master_addr=master,
            master_port=_int_env(env, "MASTER_PORT") or slurm_master_port(job_id),
            launcher="slurm",
        )
    elif (mpi := _mpi_rank_size(env)) is not None:
        rank, size, local_rank, local_size = mpi
        info = LaunchInfo(
            rank=rank,
            world_size=size,
            local_rank=local_rank if local_rank is not None else 0,
            local_world_size=local_size if local_size is not None else 1,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_env(env, "MASTER_PORT") or DEFAULT_PORT,
            launcher="mpi",
        )
    else:
        info = LaunchInfo(0, 1, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"),
                          _int_env(env, "MASTER_PORT") or DEFAULT_PORT, "single")

    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"rank {info.rank} is outside the world of size {info.world_size} "
                         f"(launcher {info.launcher}); valid ranks are 0..{info.world_size - 1}")
    if not 0 <= info.local_rank < max(info.local_world_size, 1) and info.local_world_size > 0:
        raise ValueError(f"local rank {info.local_rank} is outside the node's {info.local_world_size} processes")
    if export:
        env.update({
            "RANK": str(info.rank), "WORLD_SIZE": str(info.world_size), "LOCAL_RANK": str(info.local_rank),
            "LOCAL_WORLD_SIZE": str(info.local_world_size), "MASTER_ADDR": info.master_addr,
            "MASTER_PORT": str(info.master_port),
        })
    return info


def expected_world_size(env=None) -> int | None:
    """The world size the job scheduler promised, when it says (Slurm job or step task count)."""
    env = os.environ if env is None else env
    return _int_env(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")


def check_single_world(info: LaunchInfo, env=None) -> None:
    """Fail fast when a launch produced N separate worlds of size 1 instead of one world of size N.

    Typical cause: ``srun --mpi=none python train.py`` with an MPI-flavoured launch, or ``srun`` without
    ``torchrun`` where the environment says ``WORLD_SIZE=1``. Each process would otherwise train alone, silently.
    """
    env = os.environ if env is None else env
    expected = expected_world_size(env)
    launched_by_torchrun = info.launcher == "torchrun" and env.get("TORCHELASTIC_RUN_ID") is not None
    if launched_by_torchrun:
        return  # torchrun builds its own world (nnodes x nproc-per-node); Slurm's task count is per node
    if info.world_size == 1 and expected is not None and expected > 1:
        raise RuntimeError(
            f"this process sees a world of size 1, but Slurm started {expected} tasks "
            f"(SLURM_NTASKS={expected}): the launch created {expected} separate worlds. Launch with "
            f"`srun python -m ...` (one task per GPU; rank from SLURM_PROCID), `srun --mpi=pmix` for MPI, "
            f"or `srun torchrun --nnodes ... --nproc-per-node ...` with one task per node.")


def free_port() -> int:
    """An unused TCP port on this host (for tests and single-node runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
