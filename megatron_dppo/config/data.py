"""The ``data`` section of the run configuration (``DataConfig``): training prompts from a Hugging Face dataset,
files, or the arithmetic task. Re-exported by ``megatron_dppo.config``; every option is documented here, once."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from megatron_dppo.config.fields import _check, opt


@dataclass
class DataConfig:
    """Training prompts: a dataset (Hub id, named set, Hub-format folder, file), files (JSONL/parquet) or the
    procedurally generated arithmetic task."""

    task: Literal["files", "arithmetic", "procedural"] = opt(
        "files", "'files': prompts from data.dataset or data.train_files; 'arithmetic': the procedurally generated "
                 "arithmetic task (quickstart); 'procedural': the generated questions of data.procedural_task for "
                 "pretrained chat models (data/procedural.py), evaluated on their held-out split.")
    dataset: Optional[str] = opt(None, "Training prompts read through the Hugging Face datasets library (task=files, "
                                       "instead of data.train_files): a named set (gsm8k, math_lighteval, math500, "
                                       "aime24, aime, amc23, amc, minerva_math, olympiadbench, svamp, asdiv, "
                                       "deepscaler, dapo_math_17k: its Hub id, split, columns and reward), a Hub id "
                                       "'owner/name', a folder (save_to_disk output, data files, or a Hub repository "
                                       "clone) or a file (.jsonl/.json/.parquet/.csv/.arrow). Offline, a Hub dataset "
                                       "must be in the HF cache: else prepare files with `megatron-dppo data "
                                       "prepare`.")
    split: Optional[str] = opt(None, "Split of data.dataset: for a named set a role (train, test) or a Hub split "
                                     "name; otherwise the split name. null = train (a named set without one: test).")
    subset: Optional[str] = opt(None, "Subset (config name) of data.dataset, e.g. main for openai/gsm8k; null = the "
                                      "named set's, or the dataset's default.")
    revision: Optional[str] = opt(None, "Hub revision (branch, tag or commit) of data.dataset; null = main.")
    bad_rows: Optional[Literal["error", "skip"]] = opt(
        None, "A row of data.dataset whose prompt or gold cannot be read: error (names the row and field) or skip "
              "(dropped and counted); null = the named set's choice (skip for deepscaler), else error.")
    dedupe: Optional[bool] = opt(None, "Drop rows of data.dataset whose prompt and gold repeat an earlier row's; "
                                       "null = the named set's choice (true for dapo_math_17k), else false.")
    train_files: list = opt([], "JSONL or parquet files of training prompts (task=files), concatenated.")
    preset: Optional[str] = opt(None, "Column preset (gsm8k, math500, math, math_lighteval, aime24, amc23, "
                                      "minerva_math, olympiadbench, svamp, asdiv, deepscaler, dapo_math_17k, "
                                      "prepared; megatron_dppo/data/datasets.py); null = the named set's columns, "
                                      "the prepared layout, or the preset the file name starts with.")
    prompt_field: Optional[str] = opt(None, "Record field (or '{a} {b}' template over fields) holding the prompt; "
                                            "set it to override the preset (then answer_field/answer_format apply).")
    answer_field: Optional[str] = opt("answer", "Record field holding the gold answer (with prompt_field).")
    answer_format: Literal["plain", "gsm8k", "boxed", "list", "strip_units"] = opt(
        "plain", "How to read the gold answer (with prompt_field): plain, gsm8k (after '####'), boxed (last "
                 "\\boxed{}), list (joined), strip_units.")
    id_field: Optional[str] = opt(None, "Record field with a unique id (with prompt_field); null = file:line.")
    limit: Optional[int] = opt(None, "Read at most this many records per file (quick experiments); null = all.")
    template: str = opt("chat", "Prompt rendering: chat (the tokenizer's chat template; error if it has none), "
                                "plain ('Question: ...\\nAnswer:'), raw (text as is), or a format string with "
                                "{prompt}.")
    system_prompt: Optional[str] = opt(None, "Optional system message (chat) or first line (other templates).")
    instruction: Optional[str] = opt(None, "Text appended to every question after a blank line; 'math' = "
                                           "'Please reason step by step, and put your final answer within "
                                           "\\boxed{}.'")
    shuffle: bool = opt(True, "Shuffle prompts each epoch with a seeded, resumable sampler (seed train.seed).")
    arithmetic_train_size: int = opt(5000, "Number of arithmetic problems in the training split (task=arithmetic).")
    arithmetic_min_terms: int = opt(2, "Fewest operands of an arithmetic problem.")
    arithmetic_max_terms: int = opt(2, "Most operands of an arithmetic problem.")
    arithmetic_max_operand: int = opt(20, "Largest operand of the arithmetic task.")
    arithmetic_ops: str = opt("+-", "Operators used by the arithmetic task (subset of '+-*').")
    arithmetic_eval_split: Literal["test", "train"] = opt(
        "test", "Arithmetic evaluation prompts: test = the held-out expressions (disjoint from training); train = "
                "fresh draws from the training distribution (for small problem spaces, e.g. single-digit operands, "
                "where no held-out fact can be inferred from the others).")
    arithmetic_worked: bool = opt(False, "Worked answers: the gold completion lists the running totals left to right "
                                         "('3+4-2=' -> '7,5'; operators + and - only) and the reward is "
                                         "arithmetic_worked (last integer == answer).")
    arithmetic_warm_start: Literal["answer", "calculator"] = opt(
        "answer", "Gold completions of the warm start (train.sft_steps) on the arithmetic task: answer (the answer, or "
                  "the worked running totals) or calculator (a tool-use trace: '<calc>expression</calc>', the "
                  "calculator's result as a tool message, the answer; observation tokens masked, built with the chat "
                  "template as an episode is; needs env.name=calculator). With model.tokenizer=train-sentencepiece "
                  "the tokenizer also learns the traces, keeps <calc>, </calc> and <|tool|> whole and falls back to "
                  "bytes (model.tokenizer_vocab_size >= ~300), so every tool answer round-trips "
                  "(megatron_dppo/data/tool_traces.py).")

    procedural_task: str = opt("list_max", "The task of data.task=procedural: list_max, addition, expression or "
                                           "letter_count (megatron_dppo/data/procedural.py).")
    procedural_train_size: int = opt(5000, "Number of training questions (data.task=procedural).")
    procedural_seed: int = opt(0, "Seed of the procedural questions (train and test), independent of train.seed: "
                                  "every run of a study evaluates on the same held-out questions.")
    procedural_options: dict = opt({}, "Generator options of data.procedural_task overriding its defaults, e.g. "
                                       "{length: 5, low: 10, high: 99} for list_max.")

    def validate(self) -> None:
        if self.task == "files":
            _check(bool(self.train_files) != bool(self.dataset), "data.train_files", self.train_files,
                   "a non-empty list of JSONL/parquet files, or data.dataset (one of the two) when data.task=files")
            for f in self.train_files:
                if not Path(f).exists():
                    raise ValueError(f"data.train_files: file {f!r} does not exist")
        for key in ("split", "subset", "revision", "bad_rows", "dedupe"):
            _check(getattr(self, key) is None or bool(self.dataset), f"data.{key}", getattr(self, key),
                   "null unless data.dataset is set")
        _check(self.limit is None or self.limit >= 1, "data.limit", self.limit, "null or >= 1")
        _check(self.template in ("chat", "plain", "raw") or "{prompt}" in self.template, "data.template",
               self.template, "chat, plain, raw or a format string containing '{prompt}'")
        _check(self.arithmetic_train_size >= 1, "data.arithmetic_train_size", self.arithmetic_train_size, ">= 1")
        _check(2 <= self.arithmetic_min_terms <= self.arithmetic_max_terms, "data.arithmetic_min_terms",
               self.arithmetic_min_terms, f"in [2, data.arithmetic_max_terms={self.arithmetic_max_terms}]")
        _check(self.arithmetic_max_operand >= 1, "data.arithmetic_max_operand", self.arithmetic_max_operand, ">= 1")
        _check(bool(self.arithmetic_ops) and set(self.arithmetic_ops) <= set("+-*"), "data.arithmetic_ops",
               self.arithmetic_ops, "a non-empty subset of '+-*'")
        _check(not self.arithmetic_worked or set(self.arithmetic_ops) <= set("+-"), "data.arithmetic_ops",
               self.arithmetic_ops, "a subset of '+-' with data.arithmetic_worked=true")
        _check(self.procedural_train_size >= 1, "data.procedural_train_size", self.procedural_train_size, ">= 1")
        _check(isinstance(self.procedural_options, dict), "data.procedural_options", self.procedural_options,
               "a mapping of generator options")
