"""Parameter mapping rules Hugging Face <-> Megatron-Core, one table per model family.

The shape follows Megatron-Bridge's ``param_mapping.py`` without its Transformer Engine / CUDA requirements: each
rule is a small frozen dataclass that knows

* the names on both sides (``*`` stands for the global layer index),
* how to turn the HF tensor(s) into the *full* (TP-unsharded) Megatron tensor and back
  (``hf_to_megatron`` / ``megatron_to_hf``; a pure function of the tensors and the architecture), and
* how that full tensor is split over tensor-parallel ranks (``shard`` / ``unshard``).

Rules
-----
``ReplicatedMapping``      same tensor on every TP rank (layer norms, q/k norms).
``ColumnParallelMapping``  split along dim 0 (output features): ``W = [W_0; W_1; ...]``.
``RowParallelMapping``     split along dim 1 (input features): ``W = [W_0, W_1, ...]`` (linear_proj, linear_fc2).
``VocabParallelMapping``   column split of the vocabulary rows; pads ``V_hf`` rows up to Megatron's (possibly
                           padded) vocabulary with zeros on import and drops the padding on export.
``QKVMapping``             Megatron fuses q, k, v into ``linear_qkv`` laid out *per query group*: with
                           ``g = num_kv_heads`` groups, ``r = num_attention_heads / g`` query heads per group and
                           head size ``d``, the rows are ``[q_(0,0..r-1), k_0, v_0, q_(1,0..r-1), k_1, v_1, ...]``,
                           i.e. shape ``[g, (r + 2) d, ...]`` flattened (megatron/core/transformer/attention.py,
                           ``get_query_key_value_tensors``). TP ranks take contiguous row blocks (whole groups when
                           ``g >= tp``; when ``g < tp`` Megatron itself all-gathers and re-slices). Works for the
                           weight ``[rows, hidden]`` and the Qwen2 bias ``[rows]``.
``GatedMLPMapping``        ``linear_fc1 = [gate; up]`` (SwiGLU: ``silu(gate x) * up x``). Megatron chunks the *local*
                           output in two, so TP rank ``t`` holds ``[gate_t; up_t]``; the full tensor is ``[gate; up]``
                           (the same global layout Megatron's dist-checkpoint swiglu factory stores).
``FusedQKVMapping``        Phi-3's ``qkv_proj`` (rows ``[q; k; v]``) <-> ``linear_qkv`` (through ``QKVMapping``).
``FusedGatedMLPMapping``   Phi-3's ``gate_up_proj`` (rows ``[gate; up]``): Megatron's full ``linear_fc1`` as it is.
``TiedOutputMapping``      tied embeddings under PP > 1: the last stage holds its own copy of the word embeddings
                           as ``output_layer.weight``; it is filled from ``embed_tokens`` on import and skipped on
                           export (the first stage's embedding is the one written out).
Sequence classifiers (reward models, ``arch.num_labels``): ``output_layer.weight`` is the score head
(``megatron.score_head.ScoreHead``), replicated, <-> HF ``score.weight`` [num_labels, hidden]; no ``lm_head``.

Layer norm names depend on the Megatron layer spec: the local spec has ``input_layernorm.weight`` and
``pre_mlp_layernorm.weight``; the Transformer Engine spec fuses them into ``linear_qkv.layer_norm_weight`` and
``linear_fc1.layer_norm_weight``. ``detect_spec`` picks the right names from the model's parameter names.

Mixture-of-Experts (qwen3_moe, mixtral; ``megatron_dppo.megatron.moe``)
------------------------------------------------------------------------
A rule exists in every layer, or only in the dense or only in the sparse (MoE) layers (``layers``). Expert rules
(``expert = True``) carry a second wildcard, ``#``, for the expert index, and differ from the dense rules in two
ways only: their split runs over the *expert*-tensor-parallel group (``parallel.etp``) instead of TP, and the
Megatron name holds the rank-*local* expert index (``local_experts.<i>`` / ``weight<i>``) while the HF name holds
the *global* one; ``weights.py`` translates between them with the EP rank (``moe.global_expert_index``).

``ExpertGatedMLPMapping``  per-expert HF gate/up (Qwen3-MoE ``gate_proj``/``up_proj``, Mixtral ``w1``/``w3``) <->
                           the expert's ``linear_fc1 = [gate; up]``; ETP rank t holds ``[gate_t; up_t]``.
``ExpertRowParallelMapping``  per-expert down projection (``down_proj`` / ``w2``) <-> ``linear_fc2``, split along
                           its input features over ETP.
The router (``mlp.router.weight`` [E, H] <-> HF ``mlp.gate`` / ``block_sparse_moe.gate``) is replicated.
Expert names: ``mlp.experts.local_experts.<i>.linear_fc{1,2}.weight`` (local spec, ``SequentialMLP``) or
``mlp.experts.linear_fc{1,2}.weight<i>`` (TE spec, ``TEGroupedMLP``). With the TE spec a sparse layer keeps a
separate ``pre_mlp_layernorm.weight`` (the norm is fused into ``linear_fc1`` only in dense layers).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from megatron_dppo.megatron.moe import MOE_FAMILIES

LOCAL_SPEC = "local"
TE_SPEC = "te"
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral", "ministral", "phi3", "deepseek_v3",
                      "glm4_moe")
EXPERT_WILDCARD = "#"  # the expert index in a name pattern ("*" is the layer index)
ALL_LAYERS, DENSE_LAYERS, SPARSE_LAYERS = "all", "dense", "sparse"  # where a layer rule exists

# Symbolic dimensions used in the tables, resolved against the architecture by ``resolve_dims``.
#   V vocab, H hidden, F ffn, Q = heads * head_dim, KV = kv_heads * head_dim, D = head_dim,
#   E experts, FE expert ffn (MoE)
#   L = num_labels (the score head of a sequence classifier)
#   a family module may add its own (FAMILY_DIMS), e.g. deepseek_v3 / glm4_moe (families/deepseek.py):
#   QA q_lora_rank, QB = heads * (qk_nope + qk_rope), KVA = kv_lora + qk_rope, KVL = kv_lora_rank,
#   KVB = heads * (qk_nope + v), O = heads * v (MLA); FS the shared experts' ffn
Dims = tuple[str, ...]


def resolve_dims(dims: Dims, arch: Any) -> tuple[int, ...]:
    """Concrete HF shape of a symbolic shape such as ``("Q", "H")`` for this architecture."""
    table = {
        "V": arch.vocab_size,
        "H": arch.hidden_size,
        "F": arch.ffn_hidden_size,
        "Q": arch.num_attention_heads * arch.head_dim,
        "KV": arch.num_kv_heads * arch.head_dim,
        "D": arch.head_dim,
        "L": getattr(arch, "num_labels", None) or 1,
        # fused checkpoint tensors (phi3): qkv_proj rows [q; k; v], gate_up_proj rows [gate; up]
        "QKV": (arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim,
        "F2": 2 * arch.ffn_hidden_size,
    }
    moe = getattr(arch, "moe", None)
    if moe is not None:
        table.update(E=moe.num_experts, FE=moe.expert_ffn_hidden_size)
    extra_dims = FAMILY_DIMS.get(getattr(arch, "family", None))
    if extra_dims is not None:
        table.update(extra_dims(arch))
    return tuple(table[d] for d in dims)


def _fill(pattern: str, layer: int | None, expert: int | None) -> str:
    if layer is not None:
        pattern = pattern.replace("*", str(layer))
    if expert is not None:
        pattern = pattern.replace(EXPERT_WILDCARD, str(expert))
    return pattern


def _chunk(tensor: Tensor, parts: int, dim: int) -> list[Tensor]:
    if tensor.shape[dim] % parts:
        raise ValueError(f"cannot split dimension {dim} of shape {tuple(tensor.shape)} into {parts} equal TP shards")
    return list(torch.chunk(tensor, parts, dim=dim))


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter <-> one or more HF tensors.

    ``megatron`` and the values of ``hf`` are name patterns where ``*`` is the global layer index and ``#``
    (expert rules only) the expert index: local on the Megatron side, global on the HF side.
    ``hf`` maps a role (``"weight"``, ``"q"``, ``"gate"``...) to an HF name pattern; ``hf_dims`` gives each role's
    symbolic HF shape. ``tp_dim`` is the dimension split over TP ranks (expert rules: over expert-TP ranks;
    None: replicated). ``layers``: the rule exists in every layer, only in dense or only in sparse (MoE) layers.
    """

    megatron: str
    hf: Mapping[str, str]
    hf_dims: Mapping[str, Dims]
    layers: str = ALL_LAYERS
    tp_dim: ClassVar[int | None] = None
    export: ClassVar[bool] = True  # False: import-only (a copy of a weight exported elsewhere)
    expert: ClassVar[bool] = False  # True: one tensor per expert, split over EP (which experts) and ETP

    # --- names -------------------------------------------------------------------------------------------
    def megatron_name(self, layer: int | None = None, expert: int | None = None) -> str:
        return _fill(self.megatron, layer, expert)

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> dict[str, str]:
        return {role: _fill(n, layer, expert) for role, n in self.hf.items()}

    def hf_shapes(self, arch: Any, layer: int | None = None, expert: int | None = None) -> dict[str, tuple[int, ...]]:
        names = self.hf_names(layer, expert)
        return {names[role]: resolve_dims(self.hf_dims[role], arch) for role in self.hf}

    @property
    def is_layer(self) -> bool:
        return "*" in self.megatron

    def exists_in_layer(self, arch: Any, layer: int) -> bool:
        """Whether layer ``layer`` of ``arch`` has this parameter (dense vs MoE layers of an MoE model)."""
        if self.layers == ALL_LAYERS:
            return True
        moe = getattr(arch, "moe", None)
        sparse = moe is not None and moe.sparse_layers[layer]
        return sparse == (self.layers == SPARSE_LAYERS)

    # --- tensor transforms (full, TP-unsharded tensors) ----------------------------------------------------
    def hf_to_megatron(self, hf: Mapping[str, Tensor], arch: Any, full_shape: Sequence[int]) -> Tensor:
        """Full Megatron tensor of shape ``full_shape`` from the HF tensors keyed by role."""
        (tensor,) = hf.values()
        return tensor

    def megatron_to_hf(self, full: Tensor, arch: Any) -> dict[str, Tensor]:
        """HF tensors keyed by role from the full Megatron tensor."""
        (role,) = self.hf
        return {role: full}

    # --- tensor parallelism -------------------------------------------------------------------------------
    def shard(self, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
        """The part of the full tensor that TP rank ``tp_rank`` holds."""
        if self.tp_dim is None or tp_size == 1:
            return full
        return _chunk(full, tp_size, self.tp_dim)[tp_rank]

    def unshard(self, shards: Sequence[Tensor]) -> Tensor:
        """Inverse of ``shard``: the full tensor from the shards of TP ranks 0..tp-1 (always a new tensor)."""
        if self.tp_dim is None:
            return shards[0].clone()
        return torch.cat(list(shards), dim=self.tp_dim)


@dataclass(frozen=True)
class ReplicatedMapping(ParamMapping):
    tp_dim: ClassVar[int | None] = None


@dataclass(frozen=True)
class ColumnParallelMapping(ParamMapping):
    tp_dim: ClassVar[int | None] = 0


@dataclass(frozen=True)
class RowParallelMapping(ParamMapping):
    tp_dim: ClassVar[int | None] = 1


@dataclass(frozen=True)
class VocabParallelMapping(ColumnParallelMapping):
    """Word embeddings / output layer: rows are the vocabulary, padded with zeros up to Megatron's size."""

    def hf_to_megatron(self, hf, arch, full_shape):
        (tensor,) = hf.values()
        pad = full_shape[0] - tensor.shape[0]
        if pad < 0:
            raise ValueError(f"{self.megatron}: HF vocabulary {tensor.shape[0]} exceeds Megatron's {full_shape[0]}")
        return torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])]) if pad else tensor

    def megatron_to_hf(self, full, arch):
        (role,) = self.hf
        return {role: full[: arch.vocab_size]}


