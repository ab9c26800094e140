"""LoRA adapters <-> PEFT's format, and the merged Hugging Face model.

A PEFT LoRA adapter folder (what ``PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained`` reads):

    adapter_config.json          {"peft_type": "LORA", "r", "lora_alpha", "lora_dropout", "target_modules",
                                  "use_rslora", "bias": "none", ...}
    adapter_model.safetensors    base_model.model.model.layers.<l>.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
                                 base_model.model.model.layers.<l>.mlp.{gate,up,down}_proj.lora_{A,B}.weight
                                 (A: [r, in], B: [out, r], the HF orientation of nn.Linear)

Our adapters are per HF projection (``megatron.lora``), so the two are the same numbers: export gathers the
full tensors (TP, PP) and renames them; import reads them, checks what our adapters cannot represent (DoRA,
biases, per-layer ranks or alphas, a subset of layers, fan_in_fan_out, modules_to_save, embeddings), and
slices them into this rank's shards. ``target_modules`` is written as the list of HF projection names; on import
the projections present in the weights decide what is adapted.

``export_merged_hf_weights``: the HF weights of the merged model ``W + scaling * B @ A`` (a stream, as
``export_hf_weights``), e.g. for a rollout engine without LoRA support or a standalone fine-tuned model.

``export_rollout_weights``: what a LoRA run pushes to a rollout engine (``rollout.lora``): the base's HF weights
when the engine has none yet, then the adapter tensors under their PEFT names.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from megatron_dppo.megatron.lora import (
    BASE_LINEAR,
    PROJECTIONS,
    LoraConfig,
    full_lora_tensors,
    load_full_lora_tensors,
    merged,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."
HF_NAME = {p: BASE_LINEAR[p][2].split(".")[-1] for p in PROJECTIONS}  # q -> q_proj, proj -> o_proj, fc2 -> down_proj
PROJECTION_OF = {v: k for k, v in HF_NAME.items()}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.(lora_A|lora_B)\.weight$")
# adapter_config.json entries we cannot represent: field -> the values we accept
_MUST_BE = {"bias": ("none",), "use_dora": (False, None), "fan_in_fan_out": (False, None),
            "modules_to_save": (None, []), "layers_to_transform": (None, []), "layers_pattern": (None, [], ""),
            "rank_pattern": (None, {}), "alpha_pattern": (None, {}), "trainable_token_indices": (None, [], {}),
            "lora_bias": (False, None), "use_qalora": (False, None), "target_parameters": (None, []),
            "layer_replication": (None, []), "use_bdlora": (False, None)}


def peft_name(layer: int, projection: str, which: str) -> str:
    """PEFT's tensor name of one adapter matrix (``which``: lora_A | lora_B)."""
    return f"{PREFIX}{layer}.{BASE_LINEAR[projection][2]}.{which}.weight"


def peft_config(cfg: LoraConfig, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of our adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "use_rslora": cfg.use_rslora,
        "target_modules": sorted(HF_NAME[p] for p in cfg.projections), "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False,
    }


