"""Tiny random deepseek_v3 / glm4_moe models built with transformers (no downloads), every distinctive feature on:
multi-latent attention with and without q-LoRA, YaRN RoPE, sigmoid routing with an expert bias, group-limited
routing, the routed scaling factor, shared experts, a dense first layer, GLM's q/k norm, q/k/v bias and partial
rotary, tied and untied embeddings."""
from __future__ import annotations

import json
from pathlib import Path

import torch

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
               num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, n_routed_experts=8,
               num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5)
_MLA = dict(_COMMON, model_type="deepseek_v3", num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12)
TINY_DEEPSEEK = {
    # q-LoRA, 4 groups of 2 experts (1 kept per token), one shared expert, untied
    "deepseek_v3": dict(_MLA, q_lora_rank=24, n_group=4, topk_group=1, n_shared_experts=1, tie_word_embeddings=False,
                        rope_theta=10_000.0),
    # no q-LoRA (Moonlight / V2-Lite style q_proj), no group limit, two shared experts, tied
    "deepseek_v3_noqlora": dict(_MLA, q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                                tie_word_embeddings=True, rope_theta=50_000.0),
    # YaRN (DeepSeek-V3 / Kimi-K2's rope_scaling, with an mscale_all_dim != mscale), original context 8 positions
    # (factor = 32 / 8): the test sequences are longer
    "deepseek_v3_yarn": dict(_MLA, q_lora_rank=24, n_group=2, topk_group=1, n_shared_experts=1,
                             max_position_embeddings=32, tie_word_embeddings=False,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0, mscale=1.0,
                                                  mscale_all_dim=0.8, beta_fast=32, beta_slow=1,
                                                  original_max_position_embeddings=8)),
    # GLM-4.5: q/k norm, q/k/v bias, half-rotary heads, GQA 4:2, one shared expert, untied
    "glm4_moe": dict(_COMMON, model_type="glm4_moe", num_key_value_heads=2, head_dim=16, n_group=1, topk_group=1,
                     n_shared_experts=1, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                     tie_word_embeddings=False, rope_theta=1_000_000.0),
    # GLM without q/k norm and bias, tied
    "glm4_moe_plain": dict(_COMMON, model_type="glm4_moe", num_key_value_heads=2, head_dim=16, n_group=1,
                           topk_group=1, n_shared_experts=1, use_qk_norm=False, attention_bias=False,
                           partial_rotary_factor=0.5, tie_word_embeddings=True, rope_theta=10_000.0),
}
TOKENIZER_STUB = {"tokenizer_config.json": {"model_max_length": 256, "tokenizer_class": "PreTrainedTokenizerFast"},
                  "special_tokens_map.json": {"eos_token": "</s>"}}


def build_hf_model(name: str, seed: int = 0):
    """A transformers model of TINY_DEEPSEEK[name], every weight random and distinct (norms around 1, biases and the
    expert bias around 0: an expert bias of 0 would make a lost bias invisible)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**TINY_DEEPSEEK[name])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.tie_weights()
    return model


def save_hf_model(name: str, folder: Path, seed: int = 0) -> Path:
    model = build_hf_model(name, seed)
    model.save_pretrained(folder, safe_serialization=True)
    for fname, content in TOKENIZER_STUB.items():
        (folder / fname).write_text(json.dumps(content))
    return folder
