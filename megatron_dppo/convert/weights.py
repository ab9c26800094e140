"""Moving weights between (sharded) Megatron model chunks and HF tensor names.

``export_hf_weights``  Megatron -> stream of (HF name, full tensor), gathered over TP and PP (MoE experts: over
                       the expert-TP and expert-parallel groups) in bounded buckets.
``load_hf_weights``    HF tensors -> this rank's Megatron chunks (its TP shard of its PP stage's layers; MoE: its
                       own experts, their expert-TP shard).

Both work on the *model chunks* one rank holds (a list: one chunk per virtual pipeline stage), wrapped or not in
DDP / Float16Module, and use Megatron's parallel_state groups when they are initialized (single process
otherwise). Parameter names inside a chunk are local (``decoder.layers.0`` is the first layer *of this stage*);
they are made global with each layer's ``layer_number`` (1-based, global), which handles PP and VPP offsets.
Expert indices stay local in Megatron names (``local_experts.<i>``: the i-th expert *of this EP rank*) and become
global (``moe.global_expert_index``) only where an HF name is made.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_dppo.convert.mapping import MappingIndex, ParamMapping, Resolved, detect_spec, mapping_table, resolve_dims
from megatron_dppo.megatron.lora import is_lora_param
from megatron_dppo.megatron.moe import global_expert_index

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def unwrap_chunk(chunk: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (each exposes the wrapped model as ``.module``)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, nn.Module):
        chunk = chunk.module
    return chunk


# Buffers that are model weights (converted like parameters, never trained): the DeepSeek-style router's expert
# bias (HF ``e_score_correction_bias``)
WEIGHT_BUFFERS = ("mlp.router.expert_bias",)


def global_param_names(chunk: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(global Megatron name, parameter) for every parameter of one chunk (and every ``WEIGHT_BUFFERS`` buffer),
    layer indices made global. LoRA adapter parameters (``megatron.lora``) are not model weights and are left out
    (``convert.peft`` moves them)."""
    model = unwrap_chunk(chunk)
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    out = []
    weights = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n.endswith(WEIGHT_BUFFERS)]
    for name, param in weights:
        if is_lora_param(name):
            continue
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
    ep_group: Any = None  # expert parallel: which experts a rank holds
    ep_rank: int = 0
    ep_size: int = 1
    etp_group: Any = None  # expert tensor parallel: which slice of each of its experts
    etp_rank: int = 0
    etp_size: int = 1

    def split_for(self, mapping: ParamMapping) -> tuple[int, int]:
        """(rank, size) of the group a rule's tensor is split over: expert-TP for experts, TP otherwise."""
        return (self.etp_rank, self.etp_size) if mapping.expert else (self.tp_rank, self.tp_size)


def _parallel_groups() -> _Groups:
    from megatron.core import parallel_state as ps

    if not (dist.is_available() and dist.is_initialized() and ps.model_parallel_is_initialized()):
        return _Groups(None, None, 0, 1, 0, 1)
    return _Groups(ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
                   ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                   ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_rank(),
                   ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_group(),
                   ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())


def _hf_names(resolved: Resolved, arch: Any, ep_rank: int, ep_size: int) -> dict[str, str]:
    """HF names of a resolved parameter held by EP rank ``ep_rank`` (its local expert index made global)."""
    expert = None
    if resolved.mapping.expert:
        expert = global_expert_index(resolved.local_expert, arch.moe.num_experts, ep_rank, ep_size)
    return resolved.mapping.hf_names(resolved.layer, expert)


def _sort_key(name: str, expert: bool = False) -> tuple:
    """HF-like order: embeddings, layers by global index (a layer's experts after its other weights), final norm,
    output layer."""
    if name.startswith("embedding."):
        return (0, 0, expert, name)
    if name.startswith("decoder.layers."):
        return (1, int(name.split(".")[2]), expert, name)
    if name.startswith("decoder."):
        return (2, 0, expert, name)
    return (3, 0, expert, name)


