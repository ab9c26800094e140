"""LoRA adapters on Megatron-Core's linear layers: tensor, sequence and pipeline parallel, PEFT-exact.

A LoRA adapter adds ``scaling * B @ A`` to a frozen weight ``W`` (``W: [out, in]``, ``A: [r, in]``,
``B: [out, r]``, ``scaling = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA), computed as
``y = W x + scaling * B (A dropout(x))`` (PEFT's ``lora.Linear``, ``bias="none"``).

One adapter per Hugging Face projection
---------------------------------------
Megatron fuses q, k, v into ``linear_qkv`` and gate, up into ``linear_fc1``. A single LoRA on the fused weight
(one ``A`` shared by q, k and v) is NOT a sum of three PEFT LoRAs: its update ``B @ A`` has rank ``r`` over all
three, while three PEFT adapters have rank ``r`` each and their own ``A``; only in special cases does one equal
the other, and PEFT cannot target Megatron's fused module on an HF model. So every adapter here belongs to one
HF projection (``q, k, v, proj (o_proj), gate, up, fc2 (down_proj)``; Megatron-Bridge's "canonical LoRA"): the
adapters of a fused layer compute their outputs separately and lay them out as the fused layer's rows are
(per query group ``[q heads, k, v]``; ``[gate; up]``), so an exported adapter is exactly PEFT's and a PEFT adapter
imports exactly (``convert.peft``).

Tensor and sequence parallelism (our own layer; why not Megatron-Bridge: see docs/lora.md)
-------------------------------------------------------------------------------------
Column-parallel base (``linear_qkv``, ``linear_fc1``; TP rank t holds rows ``W_t``): ``A`` is replicated, ``B``
is split along its rows as ``W`` is (``B_t``: this rank's heads of its query groups; its slice of gate and of
up). ``h = A x`` is computed once per rank; its gradient, a sum over the ranks' ``B_t``, is all-reduced
(``copy_to_tensor_model_parallel_region`` on ``h``; ``r`` numbers per token instead of ``hidden``). Under
sequence parallelism the base gathers the sequence itself; the adapter computes ``h`` on its own sequence slice
and all-gathers ``h`` (backward: reduce-scatter), so ``A``'s gradient is partial per rank and marked
``sequence_parallel`` (Megatron's ``finalize_model_grads`` all-reduces it over TP, as for SP layer norms).

Row-parallel base (``linear_proj``, ``linear_fc2``; rank t holds columns ``W_t`` and input features ``x_t``):
``A`` is split along its columns (``A_t``), ``B`` replicated; ``h = sum_t A_t x_t`` is all-reduced (under SP
reduce-scattered over the sequence, ``B``'s gradient then partial and marked ``sequence_parallel``).

Pipeline stages need nothing: an adapter lives in its layer. Its name is that of the base linear plus
``_lora``, a sibling module (``decoder.layers.3.self_attention.linear_qkv_lora.q.lora_A``), so every base
parameter keeps its name (conversion, checkpoints) and a forward hook on the base linear adds the adapter's
output. Megatron's norms see ``tensor_model_parallel`` on the split tensor only, so replicated ones count once.

Initialisation as PEFT's default: ``A ~ kaiming_uniform(a=sqrt(5))`` (uniform in ``+-1/sqrt(in)``), ``B = 0``,
drawn for the FULL tensors from a generator seeded by (``LoraConfig.seed``, layer, projection) and then
sliced: every TP/PP layout starts from the same adapters.

Mixture-of-Experts models: attention is adapted in every layer; expert MLPs and the router are never adapted, and
``fc1``/``fc2`` targets are refused for MoE models (their dense layers included) so the export stays one
PEFT ``target_modules`` list that means the same modules on the HF model.

The reference model is the policy the run started from: ``reference_adapters(chunks)`` runs the same chunks with
the trained adapters off and the frozen starting adapters on where ``keep_as_reference`` recorded them (a run that
starts from a PEFT adapter, ``model.lora.init``), else without adapters (the frozen base, ``adapters_disabled``).
``merged(chunks)`` adds ``scaling * B @ A`` into the base weights for a while (merged export) and restores the
exact base afterwards.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import Tensor, nn

# target name -> the HF projections it adapts (our names; "qkv" and "fc1" are Megatron's fused layers)
TARGET_GROUPS = {"qkv": ("q", "k", "v"), "proj": ("proj",), "fc1": ("gate", "up"), "fc2": ("fc2",)}
PROJECTIONS = ("q", "k", "v", "proj", "gate", "up", "fc2")  # fixed order (init seeds, export order)
VALID_TARGETS = tuple(TARGET_GROUPS) + tuple(p for p in PROJECTIONS if p not in TARGET_GROUPS)
# projection -> (module holding the base linear, base linear, HF module path inside a decoder layer)
BASE_LINEAR = {"q": ("self_attention", "linear_qkv", "self_attn.q_proj"),
               "k": ("self_attention", "linear_qkv", "self_attn.k_proj"),
               "v": ("self_attention", "linear_qkv", "self_attn.v_proj"),
               "proj": ("self_attention", "linear_proj", "self_attn.o_proj"),
               "gate": ("mlp", "linear_fc1", "mlp.gate_proj"),
               "up": ("mlp", "linear_fc1", "mlp.up_proj"),
               "fc2": ("mlp", "linear_fc2", "mlp.down_proj")}
ADAPTER_SUFFIX = "_lora"  # linear_qkv -> linear_qkv_lora
_PARAM_SUFFIXES = (".lora_A", ".lora_B")


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraConfig:
    """The ``model.lora`` section (absent / null = full fine-tuning).

    rank            r of every adapter (>= 1)
    alpha           scaling numerator: the update is ``alpha / r * B @ A`` (``alpha / sqrt(r)`` with use_rslora)
    dropout         dropout on the adapter's input in training forwards (PEFT's lora_dropout; 0 = none)
    target_modules  which layers get adapters: qkv (q, k, v), proj (attention output, o_proj), fc1 (gate, up),
                    fc2 (down_proj), or single projections q, k, v, gate, up; MoE models take qkv/proj only
    use_rslora      rank-stabilized scaling alpha / sqrt(r) (PEFT's use_rslora)
    seed            seeds A's initialisation (per layer and projection, identical at every TP/PP layout)
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
    use_rslora: bool = False
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank={self.rank!r} must be an integer >= 1")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha={self.alpha!r} must be a finite number > 0")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout!r} must be in [0, 1)")
        targets = (self.target_modules,) if isinstance(self.target_modules, str) else tuple(self.target_modules)
        bad = [t for t in targets if t not in VALID_TARGETS]
        if bad or not targets:
            raise ValueError(f"lora.target_modules={list(targets)!r}: {'unknown ' + str(bad) if bad else 'empty'}; "
                             f"valid: {list(VALID_TARGETS)}")
        object.__setattr__(self, "target_modules", targets)

    @property
    def projections(self) -> tuple[str, ...]:
        """The HF projections adapted, in ``PROJECTIONS`` order."""
        wanted = {p for t in self.target_modules for p in TARGET_GROUPS.get(t, (t,))}
        return tuple(p for p in PROJECTIONS if p in wanted)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def check_lora_supported(arch, parallel, cfg: LoraConfig) -> None:
    """Refuse, by name, model / layout combinations the adapters do not handle (before anything is built)."""
    problems = []
    if getattr(arch, "mla", None) is not None:
        problems.append(f"multi-latent attention ({arch.family!r}: linear_q_down/up_proj, linear_kv_down/up_proj) "
                        "has no adapters yet; LoRA adapts the fused linear_qkv of grouped-query attention only")
    mlp = [p for p in cfg.projections if BASE_LINEAR[p][0] == "mlp"]
    if getattr(arch, "moe", None) is not None and mlp:
        problems.append(f"target_modules {mlp} on the Mixture-of-Experts model {arch.family!r}: experts and the "
                        "router are not adapted (use qkv / proj)")
    if arch.family == "phi3":  # (dense_families.FUSED_PROJECTION_FAMILIES)
        problems.append("family 'phi3' stores q/k/v and gate/up fused (qkv_proj, gate_up_proj); the adapters are per "
                        "separate HF projection, so their PEFT names and rollout pushes would not match the model "
                        "(train phi3 without LoRA)")
    qkv = [p for p in cfg.projections if p in ("q", "k", "v")]
    if qkv and arch.num_kv_heads < parallel.tp:
        problems.append(f"target_modules {qkv} with num_kv_heads={arch.num_kv_heads} < tp={parallel.tp} (Megatron "
                        "splits a query group over TP ranks; adapters need whole groups per rank)")
    if problems:
        raise ValueError("LoRA: " + "; ".join(problems))


