"""THD-capable core attention on ``torch.nn.functional.scaled_dot_product_attention`` (any device).

Megatron's local ``DotProductAttention`` refuses packed sequences (``packed_seq_params``), and Transformer
Engine, which handles them, needs CUDA. ``SDPACoreAttention`` is the local-spec twin of
``TEDotProductAttention`` for our two layouts, plugged at
``submodules.self_attention.submodules.core_attention`` by ``model.build_gpt_model``:

* ``sbhd`` (a plain ``[s, b]`` batch): query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]``; causal
  (``attn_mask_type=causal`` and no mask) or Megatron's boolean mask (True = masked out).
* ``thd`` (packed, ``packed_seq_params.qkv_format == "thd"``): query ``[t, np, hn]``, key/value
  ``[t, ng, hn]``. Sequence i occupies ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`` (or
  ``cu_seqlens_q`` without padding) and attends causally within itself only:
  ``out_i = softmax(q_i k_i^T * scale + causal) v_i``, one SDPA call per length bucket
  (lengths within a factor 2) on a ``[n, heads, L_max, hn]`` batch gathered from the packed tensors: a few
  calls instead of one per sequence (the loop dominated the CPU step with short sequences,
  docs/benchmarks.md), memory at most ~4x the per-sequence sum of ``len^2``, never O(T^2) as a
  block-diagonal mask over the whole micro-batch would be. Positions after the last segment are zero.
  Padding positions inside a segment come after its real tokens, so causality keeps them out of every real
  token's output.

Context parallelism (``context_parallel_size > 1``, thd only): the layer holds this CP rank's zigzag part of every
sequence and the GLOBAL offsets; ``SDPACoreAttention`` runs ``cp_attention.context_parallel_attention`` (all-gather
K/V over the CP group, reduce-scatter of dK/dV, bottom-right-causal segments on ``cp_kernel``: the SDPA reference,
or torch's varlen kernel with query and key offsets of their own); the TE spec uses Transformer Engine's own CP.

Sliding window (Mistral / Ministral; ``config.window_size = (left, 0)`` on the layers ``window_attn_skip_freq``
selects, ``layer_window``): query ``i`` of a sequence sees its keys ``i - left .. i`` only. The thd path applies it per
packed sequence (each bucket row is one left-aligned sequence, so one ``[L, L]`` mask, ``window_mask``, serves the
bucket); the varlen kernel gets ``window_size=(left, 0)``; context parallelism with a window is refused by name.

Grouped-query attention: each of the ``ng`` key/value heads serves ``np/ng`` consecutive query heads.
``torch.nn.attention.flex_attention`` is not used: it has no CPU backward.

``VarlenCoreAttention`` (CUDA) is the same module with its ``thd`` path on torch's own FlashAttention varlen
kernels (``torch.nn.attention.varlen``; ``varlen_attention`` is the one shim over its changing signature): fused
packed attention without Transformer Engine. ``resolve_attention_backend`` picks the backend for
``model.attention_backend`` (auto | te | varlen | sdpa); ``model.build_layer_spec`` builds it.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from .cp_attention import context_parallel_attention, sdpa_causal_segments

logger = logging.getLogger(__name__)


class SDPACoreAttention(MegatronModule):
    """Core attention (no parameters) with the constructor and forward signature of Megatron's
    ``DotProductAttention``/``TEDotProductAttention``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r}: SDPACoreAttention supports 'vanilla' only")
        cp = config.context_parallel_size
        if pg_collection is None:
            required = ["tp", "cp"] if cp > 1 else ["tp"]
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=required)
        tp_size = pg_collection.tp.size()
        # context parallelism: this rank holds its zigzag part of every packed sequence (cp_attention.py)
        self.cp_group = pg_collection.cp if cp > 1 else None
        if self.cp_group is not None and self.cp_group.size() != cp:
            raise ValueError(f"context_parallel_size={cp} but the CP process group has {self.cp_group.size()} ranks")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_kv_heads = divide(config.num_query_groups or config.num_attention_heads, tp_size)
        # query/key and value head sizes: kv_channels, or (multi-latent attention) k_channels / v_channels
        self.head_dim = k_channels if k_channels is not None else config.kv_channels
        self.v_head_dim = v_channels if v_channels is not None else self.head_dim
        if self.cp_group is not None and self.v_head_dim != self.head_dim:
            raise ValueError(f"context_parallel_size={cp} with value head dim {self.v_head_dim} != query/key head "
                             f"dim {self.head_dim} (multi-latent attention): not supported, use cp=1")
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window_left = layer_window(config, layer_number)
        if self.window_left is not None and self.cp_group is not None:
            raise ValueError(f"window_size={config.window_size} (sliding-window attention) with "
                             f"context_parallel_size={cp}: the context-parallel attention has no sliding window")
        if self.cp_group is not None and self.dropout_p:
            raise ValueError(f"attention_dropout={self.dropout_p} with context_parallel_size={cp}: the "
                             "context-parallel attention has no dropout (RL fine-tuning runs with 0)")

    # ------------------------------------------------------------------------------------------------------
    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], is_causal: bool) -> Tensor:
        """q [b, np, sq, hn], k/v [b, ng, sk, hn] -> [b, np, sq, hn]."""
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                      is_causal=is_causal, scale=self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=self.softmax_scale)

    def _forward_thd(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params: PackedSeqParams) -> Tensor:
        cu_q = packed_seq_params.cu_seqlens_q_padded
        if cu_q is None:
            cu_q = packed_seq_params.cu_seqlens_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        if cu_kv is None:
            cu_kv = packed_seq_params.cu_seqlens_kv
        if cu_kv is None:
            cu_kv = cu_q
        if cu_q is None:
            raise ValueError("packed_seq_params with qkv_format='thd' needs cu_seqlens_q (and/or _padded)")
        bounds_q = cu_q.tolist()
        bounds_kv = cu_kv.tolist()
        if bounds_q != bounds_kv:
            raise ValueError("SDPACoreAttention (self-attention) needs equal q and kv cu_seqlens, got "
                             f"{bounds_q} and {bounds_kv}")
        total = query.size(0)
        if bounds_q[-1] > total:
            raise ValueError(f"cu_seqlens ends at {bounds_q[-1]} but the packed batch has {total} positions")
        out = query.new_zeros(total, self.num_heads, self.v_head_dim)
        segments = [(s, e - s) for s, e in zip(bounds_q[:-1], bounds_q[1:]) if e > s]
        buckets: dict[int, list[tuple[int, int]]] = {}  # ceil(log2(length)) -> segments: padding < 2x
        for start, length in segments:
            buckets.setdefault((length - 1).bit_length(), []).append((start, length))
        for bucket in buckets.values():
            # One causal SDPA call per bucket: its segments gathered into a [n, heads, L_max, hn] batch (segment
            # i left-aligned in row i; the tail past its length reads position 0 and is never attended by the
            # segment's own positions: causal), then the real positions scattered back.
            starts = torch.tensor([s for s, _ in bucket], device=query.device).unsqueeze(1)
            lengths = torch.tensor([n for _, n in bucket], device=query.device).unsqueeze(1)
            offsets = torch.arange(max(n for _, n in bucket), device=query.device).unsqueeze(0)
            valid = offsets < lengths  # [n, L_max]
            index = torch.where(valid, starts + offsets, torch.zeros_like(offsets))
            gather = lambda x: x[index].permute(0, 2, 1, 3)  # noqa: E731 - [t, h, hn] -> [n, h, L_max, hn]
            length = offsets.size(1)
            if self.window_left is not None and length > self.window_left + 1 and self._causal():
                # the window per sequence: each row is one left-aligned sequence, so one [L_max, L_max] mask
                seg_out = self._sdpa(gather(query), gather(key), gather(value),
                                     window_mask(length, length, self.window_left, query.device), is_causal=False)
            else:
                seg_out = self._sdpa(gather(query), gather(key), gather(value), None, is_causal=self._causal())
            out = out.index_put((index[valid],), seg_out.permute(0, 2, 1, 3)[valid])
        return out.reshape(total, self.num_heads * self.v_head_dim)

    # the kernel of the context-parallel path: bottom-right-causal segments (cp_attention.context_parallel_attention)
    cp_kernel = staticmethod(sdpa_causal_segments)

    def _forward_thd_cp(self, query: Tensor, key: Tensor, value: Tensor,
                        packed_seq_params: PackedSeqParams) -> Tensor:
        """This CP rank's queries (its zigzag part of every sequence) against all keys of their sequences; the
        packed params hold the GLOBAL padded offsets."""
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        if cu is None:
            raise ValueError("packed_seq_params with qkv_format='thd' needs cu_seqlens_q (and/or _padded)")
        out = context_parallel_attention(query, key, value, cu, self.cp_group, scale=self.softmax_scale,
                                         attend=self.cp_kernel)
        return out.reshape(query.size(0), self.num_heads * self.head_dim)

    def _causal(self, attn_mask_type: Optional[AttnMaskType] = None) -> bool:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPACoreAttention")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attn_mask_type is not None and not self._causal(attn_mask_type):
                raise ValueError(f"attn_mask_type={attn_mask_type}: packed (thd) attention is causal only")
            if self.cp_group is not None:
                return self._forward_thd_cp(query, key, value, packed_seq_params)
            return self._forward_thd(query, key, value, packed_seq_params)
        if self.cp_group is not None:
            raise ValueError("context parallelism needs packed (thd) batches: pass packed_seq_params")
        if packed_seq_params is not None:
            raise ValueError(f"qkv_format={packed_seq_params.qkv_format!r} is not supported; use 'thd' or "
                             "no packed_seq_params")

        # sbhd: [s, b, heads, hn] -> [b, heads, s, hn]
        sq, b = query.shape[:2]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        window = None
        if self.window_left is not None:
            window = window_mask(sq, k.size(2), self.window_left, query.device)  # (causal as well)
        if attention_mask is not None:
            keep = ~attention_mask.bool()  # Megatron: True = masked
            out = self._sdpa(q, k, v, keep if window is None else keep & window, is_causal=False)
        elif window is not None and self._causal(attn_mask_type):
            out = self._sdpa(q, k, v, window, is_causal=False)
        else:
            out = self._sdpa(q, k, v, None, is_causal=self._causal(attn_mask_type))
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.v_head_dim)


