"""Pruning audit: how close is this step's pruned gradient to the full-batch gradient?

On an audit step the trainer passes the engine, the step's FULL micro-batches (every completion that was
generated, each with the prompt-level weight only) and the PRUNED micro-batches it is about to train on (with
their pruning weights in ``token_weight``), plus both denominators. :func:`pruning_audit` computes

    g_full  = grad_theta (1/D_full)   * sum_{full micro-batches}   loss_numerator
    g_prune = grad_theta (1/D_pruned) * sum_{pruned micro-batches} loss_numerator

at the CURRENT weights (call it before ``train_step``), each summed over data-parallel ranks exactly as the
update would be, flattened over the model's parameters, and returns

    cosine     = <g_prune, g_full> / (|g_prune| |g_full|)
    rel_error  = |g_prune - g_full| / |g_full|
    ess        = (sum w)^2 / sum w^2 over the kept sequences' pruning weights (when given)

plus both norms. No optimizer step is taken and every gradient buffer is zeroed afterwards, so the following
``train_step`` is unaffected (it zeroes them itself as well).

What "full" means (the audit is conditional on the prompt-level draw)
    Prompts pruned at prompt level were never generated, so their completions do not exist. The full batch is
    therefore every generated completion of the KEPT prompts, each weighted by the prompt-level 1/pi_q (and
    1/|o| for seq_mean_token_mean), with the step's denominator D. DPPO's completion pruning is unbiased
    conditional on the prompt draw, so for DPPO ``E[g_prune] = g_full`` exactly and rel_error measures its
    Monte-Carlo noise; for CPPO (no reweighting, kept-count denominator) it also measures the bias. With
    ``algo.pruner=none`` both gradients are equal (rel_error ~ 1e-7: float round-off of two packings).

Old log-probs
    Leave ``old_logprobs`` of the full micro-batches None: the engine then trains on-policy (old = current
    log-prob, ratio 1), which is what the trainer's recomputed old log-probs are at the current weights, and it
    saves a forward pass. With a KL term the full batches need ``ref_logprobs``: when any is missing this function
    fills them (reference forward only).

Parallelism
    Data parallel: gradients are reduced with a forced all-reduce (also under the distributed optimizer, whose
    normal reduce-scatter would leave each rank only a shard). Tensor / pipeline parallel: each rank holds a part
    of the vector; norms and the dot product are summed over the model-parallel group, counting parameters that
    are replicated over tensor-parallel ranks (layer norms) or shared between pipeline stages (tied embeddings)
    once, like Megatron's grad-norm. All ranks return the same numbers. Memory: one extra fp32 copy of this rank's
    parameter shard (the first gradient) while the second is computed.

Cost: one forward + backward over the full batch and one over the pruned batch (~2-3x an un-pruned step's
training phase); meant for every N-th step (``logging.audit_every``).

Trainer use (between the old-log-prob phase and ``train_step`` of ``rl_step``; not inside the PhaseTimer, so
``time/step`` and tokens/s stay comparable; the result carries its own ``audit/seconds``)::

    full = build_train_batch(train_side, prompts, prompt_cut, rollout, advantages,
                             full_completion_cut(prompt_cut, cfg.train.group_size))
    full_mbs, _ = pack(train_side, full)
    metrics.update(pruning_audit(train_side.engine, full_mbs, micro_batches, full.denominator, batch.denominator,
                                 weights=batch.seq_weights).as_metrics())
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class AuditResult:
    cosine: float
    rel_error: float
    ess: float
    full_grad_norm: float
    pruned_grad_norm: float
    full_sequences: int
    pruned_sequences: int
    seconds: float

    def as_metrics(self, prefix: str = "audit/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}


def effective_sample_size(weights: Tensor | Sequence[float]) -> float:
    """(sum w)^2 / sum w^2 over the kept units (0 when nothing is kept)."""
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    w = w[w > 0]
    sq = float((w * w).sum())
    return float(w.sum()) ** 2 / sq if sq > 0 else 0.0


def full_completion_cut(prompt_cut, group_size: int):
    """The "nothing pruned at completion level" decision [B, G] for the audit's full batch: every completion of
    every prompt kept at prompt level, weight = that prompt's 1/pi_q (1 without prompt pruning). Pass it to the
    trainer's ``build_train_batch`` in place of the step's ``total_cut``."""
    from megatron_dppo.algo.pruning import PruneResult

    keep = prompt_cut.keep.unsqueeze(-1).expand(*prompt_cut.keep.shape, group_size).clone()
    prob = prompt_cut.probabilities().double().unsqueeze(-1).expand(*keep.shape).clone()
    prob = torch.where(keep, prob, torch.ones_like(prob))
    weight = torch.where(keep, 1.0 / prob, torch.zeros_like(prob)).to(torch.float32)
    return PruneResult(keep=keep, weight=weight, keep_prob=prob)


def _audited_params(engine) -> list[torch.nn.Parameter]:
    """Parameters counted once over the model-parallel group (Megatron's grad-norm rule)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    params = []
    for chunk in engine.model_chunks:
        for p in chunk.module.parameters():
            if p.requires_grad and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                params.append(p)
    return params


def _grad_of(p: torch.nn.Parameter) -> Tensor:
    g = getattr(p, "main_grad", None)
    if g is None:
        g = p.grad
    return torch.zeros_like(p, dtype=torch.float32) if g is None else g.float()


def _model_parallel_sum(values: Tensor) -> Tensor:
    from megatron.core import parallel_state

    if parallel_state.get_model_parallel_group() is not None and \
            torch.distributed.get_world_size(parallel_state.get_model_parallel_group()) > 1:
        torch.distributed.all_reduce(values, group=parallel_state.get_model_parallel_group())
    return values


def step_gradient(engine, micro_batches: Sequence, denominator: float) -> Tensor:
    """This rank's shard of grad (1/D) sum_{DP ranks, micro-batches} loss_numerator, flattened (fp32), at the
    current weights. Gradient buffers are zeroed before and after; no optimizer step, no LR change."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_dppo.megatron.logprobs import forward_thd, run_pipeline_schedule

    if not (isinstance(denominator, (int, float)) and math.isfinite(denominator) and denominator > 0):
        raise ValueError(f"denominator={denominator!r} must be a finite number > 0")
    batches = engine._prepare(micro_batches, pad_dp=True)
    configs = [chunk.config for chunk in engine.model_chunks]
    saved = [cfg.finalize_model_grads_func for cfg in configs]

    def finalize_all_reduce(model, num_tokens=None, *args, **kwargs):
        # DP SUM with a full all-reduce (the distributed optimizer would otherwise reduce-scatter), SP layer-norm
        # and tied-embedding all-reduces; no division by the token count (the loss is already / D).
        return finalize_model_grads(model, None, force_all_reduce=True)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = forward_thd(model, batch)
        return output, lambda out, b=batch: engine._loss_func(b, float(denominator), out)

    for chunk in engine.model_chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    engine.optimizer.zero_grad()
    try:
        for cfg in configs:
            cfg.finalize_model_grads_func = finalize_all_reduce
        run_pipeline_schedule(engine.model_chunks, batches, forward_step, forward_only=False)
        scale = 1.0
        get_scale = getattr(engine.optimizer, "get_loss_scale", None)
        if callable(get_scale):
            scale = float(get_scale())
        flat = torch.cat([_grad_of(p).reshape(-1) for p in _audited_params(engine)])
        if scale != 1.0:
            flat = flat / scale
        return flat.clone()
    finally:
        for cfg, fn in zip(configs, saved):
            cfg.finalize_model_grads_func = fn
        for chunk in engine.model_chunks:
            chunk.zero_grad_buffer()
        engine.optimizer.zero_grad()


def compare_gradients(g_full: Tensor, g_prune: Tensor) -> tuple[float, float, float, float]:
    """(cosine, rel_error, |g_full|, |g_prune|) of two sharded flat gradients (sums over model-parallel ranks)."""
    if g_full.shape != g_prune.shape:
        raise ValueError(f"gradient shapes differ: {tuple(g_full.shape)} vs {tuple(g_prune.shape)}")
    a, b = g_full.double(), g_prune.double()
    sums = torch.stack([(a * a).sum(), (b * b).sum(), (a * b).sum(), ((a - b) ** 2).sum()])
    sums = _model_parallel_sum(sums)
    nf, np_, dot, diff = (float(x) for x in sums)
    norm_f, norm_p = math.sqrt(nf), math.sqrt(np_)
    cosine = dot / (norm_f * norm_p) if norm_f > 0 and norm_p > 0 else float("nan")
    rel = math.sqrt(diff) / norm_f if norm_f > 0 else float("nan")
    return cosine, rel, norm_f, norm_p


def pruning_audit(engine, full_micro_batches: Sequence, pruned_micro_batches: Sequence, full_denominator: float,
                  pruned_denominator: float | None = None, weights: Tensor | Sequence[float] | None = None
                  ) -> AuditResult:
    """Full-batch vs pruned-estimate gradient of one step (module docstring). Collective over all ranks.

    Args:
        engine: the ``PolicyEngine`` (model-parallel state initialized), at the weights of this step's rollout.
        full_micro_batches: this rank's THD micro-batches of EVERY generated completion (weight 1/pi_q each).
        pruned_micro_batches: this rank's micro-batches the step trains on (pruning weights in token_weight).
        full_denominator: D of the full batch (``loss_denominator`` with nothing pruned).
        pruned_denominator: D used for the pruned batch; default ``full_denominator`` (DPPO: the same D).
        weights: pruning weights of the kept sequences, all ranks' (for the ESS); None -> ESS = NaN.
    Returns:
        AuditResult (identical on every rank). ``.as_metrics()`` gives ``audit/cosine`` etc.
    """
    start = time.perf_counter()
    if engine.loss_cfg.kl_coef > 0:
        missing = [b for b in full_micro_batches if b.ref_logprobs is None]
        if missing:
            engine.fill_logprobs(missing, old=False, reference=True)
    g_full = step_gradient(engine, full_micro_batches, full_denominator)
    g_prune = step_gradient(engine, pruned_micro_batches,
                            full_denominator if pruned_denominator is None else pruned_denominator)
    cosine, rel, norm_f, norm_p = compare_gradients(g_full, g_prune)
    return AuditResult(
        cosine=cosine, rel_error=rel, ess=effective_sample_size(weights) if weights is not None else float("nan"),
        full_grad_norm=norm_f, pruned_grad_norm=norm_p,
        full_sequences=int(sum(int(b.num_sequences) for b in full_micro_batches if not b.is_dummy)),
        pruned_sequences=int(sum(int(b.num_sequences) for b in pruned_micro_batches if not b.is_dummy)),
        seconds=time.perf_counter() - start)
