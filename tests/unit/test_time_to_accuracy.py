"""The preregistered time-to-accuracy study (benchmarks/time_to_accuracy.py, benchmarks/_tta_stats.py): its
statistics on synthetic data (no training): smoothing and interpolation, censoring, paired ratio intervals,
Student-t p-values, Holm, the endpoints, and the preregistration's refusals."""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import _tta_stats as S
from benchmarks import time_to_accuracy as T


# ----------------------------------------------------------------------------------------------------------
# Student t
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("t, df, p", [(2.262, 9, 0.05), (12.706, 1, 0.05), (2.228, 10, 0.05), (3.250, 9, 0.01),
                                      (1.96, 10**7, 0.05), (0.0, 5, 1.0)])
def test_two_sided_p_matches_tables(t, df, p):
    assert S.t_two_sided_p(t, df) == pytest.approx(p, abs=2e-4)
    assert S.t_two_sided_p(-t, df) == pytest.approx(p, abs=2e-4)


def test_cdf_and_quantile_are_inverse_and_symmetric():
    assert S.t_cdf(-2.0, 3) == pytest.approx(0.069662, abs=1e-6)
    assert S.t_cdf(0.0, 7) == pytest.approx(0.5)
    for df in (1, 2, 5, 9, 30):
        for p in (0.6, 0.9, 0.975, 0.999):
            q = S.t_quantile(p, df)
            assert S.t_cdf(q, df) == pytest.approx(p, abs=1e-9)
            assert S.t_quantile(1 - p, df) == pytest.approx(-q, abs=1e-8)
    assert S.t_quantile(0.975, 9) == pytest.approx(2.262157, abs=1e-5)


def test_betainc_known_values():
    assert S.betainc(1.0, 1.0, 0.3) == pytest.approx(0.3)  # uniform
    assert S.betainc(2.0, 3.0, 0.4) == pytest.approx(0.5248)  # 1 - sum of binomial terms
    assert S.betainc(0.5, 0.5, 0.5) == pytest.approx(0.5)


# ----------------------------------------------------------------------------------------------------------
# Curves
# ----------------------------------------------------------------------------------------------------------
def test_running_mean_averages_what_exists_then_three():
    assert S.running_mean([0.0, 0.3, 0.6, 0.9, 0.0]) == pytest.approx([0.0, 0.15, 0.3, 0.6, 0.5])


def test_interpolation_linear_between_points_and_held_outside():
    ts, ys = [0.0, 10.0, 30.0], [0.0, 1.0, 0.0]
    assert S.interp(ts, ys, 5.0) == pytest.approx(0.5)
    assert S.interp(ts, ys, 20.0) == pytest.approx(0.5)
    assert S.interp(ts, ys, 10.0) == pytest.approx(1.0)
    assert S.interp(ts, ys, 99.0) == 0.0 and S.interp(ts, ys, -1.0) == 0.0


def test_gain_curve_is_smoothed_minus_pre():
    c = S.gain_curve([0, 1, 2, 3], [0.2, 0.5, 0.8, 0.8])
    assert c["smoothed"] == pytest.approx([0.2, 0.35, 0.5, 0.7])
    assert c["gain"] == pytest.approx([0.0, 0.15, 0.3, 0.5])
    assert c["final"] == pytest.approx(0.7) and c["final_gain"] == pytest.approx(0.5)


def test_first_crossing_interpolates_in_time():
    ts, ys = [0.0, 10.0, 20.0], [0.0, 0.1, 0.3]
    assert S.first_crossing(ts, ys, 0.2) == pytest.approx(15.0)
    assert S.first_crossing(ts, ys, 0.1) == pytest.approx(10.0)
    assert S.first_crossing(ts, ys, 0.0) == 0.0
    assert S.first_crossing(ts, ys, 0.31) is None
    # a dip after crossing does not matter: the FIRST time counts
    assert S.first_crossing([0, 1, 2, 3], [0, 0.5, 0.1, 0.6], 0.4) == pytest.approx(0.8)


def test_a_run_that_never_reaches_the_target_is_censored_at_its_total_time():
    assert S.time_to_target([0, 10, 20], [0.0, 0.05, 0.08], 0.1, total=21.5) == (21.5, True)
    t, censored = S.time_to_target([0, 10, 20], [0.0, 0.05, 0.15], 0.1, total=21.5)
    assert t == pytest.approx(15.0) and censored is False