# ==========================================================================================================
# Fused THD attention without Transformer Engine: torch.nn.attention.varlen (FlashAttention inside torch)
# ==========================================================================================================
class VarlenCoreAttention(SDPACoreAttention):
    """The SDPA twin with its packed (``thd``) path on ``torch.nn.attention.varlen.varlen_attn``: one fused
    FlashAttention varlen call per micro-batch (forward and backward), causal, GQA, bf16/fp16, CUDA only.

    Sequence i is the segment ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`` (real tokens first, then
    padding), exactly as in ``SDPACoreAttention``: the kernel gets the padded offsets as its ``cu_seq_q/k``, so
    padding after a sequence's real tokens is causally invisible to them and never needs TE's
    padding-between-sequences path. Positions after the last segment are zero. The ``sbhd`` layout (no packed
    params) is the SDPA twin's.
    """

    kernel = None  # None = torch.nn.attention.varlen.varlen_attn; tests put a CPU reference with its signature here

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.dropout_p:
            raise ValueError(f"attention_dropout={self.dropout_p}: the varlen backend has no dropout (RL "
                             "fine-tuning runs with 0); use model.attention_backend=sdpa or te")
        problem = (flash_varlen_problem(config.params_dtype, self.head_dim, self.v_head_dim) if self.kernel is None
                   else None)
        if problem:  # a replacement kernel (tests) has its own limits
            raise ValueError(f"model.attention_backend=varlen cannot be used: {problem}")

    def cp_kernel(self, query: Tensor, key: Tensor, value: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                  max_k: int, scale: float) -> Tensor:
        """The context-parallel path's segments (bottom-right causal) on the varlen kernel."""
        return varlen_attention(query, key, value, cu_q.to(torch.int32), int(max_q), causal=True, scale=scale,
                                kernel=self.kernel, cu_seqlens_k=cu_k.to(torch.int32), max_seqlen_k=int(max_k))

    def _forward_thd(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params: PackedSeqParams) -> Tensor:
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        if cu is None:
            raise ValueError("packed_seq_params with qkv_format='thd' needs cu_seqlens_q (and/or _padded)")
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        if cu_kv is None:
            cu_kv = packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and not torch.equal(cu_kv.to(cu.device), cu):
            raise ValueError("VarlenCoreAttention (self-attention) needs equal q and kv cu_seqlens")
        total = query.size(0)
        end = int(cu[-1])
        if end > total:
            raise ValueError(f"cu_seqlens ends at {end} but the packed batch has {total} positions")
        max_len = packed_seq_params.max_seqlen_q
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        out = varlen_attention(query[:end], key[:end], value[:end], cu.to(query.device, torch.int32), int(max_len),
                               causal=self._causal(), scale=self.softmax_scale, kernel=self.kernel,
                               window_left=self.window_left)
        if end < total:
            out = torch.cat([out, query.new_zeros(total - end, *out.shape[1:])], dim=0)
        return out.reshape(total, self.num_heads * self.head_dim)


