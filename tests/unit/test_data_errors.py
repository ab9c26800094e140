"""Data errors as a new user meets them, through the CLI (``megatron_dppo.cli.main``, which prints ``error: ...``
and returns 2 for a DatasetError, 1 for a full disk): every error names the file or folder at fault, nothing ends in
a traceback, and no partial file is left behind. Malformed JSON lines follow the one rule of
``megatron_dppo/data/datasets.py`` ("Bad input"): fatal, except under a named set's ``bad_rows="skip"`` (skipped and
counted in the manifest)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")

from megatron_dppo.cli import main
from megatron_dppo.data import DatasetError, load_prompt_dataset
from megatron_dppo.data.hub import load_records

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from _e2e_helpers import damaged_parquet
from _tmpfs import small_tmpfs


def _cli(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error: ")], err


def _gsm8k_rows(path: Path, n: int = 2, bad_line: int | None = None, pad: int = 0) -> Path:
    lines = [json.dumps({"question": f"What is {i} plus 1? " + "x" * pad, "answer": f"so\n#### {i + 1}"})
             for i in range(n)]
    if bad_line is not None:
        lines[bad_line - 1] = '{"question": "oops", '
    path.write_text("\n".join(lines) + "\n")
    return path


def test_unsupported_suffix_is_one_error_naming_the_file_and_the_suffixes(tmp_path, capsys):
    source = tmp_path / "gsm8k.foo"
    source.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    code, lines, err = _cli(capsys, "data", "prepare", "gsm8k", "--source", f"gsm8k={source}", "--out",
                            str(tmp_path / "out"))
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"{source}: unsupported data file type '.foo'" in lines[0]
    assert ".jsonl, .ndjson, .json, .parquet, .csv, .arrow" in lines[0]
    assert not (tmp_path / "out").exists()


def test_output_folder_that_cannot_be_created_is_named_before_anything_is_read(tmp_path, capsys):
    source = _gsm8k_rows(tmp_path / "gsm8k.jsonl")
    for out, reason in (("/proc/dppo/data", "/proc refuses a new folder"),
                        (str(source / "sub"), f"{source} is a file, not a folder")):
        code, lines, err = _cli(capsys, "data", "prepare", "gsm8k", "--source", f"gsm8k={source}", "--out", out)
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"error: --out {out}: cannot create the output folder ({reason}")


@pytest.mark.skipif(sys.platform != "linux", reason="a tmpfs mount (root)")
def test_full_disk_names_the_file_and_folder_and_leaves_no_tmp(tmp_path, capsys):
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    source = _gsm8k_rows(tmp_path / "gsm8k.jsonl", n=400, pad=40)  # ~40 kB of prepared rows
    with small_tmpfs(tmp_path / "small", 16 * 1024) as mnt:
        out = mnt / "data"
        code, lines, err = _cli(capsys, "data", "prepare", "gsm8k", "--source", f"gsm8k={source}", "--out",
                                str(out))
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0] == (f"error: No space left on device: cannot write gsm8k_train.jsonl in {out} (free space "
                            "there or choose another --out); no partial file was left")
        assert sorted(p.name for p in out.iterdir()) == []  # no gsm8k_train.jsonl.tmp


def test_malformed_json_line_is_fatal_unless_the_set_skips_bad_rows(tmp_path, capsys):
    gsm8k = _gsm8k_rows(tmp_path / "gsm8k.jsonl", n=3, bad_line=2)
    code, lines, err = _cli(capsys, "data", "prepare", "gsm8k", "--source", f"gsm8k={gsm8k}", "--out",
                            str(tmp_path / "o1"))
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"{gsm8k}:2: invalid JSON" in lines[0]
    assert not (tmp_path / "o1" / "gsm8k_train.jsonl").exists()
    # deepscaler skips unreadable rows (bad_rows="skip"): the malformed line is one of them, counted
    deepscaler = tmp_path / "deepscaler.jsonl"
    deepscaler.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "oops", \n\n[1, 2]\n'
                          '{"problem": "2+3?", "answer": "5"}\n')
    code, lines, err = _cli(capsys, "data", "prepare", "deepscaler", "--source", f"deepscaler={deepscaler}", "--out",
                            str(tmp_path / "o2"))
    assert code == 0 and lines == [], err
    entry = json.loads((tmp_path / "o2" / "manifest.json").read_text())["files"]["deepscaler_train.jsonl"]
    assert (entry["rows_read"], entry["rows"], entry["skipped"]) == (4, 2, 2)
    assert entry["skipped_examples"][0].startswith(f"{deepscaler}:2: invalid JSON")
    assert entry["skipped_examples"][1] == f"{deepscaler}:4: expected a JSON object per line, got list"
    assert [r.gold for r in load_prompt_dataset(tmp_path / "o2" / "deepscaler_train.jsonl")] == ["2", "5"]


def test_damaged_files_are_one_error_naming_the_file(tmp_path):
    parquet = damaged_parquet(tmp_path / "train.parquet")
    for read in (load_prompt_dataset, load_records):
        with pytest.raises(DatasetError, match=rf"{parquet}: not a readable parquet file \(OSError: .*Couldn't "
                                               "deserialize thrift"):
            read(str(parquet))
    arrow = tmp_path / "train.arrow"
    arrow.write_bytes(b"not arrow")
    with pytest.raises(DatasetError, match=rf"{arrow}: not a readable arrow file: "):
        load_records(str(arrow))
