"""The score head of a sequence classifier on Megatron-Core (a reward model served with the policy's own code).

A Hugging Face ``*ForSequenceClassification`` (Qwen2/Llama/Qwen3 families) is the causal decoder with its LM head
replaced by a score head ``score.weight`` [num_labels, hidden] applied at every position; the score of a sequence
is the head at its last token. ``ModelArch.num_labels`` marks such a model: ``model.build_gpt_model`` builds the
same ``GPTModel`` (TP/PP/SP, every attention backend) and puts :class:`ScoreHead` in place of the vocabulary
output layer on the last pipeline stage (the approach of verl's Megatron value model), and ``convert/`` maps
``score.weight`` <-> ``output_layer.weight`` (replicated over TP). The head is tiny, so it is replicated: under
tensor parallelism every rank holds the whole [labels, hidden] matrix and the hidden states are complete after the
last layer (with sequence parallelism the head first gathers them from the TP ranks). Serving:
``reward_engine.MegatronRewardEngine``.
"""
from __future__ import annotations

import torch
from torch import Tensor


class ScoreHead(torch.nn.Module):
    """The output layer of a sequence classifier: ``hidden @ weight.T`` with ``weight`` [num_labels, hidden],
    replicated over TP. Called as Megatron calls its output layer; returns ``(scores [s, b, labels], None)``."""

    def __init__(self, hidden_size: int, num_labels: int, *, sequence_parallel: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(num_labels, hidden_size, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: Tensor, weight: Tensor | None = None, runtime_gather_output=None, **_):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight), None


def attach_score_head(model, arch, config) -> None:
    """Replace ``model.output_layer`` (last stage) by a :class:`ScoreHead` of ``arch.num_labels`` labels."""
    old = model.output_layer
    weight = next(old.parameters())
    model.output_layer = ScoreHead(arch.hidden_size, arch.num_labels, sequence_parallel=config.sequence_parallel,
                                   dtype=weight.dtype, device=weight.device)
