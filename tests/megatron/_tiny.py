"""Tiny model configs and packed batches shared by the engine tests (seconds on CPU)."""
from __future__ import annotations

import torch

# HF-style config.json dicts, one per family. 4 layers so that pp=2 x vpp=2 divides them.
TINY_CONFIGS = {
    # Qwen3: QK-norm, explicit head_dim (heads * head_dim != hidden), GQA 4:2, untied
    "qwen3": dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=512),
    # Qwen2: bias on q, k, v; GQA 4:2
    "qwen2": dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, max_position_embeddings=512),
    # Llama / SmolLM2: tied embeddings, MHA
    "llama": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, rope_theta=100_000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, max_position_embeddings=512),
}


# Mixture-of-Experts families (kept out of TINY_CONFIGS so the dense parametrizations stay as they are): 4 experts,
# top-2; Qwen3-MoE with one dense layer (mlp_only_layers) and renormalized top-k, Mixtral sparse everywhere.
TINY_MOE_CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      mlp_only_layers=[1], decoder_sparse_step=1, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, max_position_embeddings=512),
    "mixtral": dict(model_type="mixtral", vocab_size=256, hidden_size=64, intermediate_size=32, num_local_experts=4,
                    num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    rope_theta=1_000_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    max_position_embeddings=512, sliding_window=None),
    # DeepSeek-style (megatron/deepseek_moe.py): sigmoid router + expert bias, 2 groups, a shared expert, dense
    # first layer; deepseek_v3 with multi-latent attention (q-LoRA), glm4_moe with q/k norm, q/k/v bias, half rotary
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=96,
                        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                        max_position_embeddings=512),
    "glm4_moe": dict(model_type="glm4_moe", vocab_size=256, hidden_size=64, intermediate_size=96,
                     moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                     n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_qk_norm=True,
                     attention_bias=True, partial_rotary_factor=0.5, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, max_position_embeddings=512),
}


def random_sequences(lengths, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def packed_batches(pad_multiple: int = 1, seed: int = 0, groups=((9, 5, 12), (7, 3, 8, 6))):
    """Two packed micro-batches (prompt length 2 each) of random token sequences."""
    from megatron_dppo.packing import build_thd_batch

    batches, start = [], 0
    for gi, lengths in enumerate(groups):
        seqs = random_sequences(lengths, seed=seed + gi)
        n = len(seqs)
        batches.append(build_thd_batch(seqs, [2] * n, list(range(start, start + n)), [0.0] * n, [1.0] * n,
                                       pad_multiple=pad_multiple))
        start += n
    return batches