def test_area_mean_of_piecewise_linear_curve():
    ts, ys = [0.0, 10.0, 20.0], [0.0, 1.0, 1.0]
    assert S.area_mean(ts, ys, 10.0) == pytest.approx(0.5)
    assert S.area_mean(ts, ys, 20.0) == pytest.approx(0.75)
    assert S.area_mean(ts, ys, 5.0) == pytest.approx(0.25)
    assert S.area_mean(ts, ys, 40.0) == pytest.approx((5 + 10 + 20) / 40)  # held at 1 after the run's end


def test_interval_means_use_the_steps_of_each_eval_interval():
    values = list(range(10))  # value of RL step s = s
    assert S.interval_means(values, [0, 5, 10]) == pytest.approx([2.0, 7.0])


# ----------------------------------------------------------------------------------------------------------
# Tests over seeds
# ----------------------------------------------------------------------------------------------------------
def test_paired_ratio_ci_on_synthetic_data():
    base = [100.0, 120.0, 90.0, 110.0, 105.0, 95.0, 130.0, 85.0, 100.0, 115.0]
    factors = [0.5, 0.6, 0.55, 0.45, 0.5, 0.65, 0.5, 0.55, 0.4, 0.6]
    r = S.ratio_test([b * f for b, f in zip(base, factors)], base)
    logs = [math.log(f) for f in factors]
    m, se = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(10)
    assert r["n"] == 10
    assert r["geo_mean"] == pytest.approx(math.exp(m))
    assert r["lo"] == pytest.approx(math.exp(m - 2.262157 * se), rel=1e-5)
    assert r["hi"] == pytest.approx(math.exp(m + 2.262157 * se), rel=1e-5)
    assert r["p"] < 1e-6  # every seed about twice as fast
    # an exact constant ratio: zero-width interval; the null ratio 1: p = 1
    c = S.ratio_test([2.0, 4.0, 6.0], [4.0, 8.0, 12.0])
    assert (c["geo_mean"], c["lo"], c["hi"]) == pytest.approx((0.5, 0.5, 0.5))
    assert S.ratio_test([1.0, 2.0], [1.0, 2.0])["p"] == 1.0
    # non-positive / missing pairs are left out, and counted
    assert S.ratio_test([1.0, 0.0, None, 2.0], [1.0, 1.0, 1.0, 1.0])["n"] == 2


def test_paired_test_one_sided_noninferiority_matches_the_ci_rule():
    diffs = [-0.02, 0.01, -0.04, 0.00, -0.01, -0.03, 0.02, -0.02]
    for margin in (0.01, 0.03, 0.05, 0.08):
        r = S.paired_test(diffs, null=-margin, alternative="greater")
        assert (r["p"] < 0.025) == (r["lo"] > -margin)  # one-sided 0.025 <=> lower bound of the 95% CI
    r = S.paired_test([0.1, 0.2, 0.3])
    assert r["mean"] == pytest.approx(0.2)
    assert r["hi"] - r["mean"] == pytest.approx(S.t_quantile(0.975, 2) * 0.1 / math.sqrt(3))
    assert math.isnan(S.paired_test([0.1])["lo"])  # one seed: no interval


def test_holm_on_known_p_values():
    adj = S.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert adj == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02})  # monotone step-down
    assert S.holm({"a": 0.5, "b": 0.9}) == pytest.approx({"a": 1.0, "b": 1.0})
    nan = S.holm({"a": 0.01, "b": float("nan")})
    assert nan["a"] == pytest.approx(0.01) and math.isnan(nan["b"])  # a missing hypothesis is not counted


# ----------------------------------------------------------------------------------------------------------
# Endpoints on synthetic runs
# ----------------------------------------------------------------------------------------------------------
def synthetic_run(acc: list[float], seconds_per_step: float, every: int = 10) -> dict:
    steps = [0] + [every * (i + 1) for i in range(len(acc) - 1)]
    n = steps[-1]
    return {"eval_steps": steps, "t": [s * seconds_per_step for s in steps], "acc": acc, "steps": n,
            "total": n * seconds_per_step, "total_cpu": n * seconds_per_step, "total_wall": n * seconds_per_step,
            "series": {"prune/prompt_kept_fraction": [1.0] * n, "prune/total_kept_fraction": [0.5] * n,
                       "reward/zero_variance_groups": [0.25] * n}}


PREREG = {"g_star": 0.1, "T_star": 30.0, "margin": 0.05}


