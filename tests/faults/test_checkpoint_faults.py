"""Fault injection at the checkpoint layer (real engine, real files, one process): interrupted saves, damaged
files, a lost ``latest`` pointer, a full disk, and the absence of helper processes around a save.

Every case ends in the newest usable checkpoint (restored bit for bit: the tensors read back equal the ones
saved) or in one error naming the files; nothing that was committed is lost."""
from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import _engine_fixtures as F
from _dist import single_process_world
from _tmpfs import small_tmpfs


@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=F.SEED):
        yield


def _engine():
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    seed_everything(F.SEED)
    return PolicyEngine(F.tiny_arch(num_layers=2), ParallelConfig(), OptimConfig(lr=1e-3),
                        LossConfig(kl_coef=0.0).resolved())


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.modules[0].state_dict().items() if isinstance(v, torch.Tensor)}


def _save_steps(engine, root: Path, steps) -> dict[int, dict[str, torch.Tensor]]:
    """Save a checkpoint at each step, with different weights each time; returns the weights per step."""
    from megatron_dppo.megatron.checkpoint import save_checkpoint

    saved = {}
    for step in steps:
        with torch.no_grad():
            for p in engine.modules[0].parameters():
                p.add_(0.01 * step)
        engine.optimizer.reload_model_params()
        engine.step = step
        save_checkpoint(engine, root, extra={"step": step}, keep_last=10)
        saved[step] = _params(engine)
    return saved


