"""``scripts/gpu_check.sh --cpu-smoke``: the device check's stages, small and in fp32 on the CPU, so the script
that runs on the lent GPU cannot rot. Every stage must pass (its own thresholds: varlen shim == per-sequence SDPA,
Megatron THD logits == transformers for llama/qwen2/qwen3, export round trip, fp32 master weights change, the
checkpoint reloads bit-exact)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, *args):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_TIMEOUT="600")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--out", str(tmp_path),
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    return proc, report


def test_gpu_check_cpu_smoke_every_stage_passes(tmp_path):
    proc, report = _run(tmp_path, "--skip", "quickstart")  # the quickstart stage: test below (slow)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stages = report["stages"]
    assert list(stages) == ["environment", "dist", "varlen", "hf_parity", "train_step", "moe", "checkpoint",
                            "quickstart"]
    assert {k: v["status"] for k, v in stages.items()} == {**{k: "pass" for k in stages}, "quickstart": "skip"}
    assert stages["varlen"]["module_tail_zero"] and stages["checkpoint"]["bit_exact"]
    assert stages["train_step"]["master_weights"] == "torch.float32" and stages["train_step"]["master_weights_changed"]
    assert stages["moe"]["logits_max_diff_fp32"] <= 1e-3 and stages["moe"]["master_weights_changed"]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_quickstart_resumes(tmp_path):
    proc, report = _run(tmp_path, "--only", "quickstart")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stage = report["stages"]["quickstart"]
    assert stage["status"] == "pass" and stage["rl_steps"] == 2 and "attention sdpa" in stage["banner"]
