"""Prompt datasets through the Hugging Face ``datasets`` library: named math sets, Hub ids, Hub-format folders.

``data.dataset`` (and ``megatron-dppo data prepare --source``) takes one of

    a name of HUB_DATASETS (below)       that Hub dataset, with its subset, splits, columns, reward
    a Hub id "owner/name"                datasets.load_dataset(id, data.subset, split=data.split)
    a folder written by save_to_disk     datasets.load_from_disk (a Dataset, or a DatasetDict: data.split picks)
    any other folder                     datasets.load_dataset(folder): data files (train-*.parquet, data/*.jsonl,
                                         ...) or a Hub repository clone whose README declares its configs
    a file                               .jsonl/.ndjson/.json lines/.parquet as before; .json (array), .csv, .arrow
                                         through datasets

The named sets (role -> Hub split; the columns were checked on the dataset cards where a comment says so):

    name            Hub dataset                               roles (Hub split)       prompt / gold         reward
    gsm8k           openai/gsm8k (main)                       train, test             question / "####"     gsm8k
    math_lighteval  DigitalLearningGmbH/MATH-lighteval        train, test             problem / \\boxed{}    math
    math500         HuggingFaceH4/MATH-500                    test                    problem / answer      math
    aime24          HuggingFaceH4/aime_2024                   test (train)            problem / answer      math
    aime            AI-MO/aimo-validation-aime (AIME 22-24)   test (train)            problem / answer      math
    amc23           math-ai/amc23                             test                    question / answer     math
    amc             AI-MO/aimo-validation-amc (AMC 22-23)     test (train)            problem / answer      math
    minerva_math    guanning/minervamath                      test                    problem / answer      math
    olympiadbench   Hothan/OlympiadBench (OE_TO_maths_en_COMP) test (train)           question / final_ans. math
    svamp           tongyx361/svamp                           test                    Body Question / Answer math
    asdiv           EleutherAI/asdiv (asdiv)                  test (validation)       body question / ans.  math
    deepscaler      agentica-org/DeepScaleR-Preview-Dataset   train                   problem / answer      math
    dapo_math_17k   BytedTsinghua-SIA/DAPO-Math-17k           train                   prompt / ground_truth math

Offline (``HF_DATASETS_OFFLINE=1``, ``HF_HUB_OFFLINE=1``, or no route to the Hub) a Hub dataset loads from the
Hugging Face cache when it is there; otherwise the error names the dataset and the command to run where the Hub
is reachable (``megatron-dppo data prepare NAME --out DIR``), whose files then train and evaluate offline.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from megatron_dppo.data.datasets import (
    DATASET_PRESETS,
    DatasetError,
    DatasetFileNotFoundError,
    FieldSpec,
    PromptRecord,
    ReadStats,
    is_prepared_row,
    resolve_fields,
    rows_to_records,
)


@dataclass(frozen=True)
class HubDataset:
    """A named math set on the Hub. ``splits`` maps a role (train / test) to the Hub split that holds it."""

    repo: str
    fields: FieldSpec
    splits: dict
    subset: str | None = None
    reward: str = "math"
    dedupe: bool = False  # drop rows whose prompt and gold repeat an earlier row's
    bad_rows: str = "error"  # "skip": drop unreadable rows, counted in the manifest (datasets.py, "Bad input")
    about: str = ""


_PLAIN = FieldSpec("problem", "answer", "plain")
_WITH_ID = FieldSpec("problem", "answer", "plain", id="id")

HUB_DATASETS: dict[str, HubDataset] = {
    # Card: configs main / socratic, columns question, answer; 7473 train, 1319 test.
    "gsm8k": HubDataset("openai/gsm8k", DATASET_PRESETS["gsm8k"], {"train": "train", "test": "test"}, "main",
                        reward="gsm8k", about="GSM8K grade-school word problems"),
    # Columns problem, level, type, solution (no answer column: the gold is the solution's last \boxed{}), 7500 train
    # and 5000 test: checked on copies of the lighteval MATH layout (Dahoas/MATH, math-lighteval-mt), NOT on this
    # repository's own card (unverified here).
    "math_lighteval": HubDataset("DigitalLearningGmbH/MATH-lighteval", DATASET_PRESETS["math_lighteval"],
                                 {"train": "train", "test": "test"}, about="MATH (Hendrycks), 7500 train / 5000 test"),
    # Card/eval.yaml: split test, input problem, target answer; columns problem, solution, answer, subject, level,
    # unique_id.
    "math500": HubDataset("HuggingFaceH4/MATH-500", DATASET_PRESETS["math500"], {"test": "test"},
                          about="MATH-500 (the PRM800K test subset of MATH)"),
    # Card: columns id, problem, solution, answer, url, year; one split "train" of 30 rows (AIME 2024 I and II).
    "aime24": HubDataset("HuggingFaceH4/aime_2024", _WITH_ID, {"test": "train"}, about="AIME 2024 (30)"),
    # Card: columns id, problem, solution, answer, url; one split "train" of 90 rows (AIME 2022-2024).
    "aime": HubDataset("AI-MO/aimo-validation-aime", _WITH_ID, {"test": "train"}, about="AIME 2022-2024 (90)"),
    # UNVERIFIED column names: the card lists none; assumed the Qwen2.5-Math amc23 layout (id, question, answer).
    "amc23": HubDataset("math-ai/amc23", FieldSpec("question", "answer", "plain", id="id"), {"test": "test"},
                        about="AMC 2023 (40)"),
    # UNVERIFIED column names (the card seen lists none): assumed those of its sibling aimo-validation-aime
    # (id, problem, answer); one split "train" of 83 rows.
    "amc": HubDataset("AI-MO/aimo-validation-amc", _WITH_ID, {"test": "train"}, about="AMC 2022-2023 (83)"),
    # Card: columns problem, answer, datasource; split test of 272 rows (the Minerva / OCWCourses problems).
    "minerva_math": HubDataset("guanning/minervamath", _PLAIN, {"test": "test"}, about="Minerva Math (272)"),
    # UNVERIFIED column names: the card shows the configs (OE_TO_maths_en_COMP, ...) and split train but no feature
    # list; assumed the OlympiadBench fields (id, question, final_answer as a list) that the Qwen2.5-Math file has.
    "olympiadbench": HubDataset("Hothan/OlympiadBench", DATASET_PRESETS["olympiadbench"], {"test": "train"},
                                "OE_TO_maths_en_COMP", about="OlympiadBench, English text-only math (675)"),
    # Card: columns ID, Body, Question, Equation, Answer (float), Type; split test of 1000 rows.
    "svamp": HubDataset("tongyx361/svamp", DATASET_PRESETS["svamp"], {"test": "test"}, about="SVAMP (1000)"),
    # Card (parquet conversion): config asdiv, columns body, question, solution_type, answer ("9 (apples)"),
    # formula; split validation of 2305 rows. No id column: ids are row numbers.
    "asdiv": HubDataset("EleutherAI/asdiv", FieldSpec("{body} {question}", "answer", "strip_units"),
                        {"test": "validation"}, "asdiv", about="ASDiv (2305)"),
    # Columns problem, answer, solution, 40315 rows in one split "train": checked on a copy (WaltonFuture/DeepScaleR);
    # the repository ships deepscaler.json. A Hub discussion reports 6 rows without an answer: skipped and counted.
    "deepscaler": HubDataset("agentica-org/DeepScaleR-Preview-Dataset", DATASET_PRESETS["deepscaler"],
                             {"train": "train"}, bad_rows="skip", about="DeepScaleR-Preview (40k AIME/AMC/Omni/...)"),
    # Columns data_source, prompt (a list of {content, role}), ability, reward_model {ground_truth, style},
    # extra_info {index}: checked on copies of this repository (dedup / split variants). The repository's train
    # split repeats each of its ~17.4k problems (about 1.79M rows): repeats are dropped (dedupe).
    "dapo_math_17k": HubDataset("BytedTsinghua-SIA/DAPO-Math-17k", DATASET_PRESETS["dapo_math_17k"],
                                {"train": "train"}, dedupe=True, about="DAPO-Math-17k (the prompt carries its "
                                                                       "'Answer:' instruction)"),
}
ROLES = ("train", "test")
_FILE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".arrow")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass
class Source:
    """Where a dataset comes from, resolved: kind is named | hub | disk | folder | file."""

    kind: str
    location: str
    name: str
    split: str | None
    subset: str | None
    fields: FieldSpec | str | None
    reward: str | None = None
    dedupe: bool = False
    bad_rows: str = "error"
    revision: str | None = None
    extra: dict = field(default_factory=dict)


def named(name: str) -> HubDataset:
    if name not in HUB_DATASETS:
        raise DatasetError(f"unknown dataset name {name!r}; named datasets: {', '.join(HUB_DATASETS)}")
    return HUB_DATASETS[name]


def resolve_source(dataset: str, split: str | None = None, subset: str | None = None,
                   fields: FieldSpec | str | None = None, revision: str | None = None) -> Source:
    """What ``dataset`` names (see the module docstring). ``split`` for a named set is a role (train / test) or a
    Hub split; None = its train role if it has one, else test. ``fields`` (a FieldSpec or a preset name) overrides
    the named set's columns."""
    if not isinstance(dataset, str) or not dataset.strip():
        raise DatasetError(f"dataset {dataset!r} is invalid: expected a named dataset ({', '.join(HUB_DATASETS)}), a "
                           "Hub id 'owner/name', a local folder or a file")
    by_repo = {d.repo.lower(): n for n, d in HUB_DATASETS.items()}
    key = by_repo.get(dataset.lower(), dataset)
    if key in HUB_DATASETS and not Path(dataset).exists():
        d = HUB_DATASETS[key]
        role = split or ("train" if "train" in d.splits else "test")
        return Source("named", d.repo, key, d.splits.get(role, role), subset or d.subset, fields or d.fields,
                      d.reward, d.dedupe, d.bad_rows, revision, {"role": role})
    path = Path(dataset).expanduser()
    if path.is_file():
        if path.suffix.lower() not in _FILE_SUFFIXES:
            raise DatasetError(f"{path}: unsupported data file type {path.suffix or '(no suffix)'!r}; data files end "
                               f"in {', '.join(_FILE_SUFFIXES)} (or give a Hub id or a dataset folder)")
        return Source("file", str(path), path.name.split(".")[0], split, subset, fields)
    if path.is_dir():
        marker = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
        return Source("disk" if marker else "folder", str(path), path.name, split, subset, fields)
    looks_local = (dataset.startswith(("/", "./", "../", "~")) or dataset.count("/") > 1
                   or dataset.lower().endswith(_FILE_SUFFIXES) or not _HUB_ID.fullmatch(dataset))
    if looks_local:
        raise DatasetFileNotFoundError(
            f"dataset {dataset!r} does not exist (not a file or folder here, and not a Hub id 'owner/name' nor a "
            f"named dataset: {', '.join(HUB_DATASETS)})")
    return Source("hub", dataset, dataset.rsplit("/", 1)[-1], split, subset, fields, revision=revision)


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def hub_error(src: Source, err: Exception) -> DatasetError:
    """The error of a Hub dataset that did not load: what was asked, the library's reason, and what to do."""
    what = f"Hub dataset {src.location!r}" + (f" (subset {src.subset!r})" if src.subset else "") + \
        (f", split {src.split!r}" if src.split else "")
    reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    unreachable = isinstance(err, (ConnectionError, TimeoutError)) or any(
        s in str(err) for s in ("OfflineModeIsEnabled", "offline mode", "Couldn't reach", "Failed to resolve"))
    if not unreachable:
        return DatasetError(f"{what} could not be loaded: {reason}")
    name = src.name if src.kind == "named" else src.location
    mode = ("HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set" if _offline() else "the Hub cannot be reached from here")
    return DatasetError(
        f"{what} is not in the local Hugging Face cache and {mode} ({reason}). On a machine that reaches the Hub "
        f"run `megatron-dppo data prepare {name} --out data` and train on the files it writes (data.dataset=data/"
        f"<file>.jsonl or data.train_files), or fill the cache there (HF_HOME) and copy it here.")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _split_of(ds: Any, split: str | None, where: str):
    """One split of a DatasetDict: ``split``, else train, else its only split."""
    if not hasattr(ds, "keys"):
        return ds
    names = list(ds.keys())
    pick = split or ("train" if "train" in names else names[0] if len(names) == 1 else None)
    if pick not in names:
        raise DatasetError(f"{where}: split {split!r} not found; splits: {', '.join(names)} (set data.split)")
    return ds[pick]


