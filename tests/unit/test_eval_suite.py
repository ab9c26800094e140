"""The ``eval.suite`` benchmarks are scored right: for every benchmark of ``math8`` (which contains ``math6``),
every record's gold answer, written as a model would write it, scores 1 with the reward the evaluation uses for
that benchmark, and a wrong answer (the gold changed) scores 0. Plus the suite plumbing: names, files, the
average row. Skips when ../shared/data/math is absent."""
from __future__ import annotations

import re

import pytest
from _shared_data import SHARED_MATH, shared_math_file

from megatron_dppo.config import Config, EvalConfig
from megatron_dppo.data import load_prompt_dataset
from megatron_dppo.data.suites import SUITES, suite_files
from megatron_dppo.rewards.math import format_number, parse_number
from megatron_dppo.run.build import build_scorer
from megatron_dppo.train.evaluation import results_table

BENCHMARKS = dict(SUITES["math8"])


def test_suites_are_the_papers_benchmarks_and_config_names_them():
    assert [name for name, _ in SUITES["math6"]] == ["gsm8k", "math500", "aime24", "amc23", "minerva_math",
                                                     "olympiadbench"]
    assert dict(SUITES["math8"]).keys() - dict(SUITES["math6"]).keys() == {"svamp", "asdiv"}
    suite_type = EvalConfig.__dataclass_fields__["suite"].type
    assert all(f"'{name}'" in str(suite_type) or f'"{name}"' in str(suite_type) for name in SUITES)


def test_unknown_suite_or_missing_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="math7.*math6, math8"):
        suite_files("math7", tmp_path)
    with pytest.raises(ValueError, match="gsm8k_test.jsonl"):
        suite_files("math6", tmp_path)


def _as_completion(benchmark: str, answer: str) -> str:
    return f"So the answer is\n#### {answer}" if benchmark == "gsm8k" else \
        f"Putting it together, the final answer is $\\boxed{{{answer}}}$."


def _wrong(gold: str) -> str:
    """A different answer: a numeric gold plus 1; for any other gold (expressions, tuples, intervals, text) a number
    no benchmark has as its answer. (Appending "+1" to an expression is not reliably a different answer for
    math-verify: for "$(a, b)$+1" it reads the first math span.)"""
    if re.fullmatch(r"\s*-?[\d,]*\.?\d+\s*", gold):
        return format_number(parse_number(gold) + 1)
    return "-98765"


@pytest.mark.parametrize("benchmark", list(BENCHMARKS))
@pytest.mark.parametrize("records_checked", [12, pytest.param(None, marks=pytest.mark.slow)], ids=["first12", "all"])
def test_gold_answers_score_right_and_wrong_answers_wrong(benchmark, records_checked):
    """math-verify takes 50-500 ms per answer: the default run checks the first 12 records of each benchmark, the
    slow run every record (about 2 minutes for math8 alone on one core)."""
    path = shared_math_file(BENCHMARKS[benchmark])
    records = list(load_prompt_dataset([path], limit=records_checked))
    scorer = build_scorer(Config(), [benchmark], "auto")  # exactly what evaluation uses for this set name
    golds = [r.gold for r in records]
    right = scorer.score([_as_completion(benchmark, g) for g in golds], golds, ids=[r.id for r in records])
    wrong = scorer.score([_as_completion(benchmark, _wrong(g)) for g in golds], golds, ids=[r.id for r in records])
    missed = [(r.id, r.gold) for r, v in zip(records, right.rewards) if v != 1.0]
    accepted = [(r.id, r.gold) for r, v in zip(records, wrong.rewards) if v != 0.0]
    assert not missed, f"{benchmark}: {len(missed)}/{len(records)} gold answers scored wrong, e.g. {missed[:5]}"
    assert not accepted, f"{benchmark}: {len(accepted)}/{len(records)} wrong answers scored right, e.g. {accepted[:5]}"


def test_suite_files_resolve_in_the_shared_data():
    if not SHARED_MATH.is_dir():
        pytest.skip(f"shared data not available: {SHARED_MATH}")
    files = suite_files("math8", SHARED_MATH)
    assert [name for name, _ in files] == list(BENCHMARKS) and all(p.is_file() for _, p in files)


def test_results_table_has_one_row_per_benchmark_and_the_unweighted_average():
    sets = {"gsm8k": [0] * 4, "aime24": [0] * 2}
    metrics = {"eval/gsm8k/pass@1": 0.5, "eval/gsm8k/pass@4": 0.75, "eval/aime24/pass@1": 0.1,
               "eval/aime24/pass@4": 0.2, "eval/average/pass@1": 0.3, "eval/average/pass@4": 0.475}
    table = results_table(metrics, sets, samples=4, k=4).splitlines()
    assert table[0].startswith("| benchmark | prompts | pass@1 (mean of 4 samples)")
    assert table[2] == "| gsm8k | 4 | 50.0 | 75.0 |" and table[3] == "| aime24 | 2 | 10.0 | 20.0 |"
    assert table[4] == "| **average** | 6 | **30.0** | 47.5 |"
