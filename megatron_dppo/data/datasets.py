"""Prompt datasets from JSONL or parquet files with configurable field names.

Every row becomes a ``PromptRecord(id, prompt, gold, raw)``. Which fields hold the prompt and the gold answer is a
``FieldSpec``; presets cover the common math files (their field names differ):

    gsm8k          question            answer after "#### "     (openai/gsm8k; gsm8k_train/test.jsonl)
    math500        problem             answer                   (MATH-500)
    math           problem             answer                   (a MATH split with an answer column)
    math_lighteval problem             last \\boxed{} of solution (MATH / MATH-lighteval: no answer column)
    aime24, amc23  problem             answer                   (numbers like 27.0 become "27")
    minerva_math   problem             last \\boxed{} of solution
    olympiadbench  question            final_answer (a list, joined with ", ")
    svamp          "{Body} {Question}"  Answer
    asdiv          "{body} {question}"  answer without its "(unit)" suffix
    deepscaler     problem             answer
    dapo_math_17k  prompt.0.content    reward_model.ground_truth (the verl chat layout)
    prepared       prompt              answer                   (what ``megatron-dppo data prepare`` writes)

A field name may be a dotted path into nested rows: ``reward_model.ground_truth``, ``prompt.0.content`` (a list
index). ``load_prompt_dataset(path)`` reads a file whose rows carry ``id``, ``prompt`` (text) and ``answer`` as the
``prepared`` layout; otherwise it picks the preset from the file name when ``fields`` is not given and falls back to
``FieldSpec()`` (question / answer). A prompt spec containing "{" is a template over the row's fields. Hub ids and
Hub-format folders are read by ``megatron_dppo.data.hub``.

Bad input fails early with the file, the line (row number for parquet) and the field: invalid JSON, a line that
is not UTF-8, a row that is not an object, a missing / null / non-text field, an empty prompt, a GSM8K answer
without "#### ". A missing file, a file without rows, an unsupported file type and a file its reader cannot parse
(a damaged parquet file) fail too. All of these raise ``DatasetError`` (a ValueError: the CLI prints one
``error:`` line and exits 2). The one exception is a read with ``bad_rows="skip"`` (named sets that choose it,
e.g. deepscaler, in ``megatron-dppo data prepare``): every unreadable row, an invalid JSON line included, is
dropped and counted (``ReadStats``, the manifest's ``skipped``) and the read goes on; a file that cannot be parsed
at all still fails.
"""
from __future__ import annotations

