"""Tiny random Hugging Face models of each family, built with transformers (no downloads), and helpers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "megatron"))  # _dist (also conftest.py: for imports sorted before this one)

# Every family with grouped-query attention (4 query heads, 2 KV heads), tied and untied output embeddings.
# Qwen3 uses an explicit head_dim (heads * head_dim != hidden), as the real Qwen3 models do.
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
TINY = {
    "llama_tied": dict(_COMMON, model_type="llama", tie_word_embeddings=True, rope_theta=10_000.0),
    "llama_untied": dict(_COMMON, model_type="llama", tie_word_embeddings=False, rope_theta=500_000.0),
    "qwen2_untied": dict(_COMMON, model_type="qwen2", tie_word_embeddings=False, rope_theta=1_000_000.0),
    "qwen2_tied": dict(_COMMON, model_type="qwen2", tie_word_embeddings=True, rope_theta=1_000_000.0),
    "qwen3_tied": dict(_COMMON, model_type="qwen3", tie_word_embeddings=True, head_dim=24, rope_theta=1_000_000.0),
    "qwen3_untied": dict(_COMMON, model_type="qwen3", tie_word_embeddings=False, head_dim=24, rope_theta=10_000.0),
    # sliding windows shorter than the test sequences (13 tokens): Mistral (every layer, W=4) and Ministral (sliding
    # and full layers mixed, W=5, explicit head_dim)
    "mistral_tied": dict(_COMMON, model_type="mistral", tie_word_embeddings=True, sliding_window=4,
                         rope_theta=1_000_000.0),
    "ministral_untied": dict(_COMMON, model_type="ministral", tie_word_embeddings=False, sliding_window=5,
                             head_dim=24, rope_theta=100_000.0,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                          "full_attention"]),
    # Phi-3: fused qkv_proj / gate_up_proj; tied with a window of 4 and partial rotary 0.75 (Phi-4-mini's), untied
    # with neither
    "phi3_tied": dict(_COMMON, model_type="phi3", tie_word_embeddings=True, sliding_window=4,
                      partial_rotary_factor=0.75, rope_theta=10_000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "phi3_untied": dict(_COMMON, model_type="phi3", tie_word_embeddings=False, sliding_window=None,
                        rope_theta=10_000.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}

# Shapes Megatron supports that need care at TP2: one KV head (fewer than the TP ranks: Megatron-Core all-gathers
# the fused q/k/v rows and takes its group's slice) and a vocabulary of 127 rows (odd: padded to 128, the padding
# logits masked). Kept out of TINY so the per-family parametrizations stay as they are.
ODD_SHAPES = {
    "qwen2_kv1_vocab127": dict(_COMMON, model_type="qwen2", vocab_size=127, num_key_value_heads=1,
                               tie_word_embeddings=False, rope_theta=1_000_000.0),
    "llama_tied_kv1_vocab127": dict(_COMMON, model_type="llama", vocab_size=127, num_key_value_heads=1,
                                    tie_word_embeddings=True, rope_theta=10_000.0),
}

# Mixture-of-Experts families: 4 experts, top-2. Qwen3-MoE with a dense layer (mlp_only_layers) in both router
# variants (norm_topk_prob true = Qwen3-30B-A3B, false = softmax top-k without renormalization); Mixtral.
_MOE_COMMON = dict(_COMMON, num_experts_per_tok=2, tie_word_embeddings=False)
TINY_MOE = {
    "qwen3_moe": dict(_MOE_COMMON, model_type="qwen3_moe", head_dim=24, moe_intermediate_size=32, num_experts=4,
                      norm_topk_prob=True, mlp_only_layers=[1], rope_theta=1_000_000.0),
    "qwen3_moe_unnormed": dict(_MOE_COMMON, model_type="qwen3_moe", head_dim=24, moe_intermediate_size=32,
                               num_experts=4, norm_topk_prob=False, decoder_sparse_step=2, rope_theta=10_000.0),
    "mixtral": dict(_MOE_COMMON, model_type="mixtral", intermediate_size=32, num_local_experts=4,
                    rope_theta=1_000_000.0, sliding_window=None),
}

TOKENIZER_STUB = {"tokenizer_config.json": {"model_max_length": 256, "tokenizer_class": "PreTrainedTokenizerFast"},
                  "special_tokens_map.json": {"eos_token": "</s>"}}


def build_hf_model(name: str, seed: int = 0):
    """A transformers model of config TINY[name] with every parameter random (norm weights around 1, biases
    around 0, all distinct), so a swapped or mis-laid tensor changes the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{**TINY, **ODD_SHAPES, **TINY_MOE}[name])
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
    model.tie_weights()
    return model


def save_hf_model(name: str, folder: Path, seed: int = 0) -> Path:
    """Save build_hf_model(name) as an HF folder (safetensors + config.json + stub tokenizer files)."""
    model = build_hf_model(name, seed)
    model.save_pretrained(folder, safe_serialization=True)
    for fname, content in TOKENIZER_STUB.items():
        (folder / fname).write_text(json.dumps(content))
    return folder


def tokens(batch: int = 2, length: int = 13, vocab: int = 127, seed: int = 1) -> torch.Tensor:  # every model's ids
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def megatron_logits(chunks, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, V] of a (TP/PP-sharded) GPTModel on this rank's world.

    Runs the pipeline by hand (stage i sends its hidden states [s, b, h] to stage i+1) and all-gathers the
    vocabulary shards over TP. Returns the logits on the last pipeline stage, None elsewhere.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_dppo.convert.weights import unwrap_chunk

    (model,) = [unwrap_chunk(c) for c in chunks]
    model.eval()
    position_ids = torch.arange(ids.shape[1]).expand_as(ids)
    pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group()
    with torch.no_grad():
        if pp_rank > 0:
            hidden = torch.empty(ids.shape[1], ids.shape[0], model.config.hidden_size)
            dist.recv(hidden, src=dist.get_global_rank(group, pp_rank - 1), group=group)
            model.set_input_tensor(hidden)
        out = model(ids, position_ids, None)
        if pp_rank < pp_size - 1:
            dist.send(out.contiguous(), dst=dist.get_global_rank(group, pp_rank + 1), group=group)
            return None
    tp = ps.get_tensor_model_parallel_world_size()
    vocab = getattr(model, "unpadded_vocab_size", None)  # the padding rows (an odd vocabulary at TP > 1) dropped
    if tp == 1:
        return out[..., :vocab]
    shards = [torch.empty_like(out) for _ in range(tp)]
    dist.all_gather(shards, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)[..., :vocab]