def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, *,
                     causal: bool, scale: float, kernel=None, cu_seqlens_k: Optional[Tensor] = None,
                     max_seqlen_k: Optional[int] = None, window_left: Optional[int] = None) -> Tensor:
    """Self-attention of packed sequences: query ``[t, np, hn]``, key/value ``[t, ng, hn]`` (GQA when
    ``ng < np``), ``cu_seqlens`` int32 ``[n+1]`` over exactly ``t`` positions -> ``[t, np, hn]``.
    ``cu_seqlens_k`` / ``max_seqlen_k`` (default: the query's): key segments of other lengths (the
    context-parallel path: query chunks against their key prefixes); causal is then FlashAttention's bottom-right
    alignment (query ``a`` of ``n_q`` sees keys ``b <= a + n_k - n_q``, also for ``window_size=(-1, 0)``).

    The one compat shim for ``torch.nn.attention.varlen.varlen_attn``, whose signature changed between releases
    (read from the installed function, never from a version table):

    * torch 2.10: ``varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None)``:
      causal as a flag, no ``scale`` (always ``1/sqrt(hn)``), key/value heads must equal query heads;
    * torch 2.11: ``(..., *, return_aux=None, scale=None, window_size=(-1, -1))``: causal is
      ``window_size=(-1, 0)``; still no GQA flag;
    * torch 2.12-2.13: adds ``enable_gqa`` (and KV-cache arguments we do not use).

    Without ``enable_gqa`` the key/value heads are repeated (``repeat_interleave``, Megatron's head grouping);
    without ``scale`` the query is pre-scaled so that the kernel's ``1/sqrt(hn)`` yields ``scale``. ``kernel``
    replaces ``varlen_attn`` (tests use a reference with one of these signatures on CPU). ``window_left``: a
    causal sliding window (query ``i`` sees keys ``i - window_left .. i`` of its sequence), passed as
    ``window_size=(window_left, 0)``; a kernel without ``window_size`` (torch 2.10) refuses it.
    """
    if kernel is None:
        from torch.nn.attention.varlen import varlen_attn as kernel

        problem = flash_varlen_problem(query.dtype, query.size(2))
        if problem:
            raise ValueError(problem)
    params = _kernel_parameters(kernel)
    # FlashAttention needs unit stride in the head dimension (Megatron's q/k/v are views of the fused QKV output)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    kwargs: dict = {}
    heads, kv_heads, head_dim = query.size(1), key.size(1), query.size(2)
    if kv_heads != heads:
        if heads % kv_heads:
            raise ValueError(f"query heads {heads} are not a multiple of key/value heads {kv_heads}")
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, 1.0 / math.sqrt(head_dim), rel_tol=1e-12):
        query = query * (scale * math.sqrt(head_dim))
    if window_left is not None:
        if not causal or "window_size" not in params:
            raise ValueError(f"a sliding window (window_left={window_left}) needs causal attention and a varlen "
                             f"kernel with window_size (torch >= 2.11; this is torch {torch.__version__}); use "
                             "model.attention_backend=sdpa or te")
        kwargs["window_size"] = (int(window_left), 0)
    elif "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kwargs["is_causal"] = causal
    elif causal:
        raise RuntimeError(f"torch {torch.__version__}: varlen_attn takes neither window_size nor is_causal; "
                           "cannot request causal attention (use model.attention_backend=sdpa)")
    cu_k = cu_seqlens if cu_seqlens_k is None else cu_seqlens_k
    max_k = max_seqlen if max_seqlen_k is None else max_seqlen_k
    return kernel(query, key, value, cu_seqlens, cu_k, max_seqlen, max_k, **kwargs)


