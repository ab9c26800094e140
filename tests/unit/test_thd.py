"""THD micro-batch fields (docs/algorithms.md packing step 3) on hand-computed cases, and loss equivalence between
the packed THD layout, the padded [N, L] layout and a per-sequence reference."""

import random

import pytest
import torch

from megatron_dppo.packing import (
    ThdBatch,
    build_padded_batch,
    build_plan_micro_batches,
    build_thd_batch,
    pack_sequences,
    thd_pad_multiple,
)
from megatron_dppo.packing.thd import build_rank_micro_batches

A = [11, 12, 13, 14, 15]  # prompt 11 12 | completion 13 14 15
B = [21, 22, 23]  # prompt 21 | completion 22 23


def test_pad_multiple_rules():
    assert thd_pad_multiple(1, 1, False) == 1
    assert thd_pad_multiple(4, 1, False) == 1
    assert thd_pad_multiple(4, 1, True) == 4
    assert thd_pad_multiple(2, 2, True) == 8
    assert thd_pad_multiple(2, 2, False) == 8
    assert thd_pad_multiple(1, 4, False) == 8
    with pytest.raises(ValueError, match="tp=0"):
        thd_pad_multiple(0, 1, True)
    with pytest.raises(ValueError, match="cp=0"):
        thd_pad_multiple(1, 0, False)


def test_fields_by_hand_with_padding():
    b = build_thd_batch([A, B], [2, 1], [7, 3], [1.5, -1.0], [0.5, 2.0], pad_multiple=4, pad_token_id=99)
    # lengths 5, 3 -> padded 8, 4; T = 12
    assert b.tokens.tolist() == [11, 12, 13, 14, 15, 99, 99, 99, 21, 22, 23, 99]
    assert b.cu_seqlens.tolist() == [0, 5, 8]
    assert b.cu_seqlens_padded.tolist() == [0, 8, 12]
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens_padded.dtype == torch.int32
    assert b.max_seqlen == 8
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert b.labels.tolist() == [12, 13, 14, 15, 0, 0, 0, 0, 22, 23, 0, 0]
    # A: positions 1..3 predict completion tokens 13 14 15; B: positions 0..1 predict 22 23.
    assert b.loss_mask.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0]
    assert b.token_weight.tolist() == [0, 0.5, 0.5, 0.5, 0, 0, 0, 0, 2.0, 2.0, 0, 0]
    assert b.advantages.tolist() == [1.5] * 5 + [0] * 3 + [-1.0] * 3 + [0]
    assert b.seq_index.tolist() == [0, 0, 0, 0, 0, -1, -1, -1, 1, 1, 1, -1]
    assert b.sample_ids.tolist() == [7, 3]
    assert b.num_tokens == 8 and b.num_sequences == 2 and not b.is_dummy
    assert b.seq_lengths.tolist() == [5, 3]
    assert b.old_logprobs is None and b.ref_logprobs is None
    per_seq = b.completion_values(torch.arange(12))
    assert [v.tolist() for v in per_seq] == [[1, 2, 3], [8, 9]]
    # the labels at the loss positions are exactly the completion tokens
    assert [b.labels[b.loss_mask > 0][:3].tolist(), b.labels[b.loss_mask > 0][3:].tolist()] == [[13, 14, 15], [22, 23]]


def test_no_padding_makes_cu_seqlens_equal():
    b = build_thd_batch([A, B], [2, 1], [0, 1], [0.0, 0.0], [1.0, 1.0])
    assert b.cu_seqlens.tolist() == b.cu_seqlens_padded.tolist() == [0, 5, 8]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert b.labels.tolist() == [12, 13, 14, 15, 0, 22, 23, 0]  # never the next sequence's first token
    assert b.max_seqlen == 5


def test_prompt_only_sequence_has_no_loss_positions():
    b = build_thd_batch([[1, 2, 3]], [3], [0], [1.0], [1.0])
    assert b.loss_mask.sum() == 0 and b.token_weight.sum() == 0
    assert [v.numel() for v in b.completion_values(torch.zeros(3))] == [0]


