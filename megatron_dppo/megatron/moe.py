"""Mixture-of-Experts decoders on Megatron-Core: Qwen3-MoE and Mixtral.

Both families replace the SwiGLU MLP of (some) decoder layers by a sparse block of ``E`` SwiGLU experts and a
linear router ``r = W_router h`` (no bias):

=============  ===================================================  =============================================
family         routing weights of the top-k experts                 dense layers / shared experts
=============  ===================================================  =============================================
qwen3_moe      ``p = softmax(r)``; top-k of ``p``; divided by their  ``mlp_only_layers`` and ``decoder_sparse_step``
               sum when ``norm_topk_prob`` (Qwen3-30B-A3B: true)     keep a dense MLP (``intermediate_size``);
                                                                    no shared experts
mixtral        top-k of ``r``, softmax over the k kept logits        every layer sparse; no shared experts
               (= top-k of ``softmax(r)`` renormalized)
=============  ===================================================  =============================================

Megatron's ``TopKRouter`` computes exactly these: ``moe_router_pre_softmax=True`` is "softmax over all experts,
then top-k, no renormalization" (Qwen3-MoE with ``norm_topk_prob=False``), ``False`` is "top-k of the logits,
softmax over the k" (Mixtral, and Qwen3-MoE with ``norm_topk_prob=True``, which is the same number). The router
runs in fp32 (``moe_router_dtype="fp32"``) as transformers does (``softmax(..., dtype=float)``).

Expert weights: the expert ``e`` of layer ``l`` is a SwiGLU MLP ``W2_e (silu(Wg_e x) * Wu_e x)`` stored by
Megatron as ``linear_fc1 = [Wg_e; Wu_e]`` and ``linear_fc2 = W2_e``: in ``mlp.experts.local_experts.<i>`` with the
local spec (``SequentialMLP``: a loop over experts, any device), or as ``mlp.experts.linear_fc1.weight<i>`` with
the Transformer Engine spec (``TEGroupedMLP``: one grouped GEMM for all local experts, ``moe_grouped_gemm``).
Under expert parallelism (``parallel.ep``) EP rank ``j`` holds the experts ``j * E/ep ... (j + 1) * E/ep - 1``
(``global_expert_index``); expert-tensor parallelism (``parallel.etp``) splits each expert like a dense MLP.
Expert gradients are summed over the expert-data-parallel group at every ``ep``
(``reduce_expert_grads_over_expert_grid``), and the optimizer chains a dense and an expert Adam whose gradient
norms combine into one global norm.

The load-balancing auxiliary loss is off by default (``model.moe_aux_loss_coeff: 0``, router load balancing
"none"): in RL the router should follow the reward, and slime trains Qwen3-MoE that way. When on, one step adds
the token-weighted mean of the per-micro-batch switch losses (``aux_loss_per_routed_token``), whatever the
batch size, micro-batching or layout. Tokens travel between
EP ranks with Megatron's all-to-all dispatcher (works over NCCL and gloo; it is also the dispatcher Megatron
allows with variable sequence lengths, which packed pipelines need). No token is ever dropped (no capacity
factor): dropping would make the training forward differ from the rollout.

Routing replay (``model.moe_routing_replay``) lives in ``routing_replay``: it records the top-k experts a
forward pass chose and makes a later forward use them.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe")  # the last two: deepseek_moe.py


@dataclass(frozen=True)
class MoEArch:
    """The sparse part of an MoE decoder (HF names in brackets)."""

    num_experts: int  # [num_experts] (Qwen3-MoE) / [num_local_experts] (Mixtral)
    topk: int  # [num_experts_per_tok]
    expert_ffn_hidden_size: int  # [moe_intermediate_size] (Qwen3-MoE) / [intermediate_size] (Mixtral)
    norm_topk_prob: bool  # [norm_topk_prob]; Mixtral always renormalizes
    sparse_layers: tuple[bool, ...]  # per layer: True = MoE block, False = dense MLP (ffn_hidden_size)
    router_aux_loss_coef: float = 0.0  # [router_aux_loss_coef], informative: training uses model.moe_aux_loss_coeff
    # DeepSeek-style routers (deepseek_v3, glm4_moe; ``deepseek_moe``): defaults are the qwen3_moe / mixtral router
    score_function: str = "softmax"  # softmax | sigmoid
    expert_bias: bool = False  # [e_score_correction_bias] added to the scores for the choice only (sigmoid)
    num_groups: int | None = None  # [n_group] group-limited routing (None: no group limit)
    group_topk: int | None = None  # [topk_group]
    scaling_factor: float = 1.0  # [routed_scaling_factor] multiplies the top-k weights
    shared_expert_ffn_hidden_size: int | None = None  # [n_shared_experts * moe_intermediate_size]; None: none

    def __post_init__(self):
        if self.num_experts < 2:
            raise ValueError(f"num_experts={self.num_experts} must be >= 2 for a Mixture-of-Experts model")
        if not 1 <= self.topk <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.topk} must be in 1..num_experts={self.num_experts}")
        if self.expert_ffn_hidden_size <= 0:
            raise ValueError(f"expert ffn size {self.expert_ffn_hidden_size} must be positive")
        if self.score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"score_function={self.score_function!r}; supported: softmax, sigmoid")
        if self.expert_bias and self.score_function != "sigmoid":
            raise ValueError("expert_bias=True needs score_function='sigmoid' (aux-loss-free routing)")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError(f"num_groups={self.num_groups} and group_topk={self.group_topk}: set both or neither")
        if not any(self.sparse_layers):
            raise ValueError("the configuration has no MoE layer (every layer is in mlp_only_layers or skipped "
                             "by decoder_sparse_step)")

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    def layer_pattern(self) -> list[int]:
        """Megatron's ``moe_layer_freq`` list: 1 = MoE layer, 0 = dense layer."""
        return [1 if s else 0 for s in self.sparse_layers]


