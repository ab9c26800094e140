"""The equal-compute time-to-accuracy study (benchmarks/tta_equal_compute.py) without training: the job order
(GRPO first in each seed, its total the budget of the others), the dependency pool, the preregistration's
refusals, and the endpoints on synthetic runs (Holm over the DPPO arms vs the filter, the pre-specified question)."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import tta_equal_compute as E
from benchmarks.common import run_pool


def test_schedule_runs_grpo_first_in_every_seed_and_rotates_the_others():
    jobs = E.schedule([1, 2, 3], ["grpo", "a", "b", "c"])
    assert [j for j in jobs if j[1] == "grpo"] == [(1, "grpo"), (2, "grpo"), (3, "grpo")]
    for seed in (1, 2, 3):
        mine = [a for s, a in jobs if s == seed]
        assert mine[0] == "grpo" and sorted(mine[1:]) == ["a", "b", "c"]
    assert [a for s, a in jobs if s == 1][1:] == ["a", "b", "c"]
    assert [a for s, a in jobs if s == 2][1:] == ["b", "c", "a"]


def test_pool_waits_for_dependencies_and_fails_what_can_never_run():
    done, order, lock = set(), [], threading.Lock()

    def worker(job):
        seed, arm = job
        time.sleep(0.01)
        if (seed, arm) == (2, "grpo"):
            raise RuntimeError("boom")
        with lock:
            order.append(job)
            done.add(job)

    jobs = E.schedule([1, 2], ["grpo", "x", "y"])
    errors = run_pool(jobs, worker, parallel=2, ready=lambda j: j[1] == "grpo" or (j[0], "grpo") in done)
    for seed, arm in order:
        if arm != "grpo":
            assert order.index((seed, "grpo")) < order.index((seed, arm))
    assert set(order) == {(1, "grpo"), (1, "x"), (1, "y")}
    assert sorted(j for j, _ in errors) == [(2, "grpo"), (2, "x"), (2, "y")]


def _run(t, acc, steps, total, budget):
    return {"t": t, "acc": acc, "eval_steps": list(range(len(t))), "steps": steps, "total": total,
            "total_cpu": total, "total_wall": total * 2, "budget": budget}


def test_analysis_primary_against_the_filter_with_holm_and_the_question():
    prereg = {"g_star": 0.05, "eval_every_cpu_s": 10.0, "protocol": {"max_steps": 1000}}
    arms = ["grpo", "filter", "dppo-uniform-zvf", "completion-opt-zvf", "posterior-zvf"]
    lift = {"grpo": -0.02, "filter": 0.0, "dppo-uniform-zvf": 0.0, "completion-opt-zvf": 0.04, "posterior-zvf": 0.01}
    runs = {}
    for s in range(1, 9):
        noise = 0.002 * ((s * 7) % 5 - 2)
        for a in arms:
            final = 0.2 + lift[a] + noise + (0.003 * (-1) ** s if a == "dppo-uniform-zvf" else 0.0)
            runs[(s, a)] = _run([0, 10, 20, 30, 30.4], [0.1, 0.1 + (final - 0.1) / 2, final, final, final],
                                150 if a == "grpo" else 300, 30.4, 30.4)
    an = E.analyse(runs, arms, list(range(1, 9)), prereg)
    assert an["seeds_complete"] == list(range(1, 9))
    primary = an["vs"]["filter"]
    assert primary["completion-opt-zvf"]["final"]["verdict"] == "WIN (higher)"
    assert primary["completion-opt-zvf"]["final"]["p_holm"] >= primary["completion-opt-zvf"]["final"]["p"]
    assert primary["dppo-uniform-zvf"]["final"]["verdict"] == "no difference shown"
    assert "p_holm" not in an["vs"]["grpo"]["completion-opt-zvf"]["final"]  # secondary: unadjusted
    assert an["question"]["final"]["mean"] == pytest.approx(-0.03)
    assert an["question"]["final"]["verdict"] == "the prompt level does not beat completion-only"
    assert an["vs"]["filter"]["posterior-zvf"]["steps_ratio"]["geo_mean"] == pytest.approx(1.0)
    text = E.markdown({"analysis": an, "prereg": {**prereg, "pilot": {"G_cal": 0.1}}, "deviations": [],
                       "git": {"commit": "abc", "dirty": False}})
    assert "WIN (higher)" in text and "does not beat completion-only" in text


def test_main_phase_refuses_without_a_matching_preregistration(tmp_path):
    args = E.parse_args(["--prereg", str(tmp_path / "absent.json")])
    with pytest.raises(E.PreregError, match="run the pilot first"):
        E.load_prereg(args.prereg, E.protocol(args))
    (tmp_path / "p.json").write_text(json.dumps({"fit": True, "protocol": {**E.protocol(args), "grpo_steps": 99}}))
    with pytest.raises(E.PreregError, match="grpo_steps"):
        E.load_prereg(tmp_path / "p.json", E.protocol(args))
    (tmp_path / "p.json").write_text(json.dumps({"fit": False, "reason": "G_cal small", "protocol": E.protocol(args)}))
    with pytest.raises(E.PreregError, match="unfit"):
        E.load_prereg(tmp_path / "p.json", E.protocol(args))
