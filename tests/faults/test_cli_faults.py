"""Fault injection against the real CLI: signals to whole process groups, SIGKILL of the trainer and of torchrun,
SIGKILL at each point of a checkpoint's commit, damaged checkpoints, a lost ``latest`` pointer, torn metrics, a
full disk, and a second run into a busy output folder.

Every case ends either in a resumable state whose resumed run equals the straight run (every logged metric
except wall-clock times, every tensor of the final checkpoint) or in one ``error:`` line; no recorded metric is
ever lost (a file cut back to the resume point is first kept as ``metrics.jsonl.<time>.bak``)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from _e2e_helpers import (
    PY,
    REPO,
    checkpoint_tensors,
    env,
    free_port,
    latest_checkpoint,
    read_metrics,
    stable_metrics,
    tiny_config,
    write_config,
)
from _tmpfs import small_tmpfs

pytestmark = [pytest.mark.slow]

KILL_AT = str(Path(__file__).resolve().parent / "_kill_at.py")
# 4 warm-start steps and 6 RL steps, a checkpoint every 2 of each: saves #1 warm-start 2, #2 RL 2, #3 RL 4, #4 final
SECTIONS = dict(train={"steps": 6, "sft_steps": 4}, eval={"every": 0}, checkpoint={"every": 2, "keep_last": 10})


def _config(out: Path, **extra) -> Path:
    sections = {k: dict(v) for k, v in SECTIONS.items()}
    for k, v in extra.items():
        sections.setdefault(k, {}).update(v)
    return write_config(out.parent / f"{out.name}.yaml", tiny_config(out, **sections))


def _start(config: Path, *, nproc: int = 1, kill_at: tuple[str, int] | None = None, log: Path) -> subprocess.Popen:
    """The CLI in a process group of its own (like a job step), output to ``log``."""
    if nproc > 1:
        cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", "-m", "megatron_dppo.cli"]
    elif kill_at is not None:
        cmd = [PY, KILL_AT, kill_at[0], str(kill_at[1])]
    else:
        cmd = [PY, "-m", "megatron_dppo.cli"]
    with open(log, "w") as f:
        return subprocess.Popen([*cmd, "train", "--config", str(config)], cwd=REPO, start_new_session=True,
                                env=env(MASTER_PORT=str(free_port())), stdout=f, stderr=subprocess.STDOUT)


def _run(config: Path, log: Path, **kw) -> tuple[int, str]:
    proc = _start(config, log=log, **kw)
    proc.wait(timeout=900)
    return proc.returncode, log.read_text()


def _wait_until(predicate, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"exited {proc.returncode} before the awaited point"
        time.sleep(0.1)
    raise AssertionError("timed out")


def _rl_steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text(errors="replace").count('"phase": "rl"') if path.exists() else 0


def _descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def _gone(pids: list[int], seconds: float = 15) -> list[int]:
    """The pids of ``pids`` still alive (not zombies) after waiting up to ``seconds``."""
    import psutil

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + seconds
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def _assert_equals_straight(out: Path, straight: Path) -> None:
    assert stable_metrics(read_metrics(out)) == stable_metrics(read_metrics(straight))
    a, b = checkpoint_tensors(latest_checkpoint(straight)), checkpoint_tensors(latest_checkpoint(out))
    assert a.keys() == b.keys() and not [k for k in a if not torch.equal(a[k], b[k])]


def _all_recorded_lines(out: Path) -> set[str]:
    """Every metrics line ever written in ``out``: the current file and the copies kept beside it."""
    lines = set()
    for path in [out / "metrics.jsonl", *out.glob("metrics.jsonl.*.bak")]:
        lines |= {ln for ln in path.read_bytes().decode("utf-8", "replace").splitlines() if ln.strip()}
    return lines


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    code, log = _run(_config(out), out.parent / "log")
    assert code == 0, log[-4000:]
    return out


def _clone(straight: Path, out: Path) -> Path:
    """A copy of the finished straight run under ``out`` (and its config): the state a damaged run starts from."""
    shutil.copytree(straight, out)
    return _config(out)


# ---------------------------------------------------------------------------------------------- signals
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_to_the_process_group_checkpoints_and_resumes(tmp_path, straight, sig):
    """scancel / preemption / systemd / `timeout` signal the whole process group. Expected: the step finishes,
    a checkpoint is written, exit 128 + signal; the same command resumes to the straight run's end.
    Before the fix the dist-checkpoint writer's helper processes died with the group: exit 1, BrokenPipeError."""
    out = tmp_path / "run"
    config = _config(out)
    proc = _start(config, log=tmp_path / "log")
    _wait_until(lambda: _rl_steps_logged(out) >= 1, proc)
    os.killpg(proc.pid, sig)
    proc.wait(timeout=600)
    log = (tmp_path / "log").read_text()
    assert proc.returncode == 128 + sig, log[-4000:]
    assert f"stopped by {signal.Signals(sig).name}" in log and "BrokenPipeError" not in log
    code, log = _run(config, tmp_path / "resume.log")
    assert code == 0 and "resumed from" in log, log[-4000:]
    _assert_equals_straight(out, straight)


