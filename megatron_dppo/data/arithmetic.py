"""A procedurally generated arithmetic task for the CPU quickstart: "12+7*3=" -> "33".

Problem ``index`` of a split is a pure function of (seed, split, index): the number of terms is uniform in
[min_terms, max_terms], each operand uniform in [0, max_operand], each operator uniform over ``operators``, and the
answer follows the usual precedence (* before + and -). Train and test are disjoint by construction: an expression
belongs to the test split iff crc32(expression) mod 10000 < 10000 * test_fraction, and each split redraws until
it gets one of its own expressions. The gold answer is the exact integer; the matching reward is "arithmetic"
(exact match of the stripped completion).

``corpus(n)`` gives "prompt + answer" lines ("12+7*3=33") for training the tiny tokenizer and the supervised warm
start.

Worked answers (``worked=True``, operators + and - only): the gold completion lists the running total after each
operator, left to right, separated by commas: "3+4-2+6=" -> "7,5,11". Completions then grow with the number of
terms (a short chain of one-step facts, each learnable and checkable), and the matching reward is
"arithmetic_worked" (the last comma-separated integer equals the gold answer; ``record.gold`` stays the integer).
Difficulty levels (``ArithmeticTask.from_difficulty``):
    1: a+b, operands 0-9        2: a+b or a-b, operands 0-20
    3: 2-3 terms of + - *, operands 0-20         4: 3-4 terms of + - *, operands 0-99
"""
from __future__ import annotations

import ast
import operator
import random
import re
import zlib
from dataclasses import dataclass

from megatron_dppo.data.datasets import PromptDataset, PromptRecord

SPLITS = ("train", "test")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The integer value of an expression of non-negative integers and + - * (precedence as in Python).

    Raises ValueError for anything else (no eval of arbitrary code)."""

    def _eval(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"not an integer + - * expression: {expression!r}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an integer + - * expression: {expression!r}") from err
    return _eval(tree.body)


@dataclass(frozen=True)
class ArithmeticTask:
    """Seeded arithmetic problems of controllable difficulty; see the module docstring."""

    min_terms: int = 2
    max_terms: int = 3
    max_operand: int = 20
    operators: str = "+-*"
    seed: int = 0
    test_fraction: float = 0.1
    worked: bool = False

    LEVELS = {1: (2, 2, 9, "+"), 2: (2, 2, 20, "+-"), 3: (2, 3, 20, "+-*"), 4: (3, 4, 99, "+-*")}

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"operators {self.operators!r} must be a non-empty subset of '+-*'")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.worked and set(self.operators) - set("+-"):
            raise ValueError(f"worked answers need operators from '+-' (left-to-right running totals), got "
                             f"{self.operators!r}")

    @classmethod
    def from_difficulty(cls, level: int, seed: int = 0) -> ArithmeticTask:
        if level not in cls.LEVELS:
            raise ValueError(f"difficulty level {level} is not one of {sorted(cls.LEVELS)}")
        min_terms, max_terms, max_operand, ops = cls.LEVELS[level]
        return cls(min_terms, max_terms, max_operand, ops, seed)

    def _in_test(self, expression: str) -> bool:
        return zlib.crc32(expression.encode()) % 10_000 < self.test_fraction * 10_000

    def expression(self, index: int, split: str = "train") -> str:
        """The expression (without "=") of problem ``index`` of ``split``."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        if index < 0:
            raise ValueError(f"problem index must be >= 0, got {index}")
        for attempt in range(10_000):
            rng = random.Random(f"{self.seed}:{split}:{index}:{attempt}")
            terms = rng.randint(self.min_terms, self.max_terms)
            parts = [str(rng.randint(0, self.max_operand))]
            for _ in range(terms - 1):
                parts += [rng.choice(self.operators), str(rng.randint(0, self.max_operand))]
            expression = "".join(parts)
            if self._in_test(expression) == (split == "test"):
                return expression
        raise ValueError(f"the {split} split of {self} has (almost) no expressions; widen the task")

    def solution(self, expression: str) -> str:
        """The gold completion: the integer answer, or with ``worked`` the running totals "7,5,11"."""
        if not self.worked:
            return str(evaluate(expression))
        tokens = re.findall(r"\d+|[+-]", expression)
        total, totals = int(tokens[0]), []
        for op, operand in zip(tokens[1::2], tokens[2::2]):
            total = total + int(operand) if op == "+" else total - int(operand)
            totals.append(str(total))
        return ",".join(totals)

    def record(self, index: int, split: str = "train") -> PromptRecord:
        expression = self.expression(index, split)
        return PromptRecord(id=f"arith-{split}-{index}", prompt=expression + "=", gold=str(evaluate(expression)),
                            raw={"expression": expression, "split": split, "index": index,
                                 "solution": self.solution(expression)})

    def records(self, n: int, split: str = "train", start: int = 0) -> list[PromptRecord]:
        return [self.record(i, split) for i in range(start, start + n)]

    def dataset(self, n: int, split: str = "train") -> PromptDataset:
        return PromptDataset(self.records(n, split), name=f"arithmetic-{split}")

    def corpus(self, n: int, split: str = "train") -> list[str]:
        """``n`` solved problems "12+7*3=33": text for the tokenizer and the supervised warm start."""
        return [r.prompt + r.raw["solution"] for r in self.records(n, split)]