def test_dummy_batch_for_empty_bin():
    b = build_thd_batch([], [], [], [], [], pad_multiple=4, pad_token_id=5)
    assert b.is_dummy and b.num_tokens == 0 and b.num_sequences == 0
    assert b.tokens.tolist() == [5, 5, 5, 5]
    assert b.cu_seqlens.tolist() == b.cu_seqlens_padded.tolist() == [0, 4] and b.max_seqlen == 4
    assert b.loss_mask.sum() == 0 and b.token_weight.sum() == 0 and (b.seq_index == -1).all()
    assert b.completion_values(torch.ones(4)) == []
    # plan with an empty bin -> one dummy per empty bin, same micro-batch count on every rank
    plan = pack_sequences([5, 3], capacity=8, dp_size=4)
    batches = build_plan_micro_batches(plan, [[1] * 5, [2] * 3], [1, 1], [0.0, 0.0], [1.0, 1.0])
    assert [len(r) for r in batches] == [1, 1, 1, 1]
    assert sum(mb.is_dummy for r in batches for mb in r) == 2


def test_to_device_keeps_everything():
    b = build_thd_batch([A, B], [2, 1], [7, 3], [1.5, -1.0], [0.5, 2.0], pad_multiple=2)
    b.old_logprobs = torch.randn(b.tokens.numel())
    c = b.to("cpu")
    assert isinstance(c, ThdBatch) and c.max_seqlen == b.max_seqlen
    assert torch.equal(c.old_logprobs, b.old_logprobs) and c.ref_logprobs is None
    assert torch.equal(c.cu_seqlens_padded, b.cu_seqlens_padded)


