"""A sequence classifier (reward model) under the policy's TP/PP layout: scores of token sequences.

:class:`MegatronRewardEngine` builds the classifier with ``model.build_model_chunks`` (its output layer the
``score_head.ScoreHead``), filled by ``convert.weights.load_hf_weights`` with the policy's conversion rules. It
scores token sequences: they are packed into THD micro-batches (whole sequences, at most ``batch_tokens`` tokens,
padded for sequence parallelism) and run forward-only through Megatron's pipeline schedule
(``logprobs.run_pipeline_schedule``, the one the policy uses); the last stage reads each sequence's score at its last
real token and broadcasts the scores over the pipeline group. Every rank of a model-parallel group must call
``classify`` with the same inputs; data-parallel replicas score different groups (``shard()``). Equal to the HF
model under TP2 and PP2 (tests/megatron/test_reward_engine.py).
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import Tensor

from megatron_dppo.packing.thd import build_thd_batch, thd_pad_multiple


@contextlib.contextmanager
def random_state_kept():
    """torch's CPU and CUDA generators and Megatron's model-parallel RNG tracker as they were before the block:
    building a model draws its random initialization from them, and a reward model built before the policy would
    otherwise change the policy's initialization and every sampling seed after it."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
    tracker.set_states(states)


class MegatronRewardEngine:
    """A sequence classifier under the current Megatron parallel state (module docstring); weights are filled by
    ``convert.weights.load_hf_weights(engine.model_chunks, arch, ...)``.

    Args:
        arch: a ``ModelArch`` with ``num_labels`` (``ModelArch.from_hf_config`` of the classifier's config.json).
        parallel: ``megatron.parallel.ParallelConfig`` of the initialized state (tp, pp, sp; no cp, no vpp).
        dtype: parameter dtype.
        batch_tokens: the most tokens of one packed micro-batch (a longer sequence gets a micro-batch of its own).
    """

    def __init__(self, arch, parallel, *, dtype: torch.dtype | None = None, batch_tokens: int = 4096):
        from .model import build_model_chunks

        if arch.num_labels is None:
            raise ValueError("MegatronRewardEngine needs a sequence classifier (ModelArch.num_labels); the config "
                             "describes a causal LM")
        if parallel.cp > 1 or parallel.vpp is not None:
            raise ValueError("the Megatron reward model runs with parallel.cp=1 and without virtual pipeline stages")
        self.arch, self.parallel, self.batch_tokens = arch, parallel, int(batch_tokens)
        with random_state_kept():  # its random init (replaced by the loaded weights) must not move the run's RNG
            self.model_chunks = build_model_chunks(arch, parallel, dtype)
        for chunk in self.model_chunks:
            chunk.eval()
            for p in chunk.parameters():
                p.requires_grad_(False)

    @torch.no_grad()
    def classify(self, inputs: Sequence[Sequence[int]]) -> Tensor:
        """[N] float32 scores (label 0) at each input's last token, on every rank of the model-parallel group."""
        from megatron.core import parallel_state

        from .logprobs import _engine_device, packed_seq_params, run_pipeline_schedule

        if not inputs:
            return torch.zeros(0)
        pad = thd_pad_multiple(self.parallel.tp, 1, self.parallel.sp)
        batches, order = [], []
        for chunk in self._chunks(inputs):
            seqs = [list(inputs[i]) for i in chunk]
            batches.append(build_thd_batch(seqs, [1] * len(seqs), chunk, [0.0] * len(seqs), [0.0] * len(seqs),
                                           pad_multiple=pad))
            order += chunk
        device = _engine_device()

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            tokens = batch.tokens.to(device).unsqueeze(0)
            positions = batch.position_ids.to(device).unsqueeze(0)
            output = model(tokens, positions, None, packed_seq_params=packed_seq_params(batch, device))

            def read_scores(output_tensor, non_loss_data=True):
                last = batch.cu_seqlens_padded[:-1] + (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]) - 1
                return output_tensor.reshape(-1, output_tensor.shape[-1])[last.to(device), 0].float()

            return output, read_scores

        results = run_pipeline_schedule(self.model_chunks, batches, forward_step, forward_only=True,
                                        collect_non_loss_data=True)
        last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        flat = torch.cat(list(results)).to(device) if last_stage else torch.empty(len(order), device=device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.broadcast(flat, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                        group=parallel_state.get_pipeline_model_parallel_group())
        scores = torch.empty(len(inputs))
        scores[torch.tensor(order)] = flat.float().cpu()
        return scores

    def _chunks(self, inputs: Sequence[Sequence[int]]) -> list[list[int]]:
        """Consecutive runs of input indices of at most ``batch_tokens`` tokens (a longer input alone)."""
        chunks, current, size = [], [], 0
        for i, x in enumerate(inputs):
            if current and size + len(x) > self.batch_tokens:
                chunks.append(current)
                current, size = [], 0
            current.append(i)
            size += len(x)
        if current:
            chunks.append(current)
        return chunks

    def shard(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size): the model-parallel group's ranks score the same groups."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def wake_up(self) -> None:
        """Resident all along (it is small next to the policy; nothing to wake)."""

    def sleep(self) -> None:
        """Resident all along."""
