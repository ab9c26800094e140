"""How much GPU memory a vLLM rollout engine is given.

Memory (GPU only). vLLM's ``gpu_memory_utilization`` u is a fraction of the GPU's TOTAL memory: at start-up vLLM
asks for ceil(total * u) bytes of what is free and refuses to start when less is free (vLLM 0.32,
``vllm.v1.worker.utils.request_memory``); its KV cache is what that budget leaves after weights and activations.
Colocated, the trainer is built first, so u = 0.5 fails once the trainer holds about half the GPU (~69 GiB of an
H200). ``vllm_memory_utilization`` sizes u from the memory free when the engine is built (``torch.cuda.
mem_get_info`` after ``empty_cache``, as vLLM measures it) and the requested budget: the request when it fits, else
what is free less ``STARTUP_RESERVE_BYTES`` (logged), refused with ValueError naming ``rollout.gpu_memory_utilization``
when that cannot hold vLLM's share of the weights and one full-length sequence of KV cache
(``vllm_memory_floor``).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

logger = logging.getLogger("megatron_dppo.rollout")

GIB = 1 << 30
# Left free beyond vLLM's budget when it is sized from the free memory: vLLM creates its NCCL communicators (and
# this process's CUDA context may grow) between our measurement and its own snapshot.
STARTUP_RESERVE_BYTES = GIB


def vllm_memory_floor(hf_config: dict, n_weights: int, dtype_bytes: int, tensor_parallel_size: int,
                      max_model_len: int | None = None) -> int:
    """The least budget (bytes per GPU) a vLLM engine can start with: its TP share of the ``n_weights`` weights
    and the KV cache of one sequence of ``max_model_len`` tokens (default the config's max_position_embeddings).
    vLLM's activations and CUDA graphs come on top, so this is necessary, not sufficient."""
    tp = max(1, int(tensor_parallel_size))
    floor = -(-n_weights * dtype_bytes // tp)
    layers, heads = hf_config.get("num_hidden_layers"), hf_config.get("num_attention_heads")
    max_len = max_model_len or hf_config.get("max_position_embeddings")
    if layers and heads and max_len:
        head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
        kv_heads = max(1, int(hf_config.get("num_key_value_heads") or heads) // tp)  # replicated when fewer than tp
        floor += 2 * int(layers) * kv_heads * int(head_dim) * dtype_bytes * int(max_len)
    return floor


def model_memory_floor(model_path: str | Path, tensor_parallel_size: int, dtype: str,
                       expected: dict[str, tuple[int, ...]], max_model_len: int | None = None) -> int:
    """``vllm_memory_floor`` of the HF model in ``model_path`` (config.json) with the weights ``expected``
    (name -> shape, ``vllm_engine.expected_hf_weights``; a tied output layer counted once) in vLLM's ``dtype``."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    n_weights = sum(math.prod(shape) for name, shape in expected.items() if not (tied and name == "lm_head.weight"))
    torch_dtype = getattr(torch, str(dtype), None)
    dtype_bytes = torch_dtype.itemsize if isinstance(torch_dtype, torch.dtype) else 2  # "auto": the bf16 of GPUs
    return vllm_memory_floor(config, n_weights, dtype_bytes, tensor_parallel_size, max_model_len)


def vllm_memory_utilization(requested: float, free_bytes: int, total_bytes: int, floor_bytes: int = 0,
                            reserve_bytes: int = STARTUP_RESERVE_BYTES) -> float:
    """The ``gpu_memory_utilization`` to give vLLM on a GPU with ``free_bytes`` of ``total_bytes`` free now.

    ``requested`` (rollout.gpu_memory_utilization) is the most vLLM may take, a fraction of the total as vLLM reads
    it. It is returned unchanged when ceil(total * requested) <= free - reserve (vLLM's start-up check, with room
    for what vLLM allocates before it measures); otherwise vLLM gets what is free less ``reserve_bytes``, rounded
    down to 1e-4 of the total. Raises ValueError naming rollout.gpu_memory_utilization when the budget is below
    ``floor_bytes`` (``vllm_memory_floor``): the request itself is too small, or too little memory is free."""
    if not 0 < requested <= 1:
        raise ValueError(f"rollout.gpu_memory_utilization={requested} is invalid: expected a fraction in (0, 1]")
    if total_bytes <= 0 or not 0 <= free_bytes <= total_bytes:
        raise ValueError(f"GPU memory figures do not add up: {free_bytes} bytes free of {total_bytes}")
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    if requested * total_bytes < floor_bytes:
        raise ValueError(
            f"rollout.gpu_memory_utilization={requested} gives vLLM {gib(requested * total_bytes)} of the GPU's "
            f"{gib(total_bytes)}, less than the {gib(floor_bytes)} it needs at least (its share of the weights and "
            f"one full-length sequence of KV cache); raise it to at least {floor_bytes / total_bytes:.3f}")
    room = free_bytes - reserve_bytes
    if math.ceil(requested * total_bytes) <= room:
        return requested
    fits = math.floor(max(room, 0) / total_bytes * 1e4) / 1e4
    if fits * total_bytes < floor_bytes:
        raise ValueError(
            f"rollout.gpu_memory_utilization={requested}: vLLM cannot start on this GPU: {gib(free_bytes)} of its "
            f"{gib(total_bytes)} are free when the rollout engine is built (the trainer, built first, and other "
            f"processes hold the rest); less {gib(reserve_bytes)} kept for vLLM's start-up that is below the "
            f"{gib(floor_bytes)} vLLM needs at least (its share of the weights and one full-length sequence of KV "
            "cache). Make the trainer smaller per GPU (more parallel.tp / parallel.pp, "
            "optim.distributed_optimizer=true), or give the rollout its own GPUs (rollout.placement=separate)")
    logger.warning("rollout.gpu_memory_utilization=%s asks for %s but %s of the GPU's %s are free when the vLLM "
                   "engine is built (the trainer holds the rest): vLLM gets gpu_memory_utilization=%s (%s, a smaller "
                   "KV cache)", requested, gib(requested * total_bytes), gib(free_bytes), gib(total_bytes), fits,
                   gib(fits * total_bytes))
    return fits