def export_peft_adapter(chunks: Sequence[nn.Module], cfg: LoraConfig, out_dir: str | os.PathLike, *,
                        base_model_name_or_path: str | None = None, dtype: torch.dtype | None = None) -> Path | None:
    """Write the adapters of the (TP/PP-sharded) chunks as a PEFT adapter folder. Collective: every rank calls
    it; rank 0 writes (into ``.NAME.partial``, then renamed), the others return None. ``dtype`` casts the saved
    tensors (default: the parameters' dtype)."""
    from safetensors.torch import save_file

    tensors = full_lora_tensors(chunks)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    out_dir = Path(out_dir).absolute()
    tmp = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    named = {peft_name(layer, proj, which): (t if dtype is None else t.to(dtype)).contiguous()
             for (layer, proj, which), t in tensors.items()}
    save_file(named, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(peft_config(cfg, base_model_name_or_path), indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def read_peft_adapter(folder: str | os.PathLike, num_layers: int | None = None
                      ) -> tuple[LoraConfig, dict[tuple[int, str, str], Tensor]]:
    """(our LoraConfig, {(layer, projection, lora_A | lora_B): tensor}) of a PEFT LoRA adapter folder.

    Raises ValueError naming what our adapters cannot represent. ``num_layers``: the model's, to require an
    adapter in every layer for each adapted projection (PEFT's ``layers_to_transform`` subsets are refused)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{folder}: not a PEFT adapter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    raw = json.loads(config_path.read_text())
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{config_path}: peft_type={raw.get('peft_type')!r}; only LORA adapters import")
    bad = {k: raw[k] for k, ok in _MUST_BE.items() if k in raw and raw[k] not in ok}
    if bad:
        raise ValueError(f"{config_path}: unsupported LoRA options {bad} (supported: "
                         f"{ {k: ok[0] for k, ok in _MUST_BE.items() if k in bad} })")
    tensors, unknown = {}, []
    for key, value in load_file(str(weights_path)).items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in PROJECTION_OF:
            unknown.append(key)
            continue
        tensors[(int(match.group(1)), PROJECTION_OF[match.group(2)], match.group(3))] = value
    if unknown:
        raise ValueError(f"{weights_path}: tensors our LoRA cannot represent (embeddings, other modules, "
                         f"adapter names): {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    projections = sorted({proj for _, proj, _ in tensors}, key=PROJECTIONS.index)
    if not projections:
        raise ValueError(f"{weights_path}: no LoRA tensors")
    ranks = {int(t.shape[0]) for (_, _, which), t in tensors.items() if which == "lora_A"}
    if ranks != {int(raw["r"])}:
        raise ValueError(f"{weights_path}: lora_A ranks {sorted(ranks)} differ from r={raw['r']} in {CONFIG_FILE}")
    layers = sorted({layer for layer, _, _ in tensors})
    want = range(num_layers) if num_layers is not None else range(layers[-1] + 1)
    missing = [peft_name(layer, p, w) for layer in want for p in projections for w in ("lora_A", "lora_B")
               if (layer, p, w) not in tensors]
    if missing:
        raise ValueError(f"{weights_path}: adapters must cover every layer of each adapted projection; missing "
                         f"{missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if num_layers is not None and layers[-1] >= num_layers:
        raise ValueError(f"{weights_path}: adapters for layer {layers[-1]}, the model has {num_layers} layers")
    cfg = LoraConfig(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]), dropout=float(raw.get("lora_dropout") or 0),
                     target_modules=tuple(projections), use_rslora=bool(raw.get("use_rslora", False)))
    return cfg, tensors


def load_peft_adapter(chunks: Sequence[nn.Module], folder: str | os.PathLike, cfg: LoraConfig, num_layers: int
                      ) -> LoraConfig:
    """Warm start: copy a PEFT adapter into the adapters of chunks built with ``cfg`` (not collective; each rank
    takes its shards). ``cfg`` must adapt the same projections with the same rank and scaling as the folder
    (``read_peft_adapter(folder)[0]`` gives one that does). Returns the folder's config."""
    found, tensors = read_peft_adapter(folder, num_layers)
    mine = (cfg.rank, cfg.projections, cfg.scaling)
    theirs = (found.rank, found.projections, found.scaling)
    if mine != theirs:
        raise ValueError(f"{folder}: adapter (rank, projections, scaling)={theirs}, the model's lora config gives "
                         f"{mine}; build the engine with read_peft_adapter(folder)[0]")
    load_full_lora_tensors(chunks, tensors)
    return found


def export_merged_hf_weights(chunks: Sequence[nn.Module], arch: Any, **kwargs) -> Iterator[tuple[str, Tensor]]:
    """``export_hf_weights`` of the merged model (every adapted weight ``W + scaling * B @ A``); the chunks keep
    their exact base weights afterwards. Collective, like ``export_hf_weights`` (same ``kwargs``)."""
    from megatron_dppo.convert.weights import export_hf_weights

    with merged(chunks):
        yield from export_hf_weights(chunks, arch, **kwargs)


def export_adapter_weights(chunks: Sequence[nn.Module], dtype: torch.dtype | None = None
                           ) -> Iterator[tuple[str, Tensor]]:
    """The full adapter tensors under their PEFT names (``peft_name``), on every rank. Collective (gathers over TP,
    collects over PP: ``lora.full_lora_tensors``)."""
    for (layer, proj, which), t in full_lora_tensors(chunks).items():
        yield peft_name(layer, proj, which), t if dtype is None else t.to(dtype)


def export_rollout_weights(chunks: Sequence[nn.Module], arch: Any, *, base: bool, bucket_bytes: int = 256 << 20,
                           dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """A LoRA run's weight push (``rollout.lora``): the base model's HF weights first when ``base`` (the engine has
    none yet; adapters excluded, as ``export_hf_weights`` always does), then every adapter tensor. Collective."""
    from megatron_dppo.convert.weights import export_hf_weights

    if base:
        yield from export_hf_weights(chunks, arch, bucket_bytes, dtype=dtype)
    yield from export_adapter_weights(chunks, dtype)
