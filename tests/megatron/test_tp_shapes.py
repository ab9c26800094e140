"""Shapes Megatron-Core supports that a naive TP split refuses: fewer KV heads than TP ranks (Megatron-Core
all-gathers the fused q/k/v rows over TP and each rank takes its group's slice: no copies of the KV weights to
keep tied) and a vocabulary TP does not divide (padded, the padding logits masked). Proved like every layout: TP2
loaded from the TP1 checkpoint gives the same log-probs, loss, gradient norm and updated weights as TP1."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _engine_fixtures as F
from _dist import run_distributed, single_process_world

# tiny_arch has 4 query heads; here ONE KV head (< tp=2) and 257 vocabulary rows (odd: 384 at TP2, zero-padded)
ODD = dict(num_kv_heads=1, vocab_size=257)


@pytest.fixture(scope="module")
def odd_tp1_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("odd_tp1")
    with single_process_world(seed=F.SEED):
        result = F.layout_worker(str(root), save=True, arch_changes=ODD)
    return root, result


def test_padding_logits_are_masked_to_zero_probability():
    from megatron_dppo.megatron.logprobs import mask_vocab_padding, vocab_parallel_logprobs

    with single_process_world(seed=F.SEED):
        logits = torch.randn(5, 8, requires_grad=True)
        masked = mask_vocab_padding(logits, vocab_size=6)  # rows 6, 7 are padding
        labels = torch.tensor([0, 5, 3, 1, 2])
        logp, entropy = vocab_parallel_logprobs(masked, labels, entropy_grad=True)
        expected = torch.log_softmax(logits[:, :6], dim=-1)
        torch.testing.assert_close(logp, expected.gather(1, labels[:, None]).squeeze(1))
        torch.testing.assert_close(entropy, -(expected.exp() * expected).sum(-1))
        (logp.sum() + entropy.sum()).backward()
        assert torch.isfinite(logits.grad).all() and (logits.grad[:, 6:] == 0).all()
        assert mask_vocab_padding(logits, vocab_size=8) is logits and mask_vocab_padding(logits, None) is logits


@pytest.mark.slow
@pytest.mark.multiproc
def test_tp2_with_one_kv_head_and_padded_vocabulary_equals_tp1(odd_tp1_reference):
    from test_train_step import _assert_same_step

    root, ref = odd_tp1_reference
    results = run_distributed(F.layout_worker, 2, args=(str(root),), kwargs=dict(tp=2, arch_changes=ODD),
                              timeout=420)
    for res in results:
        _assert_same_step(ref, res)