@pytest.mark.multiproc
def test_sigterm_to_torchrun_process_group(tmp_path):
    """torchrun forwards the SIGTERM to its workers (in sessions of their own); both ranks checkpoint together
    and exit 143. torchrun itself then exits 1 (its SignalException; torchrun's behaviour, not the trainer's)."""
    out = tmp_path / "run"
    proc = _start(_config(out, train={"steps": 500}), nproc=2, log=tmp_path / "log")
    _wait_until(lambda: _rl_steps_logged(out) >= 1, proc)
    workers = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=600)
    log = (tmp_path / "log").read_text()
    assert "stopped by SIGTERM" in log and "BrokenPipeError" not in log, log[-4000:]
    assert proc.returncode != 0 and not _gone(workers)
    from megatron_dppo.megatron.checkpoint import verify_checkpoint
    assert verify_checkpoint(latest_checkpoint(out)) == []


# ---------------------------------------------------------------------------------------------- SIGKILL
@pytest.mark.multiproc
def test_sigkilled_torchrun_takes_its_workers_along(tmp_path):
    """Also: while it runs, a second run into the same output folder is refused, naming rank 0's pid."""
    out = tmp_path / "run"
    config = _config(out, train={"steps": 100000})
    proc = _start(config, nproc=2, log=tmp_path / "log")
    _wait_until(lambda: _rl_steps_logged(out) >= 1, proc)
    workers = _descendants(proc.pid)
    assert len(workers) >= 2
    code, log = _run(config, tmp_path / "second.log")
    holder = int(log.split("in use by another run (pid ")[1].split()[0]) if "in use by another run" in log else None
    assert code == 2 and holder in workers and log.count("error:") == 1, log[-3000:]
    proc.kill()
    proc.wait()
    assert not _gone(workers, seconds=10), "workers kept running without their launcher"
    steps = _rl_steps_logged(out)
    time.sleep(3)
    assert _rl_steps_logged(out) == steps  # nothing trains on


def test_sigkilled_trainer_leaves_no_process_and_resumes(tmp_path, straight):
    """Reward workers in processes (reward.isolation=process): after kill -9 of the trainer nothing is left
    running (no Manager, no resource tracker, no reward worker), and the run resumes to the straight end."""
    out = tmp_path / "run"
    config = _config(out, reward={"isolation": "process", "num_workers": 2})
    proc = _start(config, log=tmp_path / "log")
    _wait_until(lambda: _rl_steps_logged(out) >= 1, proc)
    children = _descendants(proc.pid)
    assert len(children) >= 2  # the reward workers
    proc.kill()
    proc.wait()
    assert not _gone(children), "processes outlived the SIGKILLed trainer"
    before = _all_recorded_lines(out)
    code, log = _run(config, tmp_path / "resume.log")
    assert code == 0 and "resumed from" in log, log[-4000:]
    _assert_equals_straight(out, straight)
    assert before <= _all_recorded_lines(out)  # no line written before the kill is lost


@pytest.mark.parametrize("point,nth", [("latest", 1), ("manifest", 3), ("rename", 3), ("latest", 3)],
                         ids=["warm-start-save-before-latest", "before-manifest", "before-rename", "before-latest"])
