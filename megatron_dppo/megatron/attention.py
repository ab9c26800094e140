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

Grouped-query attention: each of the ``ng`` key/value heads serves ``np/ng`` consecutive query heads.
``torch.nn.attention.flex_attention`` is not used: it has no CPU backward.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


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
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: context parallelism needs "
                             "Transformer Engine attention; SDPACoreAttention supports 1 only")
        if config.window_size is not None:
            raise ValueError(f"window_size={config.window_size}: sliding-window attention is not supported by "
                             "SDPACoreAttention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r}: SDPACoreAttention supports 'vanilla' only")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_kv_heads = divide(config.num_query_groups or config.num_attention_heads, tp_size)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

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
        out = query.new_zeros(total, self.num_heads, self.head_dim)
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
            seg_out = self._sdpa(gather(query), gather(key), gather(value), None, is_causal=self._causal())
            out = out.index_put((index[valid],), seg_out.permute(0, 2, 1, 3)[valid])
        return out.reshape(total, self.num_heads * self.head_dim)

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
            return self._forward_thd(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            raise ValueError(f"qkv_format={packed_seq_params.qkv_format!r} is not supported; use 'thd' or "
                             "no packed_seq_params")

        # sbhd: [s, b, heads, hn] -> [b, heads, s, hn]
        sq, b = query.shape[:2]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if attention_mask is not None:
            out = self._sdpa(q, k, v, ~attention_mask.bool(), is_causal=False)  # Megatron: True = masked
        else:
            out = self._sdpa(q, k, v, None, is_causal=self._causal(attn_mask_type))
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * self.head_dim)