def is_lora_param(name: str) -> bool:
    """True for the parameters of an adapter (``..._lora.<projection>.lora_A`` / ``lora_B``)."""
    return name.endswith(_PARAM_SUFFIXES) and ADAPTER_SUFFIX + "." in name


# ----------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------
class LoraPair(nn.Module):
    """``lora_A: [r, in (/tp for a row-parallel base)]`` and ``lora_B: [out (/tp for a column-parallel base), r]``
    of one HF projection, this rank's parts."""

    def __init__(self, a_shape, b_shape, device, dtype):
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(a_shape, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, device=device, dtype=dtype))
        # the frozen starting adapter of the reference policy (``keep_as_reference``; None: the reference is the base).
        # Not persistent: a checkpoint holds the trained adapters, and a resume records the start again.
        self.register_buffer("ref_A", None, persistent=False)
        self.register_buffer("ref_B", None, persistent=False)


class LoraAdapter(nn.Module):
    """The adapters of one Megatron linear layer (column: qkv or fc1 or ...; row: proj or fc2).

    ``kind``: "column" | "row"; ``parts``: ordered projection -> full (out, in); ``layout``: how the parts' outputs
    form the base's output rows: "qkv" (per query group), "cat" (gate; up) or "single".
    """

    def __init__(self, kind: str, layout: str, parts: dict[str, tuple[int, int]], adapted: Sequence[str],
                 cfg: LoraConfig, config, device, dtype):
        super().__init__()
        from megatron.core import parallel_state

        self.kind, self.layout = kind, layout
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.sequence_parallel = bool(config.sequence_parallel) and self.tp > 1
        self.scaling = cfg.scaling
        self.rank = cfg.rank
        self.part_shapes = dict(parts)  # full (out, in) of every part, adapted or not
        self.enabled = True
        self.reference = False  # inside ``reference_adapters``: the frozen starting adapters, where recorded
        self.merged = False
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else None
        if layout == "qkv":
            heads, groups = config.num_attention_heads, config.num_query_groups
            self.qkv_dims = (groups // self.tp, heads // groups, config.kv_channels)
        self.pairs = nn.ModuleDict()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        for name in adapted:
            out, inp = parts[name]
            if kind == "column":
                pair = LoraPair((cfg.rank, inp), (out // self.tp, cfg.rank), device, dtype)
                split, shared = pair.lora_B, pair.lora_A
                set_tensor_model_parallel_attributes(split, True, 0, 1)
            else:
                pair = LoraPair((cfg.rank, inp // self.tp), (out, cfg.rank), device, dtype)
                split, shared = pair.lora_A, pair.lora_B
                set_tensor_model_parallel_attributes(split, True, 1, 1)
            if self.sequence_parallel:  # its gradient covers this rank's sequence slice: all-reduced over TP
                shared.sequence_parallel = True
            self.pairs[name] = pair

    # -- layout of the parts' outputs in the base linear's (local) output rows ---------------------------------
    def _local_out(self, name: str) -> int:
        out = self.part_shapes[name][0]
        return out // self.tp if self.kind == "column" else out

    def combine(self, outputs: dict[str, Tensor]) -> Tensor:
        """The base's local output features (last dim) from the parts' outputs (missing parts: zero)."""
        ref = next(iter(outputs.values()))
        lead = ref.shape[:-1]
        full = {n: outputs[n] if n in outputs else ref.new_zeros(*lead, self._local_out(n)) for n in self.part_shapes}
        if self.layout == "single":
            (only,) = full.values()
            return only
        if self.layout == "cat":
            return torch.cat([full[n] for n in self.part_shapes], dim=-1)
        groups, per_group, d = self.qkv_dims
        q = full["q"].reshape(*lead, groups, per_group * d)
        k = full["k"].reshape(*lead, groups, d)
        v = full["v"].reshape(*lead, groups, d)
        return torch.cat([q, k, v], dim=-1).reshape(*lead, groups * (per_group + 2) * d)

    # -- forward ---------------------------------------------------------------------------------------------
    def _dropout(self, x: Tensor) -> Tensor:
        if self.dropout is None or not self.training:
            return x
        replicated = self.kind == "column" and not self.sequence_parallel  # same x on every TP rank: same mask
        if replicated or self.tp == 1:
            return self.dropout(x)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return self.dropout(x)

    @property
    def has_reference(self) -> bool:
        """Whether ``keep_as_reference`` recorded starting adapters (the reference policy is then not the base)."""
        return all(pair.ref_A is not None for pair in self.pairs.values())

    def forward(self, x: Tensor, reference: bool = False) -> Tensor:
        """``scaling * B A x`` laid out as the base linear's output for its input ``x`` (this rank's part); with
        ``reference`` of the frozen starting adapters (``keep_as_reference``; no dropout)."""
        from megatron.core.tensor_parallel import mappings

        names = list(self.pairs)
        weights = {n: (p.ref_A, p.ref_B) if reference else (p.lora_A, p.lora_B) for n, p in self.pairs.items()}
        x = x if reference else self._dropout(x)
        a = torch.cat([weights[n][0] for n in names], dim=0)  # [parts * r, in]
        h = torch.matmul(x, a.t())
        if self.kind == "column":
            if self.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
            elif self.tp > 1:
                h = mappings.copy_to_tensor_model_parallel_region(h)
        elif self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h)
        elif self.tp > 1:
            h = mappings.reduce_from_tensor_model_parallel_region(h)
        hs = torch.split(h, self.rank, dim=-1)
        outs = {n: torch.matmul(hn, weights[n][1].t()) * self.scaling for n, hn in zip(names, hs)}
        return self.combine(outs)

    def delta_weight(self) -> Tensor:
        """``scaling * B @ A`` as this rank's part of the base weight (same shape as ``base.weight``)."""
        outs = {n: (p.lora_B @ p.lora_A).t() * self.scaling for n, p in self.pairs.items()}  # [in, out_n]
        return self.combine(outs).t()

    # -- checkpointing ---------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Split tensors sharded over TP along their split dim, replicated ones replicated (Megatron's format)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {f"pairs.{n}.{'lora_B' if self.kind == 'column' else 'lora_A'}": 0 if self.kind == "column" else 1
                for n in self.pairs}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axis, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])


def _lora_hook(adapter: LoraAdapter):
    def hook(module, args, kwargs, output):
        out, bias = output
        x = args[0] if args else next(iter(kwargs.values()))
        if isinstance(out, tuple):  # TE's fused norm + linear, return_layernorm_output: the adapter reads ln(x)
            out, x = out
        if adapter.merged:
            pass
        elif adapter.enabled:
            out = out + adapter(x).to(out.dtype)
        elif adapter.reference and adapter.has_reference:
            out = out + adapter(x, reference=True).to(out.dtype)
        return out, bias
    return hook


# ----------------------------------------------------------------------------------------------------------
# Attaching adapters to a model
# ----------------------------------------------------------------------------------------------------------
def _layers(chunk: nn.Module):
    model = chunk
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    decoder = getattr(model, "decoder", None)
    return list(getattr(decoder, "layers", []))


def _part_shapes(config, linear_name: str) -> tuple[str, str, dict[str, tuple[int, int]]]:
    h, d = config.hidden_size, config.kv_channels
    q, kv, f = config.num_attention_heads * d, config.num_query_groups * d, config.ffn_hidden_size
    return {"linear_qkv": ("column", "qkv", {"q": (q, h), "k": (kv, h), "v": (kv, h)}),
            "linear_proj": ("row", "single", {"proj": (h, q)}),
            "linear_fc1": ("column", "cat", {"gate": (f, h), "up": (f, h)}),
            "linear_fc2": ("row", "single", {"fc2": (h, f)})}[linear_name]


def _init_seed(seed: int, layer: int, projection: str) -> int:
    digest = hashlib.sha256(f"{seed}/{layer}/{projection}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def add_lora_adapters(chunks: Sequence[nn.Module], cfg: LoraConfig) -> list[str]:
    """Attach adapters to every decoder layer of this rank's chunks (before DDP and the optimizer) and freeze
    every base parameter. Returns the global names of the adapted base linears."""
    from megatron.core import parallel_state

    adapted = []
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for layer in _layers(chunk):
            index = layer.layer_number - 1  # global
            by_linear: dict[tuple[str, str], list[str]] = {}
            for proj in cfg.projections:
                owner, linear, _ = BASE_LINEAR[proj]
                by_linear.setdefault((owner, linear), []).append(proj)
            for (owner_name, linear_name), projs in by_linear.items():
                owner = getattr(layer, owner_name)
                base = getattr(owner, linear_name, None)
                if base is None:
                    raise ValueError(f"LoRA: layer {index} has no {owner_name}.{linear_name} (a Mixture-of-Experts "
                                     f"layer?); target_modules {projs} cannot be adapted")
                kind, layout, parts = _part_shapes(layer.config, linear_name)
                weight = base.weight
                adapter = LoraAdapter(kind, layout, parts, projs, cfg, layer.config, weight.device, weight.dtype)
                _initialise(adapter, cfg, index, tp_rank)
                if type(base).__name__ == "TELayerNormColumnParallelLinear":
                    base.return_layernorm_output = True  # the adapter needs the normalized input
                adapter.__dict__["base_linear"] = base  # a plain reference, not a submodule (no second copy)
                adapter._hook = base.register_forward_hook(_lora_hook(adapter), with_kwargs=True)
                setattr(owner, linear_name + ADAPTER_SUFFIX, adapter)
                adapted.append(f"decoder.layers.{index}.{owner_name}.{linear_name}")
    return adapted


@torch.no_grad()
def _initialise(adapter: LoraAdapter, cfg: LoraConfig, layer: int, tp_rank: int) -> None:
    """PEFT's default: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform, a=sqrt(5)) on the full A, B = 0."""
    for name, pair in adapter.pairs.items():
        _, inp = adapter.part_shapes[name]
        gen = torch.Generator().manual_seed(_init_seed(cfg.seed, layer, name))
        full = (torch.rand((cfg.rank, inp), generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(inp)
        pair.lora_A.copy_(shard_full(adapter, "lora_A", full, tp_rank))
        pair.lora_B.zero_()


def shard_full(adapter: LoraAdapter, which: str, full: Tensor, tp_rank: int) -> Tensor:
    """This TP rank's part of a full ``lora_A`` / ``lora_B`` tensor of ``adapter``."""
    split = {"column": ("lora_B", 0), "row": ("lora_A", 1)}[adapter.kind]
    if which != split[0] or adapter.tp == 1:
        return full
    return torch.chunk(full, adapter.tp, dim=split[1])[tp_rank]


def split_dim(adapter: LoraAdapter, which: str) -> int | None:
    """The dim ``which`` (lora_A / lora_B) of ``adapter`` is split along over TP, None when replicated."""
    split = {"column": ("lora_B", 0), "row": ("lora_A", 1)}[adapter.kind]
    return split[1] if which == split[0] else None


def adapters(chunks: Sequence[nn.Module]) -> Iterator[tuple[int, str, LoraAdapter]]:
    """(global layer index, base linear path inside the layer, adapter) of every adapter of the chunks."""
    for chunk in chunks:
        for layer in _layers(chunk):
            for owner_name, linear_name in (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
                                            ("mlp", "linear_fc1"), ("mlp", "linear_fc2")):
                owner = getattr(layer, owner_name, None)
                adapter = getattr(owner, linear_name + ADAPTER_SUFFIX, None) if owner is not None else None
                if adapter is not None:
                    yield layer.layer_number - 1, f"{owner_name}.{linear_name}", adapter


def has_lora(chunks: Sequence[nn.Module]) -> bool:
    return next(adapters(chunks), None) is not None


def lora_parameters(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for _, _, a in adapters(chunks) for p in a.parameters()]


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[nn.Module]):
    """The chunks compute the frozen base model (the reference policy) inside the block."""
    found = [a for _, _, a in adapters(chunks)]
    before = [a.enabled for a in found]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(found, before):
            a.enabled = state


@contextlib.contextmanager
def reference_adapters(chunks: Sequence[nn.Module]):
    """The chunks compute the reference policy inside the block: the trained adapters off, the frozen starting
    adapters on where ``keep_as_reference`` recorded them (else the frozen base, as ``adapters_disabled``)."""
    found = [a for _, _, a in adapters(chunks)]
    for a in found:
        a.reference = True
    try:
        with adapters_disabled(chunks):
            yield
    finally:
        for a in found:
            a.reference = False


@torch.no_grad()
def keep_as_reference(chunks: Sequence[nn.Module]) -> None:
    """Record the adapters as they are now (this rank's shards, e.g. a PEFT adapter just loaded as the start) as the
    frozen adapters of the reference policy (``reference_adapters``): a KL term then measures the distance from
    the policy the run started from, not from the bare base. Costs one more copy of the adapters."""
    for _, _, adapter in adapters(chunks):
        for pair in adapter.pairs.values():
            pair.ref_A = pair.lora_A.detach().clone()
            pair.ref_B = pair.lora_B.detach().clone()


@contextlib.contextmanager
def merged(chunks: Sequence[nn.Module]):
    """Inside the block every adapted base weight holds ``W + scaling * B @ A`` and the adapters are off (a
    merged model: e.g. ``convert.export_hf_weights`` exports it); afterwards the exact base weights are back."""
    saved = []
    try:
        with torch.no_grad():
            for _, _, adapter in adapters(chunks):
                if adapter.merged:
                    continue
                weight = adapter.base_linear.weight
                saved.append((adapter, weight, weight.detach().clone()))
                weight.add_(adapter.delta_weight().to(weight.dtype))
                adapter.merged = True
        yield
    finally:
        with torch.no_grad():
            for adapter, weight, original in saved:
                weight.copy_(original)
                adapter.merged = False


# ----------------------------------------------------------------------------------------------------------
# Full (TP-gathered, PP-collected) adapter tensors by HF projection
# ----------------------------------------------------------------------------------------------------------
def _gather_tp(t: Tensor, dim: int | None, tp: int) -> Tensor:
    if dim is None or tp == 1:
        return t.detach().clone()
    from megatron.core import parallel_state

    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def full_lora_tensors(chunks: Sequence[nn.Module]) -> dict[tuple[int, str, str], Tensor]:
    """Collective (every rank of the job): {(global layer, projection, "lora_A" | "lora_B"): full tensor} of the
    whole model, on every rank (gathered over TP, collected over PP; adapters are small)."""
    from megatron.core import parallel_state

    local = {}
    for layer, _, adapter in adapters(chunks):
        for name, pair in adapter.pairs.items():
            for which in ("lora_A", "lora_B"):
                full = _gather_tp(getattr(pair, which), split_dim(adapter, which), adapter.tp)
                local[(layer, name, which)] = full.cpu()
    if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized() \
            and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        stages: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        torch.distributed.all_gather_object(stages, local, group=parallel_state.get_pipeline_model_parallel_group())
        local = {k: v for stage in stages for k, v in stage.items()}
    return dict(sorted(local.items(), key=lambda kv: (kv[0][0], PROJECTIONS.index(kv[0][1]), kv[0][2])))


@torch.no_grad()
def load_full_lora_tensors(chunks: Sequence[nn.Module], tensors: dict[tuple[int, str, str], Tensor]) -> int:
    """Copy full adapter tensors (keys as ``full_lora_tensors``) into this rank's shards; every adapter of the
    chunks must be present with its full shape (ValueError naming the first that is not). Not collective.
    Returns the number of tensors read."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    used = 0
    for layer, path, adapter in adapters(chunks):
        for name, pair in adapter.pairs.items():
            out, inp = adapter.part_shapes[name]
            for which, shape in (("lora_A", (adapter.rank, inp)), ("lora_B", (out, adapter.rank))):
                key = (layer, name, which)
                if key not in tensors:
                    raise ValueError(f"no {which} for layer {layer} projection {name!r} ({path})")
                full = tensors[key]
                if tuple(full.shape) != shape:
                    raise ValueError(f"{which} of layer {layer} projection {name!r}: shape {tuple(full.shape)}, "
                                     f"the model needs {shape} (rank {adapter.rank})")
                getattr(pair, which).copy_(shard_full(adapter, which, full, tp_rank).to(getattr(pair, which).dtype))
                used += 1
    return used


# ----------------------------------------------------------------------------------------------------------
# The base a LoRA checkpoint belongs to
# ----------------------------------------------------------------------------------------------------------
def base_checksum(folder: str | os.PathLike) -> str:
    """SHA-256 over a Hugging Face model folder's ``config.json`` and weight files (``*.safetensors``, by name):
    identifies the frozen base a LoRA checkpoint was trained on."""
    folder = Path(folder)
    files = [folder / "config.json"] + sorted(folder.glob("*.safetensors"))
    missing = [str(p) for p in files if not p.is_file()] or (["*.safetensors"] if len(files) < 2 else [])
    if missing:
        raise ValueError(f"{folder}: not a Hugging Face model folder with safetensors weights (missing {missing})")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class LoraBase:
    """The frozen base of a LoRA run: where it was loaded from and the ``base_checksum`` of that folder (None for
    an engine whose base was not loaded from a folder, e.g. random tests)."""

    path: str | None = None
    sha256: str | None = None

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "LoraBase":
        return cls(str(Path(folder).absolute()), base_checksum(folder))


__all__ = ["LoraConfig", "LoraBase", "LoraAdapter", "TARGET_GROUPS", "PROJECTIONS", "BASE_LINEAR",
           "check_lora_supported", "is_lora_param", "add_lora_adapters", "adapters", "has_lora", "lora_parameters",
           "adapters_disabled", "reference_adapters", "keep_as_reference", "merged", "full_lora_tensors",
           "load_full_lora_tensors", "base_checksum"]