def moe_from_hf_config(hf: Any, family: str) -> MoEArch:
    """The ``MoEArch`` of a transformers ``Qwen3MoeConfig`` / ``MixtralConfig``; ValueError for what Megatron's
    router cannot represent (router jitter, sigmoid scores, shared experts)."""
    layers = int(hf.num_hidden_layers)
    if family == "qwen3_moe":
        experts = int(hf.num_experts)
        step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf, "mlp_only_layers", None) or [])
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        return MoEArch(num_experts=experts, topk=int(hf.num_experts_per_tok),
                       expert_ffn_hidden_size=int(hf.moe_intermediate_size),
                       norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)), sparse_layers=sparse,
                       router_aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0))
    if family == "mixtral":
        jitter = float(getattr(hf, "router_jitter_noise", 0.0) or 0.0)
        if jitter:
            raise ValueError(f"router_jitter_noise={jitter} is not supported (the router must be deterministic so "
                             "that rollout and training pick the same experts); set it to 0.0")
        return MoEArch(num_experts=int(hf.num_local_experts), topk=int(hf.num_experts_per_tok),
                       expert_ffn_hidden_size=int(hf.intermediate_size), norm_topk_prob=True,
                       sparse_layers=(True,) * layers,
                       router_aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0))
    if family in ("deepseek_v3", "glm4_moe"):
        from .deepseek_moe import moe_fields

        return MoEArch(**moe_fields(hf, family))
    raise ValueError(f"family={family!r} is not a Mixture-of-Experts family; supported: {MOE_FAMILIES}")


def moe_config_kwargs(moe: MoEArch, *, ep: int, etp: int, aux_loss_coeff: float = 0.0,
                      routing_replay: bool = False, grouped_gemm: bool = False) -> dict:
    """``TransformerConfig`` fields of the MoE blocks (merged into ``model.build_transformer_config``)."""
    if aux_loss_coeff < 0:
        raise ValueError(f"moe_aux_loss_coeff={aux_loss_coeff} must be >= 0")
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_layer_freq=moe.layer_pattern(),
        # softmax-then-top-k without renormalization only for Qwen3-MoE's norm_topk_prob=False
        moe_router_pre_softmax=moe.score_function == "softmax" and not moe.norm_topk_prob,
        moe_router_score_function=moe.score_function,
        # DeepSeek-style routers (deepseek_moe.py): a frozen expert bias (no aux-loss-free updates in RL), groups,
        # the routed scaling factor and the shared experts
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor if moe.scaling_factor != 1.0 else None,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(aux_loss_coeff),
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped_gemm,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_expert_capacity_factor=None,  # never drop tokens
        moe_enable_routing_replay=routing_replay,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


# The TransformerConfig fields above that define the model: an installed Megatron-Core lacking one cannot build it.
MOE_ARCH_CONFIG_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                          "moe_router_pre_softmax", "moe_router_score_function", "moe_router_enable_expert_bias",
                          "moe_router_bias_update_rate", "moe_router_num_groups", "moe_router_group_topk",
                          "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
                          "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                          "moe_token_dispatcher_type", "expert_model_parallel_size", "expert_tensor_parallel_size")


