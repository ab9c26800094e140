"""The files of a checkpoint root, and what a crash can do to them: the in-process shard writer, the manifest
(sizes and SHA-256 of every file) with its verification, recovery of saves a crash interrupted, and the
disk-full diagnosis. ``checkpoint.py`` (what is saved and how it loads) builds on this module.

Writer. Megatron-Core's ``torch_dist`` save strategy writes the shards from helper processes: a
``multiprocessing`` Manager (spawned, ~300 MB, plus a resource tracker) that carries the results, and forked
writer processes. Those helpers sit in the trainer's process group, so a SIGTERM to the group (``scancel``,
preemption, ``timeout``, systemd) kills them in the middle of the checkpoint the signal asked for
(``BrokenPipeError``), and a SIGKILLed trainer leaves the Manager behind. :class:`InProcessSaveStrategy` is the
same strategy (same files, same format, same planner) with the shards written by threads of the calling
process: a signal reaches the trainer's handler only, and nothing outlives the trainer.

Manifest (``manifest.json``, written last, so its presence also marks a complete checkpoint). Each rank hashes
the shard files it has just written (they are still in the page cache: the cost is one memory-speed pass,
SHA-256 runs at ~0.5-2 GB/s per core with the CPU's SHA extensions), rank 0 hashes the small shared files
(``common.pt``, ``metadata.json``, ``.metadata``). Verification on load splits the files over the ranks.
``checkpoint.verify=size`` checks sizes only (truncation, deletion; no read at all).

Recovery (:func:`recover_interrupted_saves`, rank 0, before anything is read or removed). A save renames the
complete ``.tmp-<name>`` to ``<name>``; when ``<name>`` exists already it is first moved to ``.tmp-old-<name>``.
A crash between these renames leaves the step under a temporary name only: the complete newer copy (manifest
present and valid) or else the moved-aside copy is renamed back. Resuming takes the newest checkpoint (by step)
that verifies; the ``latest`` pointer names it after every completed save, and a warning says so when it does
not (missing, damaged, or behind after a crash just before it was updated) or when a damaged one is skipped.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from megatron_dppo.distributed import collectives as D

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
MANIFEST_FILE = "manifest.json"
TMP_PREFIX = ".tmp-"
ASIDE_PREFIX = ".tmp-old-"
NAME_RE = re.compile(r"^step_(\d{8,})$")
REQUIRED_FILES = ("metadata.json", "common.pt", ".metadata")  # what every dist_checkpointing directory holds
VERIFY_LEVELS = ("hash", "size")
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """No usable checkpoint, or a checkpoint that fails verification (names the files and the problem)."""


class CheckpointDiskFullError(OSError):
    """The file system ran out of space (or quota) while a checkpoint was written; nothing was committed."""


def step_of(path: Path) -> int:
    return int(NAME_RE.match(path.name).group(1))


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------
# The in-process writer
# ----------------------------------------------------------------------------------------------------------
def in_process_save_strategy():
    """Megatron's ``torch_dist`` save strategy, writing its shards from threads of this process (module
    docstring); after a save, ``strategy.written`` holds this rank's manifest entries of the files it wrote."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.base import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_finalize
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    # Megatron hands every writer one process-wide results queue, created on first use from a spawned
    # multiprocessing Manager. A plain thread-safe queue here means that Manager is never started; this
    # writer then gives each save a queue of its own.
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()

    class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
        def __init__(self):
            super().__init__("torch_dist", 1)
            self.written: dict[str, dict] = {}

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
            _, preload_fn, args = writer.get_save_function_and_args()
            transforms = [writer.transforms] if hasattr(writer, "transforms") else []
            save_fn = None
            if preload_fn is not None:
                writer.results_queue = args[2] = queue.Queue()
                save_fn = partial(_write_buckets_in_threads, transforms, self.written)

            def finalize_fn():
                save_state_dict_async_finalize(*save_state_dict_ret)

            return AsyncRequest(save_fn, args, [finalize_fn], preload_fn=preload_fn)

    def _write_buckets_in_threads(transforms, written, rank, write_buckets, results_queue) -> None:
        """Megatron's per-bucket writer (fsync included) on one thread per bucket; then hash what was written."""
        local, done = queue.Queue(), queue.Queue()

        def one(i, bucket):
            done.put(i)  # FileSystemWriterAsync.write_preloaded_data marks its task done on this queue
            FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, local, done, use_fsync=True)

        with ThreadPoolExecutor(max_workers=max(1, len(write_buckets)), thread_name_prefix="ckpt-write") as pool:
            list(pool.map(lambda ib: one(*ib), enumerate(write_buckets)))
        results: dict | Exception = {}
        for _ in write_buckets:
            index, result = local.get()
            if isinstance(result, Exception):
                results = result
                break
            results[index] = result
        if not isinstance(results, Exception):
            for file_path, _, _ in write_buckets:
                written[os.path.basename(file_path)] = file_entry(Path(file_path))
        results_queue.put(results)

    return InProcessSaveStrategy()


