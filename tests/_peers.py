"""Where the parity tests find verl 0.9.1: ``.peers/verl`` (``make peers``: requirements/verl-peer.txt installed
with ``--no-deps --target``), never in .venv, whose tests package verl's wheel would shadow. ``verl_path()`` puts
the folder on sys.path while a test imports verl's modules (and takes it off again); skips when it is absent."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

VERL_SITE = Path(__file__).resolve().parents[1] / ".peers" / "verl"
VERL_PACKAGE = VERL_SITE / "verl"  # the package's own files (read by tests that compile single functions)


@contextlib.contextmanager
def verl_path():
    if not VERL_PACKAGE.is_dir():
        pytest.skip(f"verl 0.9.1 is not installed in {VERL_SITE} (make peers)")
    sys.path.insert(0, str(VERL_SITE))
    try:
        yield VERL_PACKAGE
    finally:
        sys.path.remove(str(VERL_SITE))