def moe_block_spec(config, backend: str, core_attention=None, vp_stage: int | None = None):
    """The decoder block spec of an MoE model: Megatron's per-layer specs (MoE layers where
    ``config.moe_layer_freq`` says, dense elsewhere), TE with grouped GEMM experts for ``backend == "te"``, else
    the local spec (``SequentialMLP`` experts) with ``core_attention`` (the varlen or SDPA class) in every layer.
    Only this pipeline rank's layers (of virtual stage ``vp_stage``) are in the block."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    ensure_moe_without_te()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=backend == "te", normalization="RMSNorm",
                                       vp_stage=vp_stage)
    if backend == "te":
        return block
    block = copy.deepcopy(block)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core_attention
    return block


def ensure_moe_without_te() -> None:
    """Megatron-Core 0.16's router linear (``moe_utils.RouterGatingLinearFunction``) tests ``te_general_gemm is
    not None``, but the name is only bound when Transformer Engine imports: without TE (CPU, or a GPU without TE)
    the router raises NameError. Binding it to None selects the plain ``torch.mm`` branch it already has."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def reduce_expert_grads_over_expert_grid(model) -> int:
    """Mark every routed-expert parameter of ``model`` expert-parallel (``allreduce = False``); returns how many.

    Megatron-Core 0.16 marks expert weights that way only when ``expert_model_parallel_size > 1``; at ``ep = 1``
    they count as dense, so ``DistributedDataParallel`` reduces their gradients over the dense data-parallel
    group and the optimizer measures their norm over the dense model-parallel group. That is only right when
    the expert grid equals the dense one (``etp == tp``). With ``tp > 1, etp = 1`` (whole experts, sequence
    parallel) every TP rank routes its own tokens through its own replica of all experts, and each replica's
    gradient is partial: it must be summed over the expert-data-parallel group (which spans those TP ranks),
    which is what the expert buffers do. Marking them always also keeps the optimizer's structure (a dense and
    an expert optimizer) the same at every ``ep``."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    marked = 0
    for module in model.modules():
        if isinstance(module, BaseMoELayer):
            for param in module.experts.parameters():
                param.allreduce = False
                marked += 1
    return marked


@contextlib.contextmanager
def aux_loss_per_routed_token(configs, routed_tokens: int):
    """While it is open, scale Megatron's load-balancing loss so that one optimizer step adds
    ``moe_aux_loss_coeff * sum_layers sum_m (T_m / T) * aux_m`` to the objective: the per-layer switch loss
    ``aux_m`` of each micro-batch ``m`` (``T_m`` routed positions; all micro-batches of all DP ranks together
    route ``T = routed_tokens``), i.e. the token-weighted mean, so its weight relative to the policy loss does not
    depend on the batch size, the micro-batching, DP, TP or the fixed denominator ``D`` of the policy loss.

    Why a scale is needed: with ``calculate_per_token_loss`` (our fixed-denominator mode) Megatron's router
    attaches ``aux_r * n_r`` (``n_r`` = the positions this rank routed) and relies on ``finalize_model_grads``
    dividing every gradient by the step's loss-token count, which the engine skips (the policy loss is already
    divided by ``D``). Unscaled, the aux gradient would grow with the number of tokens. Sequence parallelism splits
    a micro-batch's ``T_m`` positions over the TP ranks (``n_r = T_m / tp``) and each rank's ``aux_r`` is its share
    of ``aux_m`` (the router gradient is then summed over TP), hence the factor ``T_m / n_r``. The router reads
    ``config.moe_aux_loss_coeff`` at every forward, and the coefficient divides out of the loss it logs."""
    # once per config object (chunks may share one): scaling it twice would divide by T twice
    configs = list({id(c): c for c in configs if getattr(c, "num_moe_experts", None) and c.moe_aux_loss_coeff}.values())
    if not configs:
        yield
        return
    if routed_tokens <= 0:
        raise ValueError(f"routed_tokens={routed_tokens} must be > 0")
    saved = [c.moe_aux_loss_coeff for c in configs]
    try:
        for c, coeff in zip(configs, saved):
            split = c.tensor_model_parallel_size if c.sequence_parallel else 1
            c.moe_aux_loss_coeff = coeff * split / routed_tokens
        yield
    finally:
        for c, coeff in zip(configs, saved):
            c.moe_aux_loss_coeff = coeff


def global_expert_index(local_index: int, num_experts: int, ep_rank: int, ep_size: int) -> int:
    """Global expert id of the ``local_index``-th expert on EP rank ``ep_rank`` (contiguous blocks per rank)."""
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep_size}")
    per_rank = num_experts // ep_size
    if not 0 <= local_index < per_rank:
        raise ValueError(f"local expert index {local_index} out of range 0..{per_rank - 1}")
    return ep_rank * per_rank + local_index
