"""A short DPPO run on a tiny Mistral and a tiny Phi-3 policy whose sliding window (3 keys) is shorter than every
prompt plus completion: the `train` command builds it (the window on the Megatron side, MistralForCausalLM /
Phi3ForCausalLM on the HF rollout side, weights pushed every step), it really trains, and a resume from a
checkpoint gives the straight run's metrics and final checkpoint bit for bit. A refused family stops `train` (and
`convert`) with its name and reason."""
from __future__ import annotations

import shutil

import pytest
import torch
from _e2e_helpers import (
    checkpoint_tensors,
    latest_checkpoint,
    read_metrics,
    run_cli,
    stable_metrics,
    tiny_config,
    write_config,
)

TINY_MISTRAL = {
    "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "sliding_window": 3,
    "tie_word_embeddings": True, "rope_theta": 10000.0,
}


# Phi-3: fused projections, partial rotary (half of each head's channels), the window on every layer
TINY_PHI3 = {**TINY_MISTRAL, "model_type": "phi3", "partial_rotary_factor": 0.5, "tie_word_embeddings": False}
MODELS = {"mistral": TINY_MISTRAL, "phi3": TINY_PHI3}


def _config(out, model=TINY_MISTRAL, **extra):
    return tiny_config(out, model={"hf_config": dict(model), "tokenizer": "train-sentencepiece"},
                       train={"steps": 2, "sft_steps": 1}, checkpoint={"every": 1}, eval={"every": 0}, **extra)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_sliding_window_rl_step_and_resume(tmp_path, family):
    straight = tmp_path / "straight"
    proc = run_cli(write_config(tmp_path / "run.yaml", _config(straight, MODELS[family])))
    assert family in proc.stdout
    records = read_metrics(straight)
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    assert all(r["train/grad_norm"] > 0 and r["train/update_ok"] == 1.0 for r in rl)
    steps = sorted(p.name for p in (straight / "checkpoints").glob("step_*"))
    assert len(steps) >= 2

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / steps[-1])
    (resumed / "checkpoints" / "latest").write_text(steps[-2] + "\n")
    proc = run_cli(write_config(tmp_path / "resumed.yaml", _config(resumed, MODELS[family])))
    assert "resumed from" in proc.stdout
    assert stable_metrics(read_metrics(resumed)) == stable_metrics(records)
    a, b = checkpoint_tensors(latest_checkpoint(straight)), checkpoint_tensors(latest_checkpoint(resumed))
    assert sorted(a) == sorted(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


@pytest.mark.slow  # three CLI starts (~30 s idle, 100 s on the shared box)
def test_convert_and_train_refuse_a_refused_family_by_name(tmp_path):
    """gpt-oss (docs/models.md): `convert` and `train` from its folder stop with the family and the reason; `train`
    from scratch (model.hf_config) names the model type as invalid. (The other refused families: the ModelArch
    tests in tests/convert/test_window_families.py; they share this path.)"""
    import json
    import subprocess

    from _e2e_helpers import PY, REPO, env

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_MISTRAL, "vocab_size": 512, "model_type": "gpt_oss"}))
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(512, 64)}, folder / "model.safetensors")
    expected = "model_type='gpt_oss' is refused: gpt-oss needs attention sinks"
    proc = subprocess.run([PY, "-m", "megatron_dppo.cli", "convert", "hf-to-megatron", str(folder),
                           str(tmp_path / "meg")], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "meg").exists()
    cfg = _config(tmp_path / "out")
    cfg["model"] = {"path": str(folder), "hf_config": {}, "tokenizer": "train-sentencepiece"}
    proc = run_cli(write_config(tmp_path / "run.yaml", cfg), check=False, timeout=300)
    assert proc.returncode != 0 and expected in proc.stdout + proc.stderr, proc.stderr[-2000:]
    cfg = _config(tmp_path / "out2", model={**TINY_MISTRAL, "model_type": "gpt_oss"})
    proc = run_cli(write_config(tmp_path / "run2.yaml", cfg), check=False, timeout=300)
    assert proc.returncode != 0 and "model.hf_config.model_type='gpt_oss' is invalid" in proc.stderr