import itertools
import json
import re
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_dppo.rewards.math import extract_gsm8k_gold, format_number, last_boxed, parse_number


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file, line and field."""


class DatasetFileNotFoundError(DatasetError, FileNotFoundError):
    """The dataset file does not exist."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt. ``id`` is stable across runs (prompt history and resume key on it); ``gold`` is the reference
    answer as text (None for prompt-only data); ``raw`` is the source row."""

    id: str
    prompt: str
    gold: str | None
    raw: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class Prompt:
    """A training/eval prompt, rendered with its template and tokenized once at start-up (``gold``: the reference
    answer the reward compares with; ``messages``: the chat messages it was rendered from with the chat template,
    empty for the other templates: a multi-turn episode's ``Task`` carries them, docs/environments.md)."""

    id: str
    token_ids: list[int]
    gold: Any
    text: str
    messages: tuple[dict, ...] = ()


ANSWER_FORMATS = ("plain", "gsm8k", "boxed", "list", "strip_units")


@dataclass(frozen=True)
class FieldSpec:
    """Where a row keeps its prompt, gold answer and id.

    prompt: a field name, or a template such as "{Body} {Question}" (any text with "{field}" placeholders).
    answer: the gold-answer field, or None for prompt-only data.
    answer_format: how to read the gold from that field:
        plain       the value as text (integral floats such as 27.0 become "27")
        gsm8k       the number after "#### "
        boxed       the content of the last \\boxed{} (e.g. a worked solution)
        list        a list of answers joined with ", "
        strip_units drop a trailing "(unit)": "9 (apples)" -> "9"
    id: a field with a unique id; None uses "<file stem>:<line>".
    """

    prompt: str = "question"
    answer: str | None = "answer"
    answer_format: str = "plain"
    id: str | None = None

    def __post_init__(self):
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format {self.answer_format!r} is not one of {ANSWER_FORMATS}")
        if not self.prompt:
            raise ValueError("FieldSpec.prompt must name a field or be a template")


DATASET_PRESETS: dict[str, FieldSpec] = {
    "gsm8k": FieldSpec("question", "answer", "gsm8k"),
    "math500": FieldSpec("problem", "answer", "plain", id="unique_id"),
    "math": FieldSpec("problem", "answer", "plain"),
    "aime24": FieldSpec("problem", "answer", "plain", id="id"),
    "amc23": FieldSpec("problem", "answer", "plain", id="id"),
    "minerva_math": FieldSpec("problem", "solution", "boxed", id="idx"),
    "olympiadbench": FieldSpec("question", "final_answer", "list", id="id"),
    "svamp": FieldSpec("{Body} {Question}", "Answer", "plain", id="ID"),
    "asdiv": FieldSpec("{body} {question}", "answer", "strip_units", id="idx"),
    "math_lighteval": FieldSpec("problem", "solution", "boxed"),
    "deepscaler": FieldSpec("problem", "answer", "plain"),
    "dapo_math_17k": FieldSpec("prompt.0.content", "reward_model.ground_truth", "plain", id="extra_info.index"),
    "prepared": FieldSpec("prompt", "answer", "plain", id="id"),
}
PREPARED_KEYS = ("id", "prompt", "answer")  # a row with these (prompt as text) is read with the "prepared" preset


def is_prepared_row(row: dict) -> bool:
    """A row in the layout ``megatron-dppo data prepare`` writes: id, prompt (text) and answer."""
    return all(k in row for k in PREPARED_KEYS) and isinstance(row["prompt"], str)


def resolve_fields(fields: FieldSpec | str | None, path: str | Path) -> FieldSpec:
    """A FieldSpec from a spec, a preset name, or (None) the preset whose name starts the file name."""
    if isinstance(fields, FieldSpec):
        return fields
    if isinstance(fields, str):
        if fields not in DATASET_PRESETS:
            raise DatasetError(f"unknown dataset preset {fields!r}; presets: {', '.join(sorted(DATASET_PRESETS))}")
        return DATASET_PRESETS[fields]
    if fields is not None:
        raise DatasetError(f"fields must be a FieldSpec, a preset name or None, got {type(fields).__name__}")
    name = preset_for_name(path)
    return DATASET_PRESETS[name] if name else FieldSpec()


def preset_for_name(path: str | Path) -> str | None:
    """The preset whose name is the file name's stem or starts it before "_" / "-"; None when none does."""
    stem = Path(path).name.split(".")[0].lower()
    for name in sorted(DATASET_PRESETS, key=len, reverse=True):  # "math500" before "math"
        if stem == name or stem.startswith(name + "_") or stem.startswith(name + "-"):
            return name
    return None


# ---------------------------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------------------------


def _iter_jsonl(path: Path, skipped: ReadStats | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, row) of a JSON lines file. A line that is not a JSON object raises DatasetError, or with
    ``skipped`` (``bad_rows="skip"``) is counted there and passed over."""
    offset = 0  # of the line in the file, in bytes
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            start, offset = offset, offset + len(raw)
            try:
                row = _json_object(raw, start, f"{path}:{line_no}")
            except DatasetError as err:
                if skipped is None:
                    raise
                skipped.rows += 1
                skipped.skipped.append(str(err))
                continue
            if row is not None:
                yield line_no, row


def _json_object(raw: bytes, offset: int, where: str) -> dict | None:
    """One JSON lines row (None for a blank line); ``offset``: the line's byte offset in the file."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(f"{where}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte offset "
                           f"{offset + err.start} of the file); save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
    return row


PAIR_FIELDS = ("prompt", "chosen", "rejected")


def read_preference_pairs(path: str | Path) -> list[dict[str, str]]:
    """The preference pairs of a JSON lines file (``megatron-dppo rm train --pairs``): one object per line with the
    texts ``prompt``, ``chosen`` and ``rejected`` (numbers are read as text). DatasetError naming the file and line
    for a line that is not UTF-8, not JSON, not an object or lacks a text; at least 2 pairs (the last 10% are held
    out)."""
    path = Path(path)
    if not path.exists():
        raise DatasetFileNotFoundError(f"preference pairs file not found: {path}")
    if not path.is_file():
        raise DatasetError(f"preference pairs path is not a file: {path}")
    pairs = []
    for line_no, row in _iter_jsonl(path):
        where = f"{path}:{line_no}"
        missing = [name for name in PAIR_FIELDS if name not in row]
        if missing:
            keys = ", ".join(sorted(map(str, row))) or "none"
            raise DatasetError(f"{where}: missing field(s) {', '.join(missing)} (the row has: {keys}); each line "
                               "is a JSON object with the texts prompt, chosen, rejected")
        pairs.append({name: _text(row[name], where, name) for name in PAIR_FIELDS})
    if len(pairs) < 2:
        found = "no preference pairs (the file is empty)" if not pairs else "one preference pair"
        raise DatasetError(f"{path}: {found}; rm train needs at least 2 (the last 10% are held out), one JSON "
                           "object with the texts prompt, chosen, rejected per line")
    return pairs


def _iter_parquet(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading parquet files needs pyarrow, which is not installed "
                           "(pip install pyarrow), or convert the file to JSONL") from None
    import pyarrow as pa

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:  # a damaged or truncated file: "Couldn't deserialize thrift", ...
        raise DatasetError(f"{path}: not a readable parquet file ({type(err).__name__}: "
                           f"{str(err).strip().splitlines()[0] if str(err).strip() else 'no detail'})") from None
    for row_no, row in enumerate(table.to_pylist(), start=1):
        yield row_no, row


def _text(value: Any, where: str, name: str) -> str:
    if value is None:
        raise DatasetError(f"{where}: field {name!r} is null")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{where}: field {name!r} must be text or a number, got {type(value).__name__}")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _get(row: dict, name: str, where: str) -> Any:
    """``row[name]``; a name that is not a key but contains dots is a path: ``a.b`` = row["a"]["b"], ``a.0`` = the
    first element of the list row["a"]."""
    if name in row:
        return row[name]
    value: Any = row
    if "." in name:
        for part in name.split("."):
            if isinstance(value, dict) and part in value:
                value = value[part]
            elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                break
        else:
            return value
    keys = ", ".join(sorted(map(str, row))) or "none"
    raise DatasetError(f"{where}: missing field {name!r} (the row has: {keys}); set the dataset's field names")


def _prompt(row: dict, spec: FieldSpec, where: str) -> str:
    if "{" in spec.prompt:  # literal text and {field} values in order (a field may be a dotted path)
        text = "".join(literal + ("" if name is None else _text(_get(row, name, where), where, name))
                       for literal, name, _, _ in string.Formatter().parse(spec.prompt))
    else:
        value = _get(row, spec.prompt, where)
        if not isinstance(value, str):
            raise DatasetError(f"{where}: field {spec.prompt!r} must be a string, got {type(value).__name__}")
        text = value
    if not text.strip():
        raise DatasetError(f"{where}: field {spec.prompt!r} is an empty prompt")
    return text


_UNITS_RE = re.compile(r"^(.*?)\s*\([^()]*\)\s*$", re.S)


def _gold(row: dict, spec: FieldSpec, where: str) -> str | None:
    if spec.answer is None:
        return None
    value = _get(row, spec.answer, where)
    fmt = spec.answer_format
    if fmt == "list":
        if not isinstance(value, list) or not value:
            raise DatasetError(f"{where}: field {spec.answer!r} must be a non-empty list for answer_format 'list', "
                               f"got {value!r:.60}")
        return ", ".join(_text(v, where, spec.answer) for v in value)
    text = _text(value, where, spec.answer)
    if fmt == "gsm8k":
        if "####" not in text:
            raise DatasetError(f"{where}: field {spec.answer!r} has no '#### <answer>' line (answer_format 'gsm8k')")
        try:
            return extract_gsm8k_gold(text)
        except ValueError as err:
            raise DatasetError(f"{where}: field {spec.answer!r}: {err}") from None
    if fmt == "boxed":
        boxed = last_boxed(text)
        if boxed is None:
            raise DatasetError(f"{where}: field {spec.answer!r} has no \\boxed{{}} answer (answer_format 'boxed')")
        return boxed.strip()
    if fmt == "strip_units":
        match = _UNITS_RE.match(text)
        text = match.group(1) if match and match.group(1) else text
        number = parse_number(text) if re.fullmatch(r"\s*-?[\d,.]+\s*", text) else None
        return format_number(number) if number is not None else text.strip()
    if not text.strip():
        raise DatasetError(f"{where}: field {spec.answer!r} is empty")
    return text.strip()


# ---------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------


class PromptDataset(Sequence):
    """An in-memory list of PromptRecords with unique ids."""

    def __init__(self, records: Sequence[PromptRecord], name: str = "prompts"):
        if not records:
            raise DatasetError(f"dataset {name!r} has no records")
        seen: dict[str, int] = {}
        for i, record in enumerate(records):
            if record.id in seen:
                raise DatasetError(f"dataset {name!r}: duplicate id {record.id!r} (records {seen[record.id]} and {i})")
            seen[record.id] = i
        self.records = list(records)
        self.name = name

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index):
        return self.records[index]

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.records]

    def __repr__(self) -> str:
        return f"PromptDataset({self.name!r}, {len(self)} records)"