def layer_window(config: TransformerConfig, layer_number: int) -> Optional[int]:
    """The left window (keys before the query that it still sees) of global layer ``layer_number`` (1-based), or
    None when that layer attends to the whole causal prefix: Megatron-Core's ``window_size = (left, right)`` with
    ``window_attn_skip_freq`` (``is_layer_window_attention``). Only causal windows (``right == 0``) are taken."""
    from megatron.core.transformer.utils import is_layer_window_attention

    if config.window_size is None or not is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = config.window_size
    if right != 0 or left < 0:
        raise ValueError(f"window_size={config.window_size}: only causal sliding windows (left >= 0, right == 0) "
                         "are supported")
    return int(left)


def window_mask(sq: int, sk: int, left: int, device) -> Tensor:
    """Boolean ``[sq, sk]`` mask (True = attend) of causal sliding-window attention, queries aligned to the last
    ``sq`` keys: query ``i`` sees keys ``j`` with ``i - left <= j <= i``."""
    q = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    k = torch.arange(sk, device=device).unsqueeze(0)
    return (k <= q) & (q - k <= left)


# What torch's FlashAttention varlen kernels take (FlashAttention 2: half precision, head dims a multiple of 8
# up to 256); anything else fails inside the kernel, at the first forward.
FLASH_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
FLASH_VARLEN_MAX_HEAD_DIM = 256


