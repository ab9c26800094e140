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


def test_gpu_check_cpu_smoke_runs_the_bf16_training_stages(tmp_path):
    """--dtype bfloat16: the device's bf16 training stages on the CPU: bf16 parameters placed, fp32 master weights
    that change, the checkpoint reloads every training-state tensor bit-exact and the next step is exact."""
    proc, report = _run(tmp_path, "--only", "dist,train_step,checkpoint", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stages = report["stages"]
    assert report["dtype"] == "bfloat16"
    assert {k: stages[k]["status"] for k in ("dist", "train_step", "checkpoint")} == dict.fromkeys(
        ("dist", "train_step", "checkpoint"), "pass")
    step = stages["train_step"]
    assert step["dtype"] == "torch.bfloat16" and step["device_dtype_audit"] == []
    assert step["master_weights"] == "torch.float32" and step["master_weights_changed"]
    assert stages["checkpoint"]["bit_exact"] and stages["checkpoint"]["next_step_grad_norm_exact"]
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


def _gpu_checks():
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_checks.attention_stage as attention
    import gpu_checks.env_stages as env_stages
    import gpu_checks.harness as harness

    return attention, env_stages, harness


def test_module_level_varlen_tolerance_follows_the_gradient_scale():
    """bf16 at |g| ~ 18 moves in steps of 0.125: two kernels one rounding step apart fail an absolute 5e-2 and
    pass the relative limit; a real error of 1.0 at that scale still fails it; fp32 on the CPU keeps 1e-5."""
    import torch

    attention, _, _ = _gpu_checks()
    exact = torch.tensor([18.06, 0.5, -3.0])
    one_order = exact.to(torch.bfloat16).float()  # 18.0
    other_order = (exact + torch.tensor([0.01, 0.0, 0.0])).to(torch.bfloat16).float()  # 18.125: the next step
    diff = (one_order - other_order).abs().max().item()
    assert diff == 0.125 and diff > 5e-2  # what the old absolute limit rejected
    eps = torch.finfo(torch.bfloat16).eps
    limit = attention.module_limit(one_order.abs().max().item(), eps, floor=5e-2)
    assert diff <= limit < 1.0
    assert attention.module_limit(0.01, eps, floor=5e-2) == 5e-2  # never tighter than before
    assert attention.module_limit(1.0, torch.finfo(torch.float32).eps, floor=1e-5) == 1e-5


def test_a_stage_that_kills_the_process_stays_in_the_report(tmp_path):
    """A stage that ends the process (os._exit: as a CUDA abort or SIGKILL would) is recorded as crashed before it
    ran; SIGTERM (the time limit) during a stage is recorded with the signal and stops the run."""
    import signal

    driver = f"""
import os, signal, sys, time
from pathlib import Path
sys.path.insert(0, {str(REPO / 'scripts')!r})
import gpu_check
from gpu_checks.harness import Check
check = Check(True, Path(sys.argv[1]), Path(sys.argv[1]))
check.run("first", lambda: {{"figure": 1}})
if sys.argv[2] == "exit":
    check.run("dies", lambda: os._exit(3))
signal.signal(signal.SIGTERM, gpu_check._stop)
def terminated():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
try:
    check.run("terminated", terminated)
except gpu_check.Stop:
    sys.exit(143)
"""
    for how, code, stage in (("exit", 3, "dies"), ("sigterm", 128 + signal.SIGTERM, "terminated")):
        out = tmp_path / how
        proc = subprocess.run([sys.executable, "-c", driver, str(out), how], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == code, proc.stderr
        stages = json.loads((out / "gpu_check.json").read_text())["stages"]
        assert list(stages) == ["first", stage] and stages["first"]["status"] == "pass"
        assert stages[stage]["status"] == "crashed"
        if how == "exit":
            assert "ended during this stage without a Python exception" in stages[stage]["error"]
        else:
            assert stages[stage]["error"] == "Stop: stopped by signal SIGTERM (the time limit?)"


def test_compute_mode_is_read_and_exclusive_mode_skips_multi_process_stages(tmp_path):
    _, env_stages, harness = _gpu_checks()
    rows = env_stages.parse_compute_modes("0, 00000000:17:00.0, Default\n1, 00000000:65:00.0, Exclusive_Process\n")
    assert rows[1] == {"index": 1, "pci_bus_id": "00000000:65:00.0", "compute_mode": "Exclusive_Process"}
    assert env_stages.compute_mode_of(rows, "1") == "Exclusive_Process"
    assert env_stages.compute_mode_of(rows, "0,1") == "Default"
    assert env_stages.compute_mode_of(rows, "GPU-8f2a") is None  # a UUID among several GPUs: unknown
    assert env_stages.compute_mode_of(rows[:1], None) == "Default"
    check = harness.Check(False, tmp_path, tmp_path)
    check.need_shared_gpu("two processes")  # unknown mode: the stage runs
    check.compute_mode = "Exclusive_Process"
    with pytest.raises(harness.Skip, match="compute mode is Exclusive_Process: two processes on it"):
        check.need_shared_gpu("two processes")