@dataclass(frozen=True)
class TiedOutputMapping(VocabParallelMapping):
    """``output_layer.weight`` of the last PP stage when embeddings are tied: imported, never exported."""

    export: ClassVar[bool] = False


@dataclass(frozen=True)
class QKVMapping(ColumnParallelMapping):
    """Separate HF q/k/v projections (weights or biases) <-> Megatron's per-group interleaved ``linear_qkv``."""

    @staticmethod
    def _group_sizes(arch) -> tuple[int, int, int]:
        groups, heads, d = arch.num_kv_heads, arch.num_attention_heads, arch.head_dim
        if heads % groups:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
        return groups, heads // groups, d

    def hf_to_megatron(self, hf, arch, full_shape):
        g, r, d = self._group_sizes(arch)
        q, k, v = hf["q"], hf["k"], hf["v"]
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(g, r * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
        return fused.reshape(g * (r + 2) * d, *rest)

    def megatron_to_hf(self, full, arch):
        g, r, d = self._group_sizes(arch)
        rest = full.shape[1:]
        q, k, v = torch.split(full.reshape(g, (r + 2) * d, *rest), [r * d, d, d], dim=1)
        return {"q": q.reshape(g * r * d, *rest), "k": k.reshape(g * d, *rest), "v": v.reshape(g * d, *rest)}


@dataclass(frozen=True)
class GatedMLPMapping(ColumnParallelMapping):
    """HF gate_proj / up_proj <-> Megatron ``linear_fc1`` = ``[gate; up]``; TP rank t holds ``[gate_t; up_t]``."""

    def hf_to_megatron(self, hf, arch, full_shape):
        return torch.cat([hf["gate"], hf["up"]], dim=0)

    def megatron_to_hf(self, full, arch):
        gate, up = torch.chunk(full, 2, dim=0)
        return {"gate": gate, "up": up}

    def shard(self, full, tp_rank, tp_size):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([_chunk(gate, tp_size, 0)[tp_rank], _chunk(up, tp_size, 0)[tp_rank]], dim=0)

    def unshard(self, shards):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


@dataclass(frozen=True)
class ExpertGatedMLPMapping(GatedMLPMapping):
    """One expert's HF gate / up projections <-> its ``linear_fc1 = [gate; up]``; split over expert-TP ranks."""

    expert: ClassVar[bool] = True


@dataclass(frozen=True)
class ExpertRowParallelMapping(RowParallelMapping):
    """One expert's HF down projection <-> its ``linear_fc2``, split along input features over expert-TP ranks."""

    expert: ClassVar[bool] = True


# ----------------------------------------------------------------------------------------------------------------
# Family tables
# ----------------------------------------------------------------------------------------------------------------

def _w(name: str) -> dict[str, str]:
    return {"weight": name}


def _dims(*d: str) -> dict[str, Dims]:
    return {"weight": tuple(d)}


def _decoder_table(arch: Any, spec: str, *, qkv_bias: bool, qk_norm: bool) -> list[ParamMapping]:
    """The Llama-style decoder shared by all three families; ``qkv_bias`` (Qwen2) and ``qk_norm`` (Qwen3) add rows."""
    L = "decoder.layers.*."
    H = "model.layers.*."
    if spec == TE_SPEC:
        attn_norm, mlp_norm = L + "self_attention.linear_qkv.layer_norm_weight", L + "mlp.linear_fc1.layer_norm_weight"
    else:
        attn_norm, mlp_norm = L + "input_layernorm.weight", L + "pre_mlp_layernorm.weight"
    table: list[ParamMapping] = [
        VocabParallelMapping("embedding.word_embeddings.weight", _w("model.embed_tokens.weight"), _dims("V", "H")),
        ReplicatedMapping(attn_norm, _w(H + "input_layernorm.weight"), _dims("H")),
        QKVMapping(L + "self_attention.linear_qkv.weight",
                   {"q": H + "self_attn.q_proj.weight", "k": H + "self_attn.k_proj.weight",
                    "v": H + "self_attn.v_proj.weight"},
                   {"q": ("Q", "H"), "k": ("KV", "H"), "v": ("KV", "H")}),
        RowParallelMapping(L + "self_attention.linear_proj.weight", _w(H + "self_attn.o_proj.weight"),
                           _dims("H", "Q")),
        ReplicatedMapping(mlp_norm, _w(H + "post_attention_layernorm.weight"), _dims("H")),
        GatedMLPMapping(L + "mlp.linear_fc1.weight",
                        {"gate": H + "mlp.gate_proj.weight", "up": H + "mlp.up_proj.weight"},
                        {"gate": ("F", "H"), "up": ("F", "H")}),
        RowParallelMapping(L + "mlp.linear_fc2.weight", _w(H + "mlp.down_proj.weight"), _dims("H", "F")),
        ReplicatedMapping("decoder.final_layernorm.weight", _w("model.norm.weight"), _dims("H")),
    ]
    if qkv_bias:
        table.append(QKVMapping(L + "self_attention.linear_qkv.bias",
                                {"q": H + "self_attn.q_proj.bias", "k": H + "self_attn.k_proj.bias",
                                 "v": H + "self_attn.v_proj.bias"},
                                {"q": ("Q",), "k": ("KV",), "v": ("KV",)}))
    if qk_norm:
        table.append(ReplicatedMapping(L + "self_attention.q_layernorm.weight", _w(H + "self_attn.q_norm.weight"),
                                       _dims("D")))
        table.append(ReplicatedMapping(L + "self_attention.k_layernorm.weight", _w(H + "self_attn.k_norm.weight"),
                                       _dims("D")))
    if getattr(arch, "num_labels", None) is not None:  # a sequence classifier: the score head
        table.append(ReplicatedMapping("output_layer.weight", _w("score.weight"), _dims("L", "H")))
    elif arch.tie_embeddings:
        table.append(TiedOutputMapping("output_layer.weight", _w("model.embed_tokens.weight"), _dims("V", "H")))
    else:
        table.append(VocabParallelMapping("output_layer.weight", _w("lm_head.weight"), _dims("V", "H")))
    return table


def llama_table(arch: Any, spec: str = LOCAL_SPEC) -> list[ParamMapping]:
    """Llama 2/3, SmolLM2: no biases, no q/k norm."""
    return _decoder_table(arch, spec, qkv_bias=False, qk_norm=False)


def qwen2_table(arch: Any, spec: str = LOCAL_SPEC) -> list[ParamMapping]:
    """Qwen2 / Qwen2.5: bias on q, k, v projections (not on o_proj)."""
    return _decoder_table(arch, spec, qkv_bias=True, qk_norm=False)


def qwen3_table(arch: Any, spec: str = LOCAL_SPEC) -> list[ParamMapping]:
    """Qwen3 (dense): RMSNorm on each query / key head (q_norm, k_norm), no biases."""
    return _decoder_table(arch, spec, qkv_bias=False, qk_norm=True)


def _moe_decoder_table(arch: Any, spec: str, *, qk_norm: bool, block: str, router: str,
                       gate: str, up: str, down: str) -> list[ParamMapping]:
    """The Llama-style decoder with sparse layers: the dense MLP rules only in dense layers, and in sparse layers
    the router and the experts, HF names ``model.layers.<l>.<block>.{router}`` and
    ``model.layers.<l>.<block>.experts.<e>.{gate,up,down}.weight``."""
    L = "decoder.layers.*."
    H = f"model.layers.*.{block}."
    table = [replace(m, layers=DENSE_LAYERS) if ".mlp." in m.megatron else m  # dense MLP (+ TE's fused norm)
             for m in _decoder_table(arch, spec, qkv_bias=False, qk_norm=qk_norm)]
    # SequentialMLP (local spec; also the TE spec without grouped GEMM) and TEGroupedMLP (TE spec, grouped GEMM)
    experts = [("mlp.experts.local_experts.#.linear_fc1.weight", "mlp.experts.local_experts.#.linear_fc2.weight")]
    if spec == TE_SPEC:  # the sparse layer's norm is a module of its own there
        experts.append(("mlp.experts.linear_fc1.weight#", "mlp.experts.linear_fc2.weight#"))
        table.append(ReplicatedMapping(L + "pre_mlp_layernorm.weight",
                                       _w("model.layers.*.post_attention_layernorm.weight"), _dims("H"), SPARSE_LAYERS))
    table.append(ReplicatedMapping(L + "mlp.router.weight", _w(H + router), _dims("E", "H"), SPARSE_LAYERS))
    expert = H + "experts.#."
    for fc1, fc2 in experts:
        table += [ExpertGatedMLPMapping(L + fc1, {"gate": expert + gate, "up": expert + up},
                                        {"gate": ("FE", "H"), "up": ("FE", "H")}, SPARSE_LAYERS),
                  ExpertRowParallelMapping(L + fc2, _w(expert + down), _dims("H", "FE"), SPARSE_LAYERS)]
    return table


def qwen3_moe_table(arch: Any, spec: str = LOCAL_SPEC) -> list[ParamMapping]:
    """Qwen3-MoE: Qwen3 attention (q/k norm); router ``mlp.gate``, experts ``mlp.experts.<e>.{gate,up,down}_proj``;
    layers in ``mlp_only_layers`` (or off ``decoder_sparse_step``) keep the dense ``mlp.{gate,up,down}_proj``."""
    return _moe_decoder_table(arch, spec, qk_norm=True, block="mlp", router="gate.weight",
                              gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight")


def mixtral_table(arch: Any, spec: str = LOCAL_SPEC) -> list[ParamMapping]:
    """Mixtral: Llama attention; every layer sparse, router ``block_sparse_moe.gate``, experts
    ``block_sparse_moe.experts.<e>.{w1 (gate), w3 (up), w2 (down)}``."""
    return _moe_decoder_table(arch, spec, qk_norm=False, block="block_sparse_moe", router="gate.weight",
                              gate="w1.weight", up="w3.weight", down="w2.weight")


FAMILY_TABLES: dict[str, Callable[[Any, str], list[ParamMapping]]] = {
    "llama": llama_table,
    "qwen2": qwen2_table,
    "qwen3": qwen3_table,
    "qwen3_moe": qwen3_moe_table,
    "mixtral": mixtral_table,
}
# (qkv_bias, qk_norm) of each family
_FAMILY_SWITCHES = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True),
                    "qwen3_moe": (False, True), "mixtral": (False, False)}

