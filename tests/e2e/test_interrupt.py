"""Ctrl-C (SIGINT) or a scheduler's SIGTERM mid-run: the current step finishes, a checkpoint is written, the exit
status is 128 + signal; running the same command again resumes and ends exactly where a straight run ends."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch
from _e2e_helpers import (
    PY,
    REPO,
    checkpoint_tensors,
    env,
    free_port,
    latest_checkpoint,
    read_metrics,
    run_cli,
    stable_metrics,
    tiny_config,
    write_config,
)

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_leaves_a_resumable_checkpoint(tmp_path, sig):
    sections = dict(train={"steps": 6, "sft_steps": 0}, eval={"every": 0}, checkpoint={"every": 0})
    straight = tmp_path / "straight"
    run_cli(write_config(tmp_path / "straight.yaml", tiny_config(straight, **sections)))

    out = tmp_path / "interrupted"
    config = write_config(tmp_path / "interrupted.yaml", tiny_config(out, **sections))
    cmd = [PY, "-m", "megatron_dppo.cli", "train", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(MASTER_PORT=str(free_port())), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # wait for the first RL step to be logged
        if (out / "metrics.jsonl").exists() and '"phase": "rl"' in (out / "metrics.jsonl").read_text():
            break
        time.sleep(0.2)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, (proc.returncode, stderr[-3000:])
    assert f"stopped by {signal.Signals(sig).name}" in stdout
    done = [r["step"] for r in read_metrics(out) if r["phase"] == "rl"]
    assert 1 <= len(done) < 6 and (out / "checkpoints" / "latest").is_file()

    proc2 = run_cli(config)  # the same command again
    assert f"RL step {len(done)}" in proc2.stdout
    assert stable_metrics(read_metrics(out)) == stable_metrics(read_metrics(straight))
    a, b = checkpoint_tensors(latest_checkpoint(straight)), checkpoint_tensors(latest_checkpoint(out))
    assert not [k for k in a if not torch.equal(a[k], b[k])]
