"""Move the training state off the accelerator while a colocated rollout engine generates, and back.

While vLLM generates, Megatron's parameters, gradient buffers, fp32 master weights and Adam moments are idle but
hold most of the GPU (for a 7B model in bf16 with the distributed optimizer on one GPU: ~14 GB params + ~28 GB
grads in fp32 + ~84 GB fp32 master/Adam). ``TrainStateOffloader`` frees them at the level of storages: every
distinct storage behind those tensors is copied to (pinned) host memory and resized to 0 bytes, so every view of
it (Megatron's contiguous param/grad buffers and the parameters that are views into them) is released at once
without touching Python references; ``onload`` resizes the storages back and copies the bytes in, bit-exact.

Storages are found through the public objects only: the model chunks' parameters (and ``main_grad``), their DDP
buffers (``param_data``/``grad_data``), the reference chunks, and every inner ``torch.optim.Optimizer`` of the
(chained / distributed) Megatron optimizer: its parameter groups (the fp32 master weights under bf16) and its
state (Adam moments). Nothing is offloaded twice (storages are deduplicated by address).
"""
from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)


def _inner_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    if optimizer is None:
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
        return
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:  # e.g. dense + expert optimizers of an MoE model; its .optimizer asserts a single one
        for child in chained:
            yield from _inner_optimizers(child)
        return
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        yield from _inner_optimizers(inner)


def train_state_tensors(model_chunks: Iterable, optimizer=None, *, grads: bool = True) -> Iterator[torch.Tensor]:
    """Every tensor of the training state: parameters, DDP buffers, optimizer params (fp32 master weights) and
    state (Adam moments), and with ``grads`` the gradients (main_grad / grad / DDP grad buffers)."""
    buffer_fields = ("param_data", "grad_data") if grads else ("param_data",)
    for chunk in model_chunks:
        for buffer in list(getattr(chunk, "buffers", None) or []) + list(getattr(chunk, "expert_parallel_buffers",
                                                                                None) or []):
            for name in buffer_fields:
                tensor = getattr(buffer, name, None)
                if isinstance(tensor, torch.Tensor):
                    yield tensor
        for param in chunk.parameters():
            yield param.data
            for name in ("main_grad", "grad") if grads else ():
                tensor = getattr(param, name, None)
                if isinstance(tensor, torch.Tensor):
                    yield tensor
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                yield param.data
                if grads and param.grad is not None:
                    yield param.grad
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value


class TrainStateOffloader:
    """``offload()`` / ``onload()`` the storages of ``tensors()`` that live on ``device_type`` (see the module
    docstring). ``tensors`` is called at each offload, so buffers created after construction are included."""

    def __init__(self, tensors, device_type: str = "cuda"):
        self._tensors = tensors
        self.device_type = device_type
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self) -> int:
        """Copy every distinct non-empty storage to host memory and free it; returns the bytes freed."""
        if self._saved:
            raise RuntimeError("the training state is already offloaded; call onload() first")
        seen: set[int] = set()
        freed = 0
        pin = self.device_type == "cuda" and torch.cuda.is_available()
        for tensor in self._tensors():
            if tensor.device.type != self.device_type:
                continue
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes_view(storage), non_blocking=pin)
            self._saved.append((storage, host))
            freed += nbytes
        if pin:
            torch.cuda.synchronize()
        for storage, _ in self._saved:
            storage.resize_(0)
        logger.info("offloaded %.2f GiB of training state to host memory", freed / 2**30)
        return freed

    def onload(self) -> int:
        """Restore every offloaded storage bit-exact; returns the bytes restored (0 when nothing is offloaded)."""
        restored = 0
        for storage, host in self._saved:
            storage.resize_(host.numel())
            _bytes_view(storage).copy_(host, non_blocking=host.is_pinned())
            restored += host.numel()
        if self._saved and self.device_type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize()
        self._saved = []
        return restored


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def engine_offloader(engine, device_type: str = "cuda") -> TrainStateOffloader:
    """The offloader of a ``train_step.PolicyEngine``: policy chunks, optimizer, reference chunks."""
    def tensors():
        yield from train_state_tensors(engine.model_chunks, engine.optimizer)
        if engine.reference_chunks is not None:
            yield from train_state_tensors(engine.reference_chunks)

    return TrainStateOffloader(tensors, device_type)