# --- dense families beyond Llama/Qwen (megatron/dense_families.py) ---------------------------------------------
# Mistral / Ministral checkpoints have Llama's tensor names and layout: the window is attention behaviour.
# Phi-3 stores q, k, v fused as ``qkv_proj`` (rows [q; k; v]) and gate / up as ``gate_up_proj`` (rows [gate; up]).

@dataclass(frozen=True)
class FusedQKVMapping(QKVMapping):
    """HF ``qkv_proj`` = ``[q; k; v]`` (all query heads, then all key heads, then all value heads) <-> Megatron's
    per-group interleaved ``linear_qkv`` (``QKVMapping``)."""

    def hf_to_megatron(self, hf, arch, full_shape):
        q_rows, kv_rows = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        q, k, v = torch.split(hf["weight"], [q_rows, kv_rows, kv_rows], dim=0)
        return super().hf_to_megatron({"q": q, "k": k, "v": v}, arch, full_shape)

    def megatron_to_hf(self, full, arch):
        parts = super().megatron_to_hf(full, arch)
        return {"weight": torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)}


@dataclass(frozen=True)
class FusedGatedMLPMapping(GatedMLPMapping):
    """HF ``gate_up_proj`` = ``[gate; up]``: already Megatron's full ``linear_fc1``; TP shards as GatedMLPMapping."""

    def hf_to_megatron(self, hf, arch, full_shape):
        return hf["weight"]

    def megatron_to_hf(self, full, arch):
        return {"weight": full}


