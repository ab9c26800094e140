"""Export a LoRA training run: its checkpoint (adapters and their optimizer state, no base weights) -> a PEFT adapter
folder, or -> a merged Hugging Face model (``W + scaling * B @ A``) on the base the run trained on.

    megatron-dppo convert megatron-to-peft RUN/checkpoints OUT_DIR          (the adapters, PEFT's format)
    megatron-dppo convert megatron-to-hf   RUN/checkpoints OUT_DIR [--base HF_DIR]   (merged)

The checkpoint names its LoRA config and its base (folder and SHA-256 of the folder's config.json and safetensors,
``megatron.lora.LoraBase``). The merged export loads the base from that folder (or ``base``, which must have the same
checksum), adds the adapters and streams the merged weights (``convert.peft.export_merged_hf_weights``); the HF
config and tokenizer files come from the run's ``checkpoints/hf`` folder, as for a full run. Both run at any
``tp``/``pp`` (MoE: ``ep``/``etp``; ``torchrun --nproc-per-node=TP*PP``; one plain process by default) and write
atomically.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megatron_dppo.distributed import collectives as D


def lora_checkpoint(ckpt_dir: str | os.PathLike) -> tuple[Path, dict] | None:
    """(step folder, its ``megatron_dppo.json``) when ``ckpt_dir`` is a LoRA training checkpoint (a step folder or a
    checkpoint root with ``latest``), else None. Reads one small file, no process group."""
    from megatron_dppo.megatron.checkpoint import resolve_checkpoint

    ckpt_dir = Path(ckpt_dir)
    try:
        path = resolve_checkpoint(ckpt_dir)
    except ValueError:
        return None
    meta_file = path / "megatron_dppo.json"
    if not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    return (path, meta) if meta.get("lora") is not None else None


def _lora_config(meta: dict) -> Any:
    from megatron_dppo.megatron.lora import LoraConfig

    fields = dict(meta["lora"], target_modules=tuple(meta["lora"]["target_modules"]))
    return LoraConfig(**fields)


def _chunks_with_adapters(path: Path, meta: dict, tp: int, pp: int, ep: int, etp: int) -> tuple[list, Any, Any]:
    """This rank's model chunks at tp/pp, adapters attached and loaded from the checkpoint (base weights still the
    random initialisation)."""
    from megatron_dppo.convert.checkpoint import _arch_from_checkpoint_meta, _check_parallel, _init_parallel
    from megatron_dppo.megatron.checkpoint import load_adapters
    from megatron_dppo.megatron.lora import add_lora_adapters, check_lora_supported
    from megatron_dppo.megatron.model import build_model_chunks

    arch = _arch_from_checkpoint_meta(path)
    cfg = _lora_config(meta)
    parallel = _check_parallel(arch, tp, pp, ep=ep, etp=etp)
    check_lora_supported(arch, parallel, cfg)
    _init_parallel(parallel, arch)
    chunks = build_model_chunks(arch, parallel, torch.float32)
    add_lora_adapters(chunks, cfg)
    load_adapters(chunks, path)
    return chunks, arch, cfg


def _base_folder(meta: dict, base: str | os.PathLike | None, path: Path) -> Path:
    """The HF folder of the run's base: ``base`` or the one the checkpoint records, checked by its SHA-256."""
    from megatron_dppo.megatron.lora import base_checksum

    recorded = meta.get("lora_base") or {}
    folder = Path(base) if base is not None else (Path(recorded["path"]) if recorded.get("path") else None)
    if folder is None:
        raise ValueError(f"{path}: the checkpoint records no base folder (an engine without set_lora_base); pass "
                         "the base HF folder (--base)")
    if not folder.is_dir():
        raise ValueError(f"{path}: the base folder {str(folder)!r} does not exist; pass it (--base)")
    found = base_checksum(folder)
    if recorded.get("sha256") is not None and found != recorded["sha256"]:
        raise ValueError(f"{path}: the adapters were trained on the base {recorded.get('path')!r} (sha256 "
                         f"{recorded['sha256']}), {str(folder)!r} has sha256 {found}")
    return folder


def convert_lora_to_peft(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                         ep: int = 1, etp: int = 1, dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """The adapters of a LoRA training checkpoint as a PEFT adapter folder (``PeftModel.from_pretrained(base,
    out_dir)`` loads it; ``base_model_name_or_path`` is the recorded base folder). Collective over tp*pp ranks."""
    from megatron_dppo.convert.hf_io import check_output_dir
    from megatron_dppo.convert.peft import export_peft_adapter

    found = lora_checkpoint(ckpt_dir)
    if found is None:
        raise ValueError(f"{ckpt_dir}: not a LoRA training checkpoint (megatron-to-peft exports the adapters of a "
                         "run with model.lora; a full run converts with megatron-to-hf)")
    path, meta = found
    out_dir = Path(out_dir).absolute()
    check_output_dir(out_dir, overwrite)
    chunks, _, cfg = _chunks_with_adapters(path, meta, tp, pp, ep, etp)
    base = (meta.get("lora_base") or {}).get("path")
    written = export_peft_adapter(chunks, cfg, out_dir, base_model_name_or_path=base, dtype=dtype)
    D.barrier()
    return written or out_dir


def convert_lora_to_merged_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, base=None, tp: int = 1,
                              pp: int = 1, ep: int = 1, etp: int = 1, dtype: torch.dtype | None = None, hf_config=None,
                              overwrite: bool = False, max_shard_bytes: int = 5 * 1024 ** 3,
                              bucket_bytes: int = 256 * 1024 ** 2) -> Path:
    """The merged model of a LoRA training checkpoint (every adapted weight ``W + scaling * B @ A``) as an HF folder
    that transformers and vLLM load without LoRA. Collective over tp*pp ranks; rank 0 writes."""
    from megatron_dppo.convert.checkpoint import (
        _resolve_hf_config,
        _run_atomically,
        arch_from_hf_config,
        load_hf_folder,
    )
    from megatron_dppo.convert.hf_io import (
        check_output_dir,
        copy_tokenizer_files,
        make_tokenizer_config_portable,
        portable_config,
        write_safetensors_shards,
    )
    from megatron_dppo.convert.peft import export_merged_hf_weights

    found = lora_checkpoint(ckpt_dir)
    if found is None:
        raise ValueError(f"{ckpt_dir}: not a LoRA training checkpoint")
    path, meta = found
    out_dir = Path(out_dir).absolute()
    base_dir = _base_folder(meta, base, path)
    cfg, tokenizer_dir, source = _resolve_hf_config(Path(ckpt_dir), path, hf_config)
    arch_from_hf_config(cfg, f"HF config from {source}")
    check_output_dir(out_dir, overwrite)
    if dtype is None:
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        dtype = getattr(torch, name) if isinstance(getattr(torch, str(name), None), torch.dtype) else torch.float32

    chunks, arch, _ = _chunks_with_adapters(path, meta, tp, pp, ep, etp)
    load_hf_folder(chunks, base_dir, arch)

    def body(tmp: Path) -> None:
        stream = export_merged_hf_weights(chunks, arch, bucket_bytes=bucket_bytes, dtype=dtype)
        if D.rank() != 0:
            for _ in stream:  # take part in the collectives
                pass
            return
        write_safetensors_shards(stream, tmp, max_shard_bytes=max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(portable_config(cfg, dtype), indent=2, sort_keys=True) + "\n")
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
            make_tokenizer_config_portable(tmp)

    return _run_atomically(out_dir, body)