# ----------------------------------------------------------------------------------------------------------
# Manifest
# ----------------------------------------------------------------------------------------------------------
def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_of(path)}


def write_manifest(directory: Path, entries: dict[str, dict]) -> None:
    """Rank 0: complete ``entries`` (the shards the ranks hashed) with every other file, write the manifest."""
    files = dict(entries)
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if path.is_file() and rel != MANIFEST_FILE and rel not in files:
            files[rel] = file_entry(path)
    doc = {"format": 1, "hash": "sha256", "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "files": dict(sorted(files.items()))}
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_FILE)


def _problems_local(directory: Path, level: str, rank: int, world: int) -> list[str]:
    """This rank's share of the checks of one checkpoint directory (no collectives)."""
    if not directory.is_dir():
        return [f"{directory} is missing"]
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():  # written by an older version (no manifest): the files must at least be there
        missing = [f for f in REQUIRED_FILES if not (directory / f).is_file()]
        return [f"{directory / f} is missing" for f in missing] if rank == 0 else []
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{manifest} is unreadable ({type(err).__name__}: {err})"] if rank == 0 else []
    problems = []
    for i, (rel, want) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        path = directory / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        if size != want["size"]:
            problems.append(f"{path} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)")
        elif level == "hash" and sha256_of(path) != want["sha256"]:
            problems.append(f"{path} does not match its SHA-256 in {MANIFEST_FILE} (corrupted)")
    return problems


def verify_checkpoint(directory: str | os.PathLike, level: str = "hash") -> list[str]:
    """Collective: every problem of the checkpoint ``directory`` (missing, truncated or corrupted files), empty
    when it is usable. ``level``: ``hash`` (sizes and SHA-256) or ``size``. The files are split over ranks."""
    if level not in VERIFY_LEVELS:
        raise ValueError(f"checkpoint verification level {level!r}; valid: {', '.join(VERIFY_LEVELS)}")
    local = _problems_local(Path(directory), level, D.rank(), D.world_size())
    return [p for rank_problems in D.all_gather_objects(local) for p in rank_problems]


# ----------------------------------------------------------------------------------------------------------
# Recovery and choice of the checkpoint to resume from
# ----------------------------------------------------------------------------------------------------------
def _complete(directory: Path) -> bool:
    return directory.is_dir() and (directory / MANIFEST_FILE).is_file() and not _problems_local(directory, "size", 0, 1)


def recover_interrupted_saves(root: Path) -> list[str]:
    """Rank 0: put back under its final name every step a crash left under a temporary name only (module
    docstring); remove the moved-aside copies whose step is complete again. Returns what was done."""
    done = []
    if not root.is_dir():
        return done
    for aside in sorted(root.glob(f"{ASIDE_PREFIX}step_*")):
        name = aside.name[len(ASIDE_PREFIX):]
        final, newer = root / name, root / f"{TMP_PREFIX}{name}"
        if not NAME_RE.match(name):
            continue
        if not final.exists():
            source = newer if _complete(newer) else aside
            source.rename(final)
            done.append(f"{final} was under the temporary name {source.name} (a save was interrupted); renamed back")
        if aside.exists():
            shutil.rmtree(aside, ignore_errors=True)
    for tmp in sorted(root.glob(f"{TMP_PREFIX}step_*")):
        name = tmp.name[len(TMP_PREFIX):]
        if NAME_RE.match(name) and not (root / name).exists() and _complete(tmp):
            tmp.rename(root / name)
            done.append(f"{root / name} was complete under the temporary name {tmp.name} (the process stopped "
                        "before renaming it); renamed")
    if done:
        fsync_dir(root)
    return done


def _candidates(root: Path) -> tuple[list[Path], str | None]:
    """Checkpoint directories to try, newest step first, and a note when the ``latest`` pointer does not name
    the first of them (missing, unreadable, naming a missing step, or behind: the process stopped between
    renaming a new checkpoint into place and updating the pointer)."""
    steps = sorted((p for p in root.iterdir() if p.is_dir() and NAME_RE.match(p.name)), key=step_of, reverse=True)
    pointer = root / LATEST_FILE
    if not steps:
        return steps, None
    if not pointer.is_file():
        return steps, f"{pointer} is missing"
    name = pointer.read_text(errors="replace").strip()
    if name != steps[0].name:
        return steps, f"{pointer} names {name!r}, but the newest checkpoint under {root} is {steps[0].name}"
    return steps, None


