"""benchmarks/study_runner.py: a study stopped mid-way (SIGTERM to the runner) and started again resumes each
unfinished run from its checkpoint (not from step 0) and ends where a straight run ends; a CPU-budget job is
stopped by the runner once its budget is used and counts as finished. Plus the budget rule on synthetic metrics.
The runs are the tiny arithmetic config of the e2e tests, each a real ``megatron-dppo train`` process."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _e2e_helpers import PY, REPO, env, read_metrics, run_cli, stable_metrics, tiny_config, write_config

sys.path.insert(0, str(REPO))
from benchmarks import study_runner as SR
from benchmarks.common import read_metrics as read_records

DRIVER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from benchmarks import study_runner as SR
    spec = json.loads(Path(sys.argv[1]).read_text())
    jobs = [SR.Job(j["name"], Path(j["config"]), j["overrides"], Path(j["output_dir"]),
                   done=SR.cpu_budget_reached(j["budget"]) if j.get("budget") else None) for j in spec["jobs"]]
    failed = SR.run_jobs(jobs, parallel=1, state=Path(spec["state"]), poll_s=0.2)
    print("FAILED", failed, flush=True)
    sys.exit(1 if failed else 0)
""")


def _records(steps_cpu: list[float], evals: list[int]) -> list[dict]:
    recs = [{"step": s, "phase": "rl", "time/step_cpu": c} for s, c in enumerate(steps_cpu)]
    return recs + [{"step": s, "phase": "eval", "eval/x/pass@1": 0.1} for s in evals]


def test_cpu_budget_rule_on_synthetic_metrics(tmp_path):
    done = SR.cpu_budget_reached(5.0)
    assert SR.cumulative_cpu(_records([2, 2, 2, 2], [])) == [(0, 2.0), (1, 4.0), (2, 6.0), (3, 8.0)]
    assert not done(_records([2, 2], [1]))              # 4 CPU s: not there yet
    assert not done(_records([2, 2, 2], [1]))           # crossed at step 2, no evaluation since
    assert done(_records([2, 2, 2], [1, 2]))            # evaluated after the crossing step
    assert done(_records([2, 2, 2, 2], [3]))
    # a torn last line (a kill mid-write) is skipped, not an error
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "phase": "rl"}) + "\n{\"step\": 1, \"pha")
    assert SR.rl_steps(read_records(tmp_path)) == 1


@pytest.mark.slow
def test_a_stopped_study_resumes_each_run_from_its_checkpoint(tmp_path):
    sections = dict(train={"steps": 8, "sft_steps": 0}, eval={"every": 2}, checkpoint={"every": 1, "keep_last": 2})
    config = write_config(tmp_path / "tiny.yaml", tiny_config(tmp_path / "unused", **sections))
    straight = tmp_path / "straight"
    run_cli(config, f"train.output_dir={straight}", "train.seed=1")

    work = tmp_path / "study"
    spec = {"state": str(work / "state.json"), "jobs": [
        {"name": "a_s1", "config": str(config), "overrides": ["train.seed=1"], "output_dir": str(work / "a_s1")},
        {"name": "a_s2", "config": str(config), "overrides": ["train.seed=2"], "output_dir": str(work / "a_s2")},
        # an equal-CPU-budget job: far more steps than the budget allows; the runner stops it
        {"name": "budget", "config": str(config), "overrides": ["train.steps=200", "eval.every=1"],
         "output_dir": str(work / "budget"), "budget": 1.0},
    ]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "driver.py").write_text(DRIVER.format(repo=str(REPO)))
    cmd = [PY, str(tmp_path / "driver.py"), str(tmp_path / "spec.json")]

    # 1. start the study, stop it (SIGTERM to the runner) once the first run has logged 2 RL steps
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (work / "a_s1" / "metrics.jsonl").exists() and \
                sum(r["phase"] == "rl" for r in read_metrics(work / "a_s1")) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    first = sum(r["phase"] == "rl" for r in read_metrics(work / "a_s1"))
    assert 2 <= first < 8 and (work / "a_s1" / "checkpoints" / "latest").is_file(), out[-3000:]
    assert not (work / "a_s2").exists()  # the queue stopped with the runner
    state = json.loads((work / "state.json").read_text())
    assert state["jobs"]["a_s1"]["status"] == "stopped"

    # 2. the same command again: a_s1 continues from its checkpoint, the others run, everything finishes
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "resuming a_s1" in proc.stdout
    log = (work / "a_s1.log").read_text()
    assert log.count("=== ") == 2 and f"RL step {first}" in log.split("=== ")[-1]  # resumed, not restarted
    assert stable_metrics(read_metrics(work / "a_s1")) == stable_metrics(read_metrics(straight))
    assert sum(r["phase"] == "rl" for r in read_metrics(work / "a_s2")) == 8

    budget = read_metrics(work / "budget")
    cum = SR.cumulative_cpu(budget)
    assert SR.cpu_budget_reached(1.0)(budget) and len(cum) < 200  # stopped by the runner once the budget was used
    assert (work / "budget" / "checkpoints" / "latest").is_file()
    state = json.loads((work / "state.json").read_text())
    assert {j: s["status"] for j, s in state["jobs"].items()} == {"a_s1": "finished", "a_s2": "finished",
                                                                  "budget": "finished"}
    assert len(state["jobs"]["a_s1"]["segments"]) == 2 and state["jobs"]["a_s1"]["cpu_s_total"] > 0

    # 3. a third start has nothing to do
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "starting" not in proc.stdout and "resuming" not in proc.stdout