def phi3_table(arch: Any, spec: str = LOCAL_SPEC) -> list[ParamMapping]:
    """Phi-3 / Phi-4-mini: the Llama decoder with fused ``self_attn.qkv_proj`` and ``mlp.gate_up_proj``."""
    table = []
    for m in llama_table(arch, spec):
        if m.megatron.endswith("self_attention.linear_qkv.weight"):
            m = FusedQKVMapping(m.megatron, _w("model.layers.*.self_attn.qkv_proj.weight"), _dims("QKV", "H"))
        elif m.megatron.endswith("mlp.linear_fc1.weight"):
            m = FusedGatedMLPMapping(m.megatron, _w("model.layers.*.mlp.gate_up_proj.weight"), _dims("F2", "H"))
        table.append(m)
    return table


FAMILY_TABLES.update(mistral=llama_table, ministral=llama_table, phi3=phi3_table)
_FAMILY_SWITCHES.update(mistral=(False, False), ministral=(False, False), phi3=(False, False))
# ----------------------------------------------------------------------------------------------------------------


# Families with a module of their own (convert/families/, imported by the convert package) register here: their
# table, their extra symbolic dimensions (family -> arch -> {name: size}) and the checkpoint tensors they ignore
# (family -> (hf name, arch) -> bool). Their (qkv_bias, qk_norm) come from their config, not _FAMILY_SWITCHES.
FAMILY_DIMS: dict[str, Callable[[Any], dict[str, int]]] = {}
FAMILY_IGNORED_HF: dict[str, Callable[[str, Any], bool]] = {}


