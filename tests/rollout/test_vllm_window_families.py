"""vLLM (CPU) serves a sliding-window Mistral and Phi-3 (fused projections, partial rotary) and takes the weights
the trainer pushes: its sampling log-probs match transformers' teacher-forced ones with the window, and not without
it (prompt + completion longer than the window); the push is the Megatron export stream
(``convert.export_hf_weights``) of another model, whose names vLLM's loaders take. Same optional job and markers as
test_vllm_cpu.py."""
import importlib.util
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (optional CI job with vllm-cpu)", allow_module_level=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
vllm = pytest.importorskip("vllm", reason="vllm is not importable")

import torch  # noqa: E402
from _sampling_reference import max_logprob_error  # noqa: E402
from test_vllm_cpu import ENGINE_KWARGS  # noqa: E402
from transformers import AutoModelForCausalLM, MistralConfig, Phi3Config  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13, 14, 15, 16, 17]]
WINDOW = 4
REPO = Path(__file__).resolve().parents[2]


def _tiny_model(seed, window=WINDOW, family="mistral"):
    config_class = MistralConfig if family == "mistral" else Phi3Config  # Phi-3: fused qkv / gate_up, partial rotary
    extra = {} if family == "mistral" else {"partial_rotary_factor": 0.5}
    config = config_class(**extra, vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, eos_token_id=3,
                           pad_token_id=0, bos_token_id=2, tie_word_embeddings=False, sliding_window=window)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_window_family_served_and_megatron_push_accepted(tmp_path, family):
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    first = _tiny_model(0, family=family)
    first.save_pretrained(tmp_path / "first")
    engine = VLLMRolloutEngine(tmp_path / "first", **ENGINE_KWARGS)
    sampling = SamplingParams(max_new_tokens=8, seed=0)
    groups = engine.generate(PROMPTS, 2, sampling)
    assert max_logprob_error(first, groups) < 1e-4
    no_window = _tiny_model(0, window=None, family=family)
    no_window.load_state_dict(first.state_dict())
    assert max_logprob_error(no_window, groups) > 1e-3  # control: the window matters on these lengths

    second = _tiny_model(1, family=family)
    second.save_pretrained(tmp_path / "second")
    stream = _megatron_export_stream(tmp_path / "second", tmp_path / "stream.safetensors")
    assert engine.load_weights(stream) == len(stream)
    assert max_logprob_error(second, engine.generate(PROMPTS, 2, sampling)) < 1e-4


EXPORT = textwrap.dedent("""
    import sys
    import torch
    from safetensors.torch import save_file
    from megatron_dppo.convert import export_hf_weights, load_hf_weights
    from megatron_dppo.convert.hf_io import HFCheckpoint
    from megatron_dppo.megatron.model import ModelArch, build_model_chunks
    from megatron_dppo.megatron.parallel import ParallelConfig, single_process_world

    source = HFCheckpoint(sys.argv[1])
    arch = ModelArch.from_hf_config(source.config)
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32, attention_backend="sdpa")
        load_hf_weights(chunks, arch, source.get)
        save_file(dict(export_hf_weights(chunks, arch)), sys.argv[2])
""")


def _megatron_export_stream(hf_dir, out):
    """The trainer's weight stream of the model in ``hf_dir`` (Megatron-Core lives in the main venv, not vLLM's):
    loaded into a Megatron model and exported by ``export_hf_weights`` in a subprocess, read back as (name, tensor)."""
    from safetensors.torch import load_file

    python = os.environ.get("DPPO_MAIN_PYTHON", str(REPO / ".venv" / "bin" / "python"))
    if not Path(python).exists():
        pytest.skip(f"no Python with Megatron-Core at {python} (set DPPO_MAIN_PYTHON)")
    subprocess.run([python, "-c", EXPORT, str(hf_dir), str(out)], cwd=REPO, check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return list(load_file(out).items())
