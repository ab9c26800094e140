"""The worked-answer arithmetic task of the time-to-accuracy study: running totals that are the true partial
sums, a last total equal to the gold answer, the reward that checks exactly that, and the config guard."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_dppo.config import load_config
from megatron_dppo.data import ArithmeticTask, evaluate
from megatron_dppo.rewards import arithmetic_worked_reward, get_reward

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_worked_solution_lists_the_left_to_right_partial_sums_ending_at_the_answer():
    task = ArithmeticTask(2, 4, 9, "+-", seed=3, worked=True)
    lengths = set()
    for split in ("train", "test"):
        for r in task.records(200, split):
            expression, totals = r.raw["expression"], r.raw["solution"].split(",")
            terms = re.findall(r"[+-]?\d+", expression)
            assert len(totals) == len(terms) - 1  # one total per operator
            for k, total in enumerate(totals, start=2):  # the k-th total is the value of the first k terms
                assert int(total) == evaluate("".join(terms[:k]))
            assert totals[-1] == r.gold == str(evaluate(expression))
            assert arithmetic_worked_reward(r.raw["solution"], r.gold) == 1.0
            lengths.add(len(r.raw["solution"]))
    assert max(lengths) - min(lengths) >= 6  # completions really vary in length
    assert task.corpus(2)[0] == task.record(0).prompt + task.record(0).raw["solution"]
    plain = ArithmeticTask(2, 4, 9, "+-", seed=3)
    assert plain.record(0).raw["solution"] == plain.record(0).gold  # without worked: the answer alone


@pytest.mark.parametrize("completion, gold, expected", [
    ("7,5,11", "11", 1.0), (" 7,5,11 ", "11", 1.0), ("11", "11", 1.0), ("-2,-5", "-5", 1.0),
    ("7,5,12", "11", 0.0), ("7,5,", "5", 0.0), ("7,,5", "5", 0.0), ("7 5", "5", 0.0), ("", "5", 0.0),
    ("five", "5", 0.0)])
def test_worked_reward_checks_the_last_total_of_a_well_formed_answer(completion, gold, expected):
    assert arithmetic_worked_reward(completion, gold) == expected
    assert get_reward("arithmetic_worked") is arithmetic_worked_reward


def test_worked_answers_need_plus_and_minus_only():
    with pytest.raises(ValueError, match="worked answers need operators"):
        ArithmeticTask(2, 3, 9, "+-*", worked=True)
    with pytest.raises(ValueError, match="data.arithmetic_ops"):
        load_config(EXAMPLES / "quickstart.yaml", ["data.arithmetic_worked=true", "data.arithmetic_ops=+*"])
    cfg = load_config(EXAMPLES / "arithmetic_worked.yaml")
    assert cfg.data.arithmetic_worked and cfg.data.arithmetic_eval_split == "test"
