"""Whole-checkpoint conversion: HF folder <-> Megatron dist checkpoint, at any TP/PP.

Both functions run inside a world of exactly ``tp * pp`` processes (``torchrun --nproc-per-node=TP*PP``, srun,
mpirun, or one plain process for TP=PP=1) and create the process groups themselves when none exist. Mixture-of-
Experts models may also be split over ``ep`` (expert parallel) and ``etp`` (expert tensor parallel) ranks; the
world is then ``lcm(tp, ep * etp) * pp`` processes (``conversion_world_size``): data-parallel replicas of the
dense weights where the expert layout needs more ranks than TP.

Layout of a converted Megatron checkpoint (``out_dir``)::

    model/                 Megatron dist checkpoint (torch_dist) of {"model": chunk.sharded_state_dict()}
                           ({"model0", "model1", ...} with virtual pipeline stages); reshardable to any TP/PP
    hf/                    config.json + tokenizer / chat template / generation_config files of the source
    megatron_dppo.json     {"format": ..., "tp", "pp", "dtype", "arch": {...}} (informational)

Failure policy: everything that can be checked without weights (config, parallel sizes, tensor names and
shapes, output folder) is checked identically on every rank *before* a process group or a file is created, so
all ranks stop together with the same ValueError. Output goes to a hidden temporary sibling
(``.NAME.partial``) that rank 0 renames to ``out_dir`` only after every rank finished; on any error rank 0
deletes it, so no partial output directory is left behind.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_dppo.convert.hf_io import (
    HFCheckpoint,
    check_output_dir,
    copy_tokenizer_files,
    make_tokenizer_config_portable,
    portable_config,
    read_config_json,
    torch_dtype_name,
    write_safetensors_shards,
)
from megatron_dppo.convert.mapping import validate_hf_tensors
from megatron_dppo.convert.validate import check_megatron_model
from megatron_dppo.distributed import collectives as D

FORMAT = "megatron-dppo/model-v1"
MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"
META_FILE = "megatron_dppo.json"


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------

def arch_from_hf_config(cfg: dict, source: str = "HF config") -> Any:
    """``ModelArch.from_hf_config`` with the source named in the error (unsupported model_type, fields...)."""
    from megatron_dppo.megatron.model import ModelArch

    try:
        return ModelArch.from_hf_config(cfg)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def _world_size_hint() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _prepare_env_for_single_process() -> None:
    """A plain ``python tool.py`` run: one process on a free port (never a fixed port other jobs may hold)."""
    if "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def conversion_world_size(tp: int, pp: int, ep: int = 1, etp: int = 1) -> int:
    """Processes a conversion at this layout runs on: ``lcm(tp, ep * etp) * pp`` (``tp * pp`` for dense models)."""
    return math.lcm(tp, ep * etp) * pp


def _check_parallel(arch: Any, tp: int, pp: int, vpp: int | None = None, ep: int = 1, etp: int = 1) -> Any:
    from megatron_dppo.megatron.parallel import ParallelConfig, validate_parallel

    # sequence parallelism changes no weight; Megatron needs it when TP ranks route tokens to experts
    cfg = ParallelConfig(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, sp=tp > 1 and ep * etp > 1)
    needed = conversion_world_size(tp, pp, ep, etp)
    validate_parallel(arch, cfg, needed)  # the model's divisibility first: names heads / layers / vocab / experts
    world = _world_size_hint()
    if world != needed:
        what = f"tp={tp}, pp={pp}" + (f", ep={ep}, etp={etp}" if ep * etp > 1 else "")
        formula = "tp*pp" if ep * etp == 1 else "lcm(tp, ep*etp)*pp"
        raise ValueError(f"conversion at {what} needs exactly {formula}={needed} processes, "
                         f"this job has {world} (launch with torchrun --nproc-per-node={needed})")
    return cfg


def _init_parallel(cfg: Any, arch: Any) -> None:
    from megatron.core import parallel_state

    from megatron_dppo.megatron.parallel import initialize_parallel

    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_world_size() == cfg.tp
            and parallel_state.get_pipeline_model_parallel_world_size() == cfg.pp
            and parallel_state.get_virtual_pipeline_model_parallel_world_size() == cfg.vpp
            and parallel_state.get_expert_model_parallel_world_size() == cfg.ep
            and parallel_state.get_expert_tensor_parallel_world_size() == cfg.etp):
        return  # reuse the caller's groups
    _prepare_env_for_single_process()
    initialize_parallel(cfg, seed=1234, arch=arch)  # reuses an existing default process group


def _tmp_name(final: Path) -> Path:
    return final.parent / f".{final.name}.partial"


def _run_atomically(out_dir: Path, body: Callable[[Path], None]) -> Path:
    """Rank 0 creates ``.NAME.partial``; every rank runs ``body(tmp)``; rank 0 renames it after all succeeded.

    An exception on any rank makes every rank raise (the ranks agree through one all-reduce after ``body``) and
    rank 0 remove the temporary folder.
    """
    tmp = _tmp_name(out_dir)
    rank = D.rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    D.barrier()
    error: BaseException | None = None
    try:
        body(tmp)
    except Exception as exc:  # noqa: BLE001 - re-raised below once every rank knows
        error = exc
    try:
        all_ok = D.all_ranks(error is None)
    except BaseException:  # noqa: BLE001 - a failed agreement counts as a failed rank: clean up and raise below
        all_ok = False
    if not all_ok:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise RuntimeError(f"conversion failed on another rank; {out_dir} was not written")
    if rank == 0:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    D.barrier()
    return out_dir


def _chunk_keys(chunks: list) -> list[str]:
    """Megatron-LM's convention: "model" for one chunk, "model0", "model1", ... for virtual pipeline stages."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _model_sharded_state_dict(chunks: list) -> dict:
    from megatron_dppo.convert.weights import unwrap_chunk

    return {key: unwrap_chunk(c).sharded_state_dict() for key, c in zip(_chunk_keys(chunks), chunks)}


