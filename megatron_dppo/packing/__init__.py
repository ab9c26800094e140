"""Dense Prompt Packing (docs/algorithms.md): token-capped micro-batches dealt evenly to DP ranks, and the
THD layout they run in. Plain torch/python; no Megatron import."""

from megatron_dppo.packing.baselines import pack_ffd, pack_padded, pack_verl_kk
from megatron_dppo.packing.bins import karmarkar_karp
from megatron_dppo.packing.packer import pack_sequences
from megatron_dppo.packing.plan import PackingStats, attention_cost_alpha, min_bins, packing_stats
from megatron_dppo.packing.thd import (
    PaddedBatch,
    ThdBatch,
    build_padded_batch,
    build_plan_micro_batches,
    build_rank_micro_batches,
    build_thd_batch,
    thd_pad_multiple,
)

__all__ = [
    "PackingStats",
    "PaddedBatch",
    "ThdBatch",
    "attention_cost_alpha",
    "build_padded_batch",
    "build_plan_micro_batches",
    "build_rank_micro_batches",
    "build_thd_batch",
    "karmarkar_karp",
    "min_bins",
    "pack_ffd",
    "pack_padded",
    "pack_sequences",
    "pack_verl_kk",
    "packing_stats",
    "thd_pad_multiple",
]
