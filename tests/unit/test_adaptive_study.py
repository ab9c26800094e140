"""The adaptive-group-sizes study (``benchmarks/adaptive_study.py``): every arm is a valid configuration of the
model's example, the preregistration on disk is the script's protocol, and the dtype field is the one switch."""
import json

import pytest

from benchmarks import adaptive_study as A
from megatron_dppo.config import load_config
from megatron_dppo.run.build import build_loss, build_pruner


@pytest.mark.parametrize("arm", list(A.PROTOCOL["arms"]))
def test_every_arm_is_a_valid_configuration_with_its_pruner(arm):
    overrides = A.arm_overrides(A.PROTOCOL, arm, 1)
    cfg = load_config(A.REPO / A.PROTOCOL["config"], overrides)
    loss_cfg, estimator = build_loss(cfg)
    pruner = build_pruner(cfg, loss_cfg, estimator)
    assert pruner.unbiased
    assert cfg.train.cpu_budget_s == A.PROTOCOL["budget_s"]
    if arm == "allocation_filter":
        assert type(pruner).__name__ == "Adaptive" and estimator == "rloo"


def test_the_committed_preregistration_is_the_scripts_protocol():
    assert json.loads((A.REPO / "docs" / "benchmarks" / "adaptive_prereg.json").read_text()) == A.PROTOCOL


def test_the_dtype_field_adds_an_override_only_off_its_default():
    assert not any(o.startswith("model.dtype") for o in A.arm_overrides(A.PROTOCOL, "filter", 1))
    bf16 = {**A.PROTOCOL, "model_dtype": "bfloat16"}
    assert "model.dtype=bfloat16" in A.arm_overrides(bf16, "filter", 1)
    assert len(A.jobs(A.REPO / "runs" / "x", A.PROTOCOL, [])) == len(A.PROTOCOL["seeds"]) * len(A.PROTOCOL["arms"])
