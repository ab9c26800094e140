"""Named evaluation suites: the benchmark files the papers report, by name (``eval.suite``).

    math6   GSM8K (test, 1319), MATH-500 (500), AIME24 (30), AMC23 (40), Minerva Math (272), OlympiadBench (675):
            the six math benchmarks of the RL-for-reasoning papers (the DPPO paper reports their average).
    math8   math6 + SVAMP (1000) and ASDiv (2215), the two easier word-problem sets of the Qwen2.5-Math
            evaluation data.

Files are read from ``eval.data_dir`` (default ``../shared/data/math``: ``gsm8k_test.jsonl``,
``math500_test.jsonl`` and ``qwen25math/*.jsonl``), each with the field preset of its file name
(``megatron_dppo/data/datasets.py``). GSM8K is scored by the GSM8K reward (final number), every other benchmark by
math-verify (``build.build_scorer``, "auto"). The table reports pass@1 (mean correctness over ``eval.samples``
samples per prompt) per benchmark and their unweighted average, as the papers do.
"""
from __future__ import annotations

from pathlib import Path

MATH6 = (("gsm8k", "gsm8k_test.jsonl"), ("math500", "math500_test.jsonl"), ("aime24", "qwen25math/aime24.jsonl"),
         ("amc23", "qwen25math/amc23.jsonl"), ("minerva_math", "qwen25math/minerva_math.jsonl"),
         ("olympiadbench", "qwen25math/olympiadbench.jsonl"))
SUITES: dict[str, tuple[tuple[str, str], ...]] = {
    "math6": MATH6,
    "math8": MATH6 + (("svamp", "qwen25math/svamp.jsonl"), ("asdiv", "qwen25math/asdiv.jsonl")),
}


def suite_files(name: str, data_dir: str | Path) -> list[tuple[str, Path]]:
    """(benchmark name, file) of every benchmark of suite ``name``; a missing file is an error naming it."""
    if name not in SUITES:
        raise ValueError(f"eval.suite={name!r} is not a known suite; valid: {', '.join(sorted(SUITES))}")
    out = [(bench, Path(data_dir) / rel) for bench, rel in SUITES[name]]
    missing = [str(p) for _, p in out if not p.is_file()]
    if missing:
        raise ValueError(f"eval.suite={name}: missing benchmark file(s) {', '.join(missing)}; set eval.data_dir to "
                         f"the folder that holds gsm8k_test.jsonl, math500_test.jsonl and qwen25math/")
    return out
