"""Moving weights between (sharded) Megatron model chunks and HF tensor names.

``export_hf_weights``  Megatron -> stream of (HF name, full tensor), gathered over TP and PP in bounded buckets.
``load_hf_weights``    HF tensors -> this rank's Megatron chunks (its TP shard of its PP stage's layers).

Both work on the *model chunks* one rank holds (a list: one chunk per virtual pipeline stage), wrapped or not in
DDP / Float16Module, and use Megatron's parallel_state groups when they are initialized (single process
otherwise). Parameter names inside a chunk are local (``decoder.layers.0`` is the first layer *of this stage*);
they are made global with each layer's ``layer_number`` (1-based, global), which handles PP and VPP offsets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_dppo.convert.mapping import MappingIndex, ParamMapping, detect_spec, mapping_table

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def unwrap_chunk(chunk: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (each exposes the wrapped model as ``.module``)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, nn.Module):
        chunk = chunk.module
    return chunk


def global_param_names(chunk: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(global Megatron name, parameter) for every parameter of one chunk, layer indices made global."""
    model = unwrap_chunk(chunk)
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    out = []
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            _, _, local, rest = name.split(".", 3)
            global_index = layers[int(local)].layer_number - 1
            name = f"decoder.layers.{global_index}.{rest}"
        out.append((name, param))
    return out


@dataclass(frozen=True)
class _Groups:
    tp_group: Any
    pp_group: Any
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int


def _parallel_groups() -> _Groups:
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized() and ps.model_parallel_is_initialized()):
        return _Groups(None, None, 0, 1, 0, 1)
    return _Groups(ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
                   ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())


def _sort_key(name: str) -> tuple:
    """HF-like order: embeddings, layers by global index, final norm, output layer."""
    if name.startswith("embedding."):
        return (0, 0, name)
    if name.startswith("decoder.layers."):
        return (1, int(name.split(".")[2]), name)
    if name.startswith("decoder."):
        return (2, 0, name)
    return (3, 0, name)


def _index(chunks: Sequence[nn.Module], arch: Any) -> MappingIndex:
    names = [n for c in chunks for n, _ in unwrap_chunk(c).named_parameters()]
    return MappingIndex(mapping_table(arch, detect_spec(names)))