def test_errors_are_clear():
    with pytest.raises(ValueError, match=r"prompt_lengths\[0\]=0"):
        build_thd_batch([A], [0], [0], [0.0], [1.0])
    with pytest.raises(ValueError, match=r"prompt_lengths\[1\]=4 must be in \[1, 3\]"):
        build_thd_batch([A, B], [1, 4], [0, 1], [0.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="advantages has 1 entries"):
        build_thd_batch([A, B], [1, 1], [0, 1], [0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="sample_ids has 3 entries"):
        build_thd_batch([A, B], [1, 1], [0, 1, 2], [0.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        build_thd_batch([A, []], [1, 1], [0, 1], [0.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="pad_multiple=0"):
        build_thd_batch([A], [1], [0], [0.0], [1.0], pad_multiple=0)
    with pytest.raises(ValueError, match="max_length=3"):
        build_padded_batch([A], [1], [0], [0.0], [1.0], max_length=3)
    b = build_thd_batch([A], [1], [0], [0.0], [1.0])
    with pytest.raises(ValueError, match="values has 4 positions"):
        b.completion_values(torch.zeros(4))


def test_padded_layout_by_hand():
    p = build_padded_batch([A, B], [2, 1], [7, 3], [1.5, -1.0], [0.5, 2.0])
    assert p.tokens.tolist() == [A, B + [0, 0]]
    assert p.labels.tolist() == [[12, 13, 14, 15, 0], [22, 23, 0, 0, 0]]
    assert p.loss_mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert p.seq_index.tolist() == [[0] * 5, [1, 1, 1, -1, -1]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert p.num_tokens == 8


# ---------------------------------------------------------------------------------------------------------------
# Loss equivalence: THD == padded == per-sequence reference
# ---------------------------------------------------------------------------------------------------------------

VOCAB = 37
MAX_POS = 512


class ToyCausalModel:
    """logits[t] = E[token[t]] + P[position[t]]: depends on the token AND its RoPE-like position, so a wrong
    position id, a label from the wrong sequence or a shifted mask all change the loss."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.E = torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
        self.P = torch.randn(MAX_POS, VOCAB, generator=g, dtype=torch.float64)

    def logprobs(self, tokens, position_ids, labels):
        logits = self.E[tokens] + self.P[position_ids]
        return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def weighted_sum(model, tokens, position_ids, labels, loss_mask, token_weight, advantages):
    """sum_t w_t * mask_t * (-A_t * logp_t): the shape of every policy-gradient numerator."""
    logp = model.logprobs(tokens, position_ids, labels)
    return (token_weight.double() * loss_mask.double() * (-advantages.double() * logp)).sum()


def random_samples(seed, n):
    rng = random.Random(seed)
    seqs, prompts = [], []
    for _ in range(n):
        p = rng.randint(1, 20)
        c = rng.randint(0, 60)
        seqs.append([rng.randrange(1, VOCAB) for _ in range(p + c)])
        prompts.append(p)
    # float32-representable, since the batches store weights and advantages as float32
    adv = torch.tensor([rng.gauss(0, 1) for _ in range(n)], dtype=torch.float32).tolist()
    w = torch.tensor([rng.uniform(0.1, 2.0) for _ in range(n)], dtype=torch.float32).tolist()
    return seqs, prompts, adv, w


def reference_loss(model, seqs, prompts, adv, w):
    total = torch.zeros((), dtype=torch.float64)
    for s, p, a, wi in zip(seqs, prompts, adv, w):
        t = torch.tensor(s)
        pos = torch.arange(len(s) - 1)
        logp = model.logprobs(t[:-1], pos, t[1:])  # position j predicts token j + 1
        total += (wi * -a * logp[p - 1 :]).sum()  # only predictions of completion tokens
    return total


@pytest.mark.parametrize("pad_multiple", [1, 4, 8])
@pytest.mark.parametrize("dp", [1, 3])
def test_loss_identical_in_thd_padded_and_reference(pad_multiple, dp):
    model = ToyCausalModel(seed=pad_multiple)
    seqs, prompts, adv, w = random_samples(seed=10 * pad_multiple + dp, n=23)
    ref = reference_loss(model, seqs, prompts, adv, w)

    padded = build_padded_batch(seqs, prompts, list(range(len(seqs))), adv, w).flat()
    padded_loss = weighted_sum(model, padded["tokens"], padded["position_ids"], padded["labels"],
                               padded["loss_mask"], padded["token_weight"], padded["advantages"])

    lengths = [len(s) for s in seqs]
    plan = pack_sequences(lengths, capacity=160, dp_size=dp, pad_multiple=pad_multiple)
    batches = build_plan_micro_batches(plan, seqs, prompts, adv, w, pad_multiple=pad_multiple)
    assert sum(len(r) for r in batches) > dp  # several micro-batches per rank: a real packing
    thd_loss = sum(weighted_sum(model, b.tokens, b.position_ids, b.labels, b.loss_mask, b.token_weight,
                                b.advantages) for r in batches for b in r)
    for r in batches:
        for b in r:
            assert b.tokens.numel() <= 160 and b.tokens.numel() % pad_multiple == 0

    torch.testing.assert_close(padded_loss, ref, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(thd_loss, ref, rtol=1e-12, atol=1e-10)

    # The same check catches a layout bug: positions that do not restart per sequence change the loss.
    broken = sum(weighted_sum(model, b.tokens, torch.arange(b.tokens.numel()), b.labels, b.loss_mask,
                              b.token_weight, b.advantages) for r in batches for b in r)
    assert not torch.allclose(broken, ref)


def test_completion_values_match_between_layouts():
    model = ToyCausalModel(seed=3)
    seqs, prompts, adv, w = random_samples(seed=4, n=15)
    padded = build_padded_batch(seqs, prompts, list(range(len(seqs))), adv, w)
    per_seq_padded = padded.completion_values(model.logprobs(padded.tokens, padded.position_ids, padded.labels))
    plan = pack_sequences([len(s) for s in seqs], capacity=128, dp_size=2, pad_multiple=4)
    found = {}
    for rank_batches in build_plan_micro_batches(plan, seqs, prompts, adv, w, pad_multiple=4):
        for b in rank_batches:
            values = b.completion_values(model.logprobs(b.tokens, b.position_ids, b.labels))
            for sid, v in zip(b.sample_ids.tolist(), values):
                found[sid] = v
    assert sorted(found) == list(range(len(seqs)))
    for sid, v in found.items():
        assert v.numel() == len(seqs[sid]) - prompts[sid]
        torch.testing.assert_close(v, per_seq_padded[sid])


def test_labels_never_cross_sequences():
    seqs, prompts, adv, w = random_samples(seed=9, n=40)
    plan = pack_sequences([len(s) for s in seqs], capacity=200, dp_size=1, pad_multiple=2)
    for b in build_rank_micro_batches(plan[0], seqs, prompts, adv, w, pad_multiple=2):
        on = (b.loss_mask > 0).nonzero().squeeze(-1)
        assert (b.seq_index[on] >= 0).all() and (b.seq_index[on + 1] == b.seq_index[on]).all()
        assert torch.equal(b.labels[on], b.tokens[on + 1])
        assert (b.token_weight[b.loss_mask == 0] == 0).all()
        ends = b.cu_seqlens_padded[:-1].long() + b.seq_lengths - 1  # last real token of each sequence
        assert (b.labels[ends] == 0).all() and (b.loss_mask[ends] == 0).all()
        assert int(b.loss_mask.sum()) == sum(len(seqs[i]) - prompts[i] for i in b.sample_ids.tolist())
