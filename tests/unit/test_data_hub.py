"""Hub datasets without the Hub: every named set of ``megatron_dppo.data.hub`` is rebuilt here, in its Hub column
layout, as a ``load_dataset``-style folder (README configs + parquet shards), a ``save_to_disk`` folder (arrow) and
a single parquet file, then prepared with ``megatron-dppo data prepare --source`` and read back; plus the offline
error, the manifest, ``data.dataset`` in the trainer's loader, and the rule that no tracked file outside tests
points at ../shared."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from megatron_dppo.config import Config, load_config  # noqa: E402
from megatron_dppo.data import DatasetError, load_prompt_dataset  # noqa: E402
from megatron_dppo.data.hub import HUB_DATASETS, hub_error, load_records, resolve_source  # noqa: E402
from megatron_dppo.data.prepare import expand, parse_sources, prepare  # noqa: E402
from megatron_dppo.data.suites import suite_files  # noqa: E402
from megatron_dppo.run.build import build_scorer, load_train_records  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# name -> (rows in the Hub layout, the golds they must give after reading, the prompt of the first row)
_DAPO_PROMPT = [{"content": "Solve: 2 * 17 = ?\n\nRemember to put your answer on its own line after \"Answer:\".",
                 "role": "user"}]
SAMPLES: dict[str, tuple[list[dict], list[str], str]] = {
    "gsm8k": ([{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
               {"question": "Ann has 1,200 cents. How many?", "answer": "So\n#### 1,200"}],
              ["7", "1200"], "Tom has 3 apples and buys 4. How many?"),
    "math_lighteval": ([{"problem": "Half of 1?", "level": "Level 1", "type": "Algebra",
                         "solution": "It is $\\boxed{\\frac{1}{2}}$."},
                        {"problem": "2+2?", "level": "Level 1", "type": "Algebra", "solution": "$\\boxed{4}$"}],
                       ["\\frac{1}{2}", "4"], "Half of 1?"),
    "math500": ([{"problem": "Convert (0,3).", "solution": "...", "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                  "subject": "Precalculus", "level": 2, "unique_id": "test/precalculus/807.json"}],
                ["\\left( 3, \\frac{\\pi}{2} \\right)"], "Convert (0,3)."),
    "aime24": ([{"id": 60, "problem": "Aya walks.", "solution": "...", "answer": "204", "url": "u", "year": "2024"},
                {"id": 61, "problem": "Rhombus.", "solution": "...", "answer": "480", "url": "u", "year": "2024"}],
               ["204", "480"], "Aya walks."),
    "aime": ([{"id": 0, "problem": "Find n.", "solution": "...", "answer": "33", "url": "u"}], ["33"], "Find n."),
    "amc23": ([{"id": 0, "question": "Cities A and B.", "answer": 27.0, "url": "u"}], ["27"], "Cities A and B."),
    "amc": ([{"id": 0, "problem": "Cities A and B.", "answer": 27.0, "url": "u"}], ["27"], "Cities A and B."),
    "minerva_math": ([{"problem": "Telescope?", "answer": "1.6", "datasource": "minerva"}], ["1.6"], "Telescope?"),
    "olympiadbench": ([{"id": 1606, "question": "Xenia and Sergey.", "final_answer": ["2"], "unit": None},
                       {"id": 1607, "question": "Two roots.", "final_answer": ["1", "2"], "unit": None}],
                      ["2", "1, 2"], "Xenia and Sergey."),
    "svamp": ([{"ID": "chal-777", "Body": "There are 87 oranges.", "Question": "How many?", "Equation": "( 87 )",
                "Answer": 145.0, "Type": "Common-Division"}], ["145"], "There are 87 oranges. How many?"),
    "asdiv": ([{"body": "Seven red apples and two green.", "question": "How many apples?",
                "solution_type": "Addition", "answer": "9 (apples)", "formula": "7+2=9"}],
              ["9"], "Seven red apples and two green. How many apples?"),
    # the second row has no answer (a Hub discussion reports 6 such rows): skipped and counted
    "deepscaler": ([{"problem": "1+1?", "answer": "2", "solution": "..."},
                    {"problem": "Unanswered?", "answer": "", "solution": "..."},
                    {"problem": "2+3?", "answer": "5", "solution": "..."}], ["2", "5"], "1+1?"),
    # the Hub file repeats each problem: the repeats are dropped
    "dapo_math_17k": ([{"data_source": "math_dapo", "prompt": _DAPO_PROMPT, "ability": "MATH",
                        "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
                        "extra_info": {"index": "9a9b6eb4"}}] * 3
                      + [{"data_source": "math_dapo", "prompt": [{"content": "What is 3^2?", "role": "user"}],
                          "ability": "MATH", "reward_model": {"ground_truth": "9", "style": "rule-lighteval/MATH_v2"},
                          "extra_info": {"index": "b6d1b3c0"}}],
                      ["34", "9"], _DAPO_PROMPT[0]["content"]),
}


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """The datasets library caches what it converts: into this test's folder, never the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    datasets.disable_progress_bars()


