"""Small named helpers for the trainer's distributed plumbing (process groups come from megatron/parallel.py).

The trainer runs the same Python on every rank. Data that every rank must agree on is either computed
deterministically from the same inputs everywhere (prompt order, advantages, packing plan) or decided on rank 0
and broadcast (every random pruning draw: docs/architecture.md "one generator per decision, seeded from
(seed, step), drawn on one rank and broadcast"). Work that can be split (generation, reward scoring,
evaluation) is sharded over ranks with :func:`map_sharded` and gathered back in the original order.

All helpers are no-ops when torch.distributed is not initialized (a plain single process).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
R = TypeVar("R")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (pickled; for small decisions such as keep masks)."""
    if not is_initialized() or world_size() == 1:
        return obj
    box = [obj if rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
    if not is_initialized() or world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of all ranks, on every rank (collective)."""
    if not is_initialized() or world_size() == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(value: float) -> float:
    """The sum of ``value`` over all ranks, on every rank (collective; float64, exact for small sums)."""
    if not is_initialized() or world_size() == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return float(t.item())


def all_ranks(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on all of them (e.g. every rank finished writing its shard)."""
    return max_over_ranks(0 if flag else 1) == 0


def shard_bounds(n: int, num_shards: int, index: int) -> tuple[int, int]:
    """Contiguous slice ``[start, stop)`` of ``n`` items for shard ``index`` (sizes differ by at most one)."""
    base, extra = divmod(n, num_shards)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def map_sharded(fn: Callable[[list[T], int], list[R]], items: Sequence[T],
                shard_index: int | None = None, num_shards: int | None = None) -> list[R]:
    """Apply ``fn(shard_items, shard_index) -> one result per item`` to this rank's contiguous shard, gather all
    shards, and return the results in the order of ``items`` on every rank.

    Default sharding is over all ranks. Engines whose own parallelism spans several ranks (vLLM with tensor
    parallel: every rank of a TP group must call ``generate`` with the same prompts) pass their DP coordinates
    as ``shard_index``/``num_shards``; the gather then returns duplicates from those ranks and the first copy of
    each shard is used.
    """
    shard_index = rank() if shard_index is None else shard_index
    num_shards = world_size() if num_shards is None else num_shards
    start, stop = shard_bounds(len(items), num_shards, shard_index)
    mine = fn(list(items[start:stop]), shard_index) if stop > start else []
    if len(mine) != stop - start:
        raise ValueError(f"sharded function returned {len(mine)} results for {stop - start} items")
    gathered = all_gather_objects((shard_index, mine))
    by_shard: dict[int, list[R]] = {}
    for index, results in gathered:
        by_shard.setdefault(index, results)
    out: list[R] = []
    for index in range(num_shards):
        out.extend(by_shard.get(index, []))
    if len(out) != len(items):
        raise RuntimeError(f"gathered {len(out)} results for {len(items)} items (shards {sorted(by_shard)})")
    return out


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from (seed, step, tag, ...): independent streams per decision, identical on every rank."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def set_cpu_threads(local_world_size: int, threads: int | None = None) -> int:
    """Torch threads of this process: ``threads``, else OMP_NUM_THREADS when set, else the machine's cores split
    between the processes of this node. (No-op on GPU machines, where the CPU does little.)"""
    if torch.cuda.is_available():
        return torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS") and threads is None:
        return torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def pick_free_port_if_single_process() -> None:
    """A plain ``python``/``megatron-dppo`` run (no launcher variables) still needs a rendezvous port for its
    one-process group; take a free one instead of the fixed default, so concurrent runs on one machine coexist."""
    launcher_vars = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK",
                     "MASTER_PORT")
    if is_initialized() or any(os.environ.get(v) for v in launcher_vars):
        return
    from megatron_dppo.distributed.launch import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

