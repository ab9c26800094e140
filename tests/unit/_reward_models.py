"""Tiny reward models for the tests, built here in seconds: a random Qwen2 sequence classifier and a random causal
judge, each saved as an HF folder with a SentencePiece tokenizer trained on the arithmetic task (no downloads)."""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_dppo.data import ArithmeticTask, train_sentencepiece_tokenizer
from megatron_dppo.data.tokenizer import ROLE_TOKENS

TASK = ArithmeticTask(min_terms=2, max_terms=2, max_operand=9, operators="+-", seed=1234)
JUDGE_WORDS = ("yes", "no", "Question", "Answer", "Candidate", "answers", "correct", "Reply", "Is", "or")


def arithmetic_tokenizer(folder: Path, vocab_size: int = 64):
    """The quickstart's tokenizer (the arithmetic corpus, chat template with <|role|> markers)."""
    return train_sentencepiece_tokenizer(TASK.corpus(512), folder, vocab_size=vocab_size)


def judge_tokenizer(folder: Path):
    """A tokenizer whose vocabulary has the judge's words (``yes`` and ``no`` one token each)."""
    corpus = TASK.corpus(512) + ["Question: 1+2=\nAnswer: 3\nIs the answer correct? Reply yes or no.",
                                 "Candidate answers:\n1. 3\n2. 4"]
    return train_sentencepiece_tokenizer(corpus, folder, vocab_size=128,
                                         user_symbols=list(ROLE_TOKENS) + list(JUDGE_WORDS))


def random_classifier(folder: Path, tokenizer, seed: int = 0, vocab_size: int | None = None,
                      hidden: int = 64, layers: int = 2, pad_token_id: int | None = None) -> Path:
    """A randomly initialized 1-label Qwen2ForSequenceClassification saved to ``folder`` (weights spread enough
    that different inputs score differently)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    vocab = vocab_size or -(-len(tokenizer) // 64) * 64
    config = AutoConfig.for_model(
        "qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, num_labels=1,
        pad_token_id=tokenizer.pad_token_id if pad_token_id is None else pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def random_judge(folder: Path, tokenizer, seed: int = 0) -> Path:
    """A randomly initialized tiny Qwen2ForCausalLM (the judge) saved to ``folder`` with ``tokenizer``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2", vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