def test_finished_runs_survive_a_fresh_checkout_through_the_archive(tmp_path):
    """A finished run's metrics go into the archive byte for byte; restored into an empty folder the job counts as
    finished again (so a new sitting skips it and the report reads it); unfinished runs are not archived; an
    archive that no longer holds a finished run under the study's rule is refused."""
    work, archive = tmp_path / "work", tmp_path / "archive"

    def job(name):
        return SR.Job(name, tmp_path / "unused.yaml", [], work / name, done=SR.cpu_budget_reached(5.0))

    for name, recs in {"done_s1": _records([2, 2, 2], [0, 2]), "half_s1": _records([2], [0])}.items():
        (work / name).mkdir(parents=True)
        (work / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (work / "state.json").write_text(json.dumps({"jobs": {"done_s1": {"status": "finished", "segments": [],
                                                                      "cpu_s_total": 7.5}}}))
    jobs = [job("done_s1"), job("half_s1")]
    assert SR.archive_finished(jobs, archive, work / "state.json") == ["done_s1"]
    first = (archive / "done_s1.metrics.jsonl.gz").read_bytes()
    assert not (archive / "half_s1.metrics.jsonl.gz").exists()
    assert json.loads((archive / "study_state.json").read_text())["jobs"]["done_s1"]["cpu_s_total"] == 7.5
    SR.archive_finished(jobs, archive)
    assert (archive / "done_s1.metrics.jsonl.gz").read_bytes() == first  # no time stamp: unchanged file

    fresh = tmp_path / "fresh"
    jobs = [SR.Job(j.name, j.config, [], fresh / j.name, done=j.done) for j in jobs]
    assert [j.finished() for j in jobs] == [False, False]
    assert SR.restore_archived(jobs, archive) == ["done_s1"]
    assert [j.finished() for j in jobs] == [True, False]
    assert (fresh / "done_s1" / "metrics.jsonl").read_bytes() == (work / "done_s1" / "metrics.jsonl").read_bytes()
    assert SR.restore_archived(jobs, archive) == []  # a folder with metrics is never overwritten

    stricter = [SR.Job("done_s1", tmp_path / "unused.yaml", [], tmp_path / "other" / "done_s1",
                       done=SR.cpu_budget_reached(50.0))]
    with pytest.raises(SystemExit, match="does not hold a finished run"):
        SR.restore_archived(stricter, archive)