def _load(src: Source):
    """A ``datasets.Dataset`` for a named / hub / disk / folder / non-native file source."""
    try:
        import datasets  # noqa: PLC0415 - heavy, and only needed for these sources
    except ImportError:
        raise DatasetError(f"dataset {src.location!r} needs the `datasets` library (pip install -r "
                           "requirements/cpu.txt)") from None
    datasets.disable_progress_bars()
    if src.kind == "disk":
        try:
            return _split_of(datasets.load_from_disk(src.location), src.split, src.location)
        except (FileNotFoundError, ValueError) as err:
            raise DatasetError(f"{src.location}: not a readable save_to_disk folder: {err}") from None
    if src.kind == "file":
        suffix = Path(src.location).suffix.lower()
        builder = {".csv": "csv", ".arrow": "arrow", ".json": "json"}[suffix]  # (resolve_source checked it)
        try:
            return datasets.load_dataset(builder, data_files=src.location, split="train")
        except Exception as err:  # noqa: BLE001 - the library raises many types; the message names the file
            raise DatasetError(f"{src.location}: not a readable {suffix[1:]} file: {type(err).__name__}: "
                               f"{_first_line(err)}") from None
    if src.kind == "folder":
        try:
            ds = datasets.load_dataset(src.location, src.subset, split=None)
        except Exception as err:  # noqa: BLE001 - the library raises many types; the message names the folder
            raise DatasetError(f"{src.location}: not a dataset folder datasets can read (data files such as "
                               f"train.parquet / data/*.jsonl, or a Hub repository clone): {type(err).__name__}: "
                               f"{err}") from None
        return _split_of(ds, src.split, src.location)
    try:
        return datasets.load_dataset(src.location, src.subset, split=src.split, revision=src.revision)
    except Exception as err:  # noqa: BLE001 - connection, cache, split and config errors all name the dataset
        raise hub_error(src, err) from None