def mapping_table(arch: Any, spec: str = LOCAL_SPEC) -> list[ParamMapping]:
    """The rules for ``arch.family`` under layer spec ``spec`` ('local' or 'te')."""
    if arch.family not in FAMILY_TABLES:
        raise ValueError(f"unsupported model family {arch.family!r}; supported: {sorted(FAMILY_TABLES)}")
    if spec not in (LOCAL_SPEC, TE_SPEC):
        raise ValueError(f"unknown layer spec {spec!r}; expected {LOCAL_SPEC!r} or {TE_SPEC!r}")
    expected = _FAMILY_SWITCHES.get(arch.family)  # None: the family's config sets them (glm4_moe)
    got = (bool(arch.qkv_bias), bool(arch.qk_norm))
    if expected is not None and got != expected:
        raise ValueError(f"family {arch.family!r} expects (qkv_bias, qk_norm)={expected}, the architecture has {got}")
    if (getattr(arch, "moe", None) is not None) != (arch.family in MOE_FAMILIES):
        raise ValueError(f"family {arch.family!r} and moe={getattr(arch, 'moe', None)} disagree")
    return FAMILY_TABLES[arch.family](arch, spec)


def detect_spec(megatron_names: Iterable[str]) -> str:
    """'te' when layer norms are fused into linear_qkv / linear_fc1 (Transformer Engine spec), else 'local'."""
    names = list(megatron_names)
    fused = ("linear_qkv.layer_norm_weight", "linear_fc1.layer_norm_weight", "linear_q_up_proj.layer_norm_weight",
             "linear_kv_up_proj.layer_norm_weight")  # the last two: multi-latent attention's TE spec
    if any(n.endswith(fused) for n in names):
        return TE_SPEC
    return LOCAL_SPEC


