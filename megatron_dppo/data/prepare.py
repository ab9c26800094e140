"""``megatron-dppo data prepare NAME|SUITE ... --out DIR``: fetch named datasets once (on a machine that reaches the
Hugging Face Hub) and write the files training and ``eval.suite`` read offline.

For every named set (``megatron_dppo.data.hub.HUB_DATASETS``) and each of its roles it writes
``DIR/<name>_<role>.jsonl`` (``gsm8k_train.jsonl``, ``gsm8k_test.jsonl``, ``math500_test.jsonl``, ...) in the
``prepared`` layout, one JSON object per line::

    {"id": "<the source's id, or its row number>", "prompt": "<problem text>", "answer": "<gold answer>",
     "raw": {<the source row as it was: worked solutions, levels, ...>}}

which ``data.train_files`` / ``data.dataset`` / ``eval.files`` read as they are (the reward is picked from the file
name: GSM8K's for gsm8k_*, math-verify otherwise) and ``eval.suite`` finds in ``eval.data_dir``. A suite name
(math6, math8) prepares the test role of each of its benchmarks. ``DIR/manifest.json`` records for every file its
source (Hub id, subset, split, revision, or the local path and its SHA-256), the rows read / written / skipped /
duplicate, the columns used, and the file's SHA-256; preparing into the same folder again adds to it.

``--source NAME=SRC`` (or ``NAME:ROLE=SRC``) reads NAME from SRC instead of its Hub id: another Hub id, a Hub-format
folder, or a file (then the columns follow the file name's preset, e.g. ``aime24.jsonl``, else NAME's own).

Errors: a source that cannot be read, an output folder that cannot be created (both ``DatasetError``: one
``error:`` line, exit 2) and a file system that fills up (``PrepareWriteError``, an OSError naming the file and the
folder: exit 1) stop the command; a file is only ever replaced whole (written to ``<name>.jsonl.tmp``, renamed),
and a failed write removes its ``.tmp``.
"""
from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
from pathlib import Path

from megatron_dppo.data.datasets import DatasetError, ReadStats, preset_for_name
from megatron_dppo.data.hub import HUB_DATASETS, ROLES, load_records, named
from megatron_dppo.data.suites import SUITES

MANIFEST = "manifest.json"


class PrepareWriteError(OSError):
    """An output file could not be written (disk full, quota, I/O error); names the file and its folder."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def expand(names: list[str], roles: list[str] | None = None) -> list[tuple[str, str]]:
    """(dataset name, role) pairs of NAME|SUITE arguments, in order, without repeats."""
    if not names:
        raise DatasetError(f"name at least one dataset ({', '.join(HUB_DATASETS)}) or suite ({', '.join(SUITES)})")
    for role in roles or ():
        if role not in ROLES:
            raise DatasetError(f"--roles: {role!r} is not one of {', '.join(ROLES)}")
    out: list[tuple[str, str]] = []
    for name in names:
        if name in SUITES:
            pairs = [(bench, "test") for bench, _ in SUITES[name]]
        else:
            d = named(name)
            pairs = [(name, role) for role in d.splits if not roles or role in roles]
            if not pairs:
                raise DatasetError(f"{name} has no role {' or '.join(roles or [])}; it has: {', '.join(d.splits)}")
        out.extend(p for p in pairs if p not in out)
    return out


def parse_sources(items: list[str]) -> dict[tuple[str, str | None], str]:
    """``NAME=SRC`` / ``NAME:ROLE=SRC`` -> {(name, role or None): src}."""
    out: dict[tuple[str, str | None], str] = {}
    for item in items:
        key, sep, src = item.partition("=")
        name, _, role = key.partition(":")
        if not sep or not src or not name:
            raise DatasetError(f"--source {item!r}: expected NAME=SRC or NAME:ROLE=SRC")
        named(name)
        if role and role not in ROLES:
            raise DatasetError(f"--source {item!r}: role {role!r} is not one of {', '.join(ROLES)}")
        out[(name, role or None)] = src
    return out


def _replace_whole(path: Path, write) -> None:
    """Write ``path`` through ``<name>.tmp`` (``write(handle)``) and rename it into place. On failure the ``.tmp``
    is removed and PrepareWriteError names the file and its folder (a full disk: ``No space left on device``)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            write(handle)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        reason = err.strerror or str(err)
        hint = " (free space there or choose another --out)" if err.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise PrepareWriteError(err.errno, f"{reason}: cannot write {path.name} in {path.parent}{hint}; no partial "
                                           "file was left", str(path)) from None


