"""Benchmarks: measurements of the library, not tests (benchmarks/README.md indexes them by docs/benchmarks.md
section). Each script runs as ``python benchmarks/<name>.py`` or ``python -m benchmarks.<name>`` from the repository;
what they share is ``benchmarks/common.py``."""
