"""benchmarks/vs_trl.py re-states our rewards in its TRL worker (TRL's process imports nothing from this package):
the copies score every completion exactly as the package's own functions do, so TRL and we train on the same
rewards."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import vs_trl
from megatron_dppo.rewards.math import arithmetic_reward, final_number_reward

COMPLETIONS = ["91", " 91\n", "The largest number is 91.", "91, not 78", "78 then 91", "$91$", "9,1", "1,234",
               "The answer: 1,234.", "-5", "91.0", ".5", "0.50", "no number", "", "91 or 92", "x=-7", "3/4",
               "The largest is 91. Explanation: 34 < 91"]
GOLDS = ["91", "1234", "-5", "0.5", "-7", "91.0"]


def test_the_trl_workers_rewards_equal_ours():
    for gold in GOLDS:
        for text in COMPLETIONS:
            assert vs_trl.final_number_reward(text, gold) == final_number_reward(text, gold), (text, gold)
            if gold.lstrip("-").isdigit():  # the arithmetic task's golds are integers
                assert vs_trl.arithmetic_reward(text, gold) == arithmetic_reward(text, gold), (text, gold)
    assert sum(final_number_reward(t, "91") for t in COMPLETIONS) >= 4  # not vacuous: several score 1
