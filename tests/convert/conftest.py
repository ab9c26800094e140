"""The conversion tests share the engine tests' helpers (tests/megatron: ``_dist``, ``_tiny``): on sys.path before
any test module here is imported, whatever order its imports are sorted in."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "megatron"))