def _hub_folder(root: Path, name: str) -> Path:
    """A folder laid out like the Hub repository: README.md declaring the config and its splits, parquet shards."""
    d = HUB_DATASETS[name]
    config = d.subset or "default"
    files = []
    for split in d.splits.values():
        rel = f"{config}/{split}-00000-of-00001.parquet"
        (root / config).mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(SAMPLES[name][0]).to_parquet(str(root / rel))
        files.append(f"  - split: {split}\n    path: {config}/{split}-*")
    (root / "README.md").write_text("---\nconfigs:\n- config_name: " + config + "\n  data_files:\n"
                                    + "\n".join(files) + "\n---\n# a test copy\n")
    return root


def _disk_folder(root: Path, name: str) -> Path:
    d = HUB_DATASETS[name]
    dd = datasets.DatasetDict({split: datasets.Dataset.from_list(SAMPLES[name][0]) for split in d.splits.values()})
    dd.save_to_disk(str(root))
    return root


def _check_prepared(out: Path, name: str, manifest: dict) -> None:
    rows, golds, first_prompt = SAMPLES[name]
    for role in HUB_DATASETS[name].splits:
        path = out / f"{name}_{role}.jsonl"
        entry = manifest["files"][path.name]
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert entry["rows"] == len(golds) and entry["rows_read"] == len(rows)
        assert entry["reward"] == HUB_DATASETS[name].reward
        records = list(load_prompt_dataset(path))  # read back: the prepared layout, whatever the file name
        assert [r.gold for r in records] == golds
        assert records[0].prompt == first_prompt
        assert records[0].raw["raw"] == rows[0] or name in ("svamp", "amc23", "amc")  # floats stay floats in raw


@pytest.mark.parametrize("name", list(HUB_DATASETS))
def test_every_named_set_prepares_from_a_hub_folder_a_disk_folder_and_a_parquet_file(tmp_path, name):
    d = HUB_DATASETS[name]
    hub = _hub_folder(tmp_path / "hub", name)
    manifest = prepare([name], tmp_path / "from_hub", parse_sources([f"{name}={hub}"]), log=lambda *_: None)
    _check_prepared(tmp_path / "from_hub", name, manifest)
    assert {e["split"] for e in manifest["files"].values()} == set(d.splits.values())

    disk = _disk_folder(tmp_path / "disk", name)
    manifest = prepare([name], tmp_path / "from_disk", parse_sources([f"{name}={disk}"]), log=lambda *_: None)
    _check_prepared(tmp_path / "from_disk", name, manifest)
    assert {e["kind"] for e in manifest["files"].values()} == {"disk"}

    role = next(iter(d.splits))
    single = tmp_path / "one_file.parquet"  # a file name no preset matches: the named set's columns apply
    datasets.Dataset.from_list(SAMPLES[name][0]).to_parquet(str(single))
    manifest = prepare([name], tmp_path / "from_file", {(name, role): str(single)}, roles=[role],
                       log=lambda *_: None)
    entry = manifest["files"][f"{name}_{role}.jsonl"]
    assert entry["source_sha256"] == hashlib.sha256(single.read_bytes()).hexdigest()
    assert [r.gold for r in load_prompt_dataset(tmp_path / "from_file" / f"{name}_{role}.jsonl")] == SAMPLES[name][1]


def test_a_local_jsonl_source_follows_its_file_name_preset(tmp_path):
    """A local copy in another layout (the Qwen2.5-Math Minerva file: problem / worked solution) is read with the
    preset its file name names, not the Hub set's columns; the manifest keeps the source's SHA-256."""
    local = _write_rows(tmp_path / "minerva_math.jsonl", [{"problem": "Speed?", "solution": "So $\\boxed{1.6}$.",
                                                           "idx": 0}])
    manifest = prepare(["minerva_math"], tmp_path / "out", parse_sources([f"minerva_math={local}"]),
                       log=lambda *_: None)
    entry = manifest["files"]["minerva_math_test.jsonl"]
    assert entry["columns"]["answer"] == "solution" and entry["source_sha256"] == hashlib.sha256(
        local.read_bytes()).hexdigest()
    assert [r.gold for r in load_prompt_dataset(tmp_path / "out" / "minerva_math_test.jsonl")] == ["1.6"]
    with pytest.raises(DatasetError, match="unknown dataset name 'gsm9k'; named datasets: gsm8k"):
        parse_sources(["gsm9k=x.jsonl"])


def test_skipped_and_duplicate_rows_are_counted_in_the_manifest(tmp_path):
    hub = _hub_folder(tmp_path / "ds", "deepscaler")
    files = prepare(["deepscaler"], tmp_path / "o1", parse_sources([f"deepscaler={hub}"]), log=lambda *_: None)
    entry = files["files"]["deepscaler_train.jsonl"]
    assert entry["skipped"] == 1 and "'answer' is empty" in entry["skipped_examples"][0]
    assert "row 2" in entry["skipped_examples"][0]
    hub = _hub_folder(tmp_path / "dapo", "dapo_math_17k")
    files = prepare(["dapo_math_17k"], tmp_path / "o2", parse_sources([f"dapo_math_17k={hub}"]), log=lambda *_: None)
    assert files["files"]["dapo_math_17k_train.jsonl"]["duplicates"] == 2


