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


def _write_run(path, step_cpu, evals, generated=64.0, trained=32.0):
    path.mkdir(parents=True)
    recs = [{"step": s, "phase": "rl", "time/step_cpu": c, "tokens/generated": generated,
             "tokens/trained_completion": trained, "tokens/trained_sequences": 8.0}
            for s, c in enumerate(step_cpu)]
    recs += [{"step": s, "phase": "eval", A.EVAL_KEY: v} for s, v in evals.items()]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_the_report_reads_the_budget_endpoint_and_holm_names_a_planted_winner(tmp_path):
    """Synthetic runs: 4 steps of 3 CPU s against a budget of 10 s, evaluations before RL, after step 1 and after
    step 3 (the step that crosses the budget). The allocation arm is planted 0.1 above the filter on every seed
    (with seed noise), completion-level DPPO equal to it, GRPO 0.05 below with noise: Holm must call the first a
    win and leave the second undecided; time to the level is read off the linear curve."""
    protocol = dict(A.PROTOCOL, budget_s=10.0, eval_every_cpu_s=5.0, level=0.3)
    noise = {1: 0.0, 2: 0.01, 3: -0.01, 4: 0.02, 5: -0.02}
    shift = {"filter": 0.0, "filter_rloo": 0.0, "completion_dppo_filter": 0.0, "allocation_filter": 0.1,
             "grpo": -0.05}
    for arm in protocol["arms"]:
        for seed in protocol["seeds"]:
            jitter = noise[seed] if arm in ("allocation_filter", "grpo") else 0.0
            final = 0.35 + shift[arm] + jitter
            _write_run(tmp_path / f"{arm}_s{seed}", [3, 3, 3, 3], {-1: 0.1, 1: 0.2, 3: final})
    run = A.summarize_run(tmp_path / "filter_s1", protocol)
    assert (run["base"], run["final"], run["final_cpu_s"], run["steps"]) == (0.1, 0.35, 12.0, 4)
    assert run["time_to_level"] == pytest.approx(6.0 + 6.0 * (0.3 - 0.2) / (0.35 - 0.2)) and not run["censored"]
    assert run["generated_tokens_per_step"] == 64.0
    rep = A.analyse(tmp_path, protocol)
    assert rep["tests"]["allocation_filter-filter"]["mean"] == pytest.approx(0.1)
    assert rep["tests"]["allocation_filter-filter"]["verdict"] == "wins"
    assert rep["tests"]["completion_dppo_filter-filter"]["verdict"] == "no difference shown"
    assert rep["tests"]["grpo-filter"]["p_holm"] >= rep["tests"]["grpo-filter"]["p"]
    assert rep["tests"]["allocation_filter-filter"]["time_to_level_ratio"]["geo_mean"] < 1.0  # reaches 0.3 sooner
    assert "p_holm" not in rep["tests"]["filter_rloo-filter"]  # secondary: unadjusted


def test_the_report_refuses_while_runs_are_unfinished(tmp_path):
    args = A.SR.study_arguments(A.__doc__, tmp_path / "work", A.REPO / "docs" / "benchmarks" / "adaptive_prereg.json",
                                tmp_path / "archive").parse_args(["--report"])
    with pytest.raises(SystemExit, match="25 of 25 runs are not finished"):
        A.SR.run_study(args, A.PROTOCOL, A.jobs, lambda protocol, out: None)


def test_the_gpu_projection_reads_the_report(tmp_path):
    """gpu_projection.py --study on a report of synthetic runs: an arm that generates half of GRPO's tokens and
    trains as many, at the same steps to the level, is projected at (s/2 + 1 - s) of the filter's time for a
    generation share s, while on the CPU it was at par; a censored arm is flagged in the table."""
    from benchmarks import gpu_projection as G

    protocol = dict(A.PROTOCOL, budget_s=10.0, eval_every_cpu_s=5.0, level=0.3)
    for arm in protocol["arms"]:
        for seed in protocol["seeds"]:
            final = 0.25 if arm == "grpo" else 0.35  # GRPO never reaches 0.3: censored at its 12 CPU s
            _write_run(tmp_path / "work" / f"{arm}_s{seed}", [3, 3, 3, 3], {-1: 0.1, 1: 0.2, 3: final},
                       generated=32.0 if arm == "allocation_filter" else 64.0)
    report = tmp_path / "report.json"
    A.write_json(report, A.analyse(tmp_path / "work", protocol))
    out = tmp_path / "projection.json"
    assert G.main(["--study", str(report), "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    rows = {(r["arm"], r["generation_share"]): r for r in rep["rows"]}
    for s in G.SHARES:
        alloc = rows[("allocation_filter", s)]
        assert alloc["g"] == pytest.approx(0.5) and alloc["cpu_ratio_to_filter"] == pytest.approx(1.0)
        assert alloc["gpu_ratio_to_filter"] == pytest.approx(s / 2 + 1 - s)
    assert rep["arms"]["grpo"]["censored_runs"] == 5
    assert "(5 censored)" in G.markdown(rep)
