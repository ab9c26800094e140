"""Per-token log-probabilities and entropy from vocab-sharded logits, and GPTModel forwards on THD batches.

Under tensor parallelism the output layer leaves each rank with a slice ``z[..., v0:v1]`` of the logits
(``v1 - v0 = V / tp``). The full vocabulary is never gathered (V fp32 logits/token). With ``m`` the global max
(all-reduce MAX), every quantity is a sum over the vocabulary, so it is a local sum followed by an all-reduce
SUM over the TP group:

    Z        = sum_v exp(z_v - m)                          (all-reduce SUM)
    log p(y) = z_y - m - log Z                             (Megatron's ``vocab_parallel_cross_entropy``;
                                                            z_y lives on one rank, all-reduced SUM)
    H        = log Z - sum_v p_v (z_v - m)                 (entropy; sum_v exp(z_v - m)(z_v - m), SUM)

Gradients: ``d(-log p(y))/dz_v = p_v - 1[v = y]`` (Megatron's backward, per shard), and for the entropy
``dH/dz_v = -p_v (z_v - E_p[z])`` (autograd through local ops; the all-reduce has an identity backward since
every TP rank computes the same replicated value, Megatron's convention).

Temperature: with ``temperature`` = T != 1 every quantity above is that of ``softmax(z / T)``, the distribution the
rollout engine samples from at temperature T, before any top-k / top-p truncation (docs/algorithms.md, "Temperature
and truncated sampling"). Each rank divides ITS OWN shard by T before the max, the sums and the all-reduces, so the
result is exact under TP (the full-vocabulary ``log_softmax(z / T)``); the division happens on the fp32 copy of each
chunk, never on the caller's logits. Gradients gain the factor 1/T: ``d log p(y)/dz_v = (1[v = y] - p_v) / T``.

Memory: both are computed in chunks of tokens (``chunk_tokens``; default: ``LOGPROB_CHUNK_BYTES`` of fp32 per
chunk), so the fp32 temporaries are ``[chunk, V/tp]`` instead of ``[T, V/tp]``. The log-prob's autograd function
saves only the caller's logits and one fp32 ``log Z`` per token, and recomputes ``p`` chunk by chunk in the
backward. The entropy is a metric by default: computed under ``no_grad``, and only when asked for
(``with_entropy``). ``chunk_tokens=0`` selects the unchunked reference path (Megatron's
``vocab_parallel_cross_entropy`` on one fp32 copy; the entropy with autograd when ``entropy_grad``).

THD: ``packed_seq_params(batch)`` turns a ``packing.ThdBatch`` into Megatron's ``PackedSeqParams``;
``forward_thd(model, batch)`` runs the ``GPTModel`` on it (input ``[1, T]``); ``compute_logprobs`` runs the
forward-only pipeline schedule over micro-batches for any TP/PP/VPP layout.

Logits where a loss is taken (``loss_positions_only``): the loss reads log-probs only at ``loss_mask > 0``
positions (the completion tokens), yet a forward computes the output layer ``[T, H] x [H, V]`` and the vocabulary
sums for every position, the prompt included (for a 135M model with a 49k vocabulary the output layer is ~20% of
the FLOPs per position). With the switch on, ``forward_thd`` hands the output layer only the hidden states of this
rank's loss positions (``loss_positions``; a forward pre-hook on ``output_layer``), and ``batch_logprobs``
computes log-probs and entropy of those rows and scatters them into ``[T]`` with zeros elsewhere: the values at the
loss positions and every gradient are those of the full computation (up to the order of floating-point sums in
the smaller matmul). The decoder still runs on every position (the completion attends to the prompt). Under
sequence parallelism the output layer's input is split over the sequence and gathered inside the layer, so the
switch leaves it on every position there (``batch_logprobs`` reads which case it got from the logits' rows).

Context parallelism (``parallel.cp > 1``): ``forward_thd`` hands the model this CP rank's zigzag part of the
micro-batch (``packing.context_parallel``) with the GLOBAL packed offsets (Megatron's THD RoPE and the attention
place the local positions by them), so the logits cover ``T / cp`` positions. ``batch_logprobs`` takes this
rank's labels, computes the local log-probs and all-gathers them over the CP group in the full order
(``cp_comm.gather_cp_same_grad``): every CP rank then holds the log-probs of the whole micro-batch and computes
the same loss over all of its tokens, so per-sequence terms (GSPO's sequence ratio) and every denominator are
those of cp = 1. The backward keeps each rank's own slice; Megatron's DDP sums the parameter gradients over the
data-parallel x context-parallel ranks.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Sequence

import torch
from torch import Tensor

from . import compat
from .cp_comm import gather_cp_same_grad, split_to_cp_rank


# ----------------------------------------------------------------------------------------------------------
# Vocab-parallel math
# ----------------------------------------------------------------------------------------------------------
def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


LOGPROB_CHUNK_BYTES = 256 << 20  # fp32 bytes of one [chunk, V/tp] temporary


def _chunk_rows(chunk_tokens: int | None, vocab_local: int) -> int:
    if chunk_tokens is None:
        return max(1, LOGPROB_CHUNK_BYTES // (4 * max(1, vocab_local)))
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 0 (0 = unchunked, None = automatic)")
    return chunk_tokens


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float, or ValueError unless it is a finite number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (the rollout's sampling "
                         "temperature the logits are divided by)")
    return float(temperature)


def _tempered(z: Tensor, temperature: float) -> Tensor:
    """``z / T`` in place on the fp32 tensor ``z`` (T = 1: ``z`` untouched). A masked padding logit
    (``mask_vocab_padding``: dtype min / 2) may overflow to -inf for T < 0.5: it is clamped back to the fp32 minimum,
    whose probability is still exactly 0, so the entropy's ``p * z`` term stays 0 instead of 0 * inf."""
    if temperature == 1.0:
        return z
    return z.div_(temperature).clamp_(min=torch.finfo(torch.float32).min)


