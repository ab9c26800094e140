"""THD micro-batches: whole sequences concatenated on one token axis, with the bookkeeping attention and the loss need.

docs/algorithms.md packing step 3. A micro-batch of ``n`` sequences with true lengths ``l_i`` and prompt lengths
``p_i`` becomes 1-D tensors over ``T = cu_seqlens_padded[-1]`` positions:

* sequence ``i`` occupies ``[cu_seqlens_padded[i], cu_seqlens_padded[i] + l_i)``, followed by
  ``L_i - l_i`` padding tokens, where ``L_i = ceil(l_i / m) * m`` and ``m = pad_multiple``
  (:func:`thd_pad_multiple`: ``tp`` with sequence parallel, ``2 * tp * cp`` with context parallel);
* ``cu_seqlens = [0, l_0, l_0 + l_1, ...]`` (TRUE lengths) and ``cu_seqlens_padded = [0, L_0, L_0 + L_1, ...]``
  (offsets in the tensor) are kept distinct; they coincide only when ``m = 1``. Mixing them up is the classic
  silent THD bug (TransformerEngine issues 1930 / 2892, NeMo-RL 1835);
* ``position_ids`` restart at 0 for every sequence (RoPE); on padding they continue counting (harmless: masked);
* ``labels[t] = tokens[t + 1]`` when ``t + 1`` is in the same sequence, else 0 (last real token, padding);
* ``loss_mask[t] = 1`` iff ``labels[t]`` is a completion token, i.e. ``p_i - 1 <= t - start_i <= l_i - 2``:
  the logit at position ``t`` predicts token ``t + 1``, so sequence ``i`` has exactly ``l_i - p_i`` loss positions;
  with per-token ``loss_masks`` (multi-turn episodes: 1 on sampled tokens, 0 on observation tokens, one entry per
  completion token) the mask is ANDed in: position ``start_i + p_i - 1 + j`` keeps its 1 only when
  ``loss_masks[i][j] = 1``, so observation tokens are never predicted by the loss (and ``token_weight`` is 0
  there too); the sequence then has ``sum(loss_masks[i])`` loss positions;
* ``token_weight`` = the sequence's loss weight on its loss positions, 0 elsewhere; ``advantages`` = the
  sequence's advantage on its real tokens, 0 on padding; ``seq_index`` = ``i`` on real tokens, -1 on padding.

An EMPTY micro-batch (the packer emits one only when there are fewer sequences than micro-batches, see
``packer.py``) becomes a zero-token dummy: ``m`` padding tokens, ``cu_seqlens = cu_seqlens_padded = [0, m]`` (one
attention segment over the padding so every kernel sees a valid layout), ``sample_ids`` empty, all masks and
weights 0. It runs forward/backward and every collective like a real micro-batch and adds exactly 0 to the loss.

The padded layout ([N, L_max]) used as the comparison baseline is :class:`PaddedBatch` / :func:`build_padded_batch`
with the same per-token fields, so a loss over ``flat()`` of a padded batch must equal the loss over THD batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

Tensor = torch.Tensor


def thd_pad_multiple(tp: int, cp: int, sequence_parallel: bool) -> int:
    """Per-sequence padding multiple of the THD layout: ``2 * tp * cp`` with context parallel (cp > 1; CP splits
    every sequence into 2*cp chunks for load balance, each further sharded over tp), ``tp`` with sequence parallel
    (each sequence is split over the tp ranks), else 1."""
    for name, value in (("tp", tp), ("cp", cp)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name}={value} must be an integer >= 1")
    if cp > 1:
        return 2 * tp * cp
    if sequence_parallel:
        return tp
    return 1


@dataclass
class ThdBatch:
    """One packed micro-batch; every per-token field is 1-D over ``T = cu_seqlens_padded[-1]`` positions."""

    tokens: Tensor  # long [T]
    position_ids: Tensor  # long [T], restart at 0 per sequence
    labels: Tensor  # long [T], next token of the same sequence, 0 at sequence ends / padding
    loss_mask: Tensor  # float [T], 1 where labels[t] is a completion token
    token_weight: Tensor  # float [T], per-token loss weight, 0 off-mask
    advantages: Tensor  # float [T], sequence advantage on real tokens, 0 on padding
    seq_index: Tensor  # long [T], 0..n-1 within this micro-batch, -1 on padding
    cu_seqlens: Tensor  # int32 [n+1], cumulative TRUE lengths
    cu_seqlens_padded: Tensor  # int32 [n+1], cumulative padded lengths = offsets in the tensors
    max_seqlen: int  # max padded sequence length
    sample_ids: Tensor  # long [n], index of each sequence in the step's sequence list
    old_logprobs: Tensor | None = None  # float [T], filled by the engine
    ref_logprobs: Tensor | None = None  # float [T], filled by the engine
    # float [T], rollout-correction factor of the pg term (train/stages.py), or None
    rollout_weight: Tensor | None = None
    # MoE routing replay: per sequence (order of sample_ids) the [n_i, L, k] expert ids the engine recorded
    routed_experts: list[Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return 0 if self.is_dummy else int(self.cu_seqlens[-1])

    @property
    def num_sequences(self) -> int:
        return int(self.sample_ids.numel())

    @property
    def is_dummy(self) -> bool:
        """True for the zero-token placeholder micro-batch built from an empty packer bin."""
        return self.sample_ids.numel() == 0

    @property
    def seq_lengths(self) -> Tensor:
        """True length of each sequence (long [n]; empty for a dummy batch)."""
        if self.is_dummy:
            return torch.zeros(0, dtype=torch.long, device=self.cu_seqlens.device)
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    def to(self, device, non_blocking: bool = False) -> "ThdBatch":
        moved = {
            f.name: (v.to(device, non_blocking=non_blocking) if isinstance(v, Tensor) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }
        return ThdBatch(**moved)

    def completion_values(self, values: Tensor) -> list[Tensor]:
        """Split a per-position tensor ``values[T, ...]`` into one tensor per sequence holding its loss positions
        (in order: the values predicting completion tokens 1..|o|). Empty list for a dummy batch."""
        if values.shape[0] != self.tokens.shape[0]:
            raise ValueError(f"values has {values.shape[0]} positions, the batch has {self.tokens.shape[0]}")
        if self.is_dummy:
            return []
        mask = self.loss_mask.to(values.device) > 0
        bounds = self.cu_seqlens_padded.tolist()
        return [values[a:b][mask[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]


def _as_list(x, n: int, name: str) -> list[float]:
    values = x.tolist() if isinstance(x, Tensor) else list(x)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries, expected one per sequence ({n})")
    return [float(v) for v in values]


def _check_loss_masks(loss_masks, token_ids, prompt_lengths) -> list[list[float]] | None:
    """Per sequence, its completion tokens' 0/1 mask (validated: one entry per completion token, values 0 or 1)."""
    if loss_masks is None:
        return None
    if len(loss_masks) != len(token_ids):
        raise ValueError(f"loss_masks has {len(loss_masks)} entries, expected one per sequence ({len(token_ids)})")
    out = []
    for i, (mask, seq, p) in enumerate(zip(loss_masks, token_ids, prompt_lengths)):
        values = mask.tolist() if isinstance(mask, Tensor) else list(mask)
        if len(values) != len(seq) - int(p):
            raise ValueError(f"loss_masks[{i}] has {len(values)} entries for {len(seq) - int(p)} completion tokens")
        if any(v not in (0, 1) for v in values):
            raise ValueError(f"loss_masks[{i}] must hold only 0 and 1")
        out.append([float(v) for v in values])
    return out