def test_summarize_run_censors_and_flags_a_run_that_ends_before_T_star():
    slow = S.summarize_run(synthetic_run([0.2, 0.2, 0.22, 0.21], 1.0), PREREG)
    assert slow["censored"] and slow["time_to_g"] == 30.0  # counted at its total RL time
    fast = S.summarize_run(synthetic_run([0.2, 0.5, 0.5, 0.5], 0.5), PREREG)
    # smoothed gains 0, 0.15, 0.2, 0.3 at t = 0, 5, 10, 15: g* = 0.1 at t = 5 * 0.1 / 0.15
    assert not fast["censored"] and fast["time_to_g"] == pytest.approx(5 * 0.1 / 0.15)
    assert fast["ended_before_T"] and fast["gain_at_T"] == pytest.approx(0.3)
    assert fast["final"] == pytest.approx(0.5) and fast["pre"] == pytest.approx(0.2)


def test_analyse_pairs_by_seed_applies_holm_to_the_dppo_family_only():
    seeds = list(range(1, 9))
    runs = {}
    for s in seeds:
        jitter = 0.01 * (s % 3)
        runs[(s, "grpo")] = synthetic_run([0.2, 0.3 + jitter, 0.45, 0.6], 1.0)
        runs[(s, "dppo-0.5")] = synthetic_run([0.2, 0.3 + jitter, 0.45, 0.6 - 0.005 * (s % 2)], 0.5 + 0.01 * s)
        runs[(s, "cppo")] = synthetic_run([0.2, 0.2, 0.21, 0.2 + jitter], 0.8)
    a = S.analyse(runs, ["grpo", "dppo-0.5", "cppo"], seeds, PREREG, family=["dppo-0.5"])
    d = a["vs"]["grpo"]["dppo-0.5"]
    assert d["seeds"] == seeds
    assert d["e1"]["geo_mean"] < 0.6 and d["e1"]["verdict"] == "faster" and d["e1"]["p_holm"] == d["e1"]["p"]
    assert d["e3"]["verdict"] == "non-inferior" and d["e3"]["noninferior_ci"]
    c = a["vs"]["grpo"]["cppo"]
    assert c["e1"]["p_holm"] is None and c["e1"]["verdict"].endswith("(unadjusted)")
    assert c["e1"]["censored_arm"] == seeds and c["e1"]["censored_base"] == []
    assert c["e3"]["verdict"].startswith("not shown non-inferior")
    assert a["arms"]["cppo"]["reached"] == 0 and a["arms"]["grpo"]["reached"] == 8
    assert a["arms"]["grpo"]["by_interval"]["prune/total_kept_fraction"] == pytest.approx([0.5, 0.5, 0.5])
    assert a["per_run"]["cppo_s3"]["censored"]


def _r(seed, t, censored, total):
    return {"seed": seed, "time_to_g": t, "censored": censored, "total": total}


def test_censoring_check_reads_a_censored_pair_as_unknown_not_as_the_cost_ratio():
    arm = [_r(1, 20.0, False, 50.0),   # both reached: ratio 20/40
           _r(2, 30.0, False, 50.0),   # base censored at 100 >= 30: the arm was first
           _r(3, 35.0, True, 35.0),    # arm stopped at 35 without g*, base reached at 60: indeterminate
           _r(4, 40.0, True, 40.0),    # arm still running at 40 > base's 25 without g*: base first
           _r(5, 45.0, True, 45.0)]    # neither: endpoint 1 would count 45/100 here
    base = [_r(1, 40.0, False, 100.0), _r(2, 100.0, True, 100.0), _r(3, 60.0, False, 100.0),
            _r(4, 25.0, False, 100.0), _r(5, 100.0, True, 100.0)]
    c = S.censoring_check(arm, base)
    assert c["both"] == [1] and c["arm_first"] == [2] and c["indeterminate"] == [3]
    assert c["base_first"] == [4] and c["neither"] == [5]
    assert c["arm_wins"] == 2 and c["base_wins"] == 1
    assert c["ratio_both"]["n"] == 1 and c["ratio_both"]["geo_mean"] == pytest.approx(0.5)
    # the preregistered endpoint 1 over the same pairs is dominated by the censored ones
    e1 = S.ratio_test([a["time_to_g"] for a in arm], [b["time_to_g"] for b in base])
    assert e1["geo_mean"] < 0.6


def test_read_run_aligns_evaluations_with_cumulative_step_time(tmp_path):
    recs = [{"step": 0, "phase": "sft", "sft/nll": 1.0},
            {"step": -1, "phase": "eval", "eval/arithmetic_train/pass@1": 0.1}]
    for s in range(4):
        recs.append({"step": s, "phase": "rl", "time/step": 2.0, "time/step_cpu": 1.0 + s,
                     "prune/total_kept_fraction": 0.5})
        if s in (1, 3):
            recs.append({"step": s, "phase": "eval", "eval/arithmetic_train/pass@1": 0.2 + s / 10})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    cpu = T.read_run(tmp_path, "cpu")
    assert cpu["eval_steps"] == [0, 2, 4] and cpu["t"] == [0.0, 3.0, 10.0] and cpu["total"] == 10.0
    assert cpu["acc"] == pytest.approx([0.1, 0.3, 0.5]) and cpu["total_wall"] == 8.0
    assert T.read_run(tmp_path, "wall")["t"] == [0.0, 4.0, 8.0]
    for r in recs:
        r.pop("time/step_cpu", None)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    with pytest.raises(ValueError, match="time/step_cpu"):
        T.read_run(tmp_path, "cpu")


