"""The ``rollout.speculative`` section: exact speculative decoding of the rollouts (rollout/speculative.py; the
method, its exactness and its measured speed in docs/rollouts.md). Every option is documented here, once, in its
``help`` (``megatron-dppo train --help-config``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_dppo.config.fields import _check, opt

SPECULATIVE_METHODS = ("none", "ngram", "suffix", "mtp", "eagle")  # rollout.speculative.SPECULATIVE_METHODS


@dataclass
class SpeculativeConfig:
    """Speculative decoding of the rollouts: drafts verified by the policy so that the samples and their behaviour
    log-probs are exactly those of plain sampling (a draft token is kept only while the policy's own sample equals
    it), with fewer policy forwards when the drafts are right."""

    method: Literal["none", "ngram", "suffix", "mtp", "eagle"] = opt(
        "none", "none = plain sampling. ngram = prompt lookup: the draft continues the latest earlier occurrence of "
                "the last n tokens of the prompt + completion so far (HF engine: our batched verifier; vllm: vLLM's "
                "n-gram proposer). vllm only: suffix (vLLM's suffix decoding; needs the arctic-inference package, "
                "refused without it), mtp (the model's own multi-token-prediction layers; refused for a model "
                "without them), eagle (refused: needs a trained EAGLE draft model, which this library does not "
                "load).")
    num_draft_tokens: int = opt(4, "The most draft tokens verified per sequence and policy forward (vLLM "
                                   "num_speculative_tokens).")
    ngram_min: int = opt(1, "method=ngram: the shortest suffix of the history looked up (vLLM prompt_lookup_min).")
    ngram_max: int = opt(3, "method=ngram: the longest suffix looked up, tried first (vLLM prompt_lookup_max).")

    def validate(self) -> None:
        _check(self.method in SPECULATIVE_METHODS, "rollout.speculative.method", self.method,
               f"one of {SPECULATIVE_METHODS}")
        _check(self.num_draft_tokens >= 1, "rollout.speculative.num_draft_tokens", self.num_draft_tokens, ">= 1")
        _check(self.ngram_min >= 1, "rollout.speculative.ngram_min", self.ngram_min, ">= 1")
        _check(self.ngram_max >= self.ngram_min, "rollout.speculative.ngram_max", self.ngram_max,
               f">= rollout.speculative.ngram_min={self.ngram_min}")