BAD_ROWS = ("error", "skip")


@dataclass
class ReadStats:
    """What reading a dataset dropped: rows that could not be read (``bad_rows="skip"``: one message each, naming
    the row and the field) and rows whose prompt and gold repeat an earlier row's (``dedupe``)."""

    rows: int = 0
    skipped: list = field(default_factory=list)
    duplicates: int = 0


def rows_to_records(rows: Iterable[tuple[int, dict]], spec: FieldSpec | None, name: str,
                    where: Callable[[int], str], limit: int | None = None, *, bad_rows: str = "error",
                    dedupe: bool = False, stats: ReadStats | None = None) -> list[PromptRecord]:
    """PromptRecords of ``(row number, row)`` pairs. ``spec`` None: the ``prepared`` layout when the first row is
    in it (``is_prepared_row``), else ``FieldSpec()``. Ids are ``<name>:<id field>`` or ``<name>:<row number>``.
    ``bad_rows``: error (the first unreadable row raises DatasetError) or skip (drop it, counted in ``stats``);
    ``dedupe``: drop a row whose prompt and gold equal an earlier row's."""
    if bad_rows not in BAD_ROWS:
        raise ValueError(f"bad_rows={bad_rows!r} is not one of {BAD_ROWS}")
    stats = stats if stats is not None else ReadStats()
    records: list[PromptRecord] = []
    seen: set[tuple[str, str | None]] = set()
    for row_no, row in rows:
        stats.rows += 1
        at = where(row_no)
        if spec is None:
            spec = DATASET_PRESETS["prepared"] if is_prepared_row(row) else FieldSpec()
        try:
            key = row_no if spec.id is None else _text(_get(row, spec.id, at), at, spec.id)
            record_id = f"{name}:{key}"
            record = PromptRecord(record_id, _prompt(row, spec, at), _gold(row, spec, at), row)
        except DatasetError as err:
            if bad_rows == "error":
                raise
            stats.skipped.append(str(err))
            continue
        if dedupe:
            if (record.prompt, record.gold) in seen:
                stats.duplicates += 1
                continue
            seen.add((record.prompt, record.gold))
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    return records


