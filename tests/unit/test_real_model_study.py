"""The real-model study (benchmarks/real_model_study.py) without training: the committed protocol is the script's,
every arm is a valid configuration of the example that differs from the others only in its algo options, and the
endpoints are read at the evaluation after the step that crosses the budget, paired by seed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import real_model_study as R


def test_the_committed_protocol_is_the_scripts():
    path = R.REPO / "docs" / "benchmarks" / "real_model_prereg.json"
    assert json.loads(path.read_text()) == R.PROTOCOL


def test_the_arms_differ_only_in_their_algo_options_and_share_the_budget():
    from megatron_dppo.config import load_config

    cfgs = {arm: load_config(R.CONFIG, R.arm_overrides(arm, 2)) for arm in R.PROTOCOL["arms"]}
    assert {c.train.cpu_budget_s for c in cfgs.values()} == {R.PROTOCOL["budget_s"]}
    assert {c.eval.every_cpu_s for c in cfgs.values()} == {R.PROTOCOL["eval_every_cpu_s"]}
    assert (cfgs["grpo"].algo.pruner, cfgs["grpo"].algo.drop_zero_variance_groups) == ("none", False)
    assert (cfgs["filter"].algo.pruner, cfgs["filter"].algo.drop_zero_variance_groups) == ("none", True)
    assert cfgs["dppo"].algo.pruner == "dppo" and cfgs["dppo"].algo == type(cfgs["dppo"].algo)(pruner="dppo")
    for arm, cfg in cfgs.items():
        for section in ("model", "data", "rollout", "loss", "optim", "train", "eval"):
            assert getattr(cfg, section) == getattr(cfgs["grpo"], section), (arm, section)


def _write_run(path: Path, step_cpu: list[float], evals: dict[int, float]) -> None:
    path.mkdir(parents=True)
    recs = [{"step": s, "phase": "rl", "time/step_cpu": c, "prune/total_kept_fraction": 1.0}
            for s, c in enumerate(step_cpu)]
    recs += [{"step": s, "phase": "eval", R.EVAL_KEY: v} for s, v in evals.items()]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_endpoints_are_read_after_the_step_that_crosses_the_budget(tmp_path):
    protocol = dict(R.PROTOCOL, budget_s=10.0, eval_every_cpu_s=5.0, seeds=[1, 2, 3])
    for i, seed in enumerate(protocol["seeds"]):
        # step CPU 3 s: crosses 5 at step 1 (6 s) and 10 at step 3 (12 s)
        _write_run(tmp_path / f"grpo_s{seed}", [3, 3, 3, 3], {-1: 0.1, 1: 0.2, 3: 0.3 + 0.01 * i})
        _write_run(tmp_path / f"filter_s{seed}", [2, 2, 2, 2, 2], {-1: 0.1, 2: 0.25, 4: 0.4 + 0.01 * i})
        _write_run(tmp_path / f"dppo_s{seed}", [1] * 10, {-1: 0.1, 4: 0.3, 9: 0.5 - 0.02 * i})
    run = R.summarize_run(tmp_path / "grpo_s1", protocol)
    assert (run["base"], run["mid"], run["final"], run["final_cpu_s"], run["steps"]) == (0.1, 0.2, 0.3, 12.0, 4)
    rep = R.analyse(tmp_path, protocol)
    assert rep["arms"]["filter"]["final"]["mean"] == pytest.approx(0.41)
    t = rep["tests"]["dppo-grpo:final"]
    assert t["mean"] == pytest.approx((0.5 + 0.48 + 0.46) / 3 - (0.30 + 0.31 + 0.32) / 3)
    assert t["n"] == 3 and t["lo"] < t["mean"] < t["hi"]
    assert all(0 <= rep["tests"][f"{a}-{b}:final"]["p_holm"] <= 1 for a, b in protocol["comparisons"])
    assert "dppo - filter" in R.markdown(rep)
    assert R.plot(rep, tmp_path / "study.png").stat().st_size > 0