def flash_varlen_problem(dtype: Optional[torch.dtype], head_dim: Optional[int],
                         v_head_dim: Optional[int] = None) -> Optional[str]:
    """Why torch's FlashAttention varlen kernels cannot run ``dtype`` / ``head_dim`` (None: they can, or the
    value is not known); ``v_head_dim``: a value head size other than ``head_dim`` (multi-latent attention)."""
    if v_head_dim is not None and v_head_dim != head_dim:
        return (f"value head dim {v_head_dim} != query/key head dim {head_dim} (multi-latent attention): torch's "
                "FlashAttention varlen kernels need one head dim (use model.attention_backend=sdpa or te)")
    if dtype is not None and dtype not in FLASH_VARLEN_DTYPES:
        return (f"torch's FlashAttention varlen kernels take float16 or bfloat16 only, the model is {dtype} "
                "(use model.dtype=bfloat16, or model.attention_backend=sdpa or te)")
    if head_dim is not None and (head_dim % 8 or head_dim > FLASH_VARLEN_MAX_HEAD_DIM):
        return (f"head_dim={head_dim}: torch's FlashAttention varlen kernels take head dims that are multiples of "
                f"8 up to {FLASH_VARLEN_MAX_HEAD_DIM} (use model.attention_backend=sdpa or te)")
    return None


def _kernel_parameters(kernel) -> frozenset:
    import inspect

    return frozenset(inspect.signature(kernel).parameters)


# ==========================================================================================================
# Backend selection: model.attention_backend = auto | te | varlen | sdpa
# ==========================================================================================================
ATTENTION_BACKENDS = ("auto", "te", "varlen", "sdpa")
# what the banner prints for each resolved backend
BACKEND_DESCRIPTIONS = {
    "te": "Transformer Engine fused attention (TE layer spec)",
    "varlen": "torch varlen FlashAttention (local spec, no TE)",
    "sdpa": "SDPA twin (local spec, per-sequence scaled_dot_product_attention)",
}