def _loads_as(engine, path: Path, expected: dict[str, torch.Tensor]) -> bool:
    from megatron_dppo.megatron.checkpoint import load_checkpoint

    with torch.no_grad():
        for p in engine.modules[0].parameters():
            p.zero_()
    load_checkpoint(engine, path)
    got = _params(engine)
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def _largest_shard(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


# ---------------------------------------------------------------------------------------------- helper processes
def test_save_starts_no_helper_process(world, tmp_path):
    """Megatron's default writer spawns a Manager (+ resource tracker) and forks writer processes: a SIGTERM to
    the process group killed them mid-save and a SIGKILLed trainer orphaned them. Ours writes from threads."""
    import psutil

    engine = _engine()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    _save_steps(engine, tmp_path, [1, 2])
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before and not multiprocessing.active_children()
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    assert type(filesystem_async._results_queue).__module__ == "queue"  # never a Manager proxy


# ---------------------------------------------------------------------------------------------- interrupted saves
@pytest.mark.parametrize("newer_copy", ["complete", "partial", "absent"])
def test_killed_between_moving_aside_and_renaming(world, tmp_path, newer_copy, caplog):
    """Re-saving step 7: the old step_7 was moved to .tmp-old-step_7, the new copy not yet renamed (the state a
    SIGKILL there leaves; test_cli_faults kills a real process at that point). The next start takes step 7
    back automatically: the complete new copy if there is one, else the moved-aside copy, with a warning."""
    from megatron_dppo.megatron.checkpoint import find_resume_checkpoint

    engine = _engine()
    saved = _save_steps(engine, tmp_path, [5, 7])
    want = saved[7]
    (tmp_path / "step_00000007").rename(tmp_path / ".tmp-old-step_00000007")
    if newer_copy == "complete":
        want = _save_steps(engine, tmp_path / "other", [7])[7]
        shutil.copytree(tmp_path / "other" / "step_00000007", tmp_path / ".tmp-step_00000007")
    elif newer_copy == "partial":
        shutil.copytree(tmp_path / ".tmp-old-step_00000007", tmp_path / ".tmp-step_00000007")
        (tmp_path / ".tmp-step_00000007" / "manifest.json").unlink()  # the manifest is written last
        _largest_shard(tmp_path / ".tmp-step_00000007").write_bytes(b"half")
    with caplog.at_level(logging.WARNING):
        found = find_resume_checkpoint(tmp_path)
    assert found == tmp_path / "step_00000007"
    assert "interrupted" in caplog.text or "temporary name" in caplog.text
    assert _loads_as(engine, found, want)
    assert not list(tmp_path.glob(".tmp-old-*"))


def test_complete_copy_never_renamed_is_taken(world, tmp_path, caplog):
    """Killed after the manifest was written but before the rename (so `latest` still names step 3): the
    complete copy of step 4 is renamed into place and taken, with a warning about the pointer."""
    from megatron_dppo.megatron.checkpoint import find_resume_checkpoint

    engine = _engine()
    saved = _save_steps(engine, tmp_path, [3, 4])
    (tmp_path / "step_00000004").rename(tmp_path / ".tmp-step_00000004")
    (tmp_path / "latest").write_text("step_00000003\n")
    with caplog.at_level(logging.WARNING):
        found = find_resume_checkpoint(tmp_path)
    assert found == tmp_path / "step_00000004" and "names 'step_00000003'" in caplog.text
    assert _loads_as(engine, found, saved[4])


# ---------------------------------------------------------------------------------------------- damaged files
def _truncate(path: Path):
    shard = _largest_shard(path)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _bit_flip(path: Path):
    shard = _largest_shard(path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def _delete_common(path: Path):
    (path / "common.pt").unlink()


def _garbage_manifest(path: Path):
    (path / "manifest.json").write_bytes(b"\xff\x00{")


@pytest.mark.parametrize("damage", [_truncate, _bit_flip, _delete_common, _garbage_manifest],
                         ids=["truncated-shard", "bit-flip", "no-common.pt", "garbage-manifest"])
def test_damaged_latest_falls_back_to_the_previous_good_one(world, tmp_path, damage, caplog):
    from megatron_dppo.megatron.checkpoint import CheckpointError, find_resume_checkpoint, load_checkpoint

    engine = _engine()
    saved = _save_steps(engine, tmp_path, [2, 4])
    damage(tmp_path / "step_00000004")
    with caplog.at_level(logging.WARNING):
        found = find_resume_checkpoint(tmp_path)
    assert found == tmp_path / "step_00000002"
    assert "skipped: step_00000004" in caplog.text
    assert _loads_as(engine, found, saved[2])
    with pytest.raises(CheckpointError, match="step_00000004"):  # a direct load refuses the damaged one
        load_checkpoint(engine, tmp_path / "step_00000004")

    damage(tmp_path / "step_00000002")  # none is good: one clear error naming each and the problem
    with pytest.raises(CheckpointError, match=r"no usable checkpoint under .*step_00000004: .*step_00000002: "):
        find_resume_checkpoint(tmp_path)


def test_size_level_detects_truncation_without_reading(world, tmp_path):
    from megatron_dppo.megatron.checkpoint import verify_checkpoint

    engine = _engine()
    _save_steps(engine, tmp_path, [1])
    path = tmp_path / "step_00000001"
    assert verify_checkpoint(path, "size") == [] and verify_checkpoint(path, "hash") == []
    _bit_flip(path)
    assert verify_checkpoint(path, "size") == []  # same size: only the hash sees a flipped bit
    assert "SHA-256" in verify_checkpoint(path, "hash")[0]
    _truncate(path)
    assert "truncated" in verify_checkpoint(path, "size")[0]


# ---------------------------------------------------------------------------------------------- lost pointer
@pytest.mark.parametrize("pointer", ["deleted", "garbage", "names-a-missing-step"])
def test_lost_latest_pointer_takes_the_newest_complete_checkpoint(world, tmp_path, pointer, caplog):
    from megatron_dppo.megatron.checkpoint import find_resume_checkpoint

    engine = _engine()
    saved = _save_steps(engine, tmp_path, [2, 4, 6])
    (tmp_path / ".tmp-step_00000008").mkdir()  # an unfinished save is never taken
    if pointer == "deleted":
        (tmp_path / "latest").unlink()
    elif pointer == "garbage":
        (tmp_path / "latest").write_bytes(b"\xff\xfe\n")
    else:
        (tmp_path / "latest").write_text("step_00000009\n")
    with caplog.at_level(logging.WARNING):
        found = find_resume_checkpoint(tmp_path)
    assert found == tmp_path / "step_00000006" and "taking the newest usable checkpoint" in caplog.text
    assert _loads_as(engine, found, saved[6])


def test_a_pointer_left_behind_is_repaired_on_resume_and_every_reader_takes_the_trainers_checkpoint(world, tmp_path):
    """A kill right after the final checkpoint was renamed into place, before ``latest`` was updated: ``latest``
    names step 4 while step 6 is complete. Readers of the root (``resolve_checkpoint``: load_checkpoint of a root,
    ``convert megatron-to-hf``'s find_model_checkpoint) take step 6, the one a resume takes, and write nothing;
    the resume itself points ``latest`` at step 6 (a finished run never saves again to fix it). Before, readers
    followed the pointer to step 4 forever."""
    from megatron_dppo.convert.checkpoint import find_model_checkpoint
    from megatron_dppo.megatron.checkpoint import find_resume_checkpoint, resolve_checkpoint

    engine = _engine()
    saved = _save_steps(engine, tmp_path, [2, 4, 6])
    (tmp_path / "latest").write_text("step_00000004\n")
    assert resolve_checkpoint(tmp_path) == tmp_path / "step_00000006"
    assert find_model_checkpoint(tmp_path) == tmp_path / "step_00000006"
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"  # readers leave the folder as it is
    assert find_resume_checkpoint(tmp_path) == tmp_path / "step_00000006"
    assert (tmp_path / "latest").read_text().strip() == "step_00000006"  # the trainer repairs it
    assert _loads_as(engine, resolve_checkpoint(tmp_path), saved[6])


# ---------------------------------------------------------------------------------------------- disk full
def test_disk_full_injected_enospc_is_named_and_keeps_the_previous(world, tmp_path, monkeypatch):
    """ENOSPC injected at the write layer (every shard write fails as a full disk would): the error says so."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_dppo.megatron.checkpoint import CheckpointDiskFullError, find_resume_checkpoint

    engine = _engine()
    saved = _save_steps(engine, tmp_path, [1])

    def no_space(transforms, index, bucket, results, count, **kwargs):
        count.get(), count.task_done()
        results.put((index, OSError(errno.ENOSPC, "No space left on device")))

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(no_space))
    with pytest.raises(CheckpointDiskFullError, match=rf"disk full: .*{tmp_path}.*previous checkpoint .*step_00000001"):
        _save_steps(engine, tmp_path, [2])
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    assert _loads_as(engine, find_resume_checkpoint(tmp_path), saved[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (the injected case runs always)")
def test_disk_full_on_a_real_small_filesystem(world, tmp_path):
    """A tmpfs 1.5 times the size of one checkpoint holds one and part of a second: the second save fails with an
    error that names the file system, leaves no partial directory, and the first one still verifies and loads."""
    from megatron_dppo.megatron.checkpoint import CheckpointDiskFullError, find_resume_checkpoint

    engine = _engine()
    _save_steps(engine, tmp_path / "probe", [1])
    size = sum(p.stat().st_size for p in (tmp_path / "probe").rglob("*") if p.is_file())
    with small_tmpfs(tmp_path / "small", size * 3 // 2) as mnt:
        engine = _engine()
        saved = _save_steps(engine, mnt, [1])
        with pytest.raises(CheckpointDiskFullError, match=rf"disk full: no space left on the file system of {mnt}"):
            _save_steps(engine, mnt, [2])
        assert sorted(p.name for p in mnt.iterdir()) == ["latest", "step_00000001"]
        assert _loads_as(engine, find_resume_checkpoint(mnt), saved[1])