def test_sigkill_during_checkpoint_commit(tmp_path, straight, point, nth):
    """kill -9 at each point of a save's commit: the next start takes the newest complete checkpoint (repairing
    the interrupted rename), and the resumed run equals the straight run."""
    out = tmp_path / "run"
    config = _config(out)
    code, log = _run(config, tmp_path / "log", kill_at=(point, nth))
    assert code == -signal.SIGKILL and f"SIGKILL at {point} of save {nth}" in log, log[-4000:]
    before = _all_recorded_lines(out)
    code, log = _run(config, tmp_path / "resume.log")
    assert code == 0 and "resumed from" in log, log[-4000:]
    if nth == 1:
        assert "warm-start step 2, RL step 0" in log  # the warm start's own checkpoint
    _assert_equals_straight(out, straight)
    assert before <= _all_recorded_lines(out)


ASIDE_SCRIPT = """
import os, shutil, signal, sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from _dist import single_process_world
import _engine_fixtures as F
from megatron_dppo.algo.losses import LossConfig
from megatron_dppo.megatron.checkpoint import save_checkpoint
from megatron_dppo.megatron.parallel import ParallelConfig
from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine

root = Path(sys.argv[1])
with single_process_world(seed=F.SEED):
    engine = PolicyEngine(F.tiny_arch(num_layers=2), ParallelConfig(), OptimConfig(lr=1e-3),
                          LossConfig(kl_coef=0.0).resolved())
    for step in (5, 7):
        engine.step = step
        save_checkpoint(engine, root)
    shutil.copytree(root / "step_00000007", root.parent / "old-copy")
    with torch.no_grad():
        next(engine.modules[0].parameters()).add_(1.0)
    real_rename = Path.rename
    def rename(self, target):
        result = real_rename(self, target)
        if Path(target).name.startswith(".tmp-old-"):
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    Path.rename = rename
    save_checkpoint(engine, root)  # step 7 again: the old copy is moved aside, then SIGKILL
"""


def test_sigterm_during_a_checkpoint_step_writes_it_once(tmp_path, straight):
    """SIGTERM while the RL-2 checkpoint is being written: that checkpoint is the stop's checkpoint; it used to
    be written a second time (through the replace-in-place path). Exit 143; the resumed run equals straight."""
    out = tmp_path / "run"
    config = _config(out)
    code, log = _run(config, tmp_path / "log", kill_at=("sigterm", 2))
    assert code == 128 + signal.SIGTERM and "stopped by SIGTERM" in log, log[-4000:]
    saves = [line.split(": ")[1] for line in log.splitlines() if line.startswith("[kill_at] save ")]
    assert len(saves) == 2 and len(set(saves)) == 2, saves
    code, log = _run(config, tmp_path / "resume.log")
    assert code == 0 and "RL step 2)" in log, log[-4000:]
    _assert_equals_straight(out, straight)