def _index(chunks: Sequence[nn.Module], arch: Any) -> MappingIndex:
    names = [n for c in chunks for n, _ in global_param_names(c)]
    return MappingIndex(mapping_table(arch, detect_spec(names)))


def export_hf_weights(model_chunks: Sequence[nn.Module] | nn.Module, arch: Any,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """Stream the full HF weights of a (TP/PP/EP-sharded) Megatron model as ``(hf_name, tensor)``.

    Collective: **every rank of the job must iterate the stream to the end** (it broadcasts over PP and all-gathers
    over TP / EP / expert-TP inside). **Every rank yields the same full stream** (each DP replica gathers within its
    own groups); a consumer that needs it once, e.g. one rollout engine, reads it on one rank and drops it
    elsewhere.

    Memory is bounded by buckets: parameters owned by one PP stage are packed, in order, into flat buffers of
    at most ``bucket_bytes`` *gathered* bytes (a single larger parameter gets a bucket of its own); one bucket is
    broadcast from its owning stage over the PP group, all-gathered over the TP group, cut into full Megatron
    tensors, converted with the family's mapping rules and yielded. Peak extra memory is about
    ``(n + 1) * bucket_bytes / n`` plus the tensors the consumer keeps, with ``n`` the gather width (tp; for
    expert buckets ``ep * etp``, and ``(n + ep + 1) * bucket_bytes / n`` when etp > 1: the EP-gathered copies stay
    until their expert-TP gathers are done). Yielded tensors own their storage.

    Mixture-of-Experts: expert weights travel in buckets of their own. Every EP rank holds the same local names
    (``local_experts.0..E/ep-1``) for different experts, so an expert bucket is all-gathered over the EP group
    (the experts of every EP rank) and then over the expert-TP group (the slices of each expert); EP rank ``j``'s
    local expert ``i`` is yielded as global expert ``j * E/ep + i``. Every expert of every layer is yielded.

    Tied embeddings: only ``model.embed_tokens.weight`` is yielded (the last stage's copy is skipped).
    Vocabulary padding, if any, is removed. ``dtype`` casts the yielded tensors (default: the parameters' dtype).
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    groups = _parallel_groups()
    index = _index(chunks, arch)

    local: dict[str, Tensor] = {}
    for chunk in chunks:
        for name, param in global_param_names(chunk):
            if index.resolve(name).mapping.export:
                local[name] = param.detach()

    # Every stage learns every stage's parameters (name, local shape, dtype) so all ranks walk the same buckets.
    meta = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in local.items()]
    if groups.pp_size > 1:
        gathered: list = [None] * groups.pp_size
        dist.all_gather_object(gathered, meta, group=groups.pp_group)
    else:
        gathered = [meta]
    entries = [_Entry(name, shape, dtype_name, owner, index.resolve(name).mapping.expert)
               for owner, stage in enumerate(gathered) for name, shape, dtype_name in stage]
    entries.sort(key=lambda e: _sort_key(e.name, e.expert))

    device = next(iter(local.values())).device if local else torch.device("cpu")
    for bucket in _buckets(entries, bucket_bytes, groups):
        first = bucket[0]
        buf_dtype = getattr(torch, first.dtype_name)
        numel = sum(_numel(e.shape) for e in bucket)
        if first.owner == groups.pp_rank:
            flat = torch.cat([local[e.name].reshape(-1).to(buf_dtype) for e in bucket])
        else:
            flat = torch.empty(numel, dtype=buf_dtype, device=device)
        if groups.pp_size > 1:
            dist.broadcast(flat, src=dist.get_global_rank(groups.pp_group, first.owner), group=groups.pp_group)
        # flats[j][t]: the bucket as held by EP rank j, (expert-)TP rank t (dense buckets: j = this EP rank only)
        if first.expert:
            flats = [_all_gather(f, groups.etp_group, groups.etp_size)
                     for f in _all_gather(flat, groups.ep_group, groups.ep_size)]
            ep_ranks = range(groups.ep_size)
        else:
            flats = [_all_gather(flat, groups.tp_group, groups.tp_size)]
            ep_ranks = [groups.ep_rank]
        for ep_rank, split_flats in zip(ep_ranks, flats):
            offset = 0
            for e in bucket:
                size = _numel(e.shape)
                shards = [f[offset:offset + size].view(e.shape) for f in split_flats]
                offset += size
                resolved = index.resolve(e.name)
                full = resolved.mapping.unshard(shards)
                hf_names = _hf_names(resolved, arch, ep_rank, groups.ep_size)
                for role, tensor in resolved.mapping.megatron_to_hf(full, arch).items():
                    tensor = tensor.contiguous() if dtype is None else tensor.to(dtype).contiguous()
                    yield hf_names[role], tensor
        del flat, flats


@dataclass(frozen=True)
class _Entry:
    """One exported parameter: global Megatron name (local expert index), local shape, dtype, owning PP stage,
    and whether it is an expert weight (gathered over expert-TP and EP instead of TP)."""

    name: str
    shape: tuple[int, ...]
    dtype_name: str
    owner: int
    expert: bool


def _all_gather(flat: Tensor, group: Any, size: int) -> list[Tensor]:
    """``flat`` of every rank of ``group`` in rank order (``[flat]`` for a group of one)."""
    if size == 1:
        return [flat]
    out = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(out, flat.contiguous(), group=group)
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _buckets(entries: list[_Entry], bucket_bytes: int, groups: _Groups) -> Iterator[list[_Entry]]:
    """Consecutive runs of entries with the same owner stage, dtype and kind (expert or not), each at most
    ``bucket_bytes`` once gathered (x tp, or x etp * ep for experts)."""
    bucket: list[_Entry] = []
    size = 0
    for entry in entries:
        width = groups.etp_size * groups.ep_size if entry.expert else groups.tp_size
        nbytes = _numel(entry.shape) * torch.empty((), dtype=getattr(torch, entry.dtype_name)).element_size() * width
        if bucket and ((entry.owner, entry.dtype_name, entry.expert) != (bucket[0].owner, bucket[0].dtype_name,
                                                                         bucket[0].expert)
                       or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def load_hf_weights(model_chunks: Sequence[nn.Module] | nn.Module, arch: Any,
                    hf_tensor: Callable[[str], Tensor] | Mapping[str, Tensor]) -> list[str]:
    """Fill this rank's Megatron chunks from HF tensors: each rank takes its TP shard of its PP stage's layers
    (MoE: the experts of its EP rank, each one's expert-TP shard; other experts are never read).

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
            resolved = index.resolve(name)
            mapping = resolved.mapping
            hf_names = _hf_names(resolved, arch, groups.ep_rank, groups.ep_size)
            try:
                hf = {role: get(n) for role, n in hf_names.items()}
            except KeyError as err:
                raise ValueError(f"missing tensor {err.args[0]!r} needed by Megatron parameter {name!r}") from None
            _check_hf_shapes(mapping, hf_names, hf, arch)
            split_rank, split_size = groups.split_for(mapping)
            full_shape = list(param.shape)
            if mapping.tp_dim is not None:
                full_shape[mapping.tp_dim] *= split_size
            full = mapping.hf_to_megatron(hf, arch, full_shape)
            shard = mapping.shard(full, split_rank, split_size)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for Megatron parameter {name!r}: TP shard {tuple(shard.shape)} "
                                 f"from {sorted(hf_names.values())}, model has {tuple(param.shape)}")
            param.copy_(shard.to(param.dtype))
            used.extend(hf_names.values())
    return used


def _check_hf_shapes(mapping: ParamMapping, names: Mapping[str, str], hf: Mapping[str, Tensor], arch: Any) -> None:
    expected_by_role = {role: resolve_dims(mapping.hf_dims[role], arch) for role in names}
    for role, tensor in hf.items():
        if tuple(tensor.shape) != expected_by_role[role]:
            raise ValueError(f"shape mismatch for {names[role]!r}: checkpoint has {tuple(tensor.shape)}, "
                             f"the config implies {expected_by_role[role]}")
