"""A real small file system for disk-full tests: a tmpfs mounted for the test (root only), unmounted after."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: int):
    """Mount a tmpfs of ``size`` bytes (rounded down to whole pages) at ``mnt``; skip the test where that fails."""
    mnt.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 4096 * 4096}", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