def test_sigkill_between_moving_aside_and_renaming(tmp_path):
    """The replace-in-place path (a step saved again; the trainer no longer does it on a signal, but a step that
    updates nothing keeps the engine's step): kill -9 right after the old copy was moved aside. The next start
    renames the complete new copy into place, with a warning, instead of refusing to start."""
    from megatron_dppo.megatron.checkpoint import find_resume_checkpoint, verify_checkpoint

    root = tmp_path / "checkpoints"
    proc = subprocess.run([PY, "-c", ASIDE_SCRIPT, str(root), str(REPO / "tests" / "megatron")], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert not (root / "step_00000007").exists() and (root / ".tmp-old-step_00000007").is_dir()
    found = find_resume_checkpoint(root)
    assert found == root / "step_00000007" and verify_checkpoint(found) == []
    assert (found / "manifest.json").read_text() != (tmp_path / "old-copy" / "manifest.json").read_text()  # new
    assert not list(root.glob(".tmp-*"))


# ---------------------------------------------------------------------------------------------- damaged state
def _flip_a_bit(ckpt: Path) -> None:
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["bit-flip", "truncated"])  # (a deleted common.pt: test_checkpoint_faults)
def test_damaged_final_checkpoint_falls_back(tmp_path, straight, damage):
    out = tmp_path / "run"
    config = _clone(straight, out)
    final = latest_checkpoint(out)
    if damage == "bit-flip":
        _flip_a_bit(final)
    elif damage == "no-common.pt":
        (final / "common.pt").unlink()
    else:
        shard = max(final.glob("*.distcp"), key=lambda p: p.stat().st_size)
        os.truncate(shard, shard.stat().st_size // 2)
    before = _all_recorded_lines(out)
    code, log = _run(config, tmp_path / "log")
    assert code == 0, log[-4000:]
    assert f"skipped: {final.name}" in log and "RL step 4)" in log, log[-4000:]
    _assert_equals_straight(out, straight)
    assert before <= _all_recorded_lines(out)


def test_no_usable_checkpoint_is_one_error_and_changes_nothing(tmp_path, straight):
    out = tmp_path / "run"
    config = _clone(straight, out)
    for ckpt in (out / "checkpoints").glob("step_*"):
        (ckpt / "common.pt").unlink()
    metrics = (out / "metrics.jsonl").read_bytes()
    code, log = _run(config, tmp_path / "log")
    assert code == 2 and "error: no usable checkpoint under" in log and "Traceback" not in log, log[-4000:]
    assert (out / "metrics.jsonl").read_bytes() == metrics and not list(out.glob("*.bak"))


def test_lost_latest_pointer_keeps_every_metric(tmp_path, straight):
    """The issue's case: `latest` deleted made the run start over and cut metrics.jsonl from 11 lines to 1."""
    out = tmp_path / "run"
    config = _clone(straight, out)
    (out / "checkpoints" / "latest").unlink()
    metrics = (out / "metrics.jsonl").read_bytes()
    code, log = _run(config, tmp_path / "log")
    assert code == 0 and "nothing to do" in log and "latest is missing" in log, log[-4000:]
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_lost_pointer_and_final_checkpoint_resume_keeps_a_copy(tmp_path, straight):
    out = tmp_path / "run"
    config = _clone(straight, out)
    (out / "checkpoints" / "latest").unlink()
    shutil.rmtree(out / "checkpoints" / latest_checkpoint(straight).name)  # the newest is gone too: RL 4 is next
    before = _all_recorded_lines(out)
    code, log = _run(config, tmp_path / "log")
    assert code == 0 and "RL step 4)" in log, log[-4000:]
    _assert_equals_straight(out, straight)
    assert before <= _all_recorded_lines(out) and list(out.glob("metrics.jsonl.*.bak"))


def test_torn_non_utf8_metrics_line_does_not_stop_the_resume(tmp_path, straight):
    out = tmp_path / "run"
    config = _clone(straight, out)
    shutil.rmtree(out / "checkpoints" / latest_checkpoint(straight).name)  # a crash before the final save ...
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 6, "phase": "rl", "reward/mean": 0.\xff\xfe')  # ... in the middle of a line
    original = (out / "metrics.jsonl").read_bytes()
    code, log = _run(config, tmp_path / "log")
    assert code == 0 and "unreadable line" in log, log[-4000:]
    _assert_equals_straight(out, straight)
    assert any(p.read_bytes() == original for p in out.glob("metrics.jsonl.*.bak"))


# ---------------------------------------------------------------------------------------------- disk full
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (test_checkpoint_faults injects "
                                              "ENOSPC without it)")
def test_disk_full_is_one_error_naming_the_file_system(tmp_path, straight):
    """checkpoint.dir on a tmpfs that holds the warm-start checkpoint and part of the next one."""
    size = sum(p.stat().st_size for p in latest_checkpoint(straight).rglob("*") if p.is_file())
    with small_tmpfs(tmp_path / "small", size * 3 // 2) as mnt:
        out = tmp_path / "run"
        code, log = _run(_config(out, checkpoint={"dir": str(mnt)}), tmp_path / "log")
        assert code == 1 and f"error: disk full: no space left on the file system of {mnt}" in log, log[-4000:]
        assert "Traceback" not in log and "unexpected pos" not in log
        from megatron_dppo.megatron.checkpoint import find_resume_checkpoint, verify_checkpoint
        kept = find_resume_checkpoint(mnt)
        assert kept is not None and verify_checkpoint(kept) == [] and not list(mnt.glob(".tmp-*"))
