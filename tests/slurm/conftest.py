"""Helpers for tests that submit the real sbatch scripts to a real (local) Slurm cluster.

Start one with ``.ci/slurm_cluster.sh start`` (two fake nodes n1, n2 on this host); ``.ci/slurm.sh`` does the
whole cycle. Tests marked ``slurm`` skip when no cluster answers.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONF = Path(os.environ.get("DPPO_SLURM_ROOT", "/tmp/dppo-slurm")) / "etc" / "slurm.conf"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: submits jobs to a real Slurm cluster (.ci/slurm_cluster.sh start)")


def _slurm_env() -> dict[str, str] | None:
    """The environment for Slurm commands, or None when no cluster answers."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return None
    env = dict(os.environ)
    if not env.get("SLURM_CONF") and not Path("/etc/slurm/slurm.conf").exists():
        # the local cluster of .ci/slurm_cluster.sh, if its controller runs (else sinfo would wait ~10 s)
        pid_file = DEFAULT_CONF.parent.parent / "slurmctld.pid"
        try:
            os.kill(int(pid_file.read_text()), 0)
        except (OSError, ValueError):
            return None
        env["SLURM_CONF"] = str(DEFAULT_CONF)
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%D %t"], env=env, capture_output=True, text=True, timeout=15)
    except (subprocess.SubprocessError, OSError):
        return None
    return env if out.returncode == 0 and out.stdout.strip() else None


@dataclass
class Job:
    job_id: int
    workdir: Path
    name: str

    @property
    def batch_log(self) -> Path:
        return self.workdir / "logs" / f"{self.name}-{self.job_id}.out"

    def logs(self) -> str:
        """Every log of the job (batch script, per node, per rank), in full."""
        return "\n".join(p.read_text(errors="replace") for p in sorted((self.workdir / "logs").rglob("*"))
                         if p.is_file() and self.name in str(p))

    def outputs(self, out: str = "out") -> dict[int, dict]:
        return {int(p.stem.split("-")[1]): json.loads(p.read_text())
                for p in sorted((self.workdir / out).glob("rank-*.json"))}


class SlurmCluster:
    """Submit, poll (squeue, never `sbatch --wait`: its back-off is slow), inspect."""

    TERMINAL = TERMINAL

    def __init__(self, env: dict[str, str]):
        self.env = env

    def job_env(self, **extra: str) -> dict[str, str]:
        """What a job sees: this Python's environment first on PATH, Open MPI allowed as root over TCP."""
        env = dict(self.env)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env.update({"OMPI_MCA_btl": "self,tcp", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "PYTHONUNBUFFERED": "1"})
        env.update(extra)
        return env

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=kw.pop("env", self.env), capture_output=True, text=True,
                              timeout=kw.pop("timeout", 30), check=check, **kw)

    def submit(self, workdir: Path, script_args: list[str], name: str, sbatch_args: list[str] = (),
               env: dict[str, str] | None = None) -> Job:
        (workdir / "logs").mkdir(parents=True, exist_ok=True)  # Slurm does not create --output directories
        out = self.run("sbatch", "--parsable", f"--job-name={name}", f"--output={workdir}/logs/%x-%j.out",
                       *sbatch_args, *script_args, cwd=workdir, env=env or self.job_env())
        return Job(int(out.stdout.strip().split(";")[0]), workdir, name)

    def state(self, job: Job | int) -> str:
        job_id = job.job_id if isinstance(job, Job) else job
        out = self.run("squeue", "-h", "-j", str(job_id), "--states=all", "-o", "%T", check=False)
        return out.stdout.strip()

    def wait(self, job: Job | int, timeout: float, until=TERMINAL) -> tuple[str, float]:
        """Poll squeue until the job's state is in ``until``; returns (state, seconds waited)."""
        start = time.monotonic()
        while True:
            state = self.state(job)
            if state in until:
                return state, time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"job {job} still {state or 'unknown'} after {timeout:.0f} s\n"
                                     f"{self.describe(job)}")
            time.sleep(0.5)

    def show(self, job: Job | int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, StartTime, EndTime, ...)."""
        job_id = job.job_id if isinstance(job, Job) else job
        text = self.run("scontrol", "show", "job", "-o", str(job_id), check=False).stdout
        fields = {}
        for item in text.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def describe(self, job: Job | int) -> str:
        """Everything useful for a failure message: scontrol's view and the logs."""
        lines = [str(self.show(job))]
        if isinstance(job, Job):
            for log in sorted((job.workdir / "logs").rglob("*")):
                if log.is_file() and log.stat().st_size:
                    lines.append(f"--- {log.relative_to(job.workdir)}\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(lines)


@pytest.fixture(scope="session")
def slurm() -> SlurmCluster:
    env = _slurm_env()
    if env is None:
        pytest.skip("no Slurm cluster answers `sinfo` (start one with .ci/slurm_cluster.sh start)")
    return SlurmCluster(env)
