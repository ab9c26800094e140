"""The reward model of a run, from the config (``reward.model``), and ``megatron-dppo rm train``, which makes one.

``build_reward_model(cfg, policy_tokenizer)``: the ``rewards.RewardModel`` over the engine ``reward.model.engine``
names: ``hf`` (transformers, any device), ``vllm`` (pooling for classifiers, generate for judges) or
``megatron`` (a classifier under the policy's TP/PP layout, with the policy engine's own code; the trainer's
process groups must exist). None when ``reward.model.path`` is null.

``train_reward_model(cfg, out, ...)``: a small Bradley-Terry reward model (``rewards.bradley_terry``) on preference
pairs: from a JSONL file ({"prompt", "chosen", "rejected"} texts), or generated from the arithmetic task
(``data.arithmetic.preference_pairs``: graded, correct over wrong only, or a deliberately length-biased set). It uses
the run's tokenizer (a ``train-sentencepiece`` tokenizer is trained exactly as the run trains it, so the run's
``template=auto`` reuses the policy's ids) and the run's prompt template, so what it trains on is what the run
scores.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from megatron_dppo.config import Config


def build_reward_model(cfg: Config, policy_tokenizer: Any, *, shard: tuple[int, int] | None = None):
    """The run's ``rewards.RewardModel``, or None without ``reward.model.path`` (module docstring)."""
    m = cfg.reward.model
    if m.path is None:
        return None
    from megatron_dppo.rewards.hf_model import load_tokenizer
    from megatron_dppo.rewards.model import JudgeOptions, RewardModel
    from megatron_dppo.run.build import torch_dtype

    path = Path(m.path)
    hf = check_reward_model_folder(path)
    tokenizer = load_tokenizer(path)
    if not tokenizer("Is 7 + 5 = 12? yes", add_special_tokens=False)["input_ids"]:
        raise ValueError(f"reward.model.path {str(path)!r} has no tokenizer (no tokenizer.json, tokenizer.model or "
                         "vocab.json: the tokenizer loaded from it encodes text to nothing); copy the reward model's "
                         "tokenizer files into the folder (megatron-dppo rm train writes them)")
    max_length = int(hf.get("max_position_embeddings", 0) or 0) or None
    if m.engine == "hf":
        from megatron_dppo.rewards.hf_model import HFRewardEngine

        engine = HFRewardEngine(path, m.kind, dtype=torch_dtype(m.dtype), batch_size=m.batch_size, shard=shard)
    elif m.engine == "vllm":
        from megatron_dppo.rewards.vllm_model import VLLMRewardEngine

        engine = VLLMRewardEngine(path, m.kind, dtype=m.dtype, gpu_memory_utilization=m.gpu_memory_utilization,
                                  seed=cfg.train.seed, shard=shard)
    else:
        engine = megatron_reward_engine(cfg, path)
    judge = JudgeOptions(mode=m.judge_mode, template=m.judge_template, group=m.judge_group,
                         tokens=tuple(m.judge_tokens), max_new_tokens=m.judge_max_new_tokens,
                         temperature=m.judge_temperature, pattern=m.judge_pattern, unparsed_score=m.unparsed_score)
    return RewardModel(engine, tokenizer, policy_tokenizer, kind=m.kind, template=m.template, judge=judge,
                       name=str(path), timeout_s=m.timeout_s, max_length=max_length,
                       vocab_size=int(hf.get("vocab_size", 0) or 0) or None)


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_reward_model_folder(path: Path) -> dict:
    """The reward model folder's config.json (a dict), after checking it is a Hugging Face model folder with
    weights: each failure is a ValueError naming the file and the fix, before any model or step."""
    from megatron_dppo.convert.hf_io import read_config_json

    if not (path / "config.json").is_file():
        raise ValueError(f"reward.model.path {str(path)!r} is not a Hugging Face model folder (no config.json)")
    try:
        hf = read_config_json(path / "config.json")
    except ValueError as err:
        raise ValueError(f"reward.model.path: {err}") from None
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"reward.model.path {str(path)!r} has no weights (none of {', '.join(WEIGHT_FILES)}); copy "
                         "the model's weight files into the folder (megatron-dppo rm train writes a complete one)")
    return hf