def save_model_dist_checkpoint(chunks: list, path: Path) -> None:
    """Collective: write the model chunks' weights as a Megatron dist checkpoint (torch_dist) into ``path``."""
    from megatron.core import dist_checkpointing

    if D.rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    D.barrier()
    from megatron_dppo.megatron.checkpoint_files import in_process_save_strategy

    # (shards written by threads of this process: no Manager / writer processes to orphan or to lose to a signal)
    dist_checkpointing.save(_model_sharded_state_dict(chunks), str(path), sharded_strategy=in_process_save_strategy())


def check_dist_checkpoint_files(path: Path) -> None:
    """Every file a torch_dist checkpoint's ``.metadata`` names exists and is long enough for the byte ranges
    stored in it; ValueError naming the missing or truncated files (instead of a traceback deep in the load)."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - an unreadable .metadata file, whatever the unpickling raised
        raise ValueError(f"Megatron checkpoint {path}: its .metadata cannot be read ({type(err).__name__}: "
                         f"{err}); the checkpoint is incomplete or corrupt") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name in needed if not (path / name).is_file())
    short = sorted(name for name in needed if name not in missing and (path / name).stat().st_size < needed[name])
    if missing or short:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"truncated {', '.join(f'{n} ({(path / n).stat().st_size} of {needed[n]} bytes)' for n in short)}"]
            if short else [])
        raise ValueError(f"Megatron checkpoint {path} is incomplete: {'; '.join(parts)} (of the "
                         f"{len(needed)} files its .metadata names)")


@torch.no_grad()
def load_model_dist_checkpoint(chunks: list, path: Path) -> None:
    """Collective: fill the model chunks from a Megatron dist checkpoint saved at any TP/PP (resharding)."""
    from megatron.core import dist_checkpointing

    from megatron_dppo.convert.weights import unwrap_chunk

    check_dist_checkpoint_files(path)
    loaded = dist_checkpointing.load(_model_sharded_state_dict(chunks), str(path))
    for key, chunk in zip(_chunk_keys(chunks), chunks):
        result = unwrap_chunk(chunk).load_state_dict(loaded[key], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise ValueError(f"Megatron checkpoint {path} lacks model tensors {missing[:10]}")


def _arch_dict(arch: Any) -> dict:
    return dataclasses.asdict(arch) if dataclasses.is_dataclass(arch) else dict(vars(arch))


def load_hf_folder(chunks: list, hf_dir: str | os.PathLike, arch: Any | None = None) -> Any:
    """Fill this rank's (already built) model chunks straight from an HF folder; returns the ModelArch.

    For a trainer that starts from HF weights without a conversion step. Not collective: each rank reads only
    the tensors of its TP shard / PP layers. Checks as ``convert_hf_to_megatron`` does: the folder's config gives
    ``arch`` (when passed), the tensors are exactly the expected ones, the built model agrees with the config.
    """
    from megatron_dppo.convert.weights import load_hf_weights, unwrap_chunk

    hf_dir = Path(hf_dir)
    source = HFCheckpoint(hf_dir)
    found = arch_from_hf_config(source.config, f"HF config {hf_dir / 'config.json'}")
    if arch is not None and found != arch:
        diff = {k: (v, getattr(found, k)) for k, v in _arch_dict(arch).items() if getattr(found, k) != v}
        raise ValueError(f"{hf_dir}: its config gives a different architecture (model, folder): {diff}")
    validate_hf_tensors(source.shapes, found)
    for chunk in chunks:
        check_megatron_model(source.config, found, unwrap_chunk(chunk))
    load_hf_weights(chunks, found, source.get)
    return found


# ----------------------------------------------------------------------------------------------------------------
# HF -> Megatron
# ----------------------------------------------------------------------------------------------------------------

def convert_hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, tp: int = 1, pp: int = 1,
                           dtype: torch.dtype = torch.float32, overwrite: bool = False, ep: int = 1,
                           etp: int = 1) -> Path:
    """Convert an HF folder (safetensors + config.json + tokenizer files) to a Megatron dist checkpoint.

    Collective over the ``tp * pp`` processes of the job (MoE with ``ep``/``etp``: ``conversion_world_size``; each
    EP rank reads only its own experts). Validation (before anything is created): the HF
    config converts to a supported architecture (unsupported ``model_type`` / field -> ValueError naming it),
    ``tp``/``pp`` shard it (heads, KV heads, FFN, vocabulary, layers), the safetensors hold exactly the expected
    tensors with the expected shapes (missing / unexpected / shape mismatch listed by name), ``out_dir`` is free.
    After building, the Megatron ``TransformerConfig`` is compared field by field with the HF config.
    Weights are stored in ``dtype`` (default fp32: conversion is exact; training may load them in bf16).
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir).absolute()
    source = HFCheckpoint(hf_dir)
    arch = arch_from_hf_config(source.config, f"HF config {hf_dir / 'config.json'}")
    parallel = _check_parallel(arch, tp, pp, ep=ep, etp=etp)
    validate_hf_tensors(source.shapes, arch)
    check_output_dir(out_dir, overwrite)

    _init_parallel(parallel, arch)
    from megatron_dppo.convert.weights import load_hf_weights, unwrap_chunk
    from megatron_dppo.megatron.model import build_model_chunks

    chunks = build_model_chunks(arch, parallel, dtype)
    for chunk in chunks:
        check_megatron_model(source.config, arch, unwrap_chunk(chunk))
    load_hf_weights(chunks, arch, source.get)

    def body(tmp: Path) -> None:
        save_model_dist_checkpoint(chunks, tmp / MODEL_SUBDIR)
        if D.rank() == 0:
            (tmp / HF_SUBDIR).mkdir()
            shutil.copy2(hf_dir / "config.json", tmp / HF_SUBDIR / "config.json")
            copy_tokenizer_files(hf_dir, tmp / HF_SUBDIR)
            meta = {"format": FORMAT, "tp": tp, "pp": pp, "ep": ep, "etp": etp, "dtype": torch_dtype_name(dtype),
                    "source": str(hf_dir.absolute()), "arch": _arch_dict(arch)}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")

    return _run_atomically(out_dir, body)


