"""benchmarks/ is a package with one shared module (benchmarks/common.py): every script imports as
``benchmarks.<name>``, none reaches into tests/ for a helper, the README lists every script, and the shared pieces
(launching a process, the job pool, reading metrics.jsonl) do what the scripts rely on."""
from __future__ import annotations

import ast
import importlib
import json
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks.common import RunFailed, read_metrics, run, run_pool  # noqa: E402

SCRIPTS = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name != "__init__.py")
TEST_HELPERS = {p.stem for p in (REPO / "tests").rglob("_*.py")}  # _dist, _e2e_helpers, _tiny, ...


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_every_benchmark_imports_as_a_module_of_the_package(path):
    importlib.import_module(f"benchmarks.{path.stem}")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_no_benchmark_imports_a_test_helper_or_puts_tests_on_the_path(path):
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        assert not {n.split(".")[0] for n in names} & TEST_HELPERS, f"{path.name} imports a test helper: {names}"
    path_edits = [line for line in source.splitlines() if "sys.path." in line and "tests" in line]
    assert not path_edits, f"{path.name} puts a tests folder on sys.path: {path_edits}"


def test_the_readme_indexes_every_script():
    readme = (REPO / "benchmarks" / "README.md").read_text()
    missing = [p.name for p in SCRIPTS if not p.stem.startswith("_") and p.stem != "common" and p.name not in readme]
    assert not missing, f"benchmarks/README.md lacks {missing}"


def test_run_measures_the_child_and_names_failures(tmp_path):
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done')"
    out = run([sys.executable, "-c", busy], tmp_path / "busy.log")
    assert out["cpu_s"] >= 0.3 and out["wall_s"] >= out["cpu_s"] * 0.5
    assert (tmp_path / "busy.log").read_text().splitlines()[-1] == "done"
    with pytest.raises(RunFailed, match="exit 3"):
        run([sys.executable, "-c", "print('why'); raise SystemExit(3)"], tmp_path / "fail.log")
    start = time.perf_counter()
    with pytest.raises(RunFailed, match="timed out"):
        run([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "slow.log", timeout=0.5)
    assert time.perf_counter() - start < 10


def test_pool_runs_in_order_reports_failures_and_stops_on_request():
    seen, lock = [], threading.Lock()

    def worker(job):
        with lock:
            seen.append(job)
        if job == 2:
            raise ValueError("two")

    errors = run_pool([0, 1, 2, 3], worker, parallel=1, report=lambda job, err: None)
    assert seen == [0, 1, 2, 3] and [(j, str(e)) for j, e in errors] == [(2, "two")]
    seen.clear()
    assert run_pool([0, 1, 2, 3], lambda j: seen.append(j), parallel=1, stop=lambda: len(seen) >= 2) == []
    assert seen == [0, 1]


def test_read_metrics_filters_by_phase_and_skips_a_torn_line(tmp_path):
    assert read_metrics(tmp_path) == []
    lines = [{"step": 0, "phase": "sft"}, {"step": 0, "phase": "rl"}, {"step": 1, "phase": "rl"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 2, "pha')
    assert read_metrics(tmp_path) == lines
    assert [r["step"] for r in read_metrics(tmp_path, "rl")] == [0, 1]