def write_latest(root: Path, name: str) -> None:
    """Point ``latest`` at ``name`` (written to a temporary name, fsynced, renamed)."""
    tmp = root / f".{LATEST_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_FILE)
    fsync_dir(root)


def find_checkpoint(root: str | os.PathLike, level: str = "hash", repair: bool = True) -> Path | None:
    """Collective: the checkpoint under ``root`` that a run resumes from and every reader of a checkpoint root
    takes (convert, eval, ``load_checkpoint`` of a root): the newest one that verifies (normally the one ``latest``
    names; a warning says what was skipped and why); None when ``root`` holds none. Raises
    :class:`CheckpointError` when checkpoints exist but none is usable.

    ``repair`` (the trainer, which owns the folder): first put back what an interrupted save left under a
    temporary name, and afterwards point ``latest`` at the chosen checkpoint when it names another (a crash
    between renaming a new checkpoint into place and updating the pointer left it behind; a finished run never
    saves again to fix it). Without ``repair`` nothing is written."""
    root = Path(root)
    if repair and D.rank() == 0:
        for line in recover_interrupted_saves(root):
            logger.warning("checkpoint recovery: %s", line)
    D.barrier()
    if not root.is_dir():
        return None
    candidates, note = _candidates(root)
    candidates = [Path(p) for p in D.broadcast_object([str(p) for p in candidates])]  # one list on every rank
    if note and D.rank() == 0:
        logger.warning("%s; taking the newest usable checkpoint", note)
    rejected = []
    for path in candidates:
        problems = verify_checkpoint(path, level)
        if not problems:
            if rejected and D.rank() == 0:
                logger.warning("taking %s, the newest usable checkpoint; skipped: %s", path, "; ".join(rejected))
            if repair and (note or rejected) and D.rank() == 0:
                write_latest(root, path.name)
                logger.warning("%s now names %s", root / LATEST_FILE, path.name)
            D.barrier()
            return path
        rejected.append(f"{path.name}: {'; '.join(problems)}")
    if rejected:
        raise CheckpointError(f"no usable checkpoint under {root}: " + "; ".join(rejected) + ". Restore the files, "
                              "or move the checkpoints away to start over (metrics.jsonl is kept as a copy)")
    return None


# ----------------------------------------------------------------------------------------------------------
# Disk full
# ----------------------------------------------------------------------------------------------------------
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_LOW_SPACE_BYTES = 1 << 20


def _exceptions_in(err: BaseException | None):
    """``err``, its causes and contexts, and the per-rank failures a torch.distributed CheckpointException holds."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [a for a in getattr(e, "args", ()) if isinstance(a, BaseException)]


def free_bytes(path: Path) -> tuple[int, int]:
    """(bytes available to this user, total bytes) of the file system holding ``path`` (or its nearest parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def out_of_space(err: BaseException | None, directory: Path) -> bool:
    """Did this failure come from a full file system (or quota)? The errno or its text when they survived
    (torch's zip writer turns a failed write into ``RuntimeError ... unexpected pos``, losing both), else the
    free space left."""
    # (torch.distributed gathers the writers' exceptions pickled, which drops their causes: the text remains)
    texts = tuple(os.strerror(code) for code in _NO_SPACE)
    if any((isinstance(e, OSError) and e.errno in _NO_SPACE) or any(t in str(e) for t in texts)
           for e in _exceptions_in(err)):
        return True
    if err is None:
        return False
    try:
        return free_bytes(directory)[0] < _LOW_SPACE_BYTES
    except OSError:
        return False


def disk_full_error(final: Path, root: Path, previous: Path | None) -> CheckpointDiskFullError:
    try:
        free, total = free_bytes(root)
        space = f"{free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB"
    except OSError:
        space = "free space unknown"
    kept = f"the previous checkpoint {previous} is intact" if previous is not None else "no earlier checkpoint exists"
    return CheckpointDiskFullError(
        errno.ENOSPC, f"disk full: no space left on the file system of {root} ({space}) while writing checkpoint "
        f"{final.name}; nothing of it was kept and {kept}. Free space there or set checkpoint.dir to a larger "
        "file system, then run the same command again to resume")

