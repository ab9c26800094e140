"""Procedural questions for pretrained chat models (data/procedural.py), their reward (final_number) and the run
configuration that uses them (data.task=procedural): seeded and deterministic, correct answers, a test split that
no training question ever falls in (with a negative control: without the split rule the draws do overlap), options
validated by name, the held-out eval set independent of train.seed, and the reward the run picks."""
from __future__ import annotations

import random
import re

import pytest

from megatron_dppo.data.procedural import GENERATORS, REWARD, ProceduralTask
from megatron_dppo.rewards import final_number_reward
from megatron_dppo.rewards.registry import build_reward

TASKS = sorted(GENERATORS)


@pytest.mark.parametrize("name", TASKS)
def test_seeded_deterministic_and_the_seed_matters(name):
    a = ProceduralTask(name, seed=3).records(50)
    assert a == ProceduralTask(name, seed=3).records(50)
    assert a != ProceduralTask(name, seed=4).records(50)
    assert len({r.id for r in a}) == 50 and all(r.id == f"{name}-train-{i}" for i, r in enumerate(a))


@pytest.mark.parametrize("name", TASKS)
def test_no_test_question_is_ever_a_training_question(name):
    """Disjoint for two seeds and thousands of draws; the negative control shows the draws collide without the
    split rule, so the check has power (the spaces are small enough to repeat)."""
    task = ProceduralTask(name, seed=0)
    other = ProceduralTask(name, seed=1)
    train = {task.instance(i, "train")[0] for i in range(3000)} | {other.instance(i, "train")[0] for i in range(3000)}
    test = {task.instance(i, "test")[0] for i in range(300)} | {other.instance(i, "test")[0] for i in range(300)}
    assert test and not train & test
    assert all(task.in_test(k) for k in test) and not any(task.in_test(k) for k in train)
    if name != "list_max":  # ~4e7 lists: a few thousand uniform draws rarely repeat, so no overlap to show there
        raw = {task._draw(random.Random(f"raw:{i}"))[0] for i in range(3000)}
        assert raw & test, "negative control: unsplit draws should hit test questions"


def test_answers_are_correct():
    for r in ProceduralTask("list_max").records(200):
        numbers = [int(x) for x in re.findall(r"\d+", r.prompt)]
        assert len(numbers) == 5 == len(set(numbers)) and int(r.gold) == max(numbers)
        assert all(10 <= x <= 99 for x in numbers)
    for r in ProceduralTask("addition").records(100, "test"):
        a, b = map(int, re.findall(r"\d+", r.prompt))
        assert int(r.gold) == a + b
    for r in ProceduralTask("expression").records(100):
        expression = r.prompt.removeprefix("Compute ").removesuffix(".").replace(" ", "")
        assert int(r.gold) == eval(expression)  # noqa: S307 - digits and + - * only, made by the generator
    for r in ProceduralTask("letter_count").records(100):
        letter, word = re.fullmatch(r"How many times does the letter '(.)' appear in the word '(\w+)'\?",
                                    r.prompt).groups()
        assert int(r.gold) == word.count(letter) >= 1


def test_options_change_the_questions_and_are_validated_by_name():
    long = ProceduralTask("list_max", options={"length": 8, "low": 100, "high": 999}).record(0)
    numbers = [int(x) for x in re.findall(r"\d+", long.prompt)]
    assert len(numbers) == 8 and all(100 <= x <= 999 for x in numbers) and int(long.gold) == max(numbers)
    with pytest.raises(ValueError, match=r"'nope'.*not one of"):
        ProceduralTask("nope")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['size'\].*\['length', 'low', 'high'\]"):
        ProceduralTask("list_max", options={"size": 3})
    with pytest.raises(ValueError, match="list_max.*'length': 200"):  # more distinct numbers than the range holds
        ProceduralTask("list_max", options={"length": 200})
    with pytest.raises(ValueError, match="split 'dev'"):
        ProceduralTask("addition").record(0, "dev")


@pytest.mark.parametrize("text, gold, expected", [
    ("The largest number is 91.", "91", 1.0),
    ("91", "91", 1.0),
    ("Among 34, 91 and 78 the answer is 91", "91", 1.0),
    ("91 is larger than 78", "91", 0.0),        # the LAST number is the answer
    ("The answer is 91.0", "91", 1.0),
    ("-158", "-158", 1.0),
    ("1,234", "1234", 1.0),
    ("no number here", "3", 0.0),
    ("", "3", 0.0),
])
def test_final_number_reward(text, gold, expected):
    assert final_number_reward(text, gold) == expected
    assert build_reward(REWARD)(text, gold) == expected  # the registry name the procedural tasks use


def test_run_configuration_uses_the_task_its_test_split_and_its_reward():
    from megatron_dppo.config import load_config
    from megatron_dppo.rewards.registry import reward_name
    from megatron_dppo.run.build import build_scorer, procedural_task

    overrides = ["model.hf_config={model_type: qwen2}", "data.task=procedural", "data.procedural_task=addition",
                 "data.procedural_seed=5", "data.procedural_options={low: 1, high: 9}"]
    cfg = load_config(None, overrides + ["train.seed=1"])
    task = procedural_task(cfg)
    assert task == ProceduralTask("addition", seed=5, options={"low": 1, "high": 9})
    # the held-out questions do not depend on train.seed: every run of a study evaluates the same ones
    assert procedural_task(load_config(None, overrides + ["train.seed=2"])).records(20, "test") == \
        task.records(20, "test")
    assert reward_name(build_scorer(cfg, []).fn) == "final_number"
    assert reward_name(build_scorer(cfg, ["addition_test"]).fn) == "final_number"
    with pytest.raises(ValueError, match="data.procedural_train_size"):
        load_config(None, overrides + ["data.procedural_train_size=0"])
