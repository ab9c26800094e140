"""The pending prompts of over-provisioned generation (``rollout.overprovision``, train/overprovision.py): drawn
prompts not shipped to the trainer yet, each with its prompt-level decision and partial completions, kept with
the prompt sampler's position as one resumable state."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_dppo.rollout.partial import PartialRow


@dataclass
class Pending:
    """A drawn prompt not shipped yet: its sampler index, the step that drew it, its prompt-level decision (one
    unit of a ``PruneResult``: keep, weight, keep_prob, candidate, score) and, if kept, its G rows."""

    index: int
    drawn_step: int
    decision: dict[str, Any]
    rows: list[PartialRow] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(r.finish is not None for r in self.rows)

    @property
    def oldest(self) -> int | None:
        """The version of its oldest token (None: no token yet)."""
        return min((r.oldest for r in self.rows if r.versions), default=None)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "drawn_step": self.drawn_step, "decision": self.decision,
                "rows": [r.to_dict() for r in self.rows]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Pending:
        return cls(int(d["index"]), int(d["drawn_step"]), dict(d["decision"]), [PartialRow(**r) for r in d["rows"]])


class PendingPrompts:
    """The prompt sampler of ``rollout.overprovision`` > 0: ``take`` draws from the wrapped ``PromptSampler``, and
    ``pending`` holds the drawn prompts not shipped yet. Its state is the sampler's position plus the pending
    prompts, so whoever restores it (a resumed trainer, a repositioned worker) continues them."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.pending: list[Pending] = []

    def take(self, k: int) -> list[int]:
        return self.sampler.take(k)

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "pending": [p.to_dict() for p in self.pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict({k: v for k, v in state.items() if k != "pending"})
        self.pending = [Pending.from_dict(p) for p in state.get("pending", [])]

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":  # (not set yet: a copy or unpickling in progress)
            raise AttributeError(name)
        return getattr(self.sampler, name)
