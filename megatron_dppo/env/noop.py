"""``noop``: the environment that ends every episode after the first assistant turn, reward 0. With it an episode
is exactly a single-turn completion (the reference for ``max_turns=1`` equivalence tests and a template to copy)."""
from __future__ import annotations

from megatron_dppo.env.protocol import Step, Task, Turn


class NoOpEnv:
    def reset(self, task: Task, seed: int) -> list[dict]:
        return []

    def step(self, turn: Turn) -> Step:
        return Step(done=True)
