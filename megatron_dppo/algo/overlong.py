"""Completions that reach the length limit (docs/algorithms.md, "Overlong completions"): DAPO's soft overlong
punishment, a reward-shaping term, and the loss denominator of overlong filtering, which removes the truncated
completions from the loss. Plain torch."""
from __future__ import annotations

import torch
from torch import Tensor

from megatron_dppo.algo._checks import check_choice

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment of completions of ``lengths`` tokens, L_max = ``max_len``, L_cache = ``buffer``:

        0                                          if L <= L_max - L_cache
        -penalty * (L - (L_max - L_cache)) / L_cache   if L_max - L_cache < L <= L_max
        -penalty                                   if L > L_max

    So the first token past L_max - L_cache costs penalty / L_cache and a completion cut at the limit costs exactly
    ``penalty`` (verl's ``overlong_buffer``: ``min(-(L - expected_len) / len * penalty_factor, 0)``). ``buffer`` 0 is
    no penalty (zeros). Float32, the shape of ``lengths``."""
    max_len = _positive_int("max_len", max_len)
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 <= buffer <= max_len:
        raise ValueError(f"buffer (L_cache) must be an integer in [0, max_len={max_len}], got {buffer!r}")
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not 0 <= penalty < float("inf"):
        raise ValueError(f"penalty must be a finite number >= 0, got {penalty!r}")
    lengths = torch.as_tensor(lengths)
    if bool((lengths < 0).any()):
        raise ValueError(f"completion lengths must be >= 0, got {lengths.min().item()}")
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    excess = (lengths.double() - (max_len - buffer)).clamp(min=0.0, max=float(buffer))
    return (-float(penalty) * excess / buffer).to(torch.float32)


def finished_denominator(aggregation: str, finished: Tensor, lengths: Tensor, prompt_keep_prob: Tensor | None,
                         max_len: int) -> float:
    """D of overlong filtering: the full-batch denominator (``losses.loss_denominator``) counting only the completions
    that finished (``finished`` [rows, G], False = truncated at the limit), so a truncated completion is in neither the
    numerator nor the denominator:

        seq_mean_token_mean, seq_mean_token_sum:  D = number of finished completions
        seq_mean_token_sum_norm:                  D = number of finished completions * L_max
        token_mean:                               D = tokens of the finished completions (``lengths`` [rows, G])

    With prompt pruning the rows are the generated prompts and ``prompt_keep_prob`` their pi_q: the finished
    completions of a pruned prompt are unknown, so each row counts 1/pi_q times (the Horvitz-Thompson estimate, as
    for token_mean; exact in expectation). ``prompt_keep_prob`` None = every drawn prompt generated: D is exact."""
    check_choice("aggregation", aggregation, AGGREGATIONS)
    finished = torch.as_tensor(finished, dtype=torch.bool)
    lengths = torch.as_tensor(lengths).double()
    if finished.dim() != 2 or lengths.shape != finished.shape:
        raise ValueError(f"finished {tuple(finished.shape)} and lengths {tuple(lengths.shape)} must both be [rows, G]")
    if bool((lengths < 0).any()) or not bool(torch.isfinite(lengths).all()):
        raise ValueError("completion lengths must be finite and >= 0")
    per_unit = lengths if aggregation == "token_mean" else torch.ones_like(lengths)
    if aggregation == "seq_mean_token_sum_norm":
        per_unit = per_unit * _positive_int("max_len", max_len)
    per_row = (per_unit * finished.double()).sum(dim=1)
    if prompt_keep_prob is not None:
        pi = torch.as_tensor(prompt_keep_prob).double()
        if pi.shape != per_row.shape or bool(((pi <= 0) | (pi > 1)).any()):
            raise ValueError(f"prompt_keep_prob must hold one probability in (0, 1] per row ({per_row.numel()}), "
                             f"got shape {tuple(pi.shape)}")
        per_row = per_row / pi
    return float(per_row.sum())
