"""LoRA adapters on the rollout side: what a weight push carries in a LoRA run, and how each engine applies it.

A LoRA run trains adapters on a frozen base (``megatron.lora``, docs/lora.md). The base never changes, so a rollout
engine receives it once (the first push of the process, and again after the engine discarded its weights: a
level-2 vLLM sleep) and then only the adapters: per version megabytes instead of the whole model. The stream is the
usual ``(name, tensor)`` pairs, base tensors first under their Hugging Face names, then the adapter tensors under
PEFT's names (``base_model.model.model.layers.<l>.self_attn.q_proj.lora_A.weight``, ``A: [r, in]``,
``B: [out, r]``); ``split_adapters`` separates them.

The engines apply the adapters UNMERGED: ``y = W x + scaling * B (A x)``, the computation the trainer's forward does,
rather than pushing ``W + scaling * B @ A``. Both are the same function; the unmerged one is what training measured
(in bf16 a merged weight rounds the small update ``scaling * B @ A`` into ``W``'s 8-bit mantissa, which moves the
rollout policy away from the trained one), and it is cheap: two thin matmuls per adapted layer, and only the adapters
travel. ``HFAdapters`` does it on a transformers model with forward hooks on its ``nn.Linear`` projections (the same
operation as PEFT's ``lora.Linear``, which the tests compare against); vLLM does it with its own LoRA kernels (an
adapter folder per version, ``write_adapter_folder``; ``rollout/vllm_engine.py``).

``adapter_config`` is the adapter's ``adapter_config.json`` as a dict (``convert.peft.peft_config``): rank ``r``,
``lora_alpha``, ``use_rslora``, ``target_modules`` (HF projection names).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor, nn

PREFIX = "base_model.model."  # PEFT's names: this + the HF parameter name of the base linear + .lora_{A,B}.weight
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def is_adapter_weight(name: str) -> bool:
    """A LoRA tensor of the weight stream (PEFT's name), not a base weight."""
    return name.startswith(PREFIX) and name.endswith(_SUFFIXES)


def adapter_scaling(adapter_config: dict[str, Any]) -> float:
    """``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), PEFT's scaling."""
    r = int(adapter_config["r"])
    return float(adapter_config["lora_alpha"]) / (math.sqrt(r) if adapter_config.get("use_rslora") else r)


def split_adapters(weights: Iterable[tuple[str, Tensor]], adapters: dict[str, Tensor]
                   ) -> Iterator[tuple[str, Tensor]]:
    """The base tensors of ``weights``, in order; the adapter tensors are put into ``adapters`` as the stream passes
    (complete once the generator is exhausted)."""
    for name, tensor in weights:
        if is_adapter_weight(name):
            adapters[name] = tensor
        else:
            yield name, tensor


def refuse_adapters(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """``weights``, raising ValueError at the first adapter tensor (an engine that serves no adapters)."""
    for name, tensor in weights:
        if is_adapter_weight(name):
            raise ValueError(f"LoRA adapter tensor {name!r} for an engine built without lora (the run's adapter "
                             "config)")
        yield name, tensor


def nbytes(weights: Iterable[tuple[str, Tensor]]) -> int:
    """Bytes of a list of weights."""
    return sum(t.numel() * t.element_size() for _, t in weights)


class HFAdapters:
    """Unmerged LoRA adapters on a transformers causal LM: a forward hook on every adapted ``nn.Linear``
    (``target_modules`` of ``adapter_config`` inside the decoder layers) adds ``scaling * B (A x)``.

    The adapter tensors are plain tensors held here (not parameters of the model, so a base push and the model's
    ``state_dict`` do not see them); ``load`` replaces all of them at once and refuses a set that misses an
    adapted layer or has a wrong name or shape. Until the first ``load`` every adapter is zero (the base model)."""

    def __init__(self, model: nn.Module, adapter_config: dict[str, Any]):
        self.scaling = adapter_scaling(adapter_config)
        self.rank = int(adapter_config["r"])
        targets = set(adapter_config["target_modules"])
        self.layers: dict[str, nn.Linear] = {
            name: module for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets and ".layers." in name}
        if not self.layers:
            raise ValueError(f"LoRA target_modules {sorted(targets)} match no linear layer of "
                             f"{type(model).__name__}")
        self.tensors: dict[str, tuple[Tensor, Tensor]] = {}
        for name, linear in self.layers.items():
            w = linear.weight
            self.tensors[name] = (w.new_zeros(self.rank, linear.in_features), w.new_zeros(linear.out_features,
                                                                                         self.rank))
            linear.register_forward_hook(self._hook(name))
        self.loaded = False

    def _hook(self, name: str):
        def hook(module, args, output):
            a, b = self.tensors[name]
            x = args[0]
            return output + nn.functional.linear(nn.functional.linear(x.to(a.dtype), a), b).to(output.dtype) \
                * self.scaling
        return hook

    def expected(self) -> dict[str, tuple[int, ...]]:
        """{PEFT tensor name: shape} of every adapter."""
        out = {}
        for name, linear in self.layers.items():
            out[f"{PREFIX}{name}.lora_A.weight"] = (self.rank, linear.in_features)
            out[f"{PREFIX}{name}.lora_B.weight"] = (linear.out_features, self.rank)
        return out

    @torch.no_grad()
    def load(self, adapters: dict[str, Tensor]) -> int:
        """Replace every adapter with ``adapters`` (PEFT names); returns the number of tensors."""
        expected = self.expected()
        unknown = sorted(set(adapters) - set(expected))
        missing = sorted(set(expected) - set(adapters))
        if unknown or missing:
            raise ValueError(f"LoRA adapter tensors: unknown {unknown[:3]}, missing {missing[:3]} (an adapter "
                             f"push carries every adapted layer; {len(expected)} tensors expected)")
        for name, shape in expected.items():
            if tuple(adapters[name].shape) != shape:
                raise ValueError(f"LoRA tensor {name!r} has shape {tuple(adapters[name].shape)}, the model expects "
                                 f"{shape} (rank {self.rank})")
        for name, linear in self.layers.items():
            w = linear.weight
            a = adapters[f"{PREFIX}{name}.lora_A.weight"].to(device=w.device, dtype=w.dtype)
            b = adapters[f"{PREFIX}{name}.lora_B.weight"].to(device=w.device, dtype=w.dtype)
            self.tensors[name] = (a.clone(), b.clone())
        self.loaded = True
        return len(adapters)


def write_adapter_folder(adapters: dict[str, Tensor], adapter_config: dict[str, Any], folder: str | os.PathLike
                         ) -> Path:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) of ``adapters``: what vLLM's
    ``LoRARequest`` loads. Written into ``.NAME.partial`` and renamed, so a reader never sees half a folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.parent / f".{folder.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in adapters.items()}, str(tmp / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