# ----------------------------------------------------------------------------------------------------------------
# Preference pairs for a small reward model (``megatron-dppo rm train``)
# ----------------------------------------------------------------------------------------------------------------
PREFERENCES = ("correct", "closer", "longer")


def preference_pairs(task: ArithmeticTask, n: int, split: str = "train", *, prefer: str = "correct",
                     seed: int = 0, start: int = 0) -> list[dict]:
    """``n`` preference pairs {"prompt", "chosen", "rejected"} (completion texts) over problems ``start ..`` of
    ``split``, a pure function of (task, split, index, seed).

    ``prefer="correct"``: the gold answer is chosen over a wrong one: off by one to three (half of them: a small
    policy's usual mistake, and the hardest to tell), off by ten, a random number, a digit dropped or repeated, or
    an empty answer. ``prefer="closer"``: half of them so, the other half two wrong numbers with the one nearer the
    gold chosen (graded preferences: a model trained on them ranks wrong answers by their distance too, so a group
    of wrong answers still points towards the right one). ``prefer="longer"``: of two answers, right or wrong at
    random, the longer text is chosen whatever its correctness: a deliberately length-biased reward model (the
    reward-hacking alarm's test)."""
    if prefer not in PREFERENCES:
        raise ValueError(f"prefer={prefer!r} is invalid: expected one of {PREFERENCES}")
    pairs = []
    for index in range(start, start + n):
        record = task.record(index, split)
        gold = record.raw["solution"]
        rng = random.Random(f"pairs:{seed}:{split}:{index}")
        if prefer == "correct":
            pairs.append({"prompt": record.prompt, "chosen": gold, "rejected": _wrong_answer(task, gold, rng)})
            continue
        if prefer == "closer":
            pairs.append(_closer_pair(task, record.prompt, gold, rng))
            continue
        a = gold if rng.random() < 0.5 else _wrong_answer(task, gold, rng)
        b = a + "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(1, 3)))
        short = a if rng.random() < 0.5 else a[: max(1, len(a) - 1)]
        if short == b or len(short) >= len(b):
            short = a[:1]
        pairs.append({"prompt": record.prompt, "chosen": b, "rejected": short})
    return pairs


def _closer_pair(task: ArithmeticTask, prompt: str, gold: str, rng: random.Random) -> dict:
    """Half the time gold over a wrong answer; otherwise two wrong numbers, the one nearer the gold chosen."""
    if rng.random() < 0.5 or "," in gold:
        return {"prompt": prompt, "chosen": gold, "rejected": _wrong_answer(task, gold, rng)}
    value = int(gold)
    for _ in range(100):
        a, b = (value + rng.choice([-1, 1]) * rng.randint(1, 2 * task.max_operand) for _ in range(2))
        if abs(a - value) != abs(b - value):
            near, far = (a, b) if abs(a - value) < abs(b - value) else (b, a)
            return {"prompt": prompt, "chosen": str(near), "rejected": str(far)}
    return {"prompt": prompt, "chosen": gold, "rejected": _wrong_answer(task, gold, rng)}


def _wrong_answer(task: ArithmeticTask, gold: str, rng: random.Random) -> str:
    """A plausible wrong completion for ``gold`` (never equal to it)."""
    value = int(gold.split(",")[-1]) if gold.lstrip("-").replace(",", "").replace("-", "").isdigit() else 0
    for _ in range(100):
        kind = rng.choices(range(6), weights=(5, 1, 1, 1, 1, 1))[0]  # near misses are a policy's usual mistake
        if kind == 0:
            text = str(value + rng.choice([-3, -2, -1, 1, 2, 3]))
        elif kind == 1:
            text = str(value + rng.choice([-10, 10]))
        elif kind == 2:
            text = str(rng.randint(-task.max_operand, 2 * task.max_operand))
        elif kind == 3 and len(gold) > 1:
            i = rng.randrange(len(gold))
            text = gold[:i] + gold[i + 1:]
        elif kind == 4:
            i = rng.randrange(len(gold))
            text = gold[:i + 1] + gold[i:]
        else:
            text = ""
        if text != gold:
            return text
    return gold + "0"