def _check_sequences(token_ids, prompt_lengths, sample_ids, advantages, token_weights):
    n = len(token_ids)
    if len(prompt_lengths) != n:
        raise ValueError(f"prompt_lengths has {len(prompt_lengths)} entries, expected one per sequence ({n})")
    sample_ids = [int(s) for s in (sample_ids.tolist() if isinstance(sample_ids, Tensor) else sample_ids)]
    if len(sample_ids) != n:
        raise ValueError(f"sample_ids has {len(sample_ids)} entries, expected one per sequence ({n})")
    adv = _as_list(advantages, n, "advantages")
    w = _as_list(token_weights, n, "token_weights")
    for i, (seq, p) in enumerate(zip(token_ids, prompt_lengths)):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty")
        if not 1 <= int(p) <= len(seq):
            raise ValueError(
                f"prompt_lengths[{i}]={p} must be in [1, {len(seq)}] (the sequence length; the first token is "
                f"never predicted, so a prompt needs at least one token)"
            )
    return sample_ids, adv, w


def build_thd_batch(
    token_ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    sample_ids: Sequence[int] | Tensor,
    advantages: Sequence[float] | Tensor,
    token_weights: Sequence[float] | Tensor,
    pad_multiple: int = 1,
    pad_token_id: int = 0,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> ThdBatch:
    """Concatenate whole sequences (prompt + completion token ids) into one THD micro-batch (module docstring).

    ``advantages[i]`` and ``token_weights[i]`` are per-sequence scalars (``token_weights`` = the
    ``sequence_token_weights`` value). ``loss_masks[i]`` (optional) is the 0/1 mask of sequence i's completion
    tokens, ANDed into the loss mask. An empty ``token_ids`` gives the zero-token dummy micro-batch.
    """
    if int(pad_multiple) != pad_multiple or pad_multiple < 1:
        raise ValueError(f"pad_multiple={pad_multiple} must be an integer >= 1")
    sample_list, adv, w = _check_sequences(token_ids, prompt_lengths, sample_ids, advantages, token_weights)
    masks = _check_loss_masks(loss_masks, token_ids, prompt_lengths)
    if len(token_ids) == 0:
        return _dummy_batch(pad_multiple, pad_token_id)

    lengths = [len(s) for s in token_ids]
    padded = [-(-l // pad_multiple) * pad_multiple for l in lengths]
    T = sum(padded)
    tokens = torch.full((T,), pad_token_id, dtype=torch.long)
    labels = torch.zeros(T, dtype=torch.long)
    position_ids = torch.empty(T, dtype=torch.long)
    loss_mask = torch.zeros(T, dtype=torch.float32)
    token_weight = torch.zeros(T, dtype=torch.float32)
    advantage = torch.zeros(T, dtype=torch.float32)
    seq_index = torch.full((T,), -1, dtype=torch.long)

    start = 0
    for i, (seq, l, L, p) in enumerate(zip(token_ids, lengths, padded, prompt_lengths)):
        ids = torch.as_tensor(list(seq), dtype=torch.long)
        end = start + l
        tokens[start:end] = ids
        labels[start : end - 1] = ids[1:]
        position_ids[start : start + L] = torch.arange(L)
        # Positions p-1 .. l-2 predict tokens p .. l-1, the completion.
        completion = 1.0 if masks is None else torch.tensor(masks[i], dtype=torch.float32)
        loss_mask[start + p - 1 : end - 1] = completion
        token_weight[start + p - 1 : end - 1] = w[i] * completion
        advantage[start:end] = adv[i]
        seq_index[start:end] = i
        start += L

    zero = torch.zeros(1, dtype=torch.int32)
    return ThdBatch(
        tokens=tokens,
        position_ids=position_ids,
        labels=labels,
        loss_mask=loss_mask,
        token_weight=token_weight,
        advantages=advantage,
        seq_index=seq_index,
        cu_seqlens=torch.cat([zero, torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)]),
        cu_seqlens_padded=torch.cat([zero, torch.tensor(padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)]),
        max_seqlen=max(padded),
        sample_ids=torch.tensor(sample_list, dtype=torch.long),
    )


def _dummy_batch(pad_multiple: int, pad_token_id: int) -> ThdBatch:
    T = pad_multiple
    bounds = torch.tensor([0, T], dtype=torch.int32)
    return ThdBatch(
        tokens=torch.full((T,), pad_token_id, dtype=torch.long),
        position_ids=torch.arange(T, dtype=torch.long),
        labels=torch.zeros(T, dtype=torch.long),
        loss_mask=torch.zeros(T, dtype=torch.float32),
        token_weight=torch.zeros(T, dtype=torch.float32),
        advantages=torch.zeros(T, dtype=torch.float32),
        seq_index=torch.full((T,), -1, dtype=torch.long),
        cu_seqlens=bounds.clone(),
        cu_seqlens_padded=bounds.clone(),
        max_seqlen=T,
        sample_ids=torch.zeros(0, dtype=torch.long),
    )


# --------------------------------------------------------------------------------------------------------------
# Plan -> micro-batches
# --------------------------------------------------------------------------------------------------------------


def build_rank_micro_batches(
    rank_plan: Sequence[Sequence[int]],
    token_ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    advantages: Sequence[float] | Tensor,
    token_weights: Sequence[float] | Tensor,
    pad_multiple: int = 1,
    pad_token_id: int = 0,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> list[ThdBatch]:
    """One rank's micro-batches from its part of a plan (``plan[rank]``). ``token_ids``, ``prompt_lengths``,
    ``advantages``, ``token_weights`` and ``loss_masks`` (optional) cover the whole step (indexed by the plan);
    ``sample_ids`` of each batch are those step indices. Empty bins become dummy micro-batches."""
    n = len(token_ids)
    adv = _as_list(advantages, n, "advantages")
    w = _as_list(token_weights, n, "token_weights")
    if len(prompt_lengths) != n:
        raise ValueError(f"prompt_lengths has {len(prompt_lengths)} entries, expected {n}")
    out = []
    for mb in rank_plan:
        for i in mb:
            if not 0 <= i < n:
                raise ValueError(f"plan index {i} outside 0..{n - 1}")
        out.append(
            build_thd_batch(
                [token_ids[i] for i in mb],
                [prompt_lengths[i] for i in mb],
                list(mb),
                [adv[i] for i in mb],
                [w[i] for i in mb],
                pad_multiple=pad_multiple,
                pad_token_id=pad_token_id,
                loss_masks=None if loss_masks is None else [loss_masks[i] for i in mb],
            )
        )
    return out


def build_plan_micro_batches(plan, token_ids, prompt_lengths, advantages, token_weights, pad_multiple=1,
                             pad_token_id=0, loss_masks=None) -> list[list[ThdBatch]]:
    """``[dp_rank][micro_batch] -> ThdBatch`` for a whole plan (tests, benchmarks; a rank only needs its own)."""
    return [
        build_rank_micro_batches(rank, token_ids, prompt_lengths, advantages, token_weights, pad_multiple,
                                 pad_token_id, loss_masks)
        for rank in plan
    ]


# --------------------------------------------------------------------------------------------------------------
# Padded comparison layout
# --------------------------------------------------------------------------------------------------------------


@dataclass
class PaddedBatch:
    """The classic [N, L] layout (right padding), same per-token fields as :class:`ThdBatch`."""

    tokens: Tensor  # long [N, L]
    position_ids: Tensor  # long [N, L]
    labels: Tensor  # long [N, L]
    loss_mask: Tensor  # float [N, L]
    token_weight: Tensor  # float [N, L]
    advantages: Tensor  # float [N, L]
    seq_index: Tensor  # long [N, L], row index on real tokens, -1 on padding
    attention_mask: Tensor  # bool [N, L], True on real tokens
    sample_ids: Tensor  # long [N]

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def flat(self) -> dict[str, Tensor]:
        """Per-token fields flattened to 1-D over N * L positions (the flat layout ``loss_numerator`` takes)."""
        return {
            name: getattr(self, name).reshape(-1)
            for name in ("tokens", "position_ids", "labels", "loss_mask", "token_weight", "advantages", "seq_index")
        }

    def completion_values(self, values: Tensor) -> list[Tensor]:
        """``values[N, L, ...]`` -> per-row tensors at the loss positions."""
        mask = self.loss_mask.to(values.device) > 0
        return [values[i][mask[i]] for i in range(values.shape[0])]


def build_padded_batch(
    token_ids: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    sample_ids: Sequence[int] | Tensor,
    advantages: Sequence[float] | Tensor,
    token_weights: Sequence[float] | Tensor,
    pad_token_id: int = 0,
    max_length: int | None = None,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> PaddedBatch:
    """Right-padded ``[N, L]`` batch, ``L = max_length`` or the longest sequence. Same field rules as THD."""
    sample_list, adv, w = _check_sequences(token_ids, prompt_lengths, sample_ids, advantages, token_weights)
    masks = _check_loss_masks(loss_masks, token_ids, prompt_lengths)
    n = len(token_ids)
    if n == 0:
        raise ValueError("token_ids is empty: a padded batch needs at least one sequence")
    longest = max(len(s) for s in token_ids)
    L = longest if max_length is None else int(max_length)
    if L < longest:
        raise ValueError(f"max_length={max_length} is shorter than the longest sequence ({longest})")
    tokens = torch.full((n, L), pad_token_id, dtype=torch.long)
    labels = torch.zeros(n, L, dtype=torch.long)
    loss_mask = torch.zeros(n, L, dtype=torch.float32)
    token_weight = torch.zeros(n, L, dtype=torch.float32)
    advantage = torch.zeros(n, L, dtype=torch.float32)
    seq_index = torch.full((n, L), -1, dtype=torch.long)
    attention_mask = torch.zeros(n, L, dtype=torch.bool)
    for i, (seq, p) in enumerate(zip(token_ids, prompt_lengths)):
        l = len(seq)
        ids = torch.as_tensor(list(seq), dtype=torch.long)
        tokens[i, :l] = ids
        labels[i, : l - 1] = ids[1:]
        completion = 1.0 if masks is None else torch.tensor(masks[i], dtype=torch.float32)
        loss_mask[i, p - 1 : l - 1] = completion
        token_weight[i, p - 1 : l - 1] = w[i] * completion
        advantage[i, :l] = adv[i]
        seq_index[i, :l] = i
        attention_mask[i, :l] = True
    return PaddedBatch(
        tokens=tokens,
        position_ids=torch.arange(L, dtype=torch.long).expand(n, L).clone(),
        labels=labels,
        loss_mask=loss_mask,
        token_weight=token_weight,
        advantages=advantage,
        seq_index=seq_index,
        attention_mask=attention_mask,
        sample_ids=torch.tensor(sample_list, dtype=torch.long),
    )


def dummy_thd_batch(pad_multiple: int = 1):
    """A zero-weight placeholder micro-batch (``pad_multiple`` padding positions, loss mask 0)."""
    return build_thd_batch([], [], [], [], [], pad_multiple=pad_multiple)


def pad_thd_batch(batch, length: int):
    """``batch`` extended to ``length`` positions: the padding joins the last sequence's padded region
    (``cu_seqlens_padded[-1]``; true lengths unchanged), with loss mask, weights and labels 0 and
    ``seq_index = -1``. Used to give every micro-batch one shape under the interleaved pipeline schedule."""
    extra = int(length) - int(batch.tokens.numel())
    if extra < 0:
        raise ValueError(f"cannot pad a micro-batch of {batch.tokens.numel()} positions to {length}")
    if extra == 0:
        return batch

    def cat(t, value, dtype=None):
        if t is None:
            return None
        return torch.cat([t, torch.full((extra,), value, dtype=dtype or t.dtype, device=t.device)])

    last_pos = int(batch.position_ids[-1]) + 1 if batch.position_ids.numel() else 0
    cu_padded = batch.cu_seqlens_padded.clone()
    cu_padded[-1] += extra
    return dataclasses.replace(
        batch,
        tokens=cat(batch.tokens, 0),
        position_ids=torch.cat([batch.position_ids, torch.arange(last_pos, last_pos + extra,
                                                                 dtype=batch.position_ids.dtype,
                                                                 device=batch.position_ids.device)]),
        labels=cat(batch.labels, 0), loss_mask=cat(batch.loss_mask, 0.0), token_weight=cat(batch.token_weight, 0.0),
        advantages=cat(batch.advantages, 0.0), seq_index=cat(batch.seq_index, -1),
        cu_seqlens_padded=cu_padded,
        max_seqlen=max(int(batch.max_seqlen), int(cu_padded[-1] - cu_padded[-2])),
        old_logprobs=cat(batch.old_logprobs, 0.0), ref_logprobs=cat(batch.ref_logprobs, 0.0),
        rollout_weight=cat(batch.rollout_weight, 0.0),
    )