# ----------------------------------------------------------------------------------------------------------------
# Megatron -> HF
# ----------------------------------------------------------------------------------------------------------------

def find_model_checkpoint(ckpt_dir: Path) -> Path:
    """The dist-checkpoint folder to read: ``ckpt_dir/model`` (converted), ``ckpt_dir`` itself, or, for a
    training-checkpoint root (megatron_dppo.megatron.checkpoint layout), the checkpoint a resumed run would take:
    the newest that verifies, whatever ``latest`` says (``resolve_checkpoint``)."""
    for candidate in (ckpt_dir / MODEL_SUBDIR, ckpt_dir):
        if (candidate / "metadata.json").is_file():
            return _not_lora(candidate)
    if (ckpt_dir / "latest").is_file() or any(ckpt_dir.glob("step_*/metadata.json")):
        from megatron_dppo.megatron.checkpoint import resolve_checkpoint

        return _not_lora(resolve_checkpoint(ckpt_dir))
    raise ValueError(f"no Megatron dist checkpoint in {ckpt_dir} (expected {ckpt_dir / MODEL_SUBDIR}/metadata.json, "
                     f"{ckpt_dir}/metadata.json or a training-checkpoint root with step_<n> folders)")


def _not_lora(path: Path) -> Path:
    """A LoRA training checkpoint holds adapters only (no model weights): refused here by name."""
    meta = path / "megatron_dppo.json"
    if meta.is_file() and json.loads(meta.read_text()).get("lora") is not None:
        raise ValueError(f"{path} is a LoRA training checkpoint (adapters and their optimizer state, no base "
                         "weights); export the merged model with convert.lora_export.convert_lora_to_merged_hf "
                         "(`megatron-dppo convert megatron-to-hf` does), the adapters with convert_lora_to_peft "
                         "(`megatron-dppo convert megatron-to-peft`)")
    return path


HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                    "mistral": "MistralForCausalLM", "ministral": "MinistralForCausalLM", "phi3": "Phi3ForCausalLM",
                    "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


def arch_to_hf_config(arch: Any) -> dict:
    """A config.json dict for ``arch`` (for checkpoints that carry no HF config, e.g. training checkpoints).

    Token ids (bos/eos/pad) are unknown here and keep the transformers defaults: prefer the original config.
    """
    from transformers import AutoConfig

    if arch.family in ("deepseek_v3", "glm4_moe"):
        raise ValueError(f"cannot write an HF config for {arch.family!r} from the architecture alone (its router, "
                         "attention and MTP fields are not all recorded); pass the original config.json "
                         "(hf_config=... / --hf-config)")
    if arch.rope_scaling_type != "default":
        raise ValueError(f"cannot write an HF config for rope_scaling_type={arch.rope_scaling_type!r} from the "
                         "architecture alone; pass the original config.json (hf_config=...)")
    cfg = AutoConfig.for_model(
        arch.family, architectures=[HF_ARCHITECTURES[arch.family]], vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size, intermediate_size=arch.ffn_hidden_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, rope_theta=arch.rope_theta, rms_norm_eps=arch.norm_eps,
        tie_word_embeddings=arch.tie_embeddings, max_position_embeddings=arch.max_position_embeddings,
        initializer_range=arch.init_std, hidden_act="silu", **_moe_hf_fields(arch), **_window_hf_fields(arch))
    return cfg.to_dict()


def _window_hf_fields(arch: Any) -> dict:
    """The config.json fields of a sliding window (Mistral / Ministral / Phi-3) and Phi-3's partial rotary
    (megatron/dense_families.py)."""
    if arch.family not in ("mistral", "ministral", "phi3"):
        return {}
    fields: dict = {"sliding_window": arch.sliding_window}  # (None written out: Mistral's default is 4096)
    if arch.family == "phi3":
        fields["partial_rotary_factor"] = arch.rotary_percent
    if arch.family == "ministral":
        windowed = arch.window_layers or (True,) * arch.num_layers
        fields["layer_types"] = ["sliding_attention" if w and arch.sliding_window else "full_attention"
                                 for w in windowed]
    return fields


def _moe_hf_fields(arch: Any) -> dict:
    """The config.json fields of the sparse blocks (none for dense families)."""
    moe = arch.moe
    if moe is None:
        return {}
    common = dict(num_experts_per_tok=moe.topk, router_aux_loss_coef=moe.router_aux_loss_coef)
    if arch.family == "mixtral":  # every layer sparse; intermediate_size is the expert's
        if moe.expert_ffn_hidden_size != arch.ffn_hidden_size or not all(moe.sparse_layers):
            raise ValueError(f"a Mixtral config cannot express {moe} with ffn_hidden_size={arch.ffn_hidden_size}")
        return dict(common, num_local_experts=moe.num_experts, sliding_window=None)
    dense = [i for i, sparse in enumerate(moe.sparse_layers) if not sparse]
    return dict(common, num_experts=moe.num_experts, moe_intermediate_size=moe.expert_ffn_hidden_size,
                norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=dense)


