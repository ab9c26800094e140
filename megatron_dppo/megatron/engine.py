"""The policy engine: Megatron-Core model chunks + DDP + optimizer, forward-only log-probs, and one GRPO step.

``PolicyEngine`` owns this rank's model chunks (one per virtual pipeline stage), wrapped in Megatron's
``DistributedDataParallel``, a Megatron optimizer (optionally the ``DistributedOptimizer``), the learning-rate
schedule and, when the loss has a KL term, a frozen reference model. Everything runs on packed THD
micro-batches (``packing.ThdBatch``) through Megatron's pipeline schedules (``get_forward_backward_func``), so
the same code runs TP / SP / PP / VPP / DP on CPU (gloo) and on GPU (NCCL).

The fixed denominator (docs/algorithms.md, "Denominators")
-----------------------------------------------
The step must produce ``grad L`` with ``L = (1/D) * sum_{DP ranks r} sum_{micro-batches m} N_{r,m}``, where
``N_{r,m} = loss_numerator(...)`` of micro-batch ``m`` on rank ``r`` and ``D`` is the constant the trainer
computes from the full batch (``algo.losses.loss_denominator``). Megatron would normally (a) divide every
micro-batch loss by ``num_microbatches`` and (b) average gradients over the data-parallel group. Both are
switched off, precisely:

1. ``TransformerConfig.calculate_per_token_loss = True`` and the loss function returns the 3-tuple
   ``(N_{r,m} / D, num_tokens, reduced)``: the schedule (``forward_step_calc_loss``) then leaves the loss as is
   (no ``/ num_microbatches``, no ``* cp_size``), and backward accumulates ``grad N_{r,m} / D`` over micro-batches.
2. The same flag makes ``DistributedDataParallel`` use ``gradient_scaling_factor = 1``: the data-parallel
   reduction is a plain SUM over ranks (``average_in_collective`` stays False).
   Mixture-of-Experts weights are summed the same way over the expert-data-parallel group (their own buffers,
   ``moe.reduce_expert_grads_over_expert_grid``); the router's load-balancing loss, when on, is scaled per step
   by ``moe.aux_loss_per_routed_token``.
3. With that flag Megatron's ``finalize_model_grads`` would divide by the all-reduced token count; our
   ``finalize_model_grads_func`` calls it with ``num_tokens=None`` instead, so nothing else rescales.

Context parallelism: every CP rank gets the log-probs of the whole micro-batch (``logprobs.batch_logprobs``
gathers them) and computes the same ``N_{r,m}``; the backward keeps each rank's own positions, and DDP sums the
gradients over the data-parallel x context-parallel ranks, so the CP ranks together contribute ``grad N_{r,m}``
once. The step's metrics are reduced over DP only (the CP ranks hold the same sums).

Hence ``main_grad = sum_r sum_m grad N_{r,m} / D`` exactly, for any number of micro-batches and DP ranks
(``test_train_step.py`` checks TP1 == TP2+SP == PP2 == DP2 == TP2xPP2 and == the padded reference loss).

Micro-batch counts: every DP rank must run the same number of micro-batches (collectives inside the schedule
and the DP gradient reduction). The packer guarantees it; the engine still all-reduces the count (MAX) and
appends zero-weight dummy micro-batches (``ThdBatch`` with ``loss_mask = 0``) to any rank that has fewer, and,
with virtual pipeline stages, up to a multiple of ``pp`` (the interleaved schedule needs it). A dummy adds
exactly 0 to the loss and to the gradient. A micro-batch with zero positions is replaced by a dummy. With
virtual stages every micro-batch is also padded to the longest one (``pad_thd_batch``), and the interleaved
schedule runs with a fixed activation shape and separate forward / backward exchanges
(``variable_seq_lengths=False, overlap_p2p_comm=True, batch_p2p_comm=False``): on a 2-rank pipeline group
(prev peer == next peer) Megatron-Core 0.16's combined ``send_forward_backward_recv_forward_backward`` pairs
the two same-peer messages crosswise, silently swapping activations and gradients (measured here: wrong loss,
grad norm 549 instead of 3.13; NVIDIA/Megatron-LM issue 5100 / PR 5271).

Temperature
-----------
Every log-prob of the loss (the train forward's, the old policy's, the reference's) and the entropy metric are of
``softmax(logits / T)`` with T = ``loss_cfg.temperature``, the rollout's sampling temperature: the PPO ratio and
the KL are between the tempered policies, the distribution the rollout engine samples from (as verl and TRL;
docs/algorithms.md, "Temperature and truncated sampling"). The division happens per vocabulary shard before the
parallel log-softmax (``logprobs.vocab_parallel_logprobs``), exact under TP. The warm start swaps in a loss with
T = 1.

Old-policy and reference log-probs
----------------------------------
``compute_logprobs(micro_batches, model="policy" | "reference")`` runs the forward-only schedule
(``get_forward_backward_func(forward_only=True)``) on the same micro-batches; ``fill_logprobs`` stores the
results into ``batch.old_logprobs`` / ``batch.ref_logprobs``. A batch whose ``old_logprobs`` is None is trained
fully on-policy (``old_logp = logp.detach()``, ratio 1): exact when the rollout policy equals the current
weights (one optimizer step per rollout), and it saves one forward pass.

The reference model is a SECOND, FROZEN copy of the model chunks (same layout, no DDP, no optimizer, no
gradients), built only when ``kl_coef > 0`` (or ``reference=True``) and initialized from the policy's weights
at construction (``sync_reference_from_policy()`` re-copies, e.g. after loading HF weights into the policy).
Chosen over swapping a weight snapshot in and out of the policy because it never touches the policy's DDP /
optimizer buffers (no risk of training the wrong weights after an exception mid-swap) and costs only the
parameters (2 bytes/param in bf16, ~1/8 of the policy's training memory with Adam). Checkpoints save it (keys
prefixed ``reference.``), so a resumed run has the same reference.

LoRA (``lora=LoraConfig(...)``, ``megatron.lora``): adapters are attached to the policy chunks and every base
parameter is frozen before DDP and the optimizer see them, so gradients, the optimizer state (also the
DistributedOptimizer's), clipping and the grad norm cover the adapters only. The reference is then the policy's
own frozen base with the trained adapters off (no second copy of the model is built), plus the frozen starting
adapters where ``lora.keep_as_reference`` recorded them (a run started from a PEFT adapter);
``compute_logprobs(model="reference")`` runs the policy chunks inside ``lora.reference_adapters``.

Precision (``dtype``, the run's ``model.dtype``), the same code on CPU and GPU: with bfloat16 (or float16) the
chunks hold bf16 parameters and compute in bf16; DDP accumulates and reduces the gradients in fp32 buffers
(``grad_reduce_in_fp32``: ``param.main_grad`` is fp32); Megatron's mixed-precision optimizer
(``Float16OptimizerWithFloat16Params``, or the ``DistributedOptimizer`` with its fp32 shards) steps fp32 main params
with fp32 Adam state and copies them back into the bf16 parameters; checkpoints hold the fp32 main params. The
output layer's logits are bf16; every log-prob, entropy, ratio, KL and loss term is computed from them upcast to
fp32 (``logprobs.vocab_parallel_logprobs``). float16 adds Megatron's ``DynamicGradScaler`` (initial scale 2^32,
halved after each overflow past the hysteresis of 2): the first ~15-20 updates of a run overflow and are skipped
(``update_ok`` 0), as on GPU. On CPU the CPU backend (``cpu.py``) only widens the optimizers' tensor-type checks;
the default dtype is fp32 on CPU, bf16 on GPU (``model.default_dtype``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Sequence

import torch
from torch import Tensor

from megatron_dppo.algo.losses import LossConfig, loss_numerator
from megatron_dppo.algo.lr_schedule import check_schedule, lr_at_step
from megatron_dppo.config.sections import OptimConfig  # the optim section of the run configuration
from megatron_dppo.packing.thd import dummy_thd_batch, pad_thd_batch

from . import compat
from .cpu import ensure_device_backend
from .logprobs import batch_logprobs, forward_thd, run_pipeline_schedule
from .logprobs import compute_logprobs as _forward_only_logprobs
from .lora import LoraBase, LoraConfig, add_lora_adapters, check_lora_supported, reference_adapters
from .model import ModelArch, build_model_chunks, default_dtype, device_dtype_audit, engine_device
from .moe import aux_loss_per_routed_token
from .parallel import ParallelConfig
from .routing_replay import RoutingReplay, release_megatron_router_replay

logger = logging.getLogger(__name__)

# Per-micro-batch sums reduced into the step metrics (order of the stats vector).
_STAT_NAMES = ("numerator", "tokens", "clipped_tokens", "clip_high_tokens", "clip_low_tokens", "ratio_sum",
               "pg_sum", "kl_sum", "entropy_sum", "weight_sum", "sequences")


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------
DIST_CKPT_OPTIM_FORMATS = ("dp_reshardable", "fully_reshardable")



# ----------------------------------------------------------------------------------------------------------
# Micro-batch helpers
# ----------------------------------------------------------------------------------------------------------
def _pad_multiple(parallel: ParallelConfig) -> int:
    from megatron_dppo.packing import thd_pad_multiple

    return thd_pad_multiple(parallel.tp, parallel.cp, parallel.sp)


# ----------------------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------------------
class PolicyEngine:
    """Megatron-Core policy (and frozen reference) for GRPO-family training on packed THD micro-batches.

    Model-parallel state must be initialized (``parallel.initialize_parallel``). Every rank of a TP/PP group
    must pass the same micro-batches; DP ranks pass their own.

    Attributes the trainer and ``checkpoint.py`` use: ``model_chunks`` (DDP-wrapped), ``reference_chunks``
    (or None; always None with LoRA, whose reference runs the policy chunks: ``lora.reference_adapters``),
    ``optimizer`` (Megatron optimizer), ``step`` (optimizer updates done), ``arch``, ``parallel``, ``optim_cfg``,
    ``loss_cfg``, ``dtype``, ``device``, ``lora`` (a ``LoraConfig`` or None) and ``lora_base`` (``set_lora_base``).

    ``logits_at_loss_positions`` (default True): ``train_step`` and ``fill_logprobs`` compute the output layer and
    the vocabulary sums only at the loss positions (``logprobs.py``, "Logits where a loss is taken"); the update is
    the same up to floating-point summation order; False computes them at every position.
    """

    def __init__(self, arch: ModelArch, parallel: ParallelConfig, optim: OptimConfig | None = None,
                 loss: LossConfig | None = None, *, dtype: torch.dtype | None = None,
                 reference: bool | None = None, lora: LoraConfig | None = None, total_steps: int | None = None,
                 dist_ckpt_optim_format: str = "dp_reshardable", **config_overrides):
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if arch.num_labels is not None:
            raise ValueError(f"the policy must be a causal LM; this config describes a sequence classifier with "
                             f"{arch.num_labels} label(s) (a reward model? use it as reward.model.path)")
        ensure_device_backend()
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("model-parallel state is not initialized; call parallel.initialize_parallel first")
        self.arch = arch
        self.parallel = parallel
        self.optim_cfg = optim or OptimConfig()
        check_schedule(self.optim_cfg, total_steps)
        self.total_steps = total_steps  # the horizon of optim.scheduler=cosine (the engine's own schedule)
        if dist_ckpt_optim_format not in DIST_CKPT_OPTIM_FORMATS:
            raise ValueError(f"dist_ckpt_optim_format={dist_ckpt_optim_format!r}; valid: {DIST_CKPT_OPTIM_FORMATS}")
        # DistributedOptimizer checkpoint format: dp_reshardable (resumes bit-exactly, reshards over DP only) or
        # fully_reshardable (any TP/PP/DP change; gathers the state on DP rank 0 at save time)
        self.dist_ckpt_optim_format = dist_ckpt_optim_format
        self.loss_cfg = loss or LossConfig(kl_coef=0.0).resolved()  # (no KL: no reference model)
        if not self.loss_cfg.is_resolved:
            raise ValueError(f"PolicyEngine needs a resolved LossConfig (fields {self.loss_cfg.unresolved} still say "
                             "\"the preset's value\"): pass LossConfig(...).resolved(temperature)")
        self.dtype = dtype or default_dtype()
        self.device = engine_device()
        self.step = 0
        self.last_logprobs: list[Tensor] | None = None  # set by train_step (see there)
        self.logits_at_loss_positions = True  # see the class docstring

        # 1. model chunks (one per virtual stage); per-token loss mode (see module docstring)
        overrides = dict(config_overrides)
        overrides["calculate_per_token_loss"] = True
        if parallel.vpp is not None:
            # interleaved schedule on a pipeline group whose prev and next peer can coincide (pp = 2): fixed
            # shapes and separate forward / backward exchanges (see the module docstring and _prepare)
            overrides.update(variable_seq_lengths=False, overlap_p2p_comm=True, batch_p2p_comm=False)
        self.lora = lora
        self.lora_base = LoraBase()  # set_lora_base: the folder the frozen base came from
        if lora is not None:
            check_lora_supported(arch, parallel, lora)
        chunks = build_model_chunks(arch, parallel, self.dtype, **overrides)
        for chunk in chunks:
            if not chunk.config.calculate_per_token_loss:
                raise RuntimeError("TransformerConfig.calculate_per_token_loss must be True (fixed denominator)")
        if lora is not None:  # before DDP and the optimizer: they take the trainable (adapter) parameters only
            add_lora_adapters(chunks, lora)
        self._assert_placed(chunks, "policy")

        # 2. DDP: fp32 gradient reduction, a SUM over data-parallel ranks (gradient_scaling_factor = 1)
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.optim_cfg.distributed_optimizer,
            check_for_nan_in_grad=False,
            average_in_collective=False,
        )
        self.model_chunks = [
            DistributedDataParallel(config=chunk.config, ddp_config=self.ddp_config, module=chunk,
                                    disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
        for chunk in self.model_chunks:
            chunk.broadcast_params()  # DP replicas start identical whatever their seeds
        # MoE: the routers' record / replay slots (routing_replay; replay with model.moe_routing_replay)
        self.routing = RoutingReplay.for_policy(chunks, arch, replay=bool(overrides.get("moe_routing_replay")))
        if self.routing is not None and parallel.cp > 1:
            # routes are recorded per sequence from whole micro-batches; a CP rank routes only its part of each
            # (build_transformer_config refuses moe_routing_replay with cp > 1): no flip metric then
            release_megatron_router_replay(chunks)
            self.routing = None

        # 3. optimizer
        opt_kwargs = dict(
            optimizer="adam", lr=self.optim_cfg.lr, min_lr=self.optim_cfg.min_lr,
            weight_decay=self.optim_cfg.weight_decay, adam_beta1=self.optim_cfg.adam_beta1,
            adam_beta2=self.optim_cfg.adam_beta2, adam_eps=self.optim_cfg.adam_eps,
            clip_grad=self.optim_cfg.grad_clip, bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16, params_dtype=self.dtype,
            use_distributed_optimizer=self.optim_cfg.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(**compat.supported_kwargs(OptimizerConfig, opt_kwargs)), self.model_chunks)

        # 4. schedule hooks on every chunk's config (the schedule reads model_chunks[0]'s)
        from megatron.core.distributed import finalize_model_grads

        def finalize_without_token_scaling(model, num_tokens=None, *args, **kwargs):
            """Megatron's grad finalization (DP reduce, SP/embedding all-reduces) WITHOUT the division by the
            token count that calculate_per_token_loss would trigger: the loss is already divided by D."""
            return finalize_model_grads(model, None, *args, **kwargs)

        no_sync = [c.no_sync for c in self.model_chunks]
        for chunk in self.model_chunks:
            cfg = chunk.config
            cfg.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
            cfg.finalize_model_grads_func = finalize_without_token_scaling
            cfg.grad_scale_func = self.optimizer.scale_loss

        # 5. frozen reference model (LoRA: the policy's own frozen base, adapters off; no copy)
        want_reference = self.loss_cfg.kl_coef > 0 if reference is None else bool(reference)
        self.reference_chunks = None
        if want_reference and lora is None:
            self.reference_chunks = build_model_chunks(arch, parallel, self.dtype, **overrides)
            for ref in self.reference_chunks:
                ref.requires_grad_(False)
                ref.eval()
            release_megatron_router_replay(self.reference_chunks)  # the reference routes freely
            self._assert_placed(self.reference_chunks, "reference")
            self.sync_reference_from_policy()

    def _assert_placed(self, chunks, which: str) -> None:
        """Every parameter and buffer on the engine's device in its dtype before DDP / the optimizer wrap them
        (an NCCL broadcast of a CPU tensor raises; a forward mixing devices fails; see ``model.place_model``)."""
        problems = device_dtype_audit(chunks, self.device, self.dtype)
        if problems:
            raise RuntimeError(f"{len(problems)} {which} tensors are not on {self.device} in {self.dtype}: "
                               f"{problems[:5]}{' ...' if len(problems) > 5 else ''}")

    def placement_audit(self) -> list[str]:
        """``model.device_dtype_audit`` of the policy and reference chunks (empty = every tensor placed)."""
        problems = device_dtype_audit(self.modules, self.device, self.dtype)
        if self.reference_chunks is not None:
            problems += ["reference." + p for p in device_dtype_audit(self.reference_chunks, self.device, self.dtype)]
        return problems

    # ------------------------------------------------------------------------------------------------------
    @property
    def modules(self) -> list:
        """The bare ``GPTModel`` chunks of the policy (no DDP wrapper)."""
        return [c.module for c in self.model_chunks]

    def set_lora_base(self, folder) -> None:
        """Record the Hugging Face folder the frozen base was loaded from (and its checksum) for LoRA checkpoints,
        which hold the adapters only and refuse to load onto another base."""
        if self.lora is None:
            raise ValueError("set_lora_base: this engine trains all weights (no lora config)")
        self.lora_base = LoraBase.from_folder(folder)

    @torch.no_grad()
    def sync_reference_from_policy(self) -> None:
        """Copy the policy's current weights into the reference model."""
        if self.reference_chunks is None:
            raise ValueError("this engine has no reference model (kl_coef == 0 and reference not requested)")
        for ref, pol in zip(self.reference_chunks, self.modules):
            ref_params = dict(ref.named_parameters())
            for name, p in pol.named_parameters():
                ref_params[name].copy_(p)

    def set_learning_rate(self, lr: float) -> None:
        """Make the next update use ``lr`` (the caller owns the schedule: the engine's own is configured constant
        by the trainer, which sets the warm-start and RL learning rates before each update)."""
        self.optim_cfg = dataclasses.replace(self.optim_cfg, lr=lr, min_lr=min(self.optim_cfg.min_lr, lr))
        for group in self.optimizer.param_groups:
            group["max_lr"] = lr
            group["min_lr"] = min(group.get("min_lr", 0.0), lr)

    def current_lr(self) -> float:
        """Learning rate the next update uses (default parameter group)."""
        return lr_at_step(self.optim_cfg, self.step, self.optim_cfg.lr, self.optim_cfg.min_lr, self.total_steps)

    def _apply_lr(self) -> float:
        lr0 = None
        for group in self.optimizer.param_groups:
            max_lr = group.get("max_lr", self.optim_cfg.lr)
            min_lr = group.get("min_lr", self.optim_cfg.min_lr)
            lr = lr_at_step(self.optim_cfg, self.step, max_lr, min_lr, self.total_steps)
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.optim_cfg.weight_decay * group.get("wd_mult", 1.0)
            if lr0 is None or group.get("default_config", False):
                lr0 = group["lr"]
        return float(lr0 if lr0 is not None else self.current_lr())

    # ------------------------------------------------------------------------------------------------------
    def _prepare(self, micro_batches: Sequence, pad_dp: bool) -> list:
        """Move to the device, replace empty batches by dummies, equalize the count over DP (and to a
        multiple of pp with virtual stages)."""
        from megatron.core import parallel_state

        pad = _pad_multiple(self.parallel)
        batches = []
        for b in micro_batches:
            if int(b.tokens.numel()) == 0:
                b = dummy_thd_batch(pad)
            batches.append(b.to(self.device))
        count = len(batches)
        if pad_dp and parallel_state.get_data_parallel_world_size() > 1:
            n = torch.tensor([count], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX,
                                         group=parallel_state.get_data_parallel_group())
            count = int(n.item())
        if self.parallel.vpp is not None:
            count = max(count, self.parallel.pp)
            count = -(-count // self.parallel.pp) * self.parallel.pp
        count = max(count, 1)
        while len(batches) < count:
            batches.append(dummy_thd_batch(pad).to(self.device))
        if self.parallel.vpp is not None:
            # Megatron-Core's interleaved schedule mis-pairs the variable-shape exchange when the pipeline group
            # has 2 ranks (NVIDIA/Megatron-LM #5100): run it with one fixed shape instead.
            length = max(int(b.tokens.numel()) for b in batches)
            batches = [pad_thd_batch(b, length) for b in batches]
        return batches

    @torch.no_grad()
    def compute_logprobs(self, micro_batches: Sequence, model: str = "policy", with_entropy: bool = False,
                         loss_positions_only: bool = False) -> list[Tensor] | list[tuple[Tensor, Tensor]]:
        """Forward-only per-position log-probs ``logp[t] = log p(labels[t] | prefix)`` of each micro-batch
        (``[T_i]`` float32, meaningful where ``loss_mask`` is 1), on every rank (broadcast over the pipeline), of the
        policy at ``loss_cfg.temperature`` (the loss's every log-prob is tempered alike); with
        ``loss_positions_only`` computed there only (0 elsewhere).

        ``model``: "policy" (old-policy log-probs) or "reference". With ``with_entropy`` each item is
        ``(logp, entropy)``. The list has one entry per input micro-batch (dummy padding is dropped).
        """
        disabled = contextlib.nullcontext()
        if model == "policy":
            chunks = self.model_chunks
        elif model == "reference" and self.lora is not None:
            chunks, disabled = self.model_chunks, reference_adapters(self.modules)
        elif model == "reference":
            if self.reference_chunks is None:
                raise ValueError("model='reference' but this engine has no reference model "
                                 "(kl_coef == 0 and reference not requested)")
            chunks = self.reference_chunks
        else:
            raise ValueError(f"model={model!r}; valid: 'policy', 'reference'")
        n = len(micro_batches)
        batches = self._prepare(micro_batches, pad_dp=False)
        with disabled:
            results = _forward_only_logprobs(chunks, batches, with_entropy=with_entropy, broadcast=True,
                                              temperature=self.loss_cfg.temperature,
                                              loss_positions_only=loss_positions_only)[:n]
        sizes = [int(b.tokens.numel()) for b in micro_batches]
        if with_entropy:
            return [(lp[:t], ent[:t]) for (lp, ent), t in zip(results, sizes)]
        return [lp[:t] for (lp, _), t in zip(results, sizes)]

    def fill_logprobs(self, micro_batches: Sequence, old: bool = True, reference: bool | None = None) -> None:
        """Set ``batch.old_logprobs`` (policy) and, when the loss has a KL term (or ``reference``),
        ``batch.ref_logprobs`` of every micro-batch, in place (kept on the batch's own device)."""
        if old:
            # MoE: the experts chosen here are recorded per sequence (batch.routed_experts) for the replay
            with self.routing.recording(micro_batches) if self.routing else contextlib.nullcontext():
                logps = self.compute_logprobs(micro_batches, "policy",
                                              loss_positions_only=self.logits_at_loss_positions)
            for b, lp in zip(micro_batches, logps):
                b.old_logprobs = lp.to(b.tokens.device)
        want_ref = self.loss_cfg.kl_coef > 0 if reference is None else reference
        if want_ref:
            for b, lp in zip(micro_batches, self.compute_logprobs(
                    micro_batches, "reference", loss_positions_only=self.logits_at_loss_positions)):
                b.ref_logprobs = lp.to(b.tokens.device)

    # ------------------------------------------------------------------------------------------------------
    def _loss_func(self, batch, denominator: float, output_tensor: Tensor):
        """Last pipeline stage: (numerator / D, loss-token count, {"stats": sums}) for one micro-batch."""
        # the whole micro-batch, also under CP; tempered like the old and reference log-probs (compute_logprobs)
        logp, entropy = batch_logprobs(output_tensor, batch, with_entropy=True, temperature=self.loss_cfg.temperature)
        no_tokens = not bool((batch.loss_mask > 0).any())  # dummy: every term is masked out
        old = batch.old_logprobs.to(logp.device, torch.float32) if batch.old_logprobs is not None else logp.detach()
        ref = None
        if self.loss_cfg.kl_coef > 0:
            if batch.ref_logprobs is None and no_tokens:
                ref = logp.detach()
            elif batch.ref_logprobs is None:
                raise ValueError(f"kl_coef={self.loss_cfg.kl_coef} > 0 but a micro-batch has ref_logprobs=None; "
                                 "call PolicyEngine.fill_logprobs first")
            else:
                ref = batch.ref_logprobs.to(logp.device, torch.float32)
        rollout_weight = batch.rollout_weight.to(logp.device) if batch.rollout_weight is not None else None
        numerator, m = loss_numerator(logp, old, batch.advantages, batch.token_weight, batch.loss_mask,
                                      batch.seq_index, self.loss_cfg, ref, rollout_weight)
        mask = batch.loss_mask > 0
        with torch.no_grad():
            zero = torch.zeros((), dtype=torch.float64, device=logp.device)
            get = lambda k: m[k].detach().double() if k in m else zero  # noqa: E731
            stats = torch.stack([
                numerator.detach().double(), get("tokens"), get("clipped_tokens"), get("clip_high_tokens"),
                get("clip_low_tokens"), get("ratio_sum"), get("pg_sum"), get("kl_sum"),
                torch.where(mask, entropy, torch.zeros_like(entropy)).sum().double(),
                torch.where(mask, batch.token_weight, torch.zeros_like(batch.token_weight)).sum().double(),
                zero + batch.num_sequences,
            ])
        num_tokens = mask.sum().to(torch.int)
        return numerator / denominator, num_tokens, {"stats": stats, "logp": logp.detach()}

    def _routed_tokens(self, batches) -> int:
        """Positions of all micro-batches of all DP ranks when the MoE load-balancing loss is on (else 0; see
        ``moe.aux_loss_per_routed_token``)."""
        from megatron.core import parallel_state

        if self.arch.moe is None or not any(c.config.moe_aux_loss_coeff for c in self.model_chunks):
            return 0
        n = torch.tensor([sum(int(b.tokens.numel()) for b in batches)], dtype=torch.int64, device=self.device)
        if parallel_state.get_data_parallel_world_size() > 1:
            torch.distributed.all_reduce(n, group=parallel_state.get_data_parallel_group())
        return int(n.item())

    def train_step(self, micro_batches: Sequence, denominator: float) -> dict[str, float]:
        """One optimizer update on this rank's packed micro-batches.

        Gradient = grad( sum over all DP ranks and micro-batches of loss_numerator ) / ``denominator``
        (module docstring). Each batch needs ``old_logprobs`` (or None: on-policy) and, with a KL term,
        ``ref_logprobs``; an optional ``rollout_weight`` multiplies its policy-gradient term per token (rollout
        correction). Returns metrics identical on every rank:
            loss           sum of numerators / D (the step's objective, to minimize)
            grad_norm      global L2 norm of the gradient before clipping
            lr             learning rate used
            clip_fraction  clipped loss tokens / loss tokens (PPO/GSPO clipping)
            kl             mean KL estimate per loss token (0 without KL term)
            entropy        mean policy entropy per loss token
            ratio          mean importance ratio per loss token
            tokens         loss (completion) tokens of the step, all DP ranks
            sequences      sequences of the step, all DP ranks
            micro_batches  micro-batches per DP rank (after padding)
            update_ok      1.0, or 0.0 when the optimizer skipped the update (fp16 overflow / non-finite norm)
            moe/route_flip_rate  MoE policies whose batches carry recorded routes (``fill_logprobs``): fraction of
                           recorded (token, layer, k) expert choices the routers' own top-k no longer makes; with
                           ``moe_routing_replay`` the recorded experts are used all the same (``routing_replay``)
        """
        from megatron.core import parallel_state

        if isinstance(denominator, bool) or not isinstance(denominator, (int, float)) or not (
                math.isfinite(denominator) and denominator > 0):
            raise ValueError(f"denominator={denominator!r} must be a finite number > 0 (loss_denominator)")
        denominator = float(denominator)
        batches = self._prepare(micro_batches, pad_dp=True)
        for chunk in self.model_chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self._apply_lr()

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = forward_thd(model, batch, loss_positions_only=self.logits_at_loss_positions)
            return output, lambda out, b=batch: self._loss_func(b, denominator, out)

        # MoE: the routers replay (or, without model.moe_routing_replay, compare with) the recorded experts, and the
        # load-balancing loss (model.moe_aux_loss_coeff) is weighted per routed token of the whole step
        replay = self.routing.replaying(batches) if self.routing else contextlib.nullcontext({})
        aux = aux_loss_per_routed_token([c.config for c in self.model_chunks], self._routed_tokens(batches))
        with replay as route_counts, aux:
            losses = run_pipeline_schedule(self.model_chunks, batches, forward_step, forward_only=False)
        update_ok, grad_norm, _ = self.optimizer.step()
        self.step += 1
        # the train forward's own log-probs (the weights before this update), one per input micro-batch
        self.last_logprobs = None
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            self.last_logprobs = [item["logp"][: int(b.tokens.numel())].cpu()
                                  for item, b in zip(losses, micro_batches)]

        # metrics: sum over micro-batches (last stage), broadcast over PP, sum over DP
        stats = torch.zeros(len(_STAT_NAMES), dtype=torch.float64, device=self.device)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            for item in losses:
                stats += item["stats"].to(self.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.broadcast(stats, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                        group=parallel_state.get_pipeline_model_parallel_group())
        if parallel_state.get_data_parallel_world_size() > 1:
            torch.distributed.all_reduce(stats, group=parallel_state.get_data_parallel_group())
        s = dict(zip(_STAT_NAMES, stats.tolist()))
        tokens = max(s["tokens"], 1.0)
        flips = self.routing.flip_metrics(route_counts, self.device) if self.routing else {}  # collective
        return flips | {
            "loss": s["numerator"] / denominator,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": lr,
            "clip_fraction": s["clipped_tokens"] / tokens,
            "clip_high_fraction": s["clip_high_tokens"] / tokens,
            "clip_low_fraction": s["clip_low_tokens"] / tokens,
            "kl": s["kl_sum"] / tokens,
            "entropy": s["entropy_sum"] / tokens,
            "ratio": s["ratio_sum"] / tokens,
            "tokens": s["tokens"],
            "sequences": s["sequences"],
            "micro_batches": float(len(batches)),
            "update_ok": float(bool(update_ok)),
        }
