"""Named evaluation suites: the benchmark files the papers report, by name (``eval.suite``).

    math6   GSM8K (test, 1319), MATH-500 (500), AIME24 (30), AMC23 (40), Minerva Math (272), OlympiadBench (675):
            the six math benchmarks of the RL-for-reasoning papers (the DPPO paper reports their average).
    math8   math6 + SVAMP (1000) and ASDiv, the two easier word-problem sets of the Qwen2.5-Math evaluation data.

Files are read from ``eval.data_dir`` (default ``data/math``), written there by
``megatron-dppo data prepare math6 --out data/math`` (or math8): ``<benchmark>_test.jsonl`` for each benchmark.
The layout of the Qwen2.5-Math evaluation data is read too (``gsm8k_test.jsonl``, ``math500_test.jsonl`` and
``qwen25math/<benchmark>.jsonl``), each with the field preset of its file name (``megatron_dppo/data/datasets.py``).
GSM8K is scored by the GSM8K reward (final number), every other benchmark by math-verify (``build.build_scorer``,
"auto"). The table reports pass@1 (mean correctness over ``eval.samples`` samples per prompt) per benchmark and
their unweighted average, as the papers do.
"""
from __future__ import annotations

from pathlib import Path

# (benchmark, the file of the Qwen2.5-Math layout); `data prepare` writes <benchmark>_test.jsonl
MATH6 = (("gsm8k", "gsm8k_test.jsonl"), ("math500", "math500_test.jsonl"), ("aime24", "qwen25math/aime24.jsonl"),
         ("amc23", "qwen25math/amc23.jsonl"), ("minerva_math", "qwen25math/minerva_math.jsonl"),
         ("olympiadbench", "qwen25math/olympiadbench.jsonl"))
SUITES: dict[str, tuple[tuple[str, str], ...]] = {
    "math6": MATH6,
    "math8": MATH6 + (("svamp", "qwen25math/svamp.jsonl"), ("asdiv", "qwen25math/asdiv.jsonl")),
}


def suite_files(name: str, data_dir: str | Path) -> list[tuple[str, Path]]:
    """(benchmark name, file) of every benchmark of suite ``name``: ``<benchmark>_test.jsonl`` in ``data_dir``,
    else the Qwen2.5-Math layout's file; a missing benchmark is an error naming it and the command that writes it."""
    if name not in SUITES:
        raise ValueError(f"eval.suite={name!r} is not a known suite; valid: {', '.join(sorted(SUITES))}")
    out, missing = [], []
    for bench, legacy in SUITES[name]:
        candidates = [Path(data_dir) / f"{bench}_test.jsonl", Path(data_dir) / legacy]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            missing.append(f"{bench} ({' or '.join(str(p) for p in dict.fromkeys(candidates))})")
        out.append((bench, found))
    if missing:
        raise ValueError(f"eval.suite={name}: missing benchmark file(s): {'; '.join(missing)}. Write them with "
                         f"`megatron-dppo data prepare {name} --out {data_dir}` (where the Hugging Face Hub is "
                         f"reachable) or set eval.data_dir to the folder that holds them")
    return out