def vocab_parallel_entropy(logits_shard: Tensor, *, grad: bool = False, chunk_tokens: int | None = None,
                           temperature: float = 1.0) -> Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of ``softmax(z / temperature)`` over the FULL vocabulary from this rank's
    shard ``logits_shard[..., V/tp]``; fp32, shape ``logits_shard.shape[:-1]``. With ``grad=False`` (default) the
    result carries no autograd graph and is computed in chunks of ``chunk_tokens`` tokens (None = automatic);
    ``grad=True`` uses the unchunked autograd path."""
    temperature = check_temperature(temperature)
    rows = _chunk_rows(chunk_tokens, logits_shard.shape[-1])
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        if torch.is_grad_enabled() or rows == 0:
            return _entropy_unchunked(logits_shard, temperature)
        flat = logits_shard.reshape(-1, logits_shard.shape[-1])
        parts = [_entropy_unchunked(flat[i:i + rows], temperature) for i in range(0, flat.shape[0], rows)]
        out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
        return out.reshape(logits_shard.shape[:-1])


def _entropy_unchunked(logits_shard: Tensor, temperature: float = 1.0) -> Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits_shard.float()
    if temperature != 1.0:  # out of place: autograd (grad=True) needs the division in the graph
        z = torch.clamp(z / temperature, min=torch.finfo(torch.float32).min)
    m = z.detach().max(dim=-1).values
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=_tp_group())
    shifted = z - m.unsqueeze(-1)
    exp = shifted.exp()
    sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])  # one all-reduce for both
    sums = reduce_from_tensor_model_parallel_region(sums)
    sum_exp, sum_exp_z = sums[0], sums[1]
    return sum_exp.log() - sum_exp_z / sum_exp


def vocab_parallel_logprobs(logits_shard: Tensor, labels: Tensor, *, with_entropy: bool = True,
                            entropy_grad: bool = False, chunk_tokens: int | None = None, temperature: float = 1.0
                            ) -> tuple[Tensor, Tensor | None]:
    """``(log p(labels), entropy)`` of ``p = softmax(logits / temperature)`` from vocab-sharded logits, never
    gathering the vocabulary.

    ``logits_shard``: ``[..., V/tp]`` (this TP rank's slice, any float dtype); ``labels``: ``[...]`` global
    token ids in ``[0, V)``. Returns fp32 tensors of shape ``labels.shape``; the log-probs are differentiable
    w.r.t. the logits (Megatron's vocab-parallel cross entropy), the entropy only with ``entropy_grad``.
    ``entropy`` is None when ``with_entropy`` is False. Every TP rank gets the same values. ``chunk_tokens``:
    tokens per chunk (None = automatic, 0 = unchunked; see the module docstring). ``temperature``: the sampling
    temperature T > 0 (module docstring, "Temperature"); 1 leaves the computation exactly as without it.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if logits_shard.shape[:-1] != labels.shape:
        raise ValueError(f"logits_shard has shape {tuple(logits_shard.shape)}, labels {tuple(labels.shape)}: "
                         "labels must match every logits dimension but the vocabulary")
    temperature = check_temperature(temperature)
    entropy = (vocab_parallel_entropy(logits_shard, grad=entropy_grad, chunk_tokens=chunk_tokens,
                                      temperature=temperature) if with_entropy else None)
    rows = _chunk_rows(chunk_tokens, logits_shard.shape[-1])
    if rows > 0:
        from megatron.core import parallel_state

        vocab_start = parallel_state.get_tensor_model_parallel_rank() * logits_shard.shape[-1]
        flat = logits_shard.reshape(-1, logits_shard.shape[-1])
        logp = _ChunkedLogprob.apply(flat, labels.reshape(-1).long(), rows, vocab_start, temperature)
        return logp.reshape(labels.shape), entropy
    # Megatron's cross entropy subtracts the max and exponentiates IN PLACE on an fp32 input: hand it a copy (the
    # division by T, when there is one, makes it).
    if temperature != 1.0:
        logits_fp32 = torch.clamp(logits_shard.float() / temperature, min=torch.finfo(torch.float32).min)
    else:
        logits_fp32 = logits_shard.float() if logits_shard.dtype != torch.float32 else logits_shard.clone()
    logp = -vocab_parallel_cross_entropy(logits_fp32, labels.long())
    return logp, entropy


class _ChunkedLogprob(torch.autograd.Function):
    """``log p(y)``, ``p = softmax(z / T)``, from vocab-sharded logits ``z[N, V/tp]`` in chunks of rows; backward
    ``d log p(y) / dz_v = (1[v = y] - p_v) / T`` recomputed per chunk from the saved ``log Z`` (of ``z / T``)."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, rows: int, vocab_start: int, temperature: float = 1.0
                ) -> Tensor:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        n, vocab_local = logits.shape
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        log_z = torch.empty(n, dtype=torch.float32, device=logits.device)
        for i in range(0, n, rows):
            z = _tempered(logits[i:i + rows].to(torch.float32, copy=True), temperature)
            m = z.max(dim=-1).values
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=_tp_group())
            z -= m.unsqueeze(-1)
            local, inside = _local_labels(labels[i:i + rows], vocab_start, vocab_local)
            z_y = torch.where(inside, z.gather(1, local.unsqueeze(1)).squeeze(1), torch.zeros_like(m))
            sums = reduce_from_tensor_model_parallel_region(torch.stack([z.exp_().sum(dim=-1), z_y]))
            logp[i:i + rows] = sums[1] - sums[0].log()
            log_z[i:i + rows] = m + sums[0].log()
        ctx.save_for_backward(logits, labels, log_z)
        ctx.rows, ctx.vocab_start, ctx.temperature = rows, vocab_start, temperature
        return logp

    @staticmethod
    def backward(ctx, grad_logp: Tensor):
        logits, labels, log_z = ctx.saved_tensors
        n, vocab_local = logits.shape
        grad = torch.empty_like(logits)
        for i in range(0, n, ctx.rows):
            g = grad_logp[i:i + ctx.rows].float()
            if ctx.temperature != 1.0:  # d/dz = (1/T) d/d(z/T)
                g = g / ctx.temperature
            z = _tempered(logits[i:i + ctx.rows].to(torch.float32, copy=True), ctx.temperature)
            p = z.sub_(log_z[i:i + ctx.rows].unsqueeze(-1)).exp_()
            chunk = p.mul_(-g.unsqueeze(-1))
            local, inside = _local_labels(labels[i:i + ctx.rows], ctx.vocab_start, vocab_local)
            chunk.scatter_add_(1, local.unsqueeze(1), torch.where(inside, g, torch.zeros_like(g)).unsqueeze(1))
            grad[i:i + ctx.rows] = chunk
        return grad, None, None, None, None


def _local_labels(labels: Tensor, vocab_start: int, vocab_local: int) -> tuple[Tensor, Tensor]:
    local = labels - vocab_start
    inside = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), inside


# ----------------------------------------------------------------------------------------------------------
# THD batches through the GPTModel
# ----------------------------------------------------------------------------------------------------------
def packed_seq_params(batch, device: torch.device | str | None = None) -> "PackedSeqParams":  # noqa: F821
    """Megatron ``PackedSeqParams`` (``qkv_format='thd'``) of a ``ThdBatch``: the PADDED offsets as both
    ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded`` (as NeMo-RL and verl do), ``max_seqlen`` = the longest
    padded sequence. Each padded segment is one causal sequence whose padding comes after its real tokens, so no
    real token attends to padding and the padding positions are masked in the loss (``loss_mask``); TE never takes
    its padding-between-sequences path. Tensors go to ``device`` (default: the batch's)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    device = batch.tokens.device if device is None else device
    cu_padded = batch.cu_seqlens_padded.to(device=device, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_padded, cu_seqlens_kv=cu_padded,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                           max_seqlen_q=int(batch.max_seqlen), max_seqlen_kv=int(batch.max_seqlen))


def forward_thd(model, batch, *, loss_positions_only: bool = False) -> Tensor:
    """Run a ``GPTModel`` (chunk) on one packed micro-batch (moved to the engine's device).

    Returns the vocab-sharded logits ``[T, V/tp]`` on the last pipeline stage, else the hidden states Megatron
    hands to the next stage (``[T / tp if sequence parallel else T, 1, hidden]``). Under a pipeline schedule
    non-first stages read their input from ``set_input_tensor``; tokens are ignored there. Under context
    parallelism ``T`` is this CP rank's ``T / cp`` positions (module docstring; ``batch_logprobs``).
    ``loss_positions_only``: the logits of this rank's loss positions only, ``[len(loss_positions(batch)), V/tp]``
    (module docstring, "Logits where a loss is taken"; not under sequence parallelism).
    """
    unwrapped = _unwrap(model)
    config = unwrapped.config
    total = int(batch.tokens.numel())
    if config.sequence_parallel and total % config.tensor_model_parallel_size:
        raise ValueError(f"packed batch of {total} positions is not divisible by tp="
                         f"{config.tensor_model_parallel_size} (sequence parallel splits it over the TP ranks); "
                         "build it with pad_multiple=packing.thd_pad_multiple(tp, cp, sequence_parallel=True)")
    cp_group = context_parallel_group()
    if cp_group is not None:  # this CP rank's part; the packed params keep the global offsets
        cp = cp_group.size()
        if config.sequence_parallel and (total // cp) % config.tensor_model_parallel_size:
            raise ValueError(f"packed batch of {total} positions: its 1/cp={cp} part is not divisible by tp="
                             f"{config.tensor_model_parallel_size}; build it with "
                             "pad_multiple=packing.thd_pad_multiple(tp, cp, sequence_parallel=True)")
    device = _engine_device()
    cu = batch.cu_seqlens_padded
    tokens = split_to_cp_rank(batch.tokens, cu, cp_group).to(device).unsqueeze(0)  # [1, T / cp]
    position_ids = split_to_cp_rank(batch.position_ids, cu, cp_group).to(device).unsqueeze(0)
    rows = contextlib.nullcontext()
    if loss_positions_only and getattr(unwrapped, "post_process", True) and not config.sequence_parallel:
        rows = _output_rows(unwrapped, loss_positions(batch, cp_group).to(device))
    with rows:
        out = model(tokens, position_ids, None, packed_seq_params=packed_seq_params(batch, device))
    if getattr(unwrapped, "post_process", True):
        return mask_vocab_padding(out.squeeze(0), getattr(unwrapped, "unpadded_vocab_size", None))  # [T, V/tp]
    return out


def loss_positions(batch, group=None) -> Tensor:
    """Indices of the positions of ``batch`` where a loss is taken (``loss_mask > 0``) among this context-parallel
    rank's positions (``group``: the CP group, None = all of them)."""
    mask = split_to_cp_rank(batch.loss_mask, batch.cu_seqlens_padded, group)
    return (mask > 0).nonzero().flatten()


@contextlib.contextmanager
def _output_rows(model, index: Tensor):
    """Within the block, ``model.output_layer`` computes the rows ``index`` of its ``[S, B, H]`` input only."""
    def keep_rows(_module, args, kwargs):
        return (args[0].index_select(0, index), *args[1:]), kwargs

    handle = model.output_layer.register_forward_pre_hook(keep_rows, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def mask_vocab_padding(logits_shard: Tensor, vocab_size: int | None) -> Tensor:
    """Logits of the padding rows (global ids >= ``vocab_size``, see ``model.padded_vocab_size``) set to a large
    negative number: exactly zero probability, no gradient into those rows, finite log-probs and entropy."""
    from megatron.core import parallel_state

    width = logits_shard.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    if vocab_size is None or start + width <= vocab_size:
        return logits_shard
    pad = torch.arange(start, start + width, device=logits_shard.device) >= vocab_size
    return logits_shard.masked_fill(pad, torch.finfo(logits_shard.dtype).min / 2)


def context_parallel_group():
    """Megatron's context-parallel group, or None when cp = 1."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() == 1:
        return None
    return parallel_state.get_context_parallel_group()


def batch_logprobs(logits_shard: Tensor, batch, *, with_entropy: bool = True, entropy_grad: bool = False,
                   temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """``(logp[T], entropy[T])`` of a whole micro-batch from ``forward_thd``'s logits: ``vocab_parallel_logprobs``
    (at ``temperature``) with the labels of the positions the logits cover; under context parallelism gathered over
    the CP group into the full order (module docstring), identical on every CP rank. Logits of the loss positions
    only (``forward_thd(..., loss_positions_only=True)``, fewer rows than positions) give log-probs and entropy
    there and 0 at every other position."""
    group = context_parallel_group()
    cu = batch.cu_seqlens_padded
    labels = split_to_cp_rank(batch.labels, cu, group).to(logits_shard.device)
    if logits_shard.shape[0] == labels.shape[0]:
        logp, entropy = vocab_parallel_logprobs(logits_shard, labels, with_entropy=with_entropy,
                                                entropy_grad=entropy_grad, temperature=temperature)
    else:
        index = loss_positions(batch, group).to(logits_shard.device)
        if index.numel() != logits_shard.shape[0]:
            raise ValueError(f"logits have {logits_shard.shape[0]} rows for {labels.shape[0]} positions and "
                             f"{index.numel()} loss positions: neither every position nor the loss positions")
        logp, entropy = vocab_parallel_logprobs(logits_shard, labels[index], with_entropy=with_entropy,
                                                entropy_grad=entropy_grad, temperature=temperature)
        logp = logp.new_zeros(labels.shape[0]).index_copy(0, index, logp)
        entropy = None if entropy is None else entropy.new_zeros(labels.shape[0]).index_copy(0, index, entropy)
    if group is None:
        return logp, entropy
    return gather_cp_same_grad(logp, cu, group), None if entropy is None else gather_cp_same_grad(entropy, cu, group)


def thd_logprobs(model, batch, *, with_entropy: bool = True, entropy_grad: bool = False, temperature: float = 1.0
                 ) -> tuple[Tensor, Tensor | None]:
    """``(logp[T], entropy[T])`` of a packed batch on a single pipeline stage model (pp = 1).
    ``logp[t] = log p(labels[t] | tokens[<= t] of the same sequence)`` at ``temperature``; meaningful where
    ``loss_mask`` is 1."""
    return batch_logprobs(forward_thd(model, batch), batch, with_entropy=with_entropy, entropy_grad=entropy_grad,
                          temperature=temperature)


def _engine_device() -> torch.device:
    """Where the engine's tensors live: the current CUDA device, or the CPU without CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


@torch.no_grad()
def compute_logprobs(model_chunks: Sequence, micro_batches: Sequence, *, with_entropy: bool = False,
                     broadcast: bool = True, temperature: float = 1.0, loss_positions_only: bool = False
                     ) -> list[tuple[Tensor, Tensor | None]]:
    """Forward-only log-probs (and entropy) of every micro-batch with Megatron's pipeline schedule, of the policy
    at ``temperature`` (softmax of logits / T); with ``loss_positions_only`` at the loss positions only (0
    elsewhere; module docstring).

    ``model_chunks``: this rank's model chunks (one per virtual stage); ``micro_batches``: the same list of
    ``ThdBatch`` on every rank of the TP/PP group (each stage needs the THD layout). Returns
    ``[(logp[T_i], entropy[T_i] | None)]`` on the last pipeline stage and, with ``broadcast``, on every stage
    (broadcast over the pipeline group); otherwise an empty list on other stages. With virtual pipeline stages
    Megatron's interleaved schedule needs ``len(micro_batches) >= pp`` (a multiple of ``pp`` always works).
    """
    from megatron.core import parallel_state

    model_chunks = list(model_chunks)
    micro_batches = list(micro_batches)
    if not micro_batches:
        return []
    was_training = [chunk.training for chunk in model_chunks]
    for chunk in model_chunks:
        chunk.eval()
    try:
        results = _forward_only(model_chunks, micro_batches, with_entropy, check_temperature(temperature),
                                loss_positions_only)
    finally:
        for chunk, mode in zip(model_chunks, was_training):
            chunk.train(mode)
    if broadcast and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        results = _broadcast_from_last_stage(results, micro_batches, with_entropy)
    return results


def _forward_only(model_chunks: list, micro_batches: list, with_entropy: bool, temperature: float,
                  loss_positions_only: bool = False) -> list:
    from megatron.core import parallel_state

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = forward_thd(model, batch, loss_positions_only=loss_positions_only)

        def loss_func(output_tensor, non_loss_data=True):
            return batch_logprobs(output_tensor, batch, with_entropy=with_entropy, temperature=temperature)

        return output, loss_func

    results = run_pipeline_schedule(model_chunks, micro_batches, forward_step, forward_only=True,
                                    collect_non_loss_data=True)
    return list(results) if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else []


def run_pipeline_schedule(model_chunks: list, micro_batches: list, forward_step, *, forward_only: bool,
                          collect_non_loss_data: bool = False):
    """Run packed THD micro-batches (one ``[1, T]`` sequence each) through Megatron's pipeline schedule.

    The one place that calls ``get_forward_backward_func`` (forward-only log-probs, the train step, the gradient
    audit): every virtual pipeline chunk gets its own iterator over the same micro-batches; ``seq_length`` is the
    longest micro-batch (the packer keeps every one within the capacity).
    """
    iterators = [iter(micro_batches) for _ in model_chunks]
    multi = len(model_chunks) > 1
    return compat.get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if multi else iterators[0],
        model=model_chunks if multi else model_chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=max(int(b.tokens.numel()) for b in micro_batches),
        micro_batch_size=1,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


def _broadcast_from_last_stage(results: list, micro_batches: Iterable, with_entropy: bool) -> list:
    from megatron.core import parallel_state

    src = parallel_state.get_pipeline_model_parallel_last_rank()
    group = parallel_state.get_pipeline_model_parallel_group()
    is_src = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    out = []
    for i, batch in enumerate(micro_batches):
        n = int(batch.tokens.numel())
        device = _engine_device()
        rows = 2 if with_entropy else 1
        if is_src:
            logp, entropy = results[i]
            buf = torch.stack([logp, entropy]) if with_entropy else logp.unsqueeze(0)
            buf = buf.float().to(device).contiguous()
        else:
            buf = torch.empty(rows, n, dtype=torch.float32, device=device)
        torch.distributed.broadcast(buf, src=src, group=group)
        out.append((buf[0], buf[1] if with_entropy else None))
    return out