def read_prompt_records(path: str | Path, fields: FieldSpec | str | None = None,
                        limit: int | None = None) -> list[PromptRecord]:
    """PromptRecords of one JSONL (``.jsonl``/``.json`` lines) or parquet file; see the module docstring."""
    path = Path(path)
    if not path.exists():
        raise DatasetFileNotFoundError(f"dataset file not found: {path}")
    if not path.is_file():
        raise DatasetError(f"dataset path is not a file: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        rows, unit = _iter_parquet(path), "row"
    elif suffix in (".jsonl", ".json", ".ndjson"):
        rows, unit = _iter_jsonl(path), "line"
    else:
        raise DatasetError(f"{path}: unsupported dataset format {suffix!r}; use .jsonl or .parquet (other formats "
                           "and Hub-format folders: data.dataset)")
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        raise DatasetError(f"{path}: the dataset is empty (no rows)")
    prepared = fields is None and is_prepared_row(first[1])
    spec = DATASET_PRESETS["prepared"] if prepared else resolve_fields(fields, path)
    where = (lambda n: f"{path}:{n}") if unit == "line" else (lambda n: f"{path}: row {n}")
    return rows_to_records(itertools.chain([first], rows), spec, path.stem, where, limit)


def load_prompt_dataset(paths: str | Path | Sequence[str | Path], fields: FieldSpec | str | None = None,
                        limit: int | None = None) -> PromptDataset:
    """A PromptDataset from one or more files (concatenated in order); ``limit`` caps the records per file."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise DatasetError("no dataset files given")
    records = [r for p in paths for r in read_prompt_records(p, fields, limit)]
    name = "+".join(Path(p).stem for p in paths)
    return PromptDataset(records, name)
