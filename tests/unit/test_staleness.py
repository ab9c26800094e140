"""The staleness bound (megatron_dppo/dist/staleness.py) and the placement options' validation (config.py)."""

import pytest

from pathlib import Path

from megatron_dppo.config import Config, load_config
from megatron_dppo.dist.placement import Roles, roles
from megatron_dppo.dist.staleness import StalenessExceeded, StalenessGate

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_gate_admits_exactly_the_versions_t_minus_k_to_t(k):
    for step in range(6):
        gate = StalenessGate(k)
        assert gate.min_version(step) == max(0, step - k)
        for version in range(-1, step + 3):
            if max(0, step - k) <= version <= step:
                assert gate.admit(step, version) == step - version
            else:
                with pytest.raises(StalenessExceeded, match=f"train.max_staleness={k}"):
                    gate.admit(step, version)
        assert gate.max_seen <= k


@pytest.mark.parametrize("k", [0, 1, 2])
def test_fixed_gate_admits_only_version_t_minus_k(k):
    for step in range(6):
        gate = StalenessGate(k, fixed=True)
        for version in range(-1, step + 3):
            if version == max(0, step - k):
                assert gate.admit(step, version) == step - version
            else:
                with pytest.raises(StalenessExceeded, match=f"needs exactly version {max(0, step - k)}"
                                   if max(0, step - k) <= version <= step else "train.max_staleness"):
                    gate.admit(step, version)


def test_fixed_gate_after_a_resume_without_in_flight_batches_starts_from_the_restored_version():
    gate = StalenessGate(2, fixed=True)
    gate.floor = 5  # resumed at RL step 5: versions 3 and 4 are gone
    assert [gate.fixed_version(t) for t in range(5, 9)] == [5, 5, 5, 6]
    assert gate.admit(5, 3) == 2  # an in-flight batch from the checkpoint, with its own version
    assert gate.admit(6, 5) == 1  # a batch regenerated from the restored version
    with pytest.raises(StalenessExceeded, match="needs exactly version 6"):
        gate.admit(8, 7)


def test_gate_refuses_a_bad_bound():
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0, got -1"):
        StalenessGate(-1)


def test_staleness_zero_waits_for_the_weights_of_the_previous_step():
    """k = 0: batch t needs version t, which exists only after step t - 1 trained (the synchronous loop)."""
    gate = StalenessGate(0)
    assert [gate.min_version(t) for t in range(4)] == [0, 1, 2, 3]


def _config(**overrides) -> Config:
    cfg = load_config(REPO / "examples" / "quickstart.yaml")
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def test_colocated_refuses_staleness():
    with pytest.raises(ValueError, match=r"train.max_staleness=1 is invalid: expected 0 with rollout.placement="
                                         r"colocated"):
        _config(train__max_staleness=1).validate()


def test_separate_vllm_workers_form_workers_over_tp_engines_and_refuse_a_tp_that_cannot_split_the_heads(tmp_path):
    """The rollout workers form rollout.workers / rollout.tp vLLM engines (docs/async.md, "vLLM rollout workers"):
    3 workers at rollout.tp=1 are 3 engines of TP 1 whatever the heads; at rollout.tp=3 one engine cannot split
    4 attention heads over its 3 ranks, refused by name before vLLM is imported."""
    from megatron_dppo.run.build import build_rollout, rollout_tensor_parallel

    hf_config = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 64}
    cfg = _config(rollout__placement="separate", train__max_staleness=1, rollout__engine="vllm", rollout__workers=3,
                  train__output_dir=str(tmp_path))
    cfg.validate()
    assert rollout_tensor_parallel(cfg) == 1
    cfg.rollout.tp = 3
    cfg.validate()
    assert rollout_tensor_parallel(cfg) == 3
    with pytest.raises(ValueError, match=r"rollout.tp=3 with rollout.engine=vllm: .* the 4 attention heads among "
                                         r"its 3 ranks; use a rollout.tp that divides 4 and rollout.workers=3"):
        build_rollout(cfg, hf_config, None, tokenizer=None)


def test_separate_with_staleness_validates():
    _config(rollout__placement="separate", train__max_staleness=2, eval__every=0).validate()


def test_separate_evaluates_and_refills_on_the_workers():
    """eval.every and dynamic sampling run on the rollout workers (tests/e2e/test_async_run.py runs both)."""
    cfg = _config(rollout__placement="separate", train__max_staleness=1, eval__every=5,
                  dynamic_sampling__enable=True)
    cfg.algo.pruner = "none"
    cfg.validate()


def test_roles_from_the_launch():
    cfg = _config(rollout__workers=2)
    env = {"RANK": "3", "WORLD_SIZE": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    r = roles(cfg, env)
    assert r == Roles(3, 3, 2) and r.is_worker and r.side_rank == 0
    assert r.describe(1) == "rollout worker 1 (job rank 4)"
    with pytest.raises(ValueError, match="rollout.workers=2 with a job of 2 processes leaves no trainer"):
        roles(cfg, {**env, "RANK": "0", "WORLD_SIZE": "2"})
