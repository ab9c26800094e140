"""The math benchmark files of ../shared/data/math (read in place, never copied); tests skip when absent."""
from pathlib import Path

import pytest

SHARED_MATH = Path(__file__).resolve().parents[3] / "shared" / "data" / "math"


def shared_math_file(name: str) -> Path:
    path = SHARED_MATH / name
    if not path.is_file():
        pytest.skip(f"shared data not available: {path}")
    return path
