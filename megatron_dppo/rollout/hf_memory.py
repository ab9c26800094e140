"""Free a colocated HF rollout model's weights between generations, and give them back for the next push.

A colocated CPU run holds the policy twice: the trainer's parameters (with their gradients and Adam state) and the
rollout engine's copy, which only generation reads and every push overwrites whole. ``release`` frees the copy
after generating (``HFRolloutEngine.sleep`` with ``release_weights_on_sleep``); ``allocate`` gives every
parameter uninitialized memory again before the next push fills it, so the copy is absent while the trainer's
activations, gradients and optimizer are at their peak.

``allocate`` places all parameters in ONE flat buffer (each parameter a view into it): a single allocation larger
than glibc's mmap threshold, which ``release`` returns to the operating system at once. Tensors of a few MiB each,
freed and allocated one by one, can stay in the allocator's heap instead, and the resident memory would not drop.
A parameter shared by two modules (tied embeddings) is one parameter and gets one slot. Buffers (e.g. rotary
frequencies) are not weights: they stay.
"""
from __future__ import annotations

import torch


def _unique_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


def release(model: torch.nn.Module) -> None:
    """Drop every parameter's storage: ``param.data`` becomes an empty tensor of the same dtype and device, the
    shape is remembered for ``allocate``."""
    for p in _unique_parameters(model):
        p._released_shape = tuple(p.shape)  # the shape ``allocate`` restores
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def is_released(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "_released_shape") for p in model.parameters())


def allocate(model: torch.nn.Module) -> None:
    """Give every released parameter uninitialized memory: views into one flat buffer per (dtype, device)."""
    params = [p for p in _unique_parameters(model) if hasattr(p, "_released_shape")]
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in params:
        by_kind.setdefault((p.dtype, p.device), []).append(p)
    for (dtype, device), group in by_kind.items():
        sizes = [int(torch.Size(p._released_shape).numel()) for p in group]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        for p, piece in zip(group, flat.split(sizes)):
            p.data = piece.view(p._released_shape)
            del p._released_shape


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage the model holds now (0 after ``release``; shared storage counted once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())