@dataclass(frozen=True)
class BackendProbe:
    """What the machine offers: ``te``/``varlen`` are None when usable, else the reason they are not."""

    cuda: bool
    te: Optional[str]
    varlen: Optional[str]


def probe_backends() -> BackendProbe:
    """Probe this process's machine (cached: TE's smoke test runs a kernel once)."""
    return _probe_cached()


@functools.lru_cache(maxsize=None)
def _probe_cached() -> BackendProbe:
    cuda = torch.cuda.is_available()
    return BackendProbe(cuda=cuda, te=_te_problem(cuda), varlen=_varlen_problem(cuda))


def _te_problem(cuda: bool) -> Optional[str]:
    from . import compat

    if not cuda:
        return "no CUDA device (Transformer Engine is GPU only)"
    if compat.detect_gpu_extras().transformer_engine is None:
        return "transformer_engine is not installed"
    if not compat.have_transformer_engine():
        return "transformer_engine is installed but does not import"
    try:  # "imports" is not "works": a TE built for another CUDA/torch fails at its first kernel
        import transformer_engine.pytorch as te

        layer = te.Linear(16, 16, params_dtype=torch.bfloat16, device="cuda")
        layer(torch.ones(16, 16, dtype=torch.bfloat16, device="cuda"))
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001 - any failure means "not usable", reported verbatim
        return f"transformer_engine imports but its smoke test failed ({type(err).__name__}: {err})"
    return None


def _varlen_problem(cuda: bool) -> Optional[str]:
    if not cuda:
        return "no CUDA device (torch's varlen FlashAttention kernels are CUDA only)"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.10)"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return f"FlashAttention needs compute capability >= 8.0 (this GPU: {torch.cuda.get_device_capability()})"
    return None


def resolve_attention_backend(requested: str = "auto", probe: Optional[BackendProbe] = None, *,
                              dtype: Optional[torch.dtype] = None, head_dim: Optional[int] = None,
                              v_head_dim: Optional[int] = None) -> str:
    """The backend to build: ``te``, ``varlen`` or ``sdpa``.

    ``auto``: TE when it imports and works on CUDA, else varlen on CUDA when the model's ``dtype`` and
    ``head_dim`` fit torch's FlashAttention kernels (``flash_varlen_problem``; None = not checked), else the SDPA
    twin (CPU, an fp32 model, or a GPU where neither fused path works). An explicit choice that cannot work raises
    ``ValueError`` naming why; it never falls back silently. ``sdpa`` works everywhere.
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention_backend={requested!r} is invalid: expected one of {ATTENTION_BACKENDS}")
    if requested == "sdpa":
        return "sdpa"
    probe = probe or probe_backends()
    varlen = probe.varlen or flash_varlen_problem(dtype, head_dim, v_head_dim)
    if requested == "te":
        if probe.te is not None:
            raise ValueError(f"model.attention_backend=te cannot be used: {probe.te}. Use auto, varlen (CUDA) "
                             "or sdpa")
        return "te"
    if requested == "varlen":
        if varlen is not None:
            raise ValueError(f"model.attention_backend=varlen cannot be used: {varlen}. Use auto, te "
                             "(CUDA + Transformer Engine) or sdpa")
        return "varlen"
    if probe.te is None:
        return "te"
    if varlen is None:
        return "varlen"
    if probe.cuda:
        logger.warning("model.attention_backend=auto on CUDA: neither TE (%s) nor varlen (%s) is usable; using "
                       "the SDPA twin (correct, slower)", probe.te, varlen)
    return "sdpa"


def core_attention_class(backend: str):
    """The ``core_attention`` module of the local layer spec for a resolved non-TE backend."""
    if backend == "varlen":
        return VarlenCoreAttention
    if backend == "sdpa":
        return SDPACoreAttention
    raise ValueError(f"backend={backend!r} has no local-spec core attention (expected 'varlen' or 'sdpa')")