def _native_rows(path: Path, skipped: ReadStats | None = None) -> Iterator[tuple[int, dict]] | None:
    """Rows of a file the package reads without ``datasets`` (JSON lines, parquet); None for other files.
    ``skipped``: unreadable JSON lines are counted there instead of raising (``bad_rows="skip"``)."""
    from megatron_dppo.data.datasets import _iter_jsonl, _iter_parquet  # noqa: PLC0415

    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _iter_parquet(path)
    if suffix in (".jsonl", ".ndjson"):
        return _iter_jsonl(path, skipped)
    if suffix == ".json":
        with path.open("rb") as handle:
            head = handle.read(4096).lstrip()
        return None if head.startswith(b"[") else _iter_jsonl(path, skipped)
    return None


def load_records(dataset: str, *, split: str | None = None, subset: str | None = None,
                 fields: FieldSpec | str | None = None, revision: str | None = None, limit: int | None = None,
                 bad_rows: str | None = None, dedupe: bool | None = None,
                 stats: ReadStats | None = None) -> tuple[list[PromptRecord], Source]:
    """PromptRecords of ``dataset`` (see the module docstring) and its resolved Source. ``bad_rows`` / ``dedupe``
    None = the named set's choice (else error / off). Columns: ``fields``, else the named set's, else the
    ``prepared`` layout when the first row is in it, else the preset whose name starts the file / folder / repo
    name, else question / answer."""
    src = resolve_source(dataset, split, subset, fields, revision)
    stats = stats if stats is not None else ReadStats()
    bad_rows = bad_rows or src.bad_rows
    rows = _native_rows(Path(src.location), stats if bad_rows == "skip" else None) if src.kind == "file" else None
    if src.kind == "file" and (src.split or src.subset):
        raise DatasetError(f"{src.location}: a single file has no splits or subsets; unset data.split / "
                           "data.subset (or give a folder / Hub id)")
    if rows is None:
        ds = _load(src)
        rows = ((i, row) for i, row in enumerate(ds, start=1))
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        raise DatasetError(f"dataset {dataset!r}" + (f" split {src.split!r}" if src.split else "") + " has no rows")
    spec = src.fields
    if spec is None:
        spec = DATASET_PRESETS["prepared"] if is_prepared_row(first[1]) else resolve_fields(None, src.name)
    elif isinstance(spec, str):
        spec = resolve_fields(spec, src.name)
    where_name = src.location + (f" [{src.split}]" if src.split and src.kind != "file" else "")
    unit = "line" if src.kind == "file" and Path(src.location).suffix.lower() in (".jsonl", ".ndjson") else "row"
    where = (lambda n: f"{where_name}:{n}") if unit == "line" else (lambda n: f"{where_name}: row {n}")
    records = rows_to_records(itertools.chain([first], rows), spec, src.name, where, limit,
                              bad_rows=bad_rows, dedupe=src.dedupe if dedupe is None else dedupe, stats=stats)
    if not records:
        raise DatasetError(f"dataset {dataset!r}: no usable rows ({stats.rows} read, {len(stats.skipped)} "
                           f"skipped, e.g. {stats.skipped[:1]})")
    src.extra["fields"] = json.loads(json.dumps(spec.__dict__))
    return records, src