def test_suite_prepare_writes_what_eval_suite_reads_and_the_manifest_accumulates(tmp_path):
    sources = []
    for bench in ("gsm8k", "math500", "aime24", "amc23", "minerva_math", "olympiadbench"):
        sources.append(f"{bench}:test={_hub_folder(tmp_path / bench, bench)}")
    assert expand(["math6"]) == [(b, "test") for b in ("gsm8k", "math500", "aime24", "amc23", "minerva_math",
                                                      "olympiadbench")]
    out = tmp_path / "data" / "math"
    prepare(["math6"], out, parse_sources(sources), log=lambda *_: None)
    files = suite_files("math6", out)
    assert [p.name for _, p in files] == [f"{b}_test.jsonl" for b, _ in files]
    prepare(["gsm8k"], out, parse_sources([f"gsm8k={tmp_path / 'gsm8k'}"]), roles=["train"], log=lambda *_: None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {f"{b}_test.jsonl" for b, _ in files} | {"gsm8k_train.jsonl"}


def test_offline_error_names_the_dataset_and_the_command(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "megatron_dppo.cli", "data", "prepare", "gsm8k", "--out",
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "'openai/gsm8k'" in proc.stderr and "HF_DATASETS_OFFLINE" in proc.stderr
    assert "megatron-dppo data prepare gsm8k --out" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written for a dataset that did not load


def test_hub_errors_say_what_failed_and_what_to_do(monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    src = resolve_source("gsm8k", split="test")
    msg = str(hub_error(src, ValueError("Unknown split \"dev\". Should be one of ['train', 'test'].")))
    assert msg.startswith("Hub dataset 'openai/gsm8k' (subset 'main'), split 'test' could not be loaded")
    assert "Unknown split" in msg and "data prepare" not in msg
    msg = str(hub_error(src, ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")))
    assert "the Hub cannot be reached from here" in msg and "megatron-dppo data prepare gsm8k --out data" in msg


def test_data_dataset_reads_folders_files_and_names_its_columns(tmp_path):
    disk = _disk_folder(tmp_path / "disk", "gsm8k")
    cfg = _cfg("data.task=files", f"data.dataset={disk}", "data.split=test", "data.preset=gsm8k")
    assert [r.gold for r in load_train_records(cfg)] == ["7", "1200"]
    hub = _hub_folder(tmp_path / "hub", "dapo_math_17k")  # a Hub clone: preset by hand, dedupe on request
    cfg = _cfg("data.task=files", f"data.dataset={hub}", "data.subset=default", "data.preset=dapo_math_17k",
               "data.dedupe=true")
    records = load_train_records(cfg)
    assert [r.gold for r in records] == ["34", "9"] and records[0].id == "hub:9a9b6eb4"
    wrong = _cfg("data.task=files", f"data.dataset={disk}", "data.split=dev")
    with pytest.raises(DatasetError, match="split 'dev' not found; splits: train, test"):
        load_train_records(wrong)
    with pytest.raises(DatasetError, match=r"missing field 'question'.*has: answer, prompt"):
        load_records(str(_write_rows(tmp_path / "x.jsonl", [{"prompt": [1], "answer": "1"}])))
    with pytest.raises(DatasetError, match="does not exist.*named dataset: gsm8k"):
        resolve_source("data/missing_train.jsonl")
    assert resolve_source("openai/gsm8k").kind == "named"  # the Hub id of a named set gets its columns
    assert resolve_source("someone/some-set").kind == "hub"


def _cfg(*overrides: str) -> Config:
    cfg = load_config(None, list(overrides), validate=False)
    cfg.data.validate()
    return cfg


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_config_and_reward_of_a_named_dataset():
    with pytest.raises(ValueError, match="data.train_files.*one of the two"):
        _cfg("data.task=files", "data.dataset=gsm8k", "data.train_files=[a.jsonl]")
    with pytest.raises(ValueError, match="data.split='test' is invalid: expected null unless data.dataset"):
        _cfg("data.task=arithmetic", "data.split=test")
    cfg = Config()
    assert build_scorer(cfg, ["gsm8k"]).name == "gsm8k"
    assert build_scorer(cfg, ["dapo_math_17k"]).name == "math"
    assert build_scorer(cfg, ["data/gsm8k_train.jsonl"]).name == "gsm8k"


def test_no_tracked_file_outside_tests_points_at_the_shared_folder():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "grep", "-n", "-I", "-F", "-e", "../shared", "-e", 'parent / "shared"', "--", ".",
                           ":!tests"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, f"tracked files outside tests refer to ../shared:\n{proc.stdout}"