def _write_jsonl(records, path: Path) -> None:
    def write(handle):
        for r in records:
            row = {"id": r.id.split(":", 1)[1], "prompt": r.prompt, "answer": r.gold, "raw": r.raw}
            handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")

    _replace_whole(path, write)


def _out_error(out: Path, reason: str) -> DatasetError:
    return DatasetError(f"--out {out}: cannot create the output folder ({reason}); choose a writable folder")


def _check_out(out: Path) -> None:
    """Before any download: ``out`` exists as a folder, or its nearest existing parent is a folder that takes a
    new folder (probed with an empty one, removed again: /proc, /sys or a read-only mount refuse it)."""
    import tempfile  # noqa: PLC0415

    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise _out_error(out, f"{existing} is a file, not a folder")
    if existing == out:
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dppo-write-probe-", dir=existing))
    except OSError as err:
        raise _out_error(out, f"{existing} refuses a new folder: {err.strerror or err}") from None


def _make_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _out_error(out, f"{err.strerror or err}: {err.filename or out}") from None


def prepare(names: list[str], out: str | Path, sources: dict[tuple[str, str | None], str] | None = None,
            roles: list[str] | None = None, revision: str | None = None, limit: int | None = None,
            log=print) -> dict:
    """Write ``<out>/<name>_<role>.jsonl`` for every (name, role) of ``names`` and update ``<out>/manifest.json``;
    returns the manifest. Nothing is written for a dataset that fails to load (the error names it)."""
    out = Path(out)
    sources = sources or {}
    pairs = expand(names, roles)
    _check_out(out)  # before any download
    manifest_path = out / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"files": {}}
    try:
        import datasets  # noqa: PLC0415

        lib = f"datasets {datasets.__version__}"
    except ImportError:
        lib = "datasets not installed"
    for name, role in pairs:
        d = HUB_DATASETS[name]
        src = sources.get((name, role)) or sources.get((name, None))
        stats = ReadStats()
        if src is None:  # the named set itself: its Hub id, subset and the role's split
            records, resolved = load_records(name, split=role, revision=revision, limit=limit, stats=stats)
            entry = {"source": d.repo, "kind": "hub", "subset": resolved.subset, "split": resolved.split,
                     "revision": revision or "main"}
        else:
            local = Path(src).expanduser()
            split = None if local.is_file() else d.splits.get(role, role)
            fields = None if local.is_file() and preset_for_name(local.name) else d.fields
            records, resolved = load_records(src, split=split, subset=None if local.is_file() else d.subset,
                                             fields=fields, revision=revision,
                                             limit=limit, bad_rows=d.bad_rows, dedupe=d.dedupe, stats=stats)
            entry = {"source": str(local.resolve()) if local.exists() else src, "kind": resolved.kind,
                     "subset": resolved.subset, "split": resolved.split}
            if local.is_file():
                entry["source_sha256"] = sha256_file(local)
        path = out / f"{name}_{role}.jsonl"
        _make_out(out)
        _write_jsonl(records, path)
        entry.update({"dataset": name, "role": role, "reward": d.reward, "columns": resolved.extra["fields"],
                      "rows_read": stats.rows, "rows": len(records), "skipped": len(stats.skipped),
                      "duplicates": stats.duplicates, "skipped_examples": stats.skipped[:3],
                      "limit": limit, "sha256": sha256_file(path), "bytes": path.stat().st_size,
                      "prepared_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                      "library": lib})
        manifest["files"][path.name] = entry
        log(f"{path}: {len(records)} rows from {entry['source']}" + (f" [{entry['split']}]" if entry["split"] else "")
            + (f", {len(stats.skipped)} skipped" if stats.skipped else "")
            + (f", {stats.duplicates} duplicates dropped" if stats.duplicates else ""))
    manifest.update({"format": 1, "written_by": "megatron-dppo data prepare"})
    _make_out(out)
    _replace_whole(manifest_path, lambda h: h.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n"))
    log(f"{manifest_path}: {len(manifest['files'])} files")
    return manifest
