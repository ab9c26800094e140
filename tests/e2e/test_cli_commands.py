"""The other subcommands on a finished tiny run: eval (pass@1/pass@k of the latest checkpoint), bench (time per
phase), convert megatron-to-hf (the run's checkpoint root -> an HF folder transformers loads), --help-config."""
from __future__ import annotations

import json
import subprocess

import pytest
from _e2e_helpers import PY, REPO, env, free_port, run_cli, tiny_config, write_config

pytestmark = [pytest.mark.slow]


def _cli(*args, timeout=600):
    proc = subprocess.run([PY, "-m", "megatron_dppo.cli", *args], cwd=REPO, env=env(MASTER_PORT=str(free_port())),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_eval_bench_convert_on_a_trained_run(tmp_path):
    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", tiny_config(out, train={"steps": 2, "sft_steps": 0},
                                                             eval={"every": 0}))
    run_cli(config)

    proc = _cli("eval", "--config", str(config))
    assert "resuming step_00000002" in proc.stdout and "eval/arithmetic_test/pass@2" in proc.stdout
    result = json.loads((out / "eval.json").read_text())
    assert result["rl_step"] == 2 and 0.0 <= result["eval/arithmetic_test/pass@1"] <= 1.0

    proc = _cli("bench", "--config", str(config), "--steps", "2")
    assert "median over 2 RL steps" in proc.stdout and "time/train" in proc.stdout

    hf_out = tmp_path / "hf"
    _cli("convert", "megatron-to-hf", str(out / "checkpoints"), str(hf_out))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(hf_out, local_files_only=True)
    ids = torch.tensor([tok("7+5=")["input_ids"]])
    assert torch.isfinite(model(ids).logits).all()

    proc = _cli("train", "--help-config")
    assert "algo.r_q: float = 0.5" in proc.stdout and "packing.capacity" in proc.stdout
