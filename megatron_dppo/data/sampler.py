"""A seeded, resumable prompt sampler.

Epoch e visits every prompt index once, in the order ``permutation(seed, e)`` (numpy PCG64 seeded with
[seed, e]: the same on every rank and platform). ``take(k)`` returns the next k indices and moves the cursor,
continuing into the next epoch when the current one runs out, so any batch size (including the larger draws of
prompt pruning) works. ``state_dict()`` holds (seed, num_prompts, shuffle, epoch, cursor); restoring it and
continuing gives exactly the indices an uninterrupted run would have drawn.
"""
from __future__ import annotations

import numpy as np


class PromptSampler:
    """Yields prompt indices in seeded epoch-shuffled order; see the module docstring."""

    def __init__(self, num_prompts: int, seed: int = 0, shuffle: bool = True):
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        self.num_prompts = int(num_prompts)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_prompts)

    def take(self, k: int) -> list[int]:
        """The next ``k`` prompt indices (crossing into the next epoch when needed)."""
        if k < 0:
            raise ValueError(f"cannot take {k} prompts")
        out: list[int] = []
        while len(out) < k:
            if self.cursor == self.num_prompts:
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
            n = min(k - len(out), self.num_prompts - self.cursor)
            out.extend(int(i) for i in self._order[self.cursor : self.cursor + n])
            self.cursor += n
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "num_prompts": self.num_prompts, "shuffle": self.shuffle,
                "epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position; the dataset size, seed and shuffle flag must match the saved ones."""
        if state.get("pending"):
            raise ValueError(f"the sampler state holds {len(state['pending'])} drawn prompts not trained yet "
                             "(rollout.overprovision > 0 when it was saved); resume with rollout.overprovision > 0 "
                             "so that they are trained, not lost")
        for key in ("seed", "num_prompts", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                                 f"{key}={getattr(self, key)!r}; resume with the same dataset and seed")
        if not 0 <= state["cursor"] <= self.num_prompts or state["epoch"] < 0:
            raise ValueError(f"sampler state has an invalid position: epoch={state['epoch']}, "
                             f"cursor={state['cursor']} (num_prompts={self.num_prompts})")
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._order = self._permutation(self.epoch)
