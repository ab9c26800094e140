"""Prompt data: datasets (JSONL/parquet files; Hub ids and Hub-format folders in hub.py, `data prepare` in
prepare.py), chat templates, a resumable sampler, the arithmetic quickstart task
and its tiny SentencePiece tokenizer, procedural questions with held-out splits for pretrained chat models.

    ds = load_prompt_dataset("data/gsm8k_train.jsonl")   # `megatron-dppo data prepare gsm8k --out data` wrote it
    records, source = hub.load_records("gsm8k", split="test")  # a named set, Hub id, Hub-format folder, file
    fmt = PromptFormatter(tokenizer, template="chat", instruction=MATH_INSTRUCTION)
    ids = encode_prompts(fmt, records, max_new_tokens=256, context_length=1024)  # raises on a too-long prompt
    sampler = PromptSampler(len(ds), seed=1); batch = [ds[i] for i in sampler.take(8)]
"""
from megatron_dppo.data.arithmetic import ArithmeticTask, evaluate
from megatron_dppo.data.datasets import (
    DATASET_PRESETS,
    DatasetError,
    DatasetFileNotFoundError,
    FieldSpec,
    Prompt,
    PromptDataset,
    PromptRecord,
    load_prompt_dataset,
    read_prompt_records,
    resolve_fields,
)
from megatron_dppo.data.procedural import ProceduralTask
from megatron_dppo.data.sampler import PromptSampler
from megatron_dppo.data.templates import (
    MATH_INSTRUCTION,
    PLAIN_TEMPLATE,
    PromptFormatter,
    check_prompt_fits,
    encode_prompts,
)
from megatron_dppo.data.tokenizer import DEFAULT_CHAT_TEMPLATE, load_tokenizer, train_sentencepiece_tokenizer

__all__ = [
    "ArithmeticTask", "DATASET_PRESETS", "DEFAULT_CHAT_TEMPLATE", "DatasetError", "DatasetFileNotFoundError",
    "FieldSpec", "MATH_INSTRUCTION", "PLAIN_TEMPLATE", "Prompt", "PromptDataset", "PromptFormatter", "PromptRecord",
    "ProceduralTask", "PromptSampler", "check_prompt_fits", "encode_prompts", "evaluate", "load_prompt_dataset",
    "load_tokenizer", "read_prompt_records", "resolve_fields", "train_sentencepiece_tokenizer",
]