# ----------------------------------------------------------------------------------------------------------
# Preregistration
# ----------------------------------------------------------------------------------------------------------
def study_args(**kw):
    args = T.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def write_prereg(path: Path, gains: dict, **kw) -> dict:
    args = study_args(**kw)
    prereg = T.make_prereg(args, T.protocol(args), gains, {k: 200.0 for k in gains}, ["grpo", "dppo-0.5"], {})
    path.write_text(json.dumps(prereg))
    return prereg


def test_make_prereg_applies_the_rules():
    args = study_args()
    p = T.make_prereg(args, T.protocol(args), {"101": 0.3, "102": 0.5}, {"101": 100.0, "102": 140.0}, ["grpo"], {})
    assert p["fit"] and p["calibration"]["G_cal"] == pytest.approx(0.4)
    assert p["g_star"] == pytest.approx(0.24) and p["margin"] == pytest.approx(0.1)
    assert p["T_star"] == pytest.approx(60.0)
    assert p["main_seeds"] == list(range(1, 9)) and p["clock"] == "cpu" and p["steps"] == 150
    assert p["multiple_comparisons"]["family"] == T.DPPO_FAMILY and "git_commit" in p and p["created"]
    unfit = T.make_prereg(args, T.protocol(args), {"101": 0.05, "102": 0.1}, {"101": 1.0, "102": 1.0}, ["grpo"], {})
    assert not unfit["fit"] and "0.0750" in unfit["reason"]


def test_prereg_refusals(tmp_path):
    path = tmp_path / "prereg.json"
    current = T.protocol(study_args())
    with pytest.raises(T.PreregError, match="no preregistration"):
        T.load_prereg(path, current)
    write_prereg(path, {"101": 0.02, "102": 0.04})
    with pytest.raises(T.PreregError, match="task unfit"):
        T.load_prereg(path, current)
    write_prereg(path, {"101": 0.3, "102": 0.4})
    assert T.load_prereg(path, current)["fit"]
    for change, word in (({"clock": "wall"}, "clock"), ({"steps": 100}, "steps"),
                         ({"eval_every": 10}, "overrides"), ({"extra": ["optim.lr=1e-3"]}, "overrides")):
        with pytest.raises(T.PreregError, match=word):
            T.load_prereg(path, T.protocol(study_args(**change)))
    other = tmp_path / "other.yaml"
    other.write_text((T.REPO / "examples" / "quickstart.yaml").read_text() + "\n# changed\n")
    with pytest.raises(T.PreregError, match="config"):
        T.load_prereg(path, T.protocol(study_args(config=other)))


def test_main_phase_refuses_without_a_fit_preregistration(tmp_path):
    with pytest.raises(SystemExit, match="no preregistration"):
        T.main(["--prereg", str(tmp_path / "absent.json"), "--work-dir", str(tmp_path / "w")])
    write_prereg(tmp_path / "unfit.json", {"101": 0.0, "102": 0.01})
    with pytest.raises(SystemExit, match="task unfit"):
        T.main(["--prereg", str(tmp_path / "unfit.json"), "--work-dir", str(tmp_path / "w")])
    assert not (tmp_path / "w").exists()  # nothing was trained


def test_arms_are_the_preregistered_ones():
    assert T.DEFAULT_ARMS == ["grpo", "dapo-filter", "dppo-0.5", "dppo-0.7", "dppo-0.5-zvf", "dppo-opt",
                              "cppo-0.5-alloc"]
    assert set(T.DPPO_FAMILY) <= set(T.DEFAULT_ARMS)
    assert {"dppo-0.5-prompt-only", "dppo-0.5-completion-only"} <= set(T.METHODS) - set(T.DEFAULT_ARMS)
    assert T.METHODS["dapo-filter"] == ["algo.pruner=none", "algo.drop_zero_variance_groups=true"]
    assert T.schedule([1, 2], ["a", "b", "c"]) == [(1, "a"), (1, "b"), (1, "c"), (2, "b"), (2, "c"), (2, "a")]
