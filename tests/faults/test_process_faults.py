"""Fault injection at the process and file level, without a model (fast): a parent killed with SIGKILL takes its
child along, SIGHUP stops a run like SIGTERM, a second run cannot take a locked output folder, and a metrics
file with torn lines or later steps than the resume point is repaired without losing a byte."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by its new parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""
CHILD = """
import sys, time
from megatron_dppo.distributed.launch import die_with_parent
assert die_with_parent()
open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w").close()
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("bound", [True, False])
def test_child_dies_with_its_sigkilled_parent(bound):
    """The mechanism behind torchrun workers (launch.bind_to_launcher) and reward workers: a child in a session
    of its own (as torchrun and the reward pool start them) survives a SIGKILLed parent unless bound."""
    child_code = CHILD if bound else "import time; time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, child_code], stdout=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    child = int(parent.stdout.readline())
    time.sleep(1.5 if bound else 0.2)  # let the child reach prctl
    try:
        parent.kill()
        parent.wait()
        assert _wait_gone(child) == bound
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_bind_to_launcher_only_binds_torchrun_workers():
    from megatron_dppo.distributed.launch import LaunchInfo, bind_to_launcher

    single = LaunchInfo(0, 1, 0, 1, "127.0.0.1", 29500, "single")
    slurm = LaunchInfo(0, 2, 0, 2, "127.0.0.1", 29500, "slurm")
    assert not bind_to_launcher(single, {}) and not bind_to_launcher(slurm, {"SLURM_PROCID": "0"})


def test_sighup_stops_like_sigterm():
    from megatron_dppo.run.lifecycle import StopSignals

    # a terminal's SIGHUP (default action), whatever pytest inherited: under `nohup` SIGHUP is ignored and stays
    # ignored by design (the next test)
    inherited = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
            assert stop.received == signal.SIGHUP and stop.poll() == signal.SIGHUP
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, inherited)


def test_nohup_keeps_ignoring_sighup():
    from megatron_dppo.run.lifecycle import StopSignals

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_second_run_cannot_take_a_locked_output_folder(tmp_path):
    from megatron_dppo.run.lifecycle import lock_output_dir

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom megatron_dppo.run.lifecycle import "
                               "lock_output_dir\nlock_output_dir(sys.argv[1])\nprint('locked', flush=True)\n"
                               "time.sleep(600)", str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        import socket
        with pytest.raises(ValueError, match=rf"{tmp_path} is in use by another run \(pid {holder.pid} on host "
                                             rf"{socket.gethostname()}, started .*train.output_dir"):
            lock_output_dir(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock = lock_output_dir(tmp_path)  # the kernel released the killed holder's lock: no stale lock
    assert f"pid {os.getpid()} " in (tmp_path / ".lock").read_text()
    assert lock_output_dir(tmp_path) is not None  # the same process may take its own folder again
    lock.release()


# ---------------------------------------------------------------------------------------------- metrics.jsonl
def _records(n: int, phase: str = "rl") -> list[str]:
    return [json.dumps({"step": s, "phase": phase, "reward/mean": s / 10}) for s in range(n)]


def test_torn_non_utf8_line_is_skipped_and_kept(tmp_path):
    from megatron_dppo.run.metrics import MetricsSink, read_jsonl

    path = tmp_path / "metrics.jsonl"
    lines = _records(4)
    original = ("\n".join(lines[:2]) + "\n").encode() + b'{"step": 2, "phase": "rl", "rew\xff\xfe\n' + \
        ("\n".join(lines[2:]) + "\n").encode()
    path.write_bytes(original)
    with pytest.warns(UserWarning, match="unreadable"):
        assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 3]
    sink = MetricsSink(tmp_path, enabled=True, tensorboard=False)
    with pytest.warns(UserWarning, match=r"1 unreadable line\(s\) .*kept as .*metrics\.jsonl\..*\.bak"):
        sink.open(resume_key=(1, 3))
    sink.close()
    assert path.read_text().splitlines() == lines[:3]
    backups = list(tmp_path.glob("metrics.jsonl.*.bak"))
    assert len(backups) == 1 and backups[0].read_bytes() == original  # not a byte lost


@pytest.mark.parametrize("resume_key", [(1, 0), None], ids=["resumed-at-step-0", "fresh-start"])
def test_dropping_later_steps_keeps_a_copy(tmp_path, resume_key):
    """Resuming earlier than the file goes (e.g. `latest` lost, then found an older checkpoint) or starting fresh
    over an old file: the file is cut to the resume point, and the original is kept beside it."""
    from megatron_dppo.run.metrics import MetricsSink

    path = tmp_path / "metrics.jsonl"
    original = "\n".join(_records(2, "sft") + _records(11)) + "\n"
    path.write_text(original)
    sink = MetricsSink(tmp_path, enabled=True, tensorboard=False)
    with pytest.warns(UserWarning, match="later steps than the resume point"):
        sink.open(resume_key=resume_key)
    sink.close()
    assert path.read_text().splitlines() == (_records(2, "sft") if resume_key else [])
    (backup,) = tmp_path.glob("metrics.jsonl.*.bak")
    assert backup.read_text() == original


def test_nothing_dropped_no_copy(tmp_path):
    from megatron_dppo.run.metrics import MetricsSink

    (tmp_path / "metrics.jsonl").write_text("\n".join(_records(3)) + "\n")
    sink = MetricsSink(tmp_path, enabled=True, tensorboard=False)
    sink.open(resume_key=(1, 3))
    sink.close()
    assert not list(tmp_path.glob("*.bak")) and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
