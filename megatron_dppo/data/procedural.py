"""Procedurally generated questions with an exact integer answer, for pretrained chat models (the SmolLM2 example).

    task = ProceduralTask("list_max", seed=0)
    task.record(7, "train")   # PromptRecord(id="list_max-train-7", prompt="What is the largest number in the list
                              #   ...?", gold="91")
    task.records(200, "test") # the held-out questions

Every instance is a pure function of (task, options, seed, split, index). The test split is held out by
construction: an instance belongs to the test split iff crc32(its key) mod 10000 < 10000 * test_fraction, where
the key is the instance's content (the list, the operands, the word and letter), and each split redraws until it
gets one of its own. So no test question is ever a training question, whatever the seed or the training size; a
held-out question is a new instance (a new list, new operands), not a fact left out of a table. The instances do
not depend on ``train.seed`` (``data.procedural_seed`` picks them), so every run of a study evaluates on the same
held-out questions; ``train.seed`` still orders the training prompts.

Tasks (generator options and defaults; ``data.procedural_options`` overrides them):
    list_max      "What is the largest number in the list 34, 78, 12, 56, 91?" -> 91
                  length=5 distinct numbers in [low=10, high=99]
    addition      "What is 47 + 38?" -> 85                      operands in [low=10, high=99]
    expression    "Compute 12 + 7 * 3." -> 33                   terms=3 operands in [low=2, high=20], ops="+-*"
    letter_count  "How many times does the letter 'r' appear in the word 'strawberry'?" -> 3
                  a word of ``WORDS`` and one of its letters
Their reward is ``final_number`` (rewards/math.py): the last number the completion writes equals the answer, the
extraction GSM8K graders use, so "The largest number is 91." is correct. The base held-out accuracy of
SmolLM2-135M-Instruct on each is measured by ``benchmarks/real_task_selection.py`` (docs/benchmarks.md).
"""
from __future__ import annotations

import inspect
import random
import zlib
from dataclasses import dataclass, field
from typing import Callable

from megatron_dppo.data.datasets import PromptDataset, PromptRecord

SPLITS = ("train", "test")
REWARD = "final_number"

WORDS = (
    "apple", "banana", "cherry", "strawberry", "mississippi", "balloon", "coffee", "committee", "bookkeeper",
    "address", "assessment", "parallel", "pepper", "success", "tomorrow", "grammar", "happiness", "necessary",
    "letter", "butter", "summer", "bottle", "rabbit", "kitten", "puzzle", "giraffe", "elephant", "banana",
    "pizza", "yellow", "window", "garden", "teacher", "library", "umbrella", "mountain", "river", "forest",
    "village", "planet", "rocket", "engineer", "chocolate", "cinnamon", "potato", "tomato", "avocado", "lemon",
    "orange", "papaya", "cucumber", "broccoli", "spinach", "cabbage", "carrot", "pineapple", "raspberry",
    "blueberry", "watermelon", "hippopotamus", "alligator", "kangaroo", "penguin", "dolphin", "squirrel",
    "caterpillar", "butterfly", "dragonfly", "grasshopper", "mosquito", "football", "basketball", "baseball",
    "volleyball", "tennis", "swimming", "running", "freedom", "kingdom", "bubble", "sweet", "little", "middle",
    "cookie", "noodle", "spaghetti", "broom", "balloonist", "assassin", "occurrence", "possession", "referee",
)


def _list_max(rng: random.Random, length: int = 5, low: int = 10, high: int = 99):
    numbers = rng.sample(range(low, high + 1), length)
    return (",".join(map(str, numbers)), f"What is the largest number in the list {', '.join(map(str, numbers))}?",
            max(numbers))


def _addition(rng: random.Random, low: int = 10, high: int = 99):
    a, b = rng.randint(low, high), rng.randint(low, high)
    return f"{a}+{b}", f"What is {a} + {b}?", a + b


def _expression(rng: random.Random, terms: int = 3, low: int = 2, high: int = 20, ops: str = "+-*"):
    from megatron_dppo.data.arithmetic import evaluate

    parts = [str(rng.randint(low, high))]
    for _ in range(terms - 1):
        parts += [rng.choice(ops), str(rng.randint(low, high))]
    return "".join(parts), f"Compute {' '.join(parts)}.", evaluate("".join(parts))


def _letter_count(rng: random.Random, words: tuple[str, ...] = WORDS):
    word = rng.choice(words)
    letter = rng.choice(sorted(set(word)))
    return (f"{word}:{letter}", f"How many times does the letter '{letter}' appear in the word '{word}'?",
            word.count(letter))


GENERATORS: dict[str, Callable] = {"list_max": _list_max, "addition": _addition, "expression": _expression,
                                   "letter_count": _letter_count}


@dataclass(frozen=True)
class ProceduralTask:
    """Seeded questions of one task of ``GENERATORS``; see the module docstring."""

    name: str
    seed: int = 0
    test_fraction: float = 0.1
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.name not in GENERATORS:
            raise ValueError(f"procedural task {self.name!r} is not one of {sorted(GENERATORS)}")
        allowed = list(inspect.signature(GENERATORS[self.name]).parameters)[1:]
        unknown = sorted(set(self.options) - set(allowed))
        if unknown:
            raise ValueError(f"procedural task {self.name!r}: unknown option(s) {unknown}; its options are {allowed}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        self._draw(random.Random(0))  # bad option values (e.g. a list longer than its range) fail here, named

    def _draw(self, rng: random.Random) -> tuple[str, str, int]:
        try:
            return GENERATORS[self.name](rng, **self.options)
        except (ValueError, TypeError) as err:
            raise ValueError(f"procedural task {self.name!r} with options {self.options}: {err}") from None

    def in_test(self, key: str) -> bool:
        return zlib.crc32(f"{self.name}:{key}".encode()) % 10_000 < self.test_fraction * 10_000

    def instance(self, index: int, split: str = "train") -> tuple[str, str, int]:
        """(key, question, answer) of instance ``index`` of ``split``."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        if index < 0:
            raise ValueError(f"instance index must be >= 0, got {index}")
        for attempt in range(10_000):
            key, question, answer = self._draw(random.Random(f"{self.name}:{self.seed}:{split}:{index}:{attempt}"))
            if self.in_test(key) == (split == "test"):
                return key, question, answer
        raise ValueError(f"the {split} split of {self} has (almost) no instances; widen the task's options")

    def record(self, index: int, split: str = "train") -> PromptRecord:
        key, question, answer = self.instance(index, split)
        return PromptRecord(id=f"{self.name}-{split}-{index}", prompt=question, gold=str(answer),
                            raw={"key": key, "split": split, "index": index})

    def records(self, n: int, split: str = "train", start: int = 0) -> list[PromptRecord]:
        return [self.record(i, split) for i in range(start, start + n)]

    def dataset(self, n: int, split: str = "train") -> PromptDataset:
        return PromptDataset(self.records(n, split), name=f"{self.name}-{split}")
