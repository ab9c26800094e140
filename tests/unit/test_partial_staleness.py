"""Partial rollouts (rollout.max_interruptions) on the trainer's side: the staleness bound counts per token, the
options' validation, and rollout.mask_offpolicy's loss masks."""

from pathlib import Path

import pytest
import torch

from megatron_dppo.config import Config, load_config
from megatron_dppo.distributed.placement import batch_token_versions
from megatron_dppo.distributed.staleness import StalenessExceeded, StalenessGate
from megatron_dppo.train.rollouts import Rollout

REPO = Path(__file__).resolve().parents[2]


def _config(**overrides) -> Config:
    cfg = load_config(REPO / "examples" / "quickstart.yaml")
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def _rollout(versions, mask=False):
    return Rollout(prompts=[None] * len(versions), completions=[[[7] * len(v) for v in g] for g in versions],
                   texts=[["" for _ in g] for g in versions],
                   behaviour_logprobs=[[[-1.0] * len(v) for v in g] for g in versions],
                   truncated=[[False for _ in g] for g in versions], token_versions=versions, mask_offpolicy=mask)


class _Batch:
    def __init__(self, versions):
        self.rollout = _rollout(versions)


def test_the_bound_counts_every_token():
    """k = 1, step 5: tokens of versions 4..5 are admitted; one token of version 3 fails the batch, though the
    samples' LAST versions (5) are all within the bound (a per-sample count by the newest token would admit it)."""
    gate = StalenessGate(1)
    assert gate.admit(5, 4, batch_token_versions(_Batch([[[4, 4, 5], [4]], [[4, 5, 5], [4, 4]]]))) == 1
    with pytest.raises(StalenessExceeded, match=r"tokens of weight versions 3..5; .* allows versions 4..5 for "
                                                r"every token"):
        gate.admit(5, 3, batch_token_versions(_Batch([[[3, 4, 5]], [[4, 5]]])))
    with pytest.raises(StalenessExceeded, match="must be the oldest"):  # the stamp hides an older token
        gate.admit(5, 4, batch_token_versions(_Batch([[[3, 5]]])))
    with pytest.raises(StalenessExceeded):  # a token newer than the trained step cannot exist
        gate.admit(5, 5, batch_token_versions(_Batch([[[5, 6]]])))
    assert gate.admitted == [(5, 4)]


def test_whole_batches_have_no_token_versions():
    class Plain:
        rollout = _rollout([[[1, 1]]])
    Plain.rollout.token_versions = None
    assert batch_token_versions(Plain()) is None and StalenessGate(1).admit(2, 1, None) == 1


def test_mask_offpolicy_trains_only_the_last_segment_of_each_sample():
    versions = [[[0, 0, 1, 1], [0, 0]], [[1, 1, 1], [0, 1, 2]]]
    assert _rollout(versions).loss_masks is None  # off: every token trained (each corrected by its own pi_behav)
    assert _rollout(versions, mask=True).loss_masks == [[[0, 0, 1, 1], [1, 1]], [[1, 1, 1], [0, 0, 1]]]
    assert torch.equal(_rollout(versions, mask=True).lengths(), torch.tensor([[4.0, 2.0], [3.0, 3.0]],
                                                                          dtype=torch.float64))


def test_partial_rollouts_validate_only_where_a_version_can_arrive_mid_batch():
    ok = dict(rollout__placement="separate", train__max_staleness=1, rollout__max_interruptions=2)
    _config(**ok).validate()
    _config(**ok, rollout__mask_offpolicy=True).validate()
    for extra, message in [(dict(train__max_staleness=0), r"train.max_staleness=0 is invalid: expected >= 1"),
                           (dict(train__staleness_mode="fixed"), r"train.staleness_mode='?fixed'? is invalid"),
                           (dict(rollout__placement="colocated", train__max_staleness=0),
                            r"rollout.max_interruptions=2 is invalid: expected 0 with rollout.placement=colocated"),
                           (dict(dynamic_sampling__enable=True), r"0 with dynamic_sampling.enable"),
                           (dict(rollout__engine="vllm", rollout__workers=2, rollout__tp=2),
                            r"rollout.tp=2 is invalid: expected 1 with rollout.max_interruptions")]:
        cfg = _config(**{**ok, **extra})
        if extra.get("dynamic_sampling__enable"):
            cfg.algo.pruner = "none"
        with pytest.raises(ValueError, match=message):
            cfg.validate()
    with pytest.raises(ValueError, match=r"rollout.max_interruptions=-1 is invalid"):
        _config(**{**ok, "rollout__max_interruptions": -1}).validate()


def test_partial_metrics_count_tokens_samples_and_offpolicy_segments():
    from megatron_dppo.rollout.partial import partial_metrics

    m = partial_metrics([[[4, 4, 5], [5]], [[4, 4, 4, 4]]], step=5)  # 8 tokens: six of version 4, two of 5
    assert m["async/token_staleness"] == (2 * 1 + 0 + 0 + 4 * 1) / 8
    assert m["async/interrupted_samples"] == 1 / 3
    assert m["async/offpolicy_tokens"] == 2 / 8  # the two version-4 tokens before the sample's version 5