def megatron_reward_engine(cfg: Config, path: Path):
    """A sequence classifier under the policy's TP/PP layout (Megatron's parallel state must be initialized),
    filled from the HF folder by the policy's own conversion rules."""
    from megatron_dppo.convert.hf_io import HFCheckpoint
    from megatron_dppo.convert.mapping import validate_hf_tensors
    from megatron_dppo.convert.weights import load_hf_weights
    from megatron_dppo.megatron.arch import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.megatron.reward_engine import MegatronRewardEngine
    from megatron_dppo.run.build import torch_dtype

    arch = ModelArch.from_hf_config(json.loads((path / "config.json").read_text()))
    if arch.num_labels != 1:
        raise ValueError(f"reward.model.engine=megatron takes a sequence classifier with one label; "
                         f"{str(path)!r} is "
                         f"{'a causal LM' if arch.num_labels is None else f'{arch.num_labels} labels'}")
    p = cfg.parallel
    parallel = ParallelConfig(tp=p.tp, pp=p.pp, sp=p.sp, ep=p.ep, etp=p.etp)
    checkpoint = HFCheckpoint(path)
    validate_hf_tensors(checkpoint.shapes, arch)
    engine = MegatronRewardEngine(arch, parallel, dtype=torch_dtype(cfg.reward.model.dtype),
                                  batch_tokens=cfg.packing.capacity)
    load_hf_weights(engine.model_chunks, arch, checkpoint.get)
    return engine


# ================================================================================================================
# megatron-dppo rm train
# ================================================================================================================
def train_reward_model(cfg: Config, out: str | Path, *, pairs_file: str | None = None, prefer: str = "closer",
                       num_pairs: int = 4000, heldout: int = 500, template: str = "tokens", bt=None,
                       log_every: int = 0) -> dict:
    """Train a small Bradley-Terry reward model for the run ``cfg`` describes and save it to ``out`` (module
    docstring); returns its record (pairwise accuracy on the held-out pairs among it)."""
    from megatron_dppo.data.datasets import read_preference_pairs
    from megatron_dppo.distributed import collectives as D
    from megatron_dppo.rewards.bradley_terry import BTConfig, small_classifier_config, train_bradley_terry
    from megatron_dppo.rewards.model_inputs import InputBuilder, Sample, resolve_template
    from megatron_dppo.run.build import _formatter, arithmetic_task, build_hf_config, build_tokenizer, resolve_model_dir

    D.set_cpu_threads(1, cfg.train.cpu_threads)
    out = Path(out)
    bt = bt or BTConfig()
    if pairs_file is not None:  # (read and checked before anything is written)
        rows = read_preference_pairs(pairs_file)
        cut = len(rows) - max(1, len(rows) // 10)
        train_rows, heldout_rows, source = rows[:cut], rows[cut:], str(pairs_file)
    elif cfg.data.task != "arithmetic":
        raise ValueError("rm train without --pairs generates pairs from the arithmetic task; with data.task="
                         f"{cfg.data.task!r} give --pairs FILE.jsonl ({{prompt, chosen, rejected}} per line)")
    work = copy.deepcopy(cfg)
    work.train.output_dir = str(out)  # (a train-sentencepiece tokenizer is trained into <out>/tokenizer)
    tokenizer = build_tokenizer(work)
    formatter = _formatter(work, tokenizer)
    if pairs_file is None:
        from megatron_dppo.data.arithmetic import preference_pairs

        task = arithmetic_task(work)
        train_rows = preference_pairs(task, num_pairs, "train", prefer=prefer, seed=cfg.train.seed)
        heldout_rows = preference_pairs(task, heldout, "test", prefer=prefer, seed=cfg.train.seed)
        source = f"arithmetic task, prefer={prefer}"
    builder = InputBuilder(resolve_template(template, tokenizer, tokenizer), tokenizer)

    def encode(row: dict, which: str) -> list[int]:
        completion = row[which]
        ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        return builder.classifier_input(Sample(formatter.encode(row["prompt"]), ids, row["prompt"], completion))

    train_pairs = [(encode(r, "chosen"), encode(r, "rejected")) for r in train_rows]
    heldout_pairs = [(encode(r, "chosen"), encode(r, "rejected")) for r in heldout_rows]
    longest = max(len(x) for pair in train_pairs + heldout_pairs for x in pair)
    policy = build_hf_config(work, tokenizer, resolve_model_dir(work))
    context = int(policy.get("max_position_embeddings", 0) or 0)
    hf_config = small_classifier_config(int(policy["vocab_size"]), max(context, longest), tokenizer, bt)
    meta = {"source": source, "template": template, "prompt_template": cfg.data.template}
    return train_bradley_terry(train_pairs, hf_config, out, tokenizer, bt=bt, heldout=heldout_pairs, meta=meta,
                               log_every=log_every)