def _arch_from_checkpoint_meta(model_dir: Path) -> Any | None:
    """The ModelArch recorded in a training checkpoint's common state (None when it has none)."""
    from megatron.core import dist_checkpointing

    from megatron_dppo.megatron.model import ModelArch

    try:
        common = dist_checkpointing.load_common_state_dict(str(model_dir))
    except Exception:  # noqa: BLE001 - no common state / other format
        return None
    arch = (common.get("meta") or {}).get("arch") if isinstance(common, dict) else None
    if not isinstance(arch, dict):
        return None
    if isinstance(arch.get("moe"), dict):  # dataclasses.asdict flattened the MoE part
        from megatron_dppo.megatron.moe import MoEArch

        moe = dict(arch["moe"], sparse_layers=tuple(arch["moe"]["sparse_layers"]))
        arch = dict(arch, moe=MoEArch(**moe))
    if isinstance(arch.get("mla"), dict):  # likewise the multi-latent attention (deepseek_v3)
        from megatron_dppo.megatron.deepseek_moe import MLAArch

        arch = dict(arch, mla=MLAArch(**arch["mla"]))
    return ModelArch(**arch)


def _resolve_hf_config(ckpt_dir: Path, model_dir: Path, hf_config: str | os.PathLike | None
                       ) -> tuple[dict, Path | None, str]:
    """(config dict, folder whose tokenizer files to copy or None, description of the source)."""
    if hf_config is not None:
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"hf_config={hf_config}: {path} does not exist")
        return read_config_json(path), path.parent, str(path)
    for folder in (ckpt_dir / HF_SUBDIR, model_dir / HF_SUBDIR, model_dir.parent / HF_SUBDIR):
        if (folder / "config.json").is_file():
            return read_config_json(folder / "config.json"), folder, str(folder / "config.json")
    arch = _arch_from_checkpoint_meta(model_dir)
    if arch is None:
        raise ValueError(f"no HF config for {ckpt_dir}: no {ckpt_dir / HF_SUBDIR}/config.json and no architecture "
                         "in the checkpoint metadata (pass hf_config=... / --hf-config)")
    return arch_to_hf_config(arch), None, f"the architecture recorded in {model_dir}"


def convert_megatron_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, tp: int = 1, pp: int = 1,
                           dtype: torch.dtype | None = None, hf_config: str | os.PathLike | None = None,
                           overwrite: bool = False, max_shard_bytes: int = 5 * 1024 ** 3,
                           bucket_bytes: int = 256 * 1024 ** 2, ep: int = 1, etp: int = 1) -> Path:
    """Convert a Megatron checkpoint (saved at any TP/PP/EP; resharded on load) to an HF folder, running at
    ``tp``/``pp`` (and, MoE, ``ep``/``etp``).

    ``ckpt_dir``: a converted checkpoint (``model/`` + ``hf/``), a bare dist-checkpoint folder, or a training
    checkpoint root / step folder (its model weights are read; optimizer and RNG state are ignored).
    The HF config comes from ``hf_config`` (a config.json or a folder holding one), else from an ``hf/`` folder
    next to the weights, else it is rebuilt from the architecture a training checkpoint records; tokenizer
    files next to the config are copied. ``dtype`` of the written tensors defaults to the config's
    ``dtype``/``torch_dtype`` (fp32 when absent). Rank 0 writes; the other ranks take part in the gathers.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir).absolute()
    model_dir = find_model_checkpoint(ckpt_dir)
    cfg, tokenizer_dir, cfg_source = _resolve_hf_config(ckpt_dir, model_dir, hf_config)
    arch = arch_from_hf_config(cfg, f"HF config from {cfg_source}")
    parallel = _check_parallel(arch, tp, pp, ep=ep, etp=etp)
    check_output_dir(out_dir, overwrite)
    if dtype is None:
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        dtype = getattr(torch, name) if isinstance(getattr(torch, str(name), None), torch.dtype) else torch.float32

    _init_parallel(parallel, arch)
    from megatron_dppo.convert.weights import export_hf_weights, unwrap_chunk
    from megatron_dppo.megatron.model import build_model_chunks

    chunks = build_model_chunks(arch, parallel, torch.float32)  # fp32 holds every stored dtype exactly
    for chunk in chunks:
        check_megatron_model(cfg, arch, unwrap_chunk(chunk))
    load_model_dist_checkpoint(chunks, model_dir)

    def body(tmp: Path) -> None:
        stream = export_hf_weights(chunks, arch, bucket_bytes=bucket_bytes, dtype=dtype)
        if D.rank() != 0:
            for _ in stream:  # take part in the collectives, keep nothing
                pass
            return
        write_safetensors_shards(stream, tmp, max_shard_bytes=max_shard_bytes)
        out_cfg = portable_config(cfg, dtype)
        (tmp / "config.json").write_text(json.dumps(out_cfg, indent=2, sort_keys=True) + "\n")
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
            make_tokenizer_config_portable(tmp)

    return _run_atomically(out_dir, body)