def export_hf_weights(model_chunks: Sequence[nn.Module] | nn.Module, arch: Any,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """Stream the full HF weights of a (TP/PP-sharded) Megatron model as ``(hf_name, tensor)``.

    Collective: **every rank of the job must iterate the stream to the end** (it broadcasts over PP and all-gathers
    over TP inside). **Every rank yields the same full stream** (each DP replica gathers within its own TP/PP
    groups); a consumer that needs it once, e.g. one rollout engine, reads it on one rank and drops it elsewhere.

    Memory is bounded by buckets: parameters owned by one PP stage are packed, in order, into flat buffers of
    at most ``bucket_bytes`` *gathered* bytes (a single larger parameter gets a bucket of its own); one bucket is
    broadcast from its owning stage over the PP group, all-gathered over the TP group, cut into full Megatron
    tensors, converted with the family's mapping rules and yielded. Peak extra memory is about
    ``(tp + 1) * bucket_bytes / tp`` plus the tensors the consumer keeps. Yielded tensors own their storage.

    Tied embeddings: only ``model.embed_tokens.weight`` is yielded (the last stage's copy is skipped).
    Vocabulary padding, if any, is removed. ``dtype`` casts the yielded tensors (default: the parameters' dtype).
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    groups = _parallel_groups()
    index = _index(chunks, arch)

    local: dict[str, Tensor] = {}
    for chunk in chunks:
        for name, param in global_param_names(chunk):
            mapping, _ = index.lookup(name)
            if mapping.export:
                local[name] = param.detach()

    # Every stage learns every stage's parameters (name, local shape, dtype) so all ranks walk the same buckets.
    meta = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in local.items()]
    if groups.pp_size > 1:
        gathered: list = [None] * groups.pp_size
        dist.all_gather_object(gathered, meta, group=groups.pp_group)
    else:
        gathered = [meta]
    entries = sorted(((name, shape, dtype_name, owner) for owner, stage in enumerate(gathered)
                      for name, shape, dtype_name in stage), key=lambda e: _sort_key(e[0]))

    device = next(iter(local.values())).device if local else torch.device("cpu")
    for bucket in _buckets(entries, bucket_bytes, groups.tp_size):
        owner, dtype_name = bucket[0][3], bucket[0][2]
        buf_dtype = getattr(torch, dtype_name)
        numel = sum(_numel(shape) for _, shape, _, _ in bucket)
        if owner == groups.pp_rank:
            flat = torch.cat([local[name].reshape(-1).to(buf_dtype) for name, _, _, _ in bucket])
        else:
            flat = torch.empty(numel, dtype=buf_dtype, device=device)
        if groups.pp_size > 1:
            dist.broadcast(flat, src=dist.get_global_rank(groups.pp_group, owner), group=groups.pp_group)
        if groups.tp_size > 1:
            tp_flats = [torch.empty_like(flat) for _ in range(groups.tp_size)]
            dist.all_gather(tp_flats, flat, group=groups.tp_group)
        else:
            tp_flats = [flat]
        offset = 0
        for name, shape, _, _ in bucket:
            size = _numel(shape)
            shards = [f[offset:offset + size].view(shape) for f in tp_flats]
            offset += size
            mapping, layer = index.lookup(name)
            full = mapping.unshard(shards)
            hf_names = mapping.hf_names(layer)
            for role, tensor in mapping.megatron_to_hf(full, arch).items():
                tensor = tensor.contiguous() if dtype is None else tensor.to(dtype).contiguous()
                yield hf_names[role], tensor
        del flat, tp_flats


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _buckets(entries: list, bucket_bytes: int, tp_size: int) -> Iterator[list]:
    """Consecutive runs of entries with the same owner stage and dtype, each at most ``bucket_bytes`` gathered."""
    bucket: list = []
    size = 0
    for entry in entries:
        _, shape, dtype_name, owner = entry
        nbytes = _numel(shape) * torch.empty((), dtype=getattr(torch, dtype_name)).element_size() * tp_size
        if bucket and (owner != bucket[0][3] or dtype_name != bucket[0][2] or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def load_hf_weights(model_chunks: Sequence[nn.Module] | nn.Module, arch: Any,
                    hf_tensor: Callable[[str], Tensor] | Mapping[str, Tensor]) -> list[str]:
    """Fill this rank's Megatron chunks from HF tensors: each rank takes its TP shard of its PP stage's layers.

    ``hf_tensor`` is a mapping or a function name -> full HF tensor (e.g. ``HFCheckpoint.get`` which reads lazily
    from safetensors, so a rank only reads the tensors its layers need). Not collective. Validate the checkpoint
    as a whole first (``validate_hf_tensors``): this function only sees one rank's share. Every parameter of the
    chunks must be covered by a rule and match its shape exactly; ValueError names the first one that does not.
    Returns the HF names that were read.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    get = hf_tensor.__getitem__ if isinstance(hf_tensor, Mapping) else hf_tensor
    groups = _parallel_groups()
    index = _index(chunks, arch)
    used: list[str] = []
    for chunk in chunks:
        for name, param in global_param_names(chunk):
            mapping, layer = index.lookup(name)
            hf_names = mapping.hf_names(layer)
            try:
                hf = {role: get(n) for role, n in hf_names.items()}
            except KeyError as err:
                raise ValueError(f"missing tensor {err.args[0]!r} needed by Megatron parameter {name!r}") from None
            _check_hf_shapes(mapping, layer, hf, arch)
            full_shape = list(param.shape)
            if mapping.tp_dim is not None:
                full_shape[mapping.tp_dim] *= groups.tp_size
            full = mapping.hf_to_megatron(hf, arch, full_shape)
            shard = mapping.shard(full, groups.tp_rank, groups.tp_size)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for Megatron parameter {name!r}: TP shard {tuple(shard.shape)} "
                                 f"from {sorted(hf_names.values())}, model has {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))
            used.extend(hf_names.values())
    return used


def _check_hf_shapes(mapping: ParamMapping, layer: int | None, hf: Mapping[str, Tensor], arch: Any) -> None:
    names = mapping.hf_names(layer)
    shapes = mapping.hf_shapes(arch, layer)
    expected_by_role = {role: shapes[names[role]] for role in names}
    for role, tensor in hf.items():
        if tuple(tensor.shape) != expected_by_role[role]:
            raise ValueError(f"shape mismatch for {names[role]!r}: checkpoint has {tuple(tensor.shape)}, "
                             f"the config implies {expected_by_role[role]}")
