"""``scripts/gpu_check.sh --cpu-smoke``: the device check's stages, small and in fp32 on the CPU, so the script
that runs on the lent GPU cannot rot. Every stage must pass (its own thresholds: varlen shim == per-sequence SDPA,
Megatron THD logits == transformers for llama/qwen2/qwen3, export round trip, fp32 master weights change, the
checkpoint reloads bit-exact). ``$OUT`` (here ``--out``) keeps only the report and short logs: a device run returns
only a few small files. The resumed step's comparison is tested on its own (a GPU's backward may add in another
order)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _only_report_and_logs(out: Path) -> None:
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert "gpu_check.json" in names
    assert [n for n in names if n != "gpu_check.json" and not (n.endswith(".log") and "/" not in n)] == []
    assert all((out / n).stat().st_size <= 6000 for n in names if n.endswith(".log"))


def _run(tmp_path, *args):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_TIMEOUT="600")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--out", str(tmp_path),
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    return proc, report


def test_gpu_check_cpu_smoke_every_stage_passes(tmp_path):
    proc, report = _run(tmp_path, "--skip", "quickstart,async")  # those two stages: tests below (slow)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stages = report["stages"]
    assert list(stages) == ["environment", "dist", "varlen", "hf_parity", "train_step", "moe", "checkpoint",
                            "quickstart", "async"]
    assert {k: v["status"] for k, v in stages.items()} == {**{k: "pass" for k in stages}, "quickstart": "skip",
                                                           "async": "skip"}
    assert stages["varlen"]["module_tail_zero"] and stages["checkpoint"]["bit_exact"]
    assert stages["train_step"]["master_weights"] == "torch.float32" and stages["train_step"]["master_weights_changed"]
    assert stages["moe"]["logits_max_diff_fp32"] <= 1e-3 and stages["moe"]["master_weights_changed"]
    assert stages["train_step"]["device_dtype_audit"] == [] and stages["checkpoint"]["next_step_grad_norm_exact"]
    _only_report_and_logs(tmp_path)


@pytest.mark.slow
def test_gpu_check_cpu_smoke_quickstart_resumes(tmp_path):
    proc, report = _run(tmp_path, "--only", "quickstart")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stage = report["stages"]["quickstart"]
    assert stage["status"] == "pass" and stage["rl_steps"] == 2 and "attention sdpa" in stage["banner"]
    assert stage["logs"] == ["quickstart_run1.log", "quickstart_run2.log"]
    _only_report_and_logs(tmp_path)  # the run folder and its checkpoints stayed in the scratch folder


@pytest.mark.slow
def test_gpu_check_cpu_smoke_async_separate_placement_resumes(tmp_path):
    proc, report = _run(tmp_path, "--only", "async")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stage = report["stages"]["async"]
    assert stage["status"] == "pass", stage
    assert len(stage["staleness"]) == 4 and stage["staleness"][2] == 0 and max(stage["staleness"]) <= 1
    assert stage["kl_k3_staleness0_max"] < 1e-5  # fp32 on the CPU: the worker generated with the trainer's weights
    assert stage["logs"] == ["async_run1.log", "async_run2.log"]
    _only_report_and_logs(tmp_path)


def test_resumed_step_comparison():
    """Loss bit-exact always; the grad norm bit-exact on the CPU, within 1e-3 relative on a GPU."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_checks.train_stages import GRAD_NORM_RTOL, compare_next_step

    step = {"loss": 0.5, "grad_norm": 2.0}
    near = {"loss": 0.5, "grad_norm": 2.0 * (1 + GRAD_NORM_RTOL / 4)}
    assert compare_next_step(step, dict(step), exact_grad_norm=True)["next_step_grad_norm_exact"]
    figures = compare_next_step(step, near, exact_grad_norm=False)
    assert not figures["next_step_grad_norm_exact"] and 0 < figures["next_step_grad_norm_rel_diff"] < GRAD_NORM_RTOL
    with pytest.raises(AssertionError, match="grad norm differs after resume"):
        compare_next_step(step, near, exact_grad_norm=True)
    with pytest.raises(AssertionError, match="grad norm differs after resume"):
        compare_next_step(step, {"loss": 0.5, "grad_norm": 2.01}, exact_grad_norm=False)
    with pytest.raises(AssertionError, match="loss differs after resume: 0.5 vs 0.5000001"):
        compare_next_step(step, {"loss": 0.5000001, "grad_norm": 2.0}, exact_grad_norm=False)
