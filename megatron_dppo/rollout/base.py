"""The rollout-engine protocol shared by the HF (CPU) and vLLM (GPU) engines.

    engine.generate(prompt_token_ids, n, sampling) -> list[CompletionGroup]   # one group of n per prompt, in order
    engine.load_weights(iterable of (hf_name, tensor))                        # e.g. convert.export_hf_weights(...)
    engine.sleep(); engine.wake_up(tags=None)                                  # free / restore accelerator memory

Log-probabilities (the behaviour policy). For every generated token y_t a Completion carries
    logprobs[t] = log mu(y_t | x, y_<t), mu the distribution the token was actually drawn from: the logits divided
                  by the temperature, then top-k and top-p (tokens outside the kept set at -inf), renormalized:
                  log_softmax(warp(logits))[y_t]. Every engine returns them in every sampling mode.
The trainer's log-probs are of the tempered, UNtruncated policy softmax(logits / T) (LossConfig.temperature, as
verl and TRL). Without top-k / top-p the two are the same distribution, and logprobs equal the trainer's at the same
weights up to numerics; with truncation log mu(y) - log pi_T(y) = -log Z_K >= 0, Z_K the tempered mass of the kept
set. The rollout correction and the stale-batch (decoupled) objective use these log-probs as pi_behav
(docs/algorithms.md, "Temperature and truncated sampling").

Token ids include the stop token that ended a completion (EOS or one of ``stop_token_ids``), with its log-prob, so
the policy learns to stop; ``finish_reason`` is "stop" then and "length" when ``max_new_tokens`` ran out.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature > 0 (greedy decoding is not offered: RL needs samples); top_k <= 0 and
    top_p == 1.0 disable truncation; ``seed`` makes a generate() call reproducible; generation stops at the EOS
    token(s) of the engine and at ``stop_token_ids``."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class Completion:
    """One sampled completion; ``logprobs``: the behaviour log-probs (module docstring), one per token."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"

    def __post_init__(self):
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")


@dataclass
class CompletionGroup:
    """The n completions of one prompt."""

    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)


WeightStream = Iterable[tuple[str, torch.Tensor]]


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[CompletionGroup]:
        """n completions for each prompt (token ids without padding), groups in prompt order."""
        ...

    def load_weights(self, weights: WeightStream) -> int:
        """Copy HF-named tensors into the model; returns the number of tensors loaded. Unknown names or shapes
        raise ValueError."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory held for generation (no-op on CPU)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo sleep() before the next generate() / load_weights(); ``tags`` ("weights", "kv_cache", None = all)
        lets vLLM restore weights before its KV cache around a weight push."""
        ...


def validate_prompts(prompt_token_ids: list[list[int]], n: int) -> None:
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    for i, ids in enumerate(prompt_token_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