# ----------------------------------------------------------------------------------------------------------------
# Name resolution
# ----------------------------------------------------------------------------------------------------------------

class Resolved(NamedTuple):
    """A Megatron parameter name resolved against a table: its rule, global layer and (expert rules) the
    rank-local expert index."""

    mapping: ParamMapping
    layer: int | None
    local_expert: int | None


def _name_regex(pattern: str) -> re.Pattern:
    body = re.escape(pattern).replace(r"\*", r"(?P<layer>\d+)")
    body = body.replace(re.escape(EXPERT_WILDCARD), r"(?P<expert>\d+)")
    return re.compile(body + "$")


@dataclass
class MappingIndex:
    """Finds the rule (and layer / local expert index) for a global Megatron parameter name."""

    table: list[ParamMapping]
    _exact: dict[str, ParamMapping] = field(init=False, default_factory=dict)
    _patterns: list[tuple[re.Pattern, ParamMapping]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        for m in self.table:
            if m.is_layer:
                self._patterns.append((_name_regex(m.megatron), m))
            else:
                self._exact[m.megatron] = m

    def resolve(self, megatron_name: str) -> Resolved:
        if megatron_name in self._exact:
            return Resolved(self._exact[megatron_name], None, None)
        for pattern, m in self._patterns:
            match = pattern.match(megatron_name)
            if match:
                expert = match.groupdict().get("expert")
                return Resolved(m, int(match.group("layer")), None if expert is None else int(expert))
        raise ValueError(f"no HF mapping for Megatron parameter {megatron_name!r} "
                         f"(known: {[m.megatron for m in self.table]})")

    def lookup(self, megatron_name: str) -> tuple[ParamMapping, int | None]:
        """(rule, global layer) of a name; ``resolve`` also gives an expert rule's local expert index."""
        resolved = self.resolve(megatron_name)
        return resolved.mapping, resolved.layer


def expected_hf_shapes(arch: Any, spec: str = LOCAL_SPEC) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the architecture needs, with its shape (the checkpoint must contain exactly these)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for m in mapping_table(arch, spec):
        if not m.export:
            continue
        for layer in (range(arch.num_layers) if m.is_layer else [None]):
            if layer is not None and not m.exists_in_layer(arch, layer):
                continue
            for expert in (range(arch.moe.num_experts) if m.expert else [None]):
                shapes.update(m.hf_shapes(arch, layer, expert))
    return shapes


# HF tensors that may be present in a checkpoint but carry no weights (buffers of old transformers versions).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def validate_hf_tensors(hf_shapes: Mapping[str, Sequence[int]], arch: Any) -> None:
    """Compare a checkpoint's tensor names and shapes with what ``arch`` needs; ValueError listing every problem.

    ``lm_head.weight`` is tolerated when embeddings are tied (transformers ignores it and re-ties).
    """
    expected = expected_hf_shapes(arch)
    problems: list[str] = []
    for name in sorted(expected.keys() - hf_shapes.keys()):
        problems.append(f"missing tensor {name!r} (expected shape {expected[name]})")
    for name in sorted(hf_shapes.keys() - expected.keys()):
        if name.endswith(IGNORED_HF_SUFFIXES) or (arch.tie_embeddings and name == "lm_head.weight"):
            continue
        if arch.family in FAMILY_IGNORED_HF and FAMILY_IGNORED_HF[arch.family](name, arch):
            continue
        problems.append(f"unexpected tensor {name!r} with shape {tuple(hf_shapes[name])}")
    for name in sorted(expected.keys() & hf_shapes.keys()):
        if tuple(hf_shapes[name]) != expected[name]:
            problems.append(f"shape mismatch for {name!r}: checkpoint has {tuple(hf_shapes[name])}, "
                            f"the config implies {expected[name]}")
    if problems:
        head = (f"HF checkpoint does not match the {arch.family} architecture from its config "
                f"({len(problems)} problems):")
        raise ValueError("\n  ".join([head] + problems[:50] + (["..."] if len(problems) > 50 else [])))
