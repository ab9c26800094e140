"""Partial rollouts: generation that takes a new weight version mid-batch (``rollout.max_interruptions``).

A rollout worker (``rollout.placement=separate``) generating batch t from version v may receive version v + 1
while the batch is still generating (the trainer finished its step). With partial rollouts the worker stops the
samples still running at a token boundary, loads the new version, and continues them under it:

- HF engine: ``generate(..., interrupt=ask)`` asks after every sampled token; once a newer version has arrived the
  running rows stop there (finish_reason "interrupted"). The continuation re-prefills prompt + partial completion
  under the new weights and samples on.
- Any other engine (vLLM): generation runs in chunks of ``chunk_tokens`` tokens (a request that ends a chunk at
  ``max_tokens`` below its budget is unfinished), and a version that arrived is taken between chunks; the next
  chunk resumes from the partial ids (vLLM's prefix cache keeps the re-prefill of the prompt cheap).

Every token carries the version of the weights that sampled it and its behaviour log-prob under exactly those
weights (``PartialCompletion.versions``, ``.logprobs``): the continuation's log-probs come from the engine's own
sampler after the load, so they are those of the new version (tests/rollout/test_partial_rollouts.py checks both
against a teacher-forced forward of each version). All rows in flight are interrupted together, so a sample is
interrupted at most as often as the batch takes a version mid-generation, which ``max_interruptions`` bounds.

``generate_partial`` is the loop; ``InterruptibleEngine`` wraps a worker's engine with it (the rest of the
rollout side calls ``generate`` as usual and gets ``PartialCompletion``s)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_dppo.rollout.base import Completion, CompletionGroup, SamplingParams, validate_prompts

INTERRUPTED = "interrupted"  # finish_reason of a row an engine stopped at a token boundary (HF engine)


@dataclass
class PartialCompletion(Completion):
    """A completion whose tokens may come from several weight versions: ``versions[t]`` sampled token t, and
    ``logprobs[t]`` is its log-prob under that version (the behaviour policy of that token)."""

    versions: list[int] = field(default_factory=list)
    interruptions: int = 0  # how many times a new version was taken while this sample was running

    def __post_init__(self):
        super().__post_init__()
        if len(self.versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.versions)} versions")


class WeightSource(Protocol):
    """Where newer versions come from, for ``generate_partial``."""

    def newer(self) -> bool:
        """Whether a version newer than the engine's has arrived (cheap: asked after every token)."""
        ...

    def load_newer(self) -> int:
        """Load the newest arrived version into the engine; returns its number."""
        ...


@dataclass
class PartialRow:
    """One sample being generated: its prompt, the tokens so far with their log-probs and versions."""

    prompt: int  # index into the prompts
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    interruptions: int = 0
    finish: str | None = None  # None while unfinished

    @property
    def oldest(self) -> int | None:
        """The version of its oldest token (None before the first)."""
        return min(self.versions) if self.versions else None

    def completion(self) -> PartialCompletion:
        return PartialCompletion(self.tokens, self.logprobs, self.finish, versions=self.versions,
                                 interruptions=self.interruptions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def extend(self, completion: Completion, version: int, budget: int) -> None:
        self.tokens += completion.token_ids
        self.logprobs += completion.logprobs
        self.versions += [version] * len(completion.token_ids)
        if completion.finish_reason == "stop" or len(self.tokens) >= budget:
            self.finish = completion.finish_reason if completion.finish_reason == "stop" else "length"


def generate_partial(engine, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, version: int,
                     source: WeightSource, max_interruptions: int, chunk_tokens: int | None = None,
                     ) -> tuple[list[CompletionGroup], int]:
    """n completions per prompt, taking up to ``max_interruptions`` newer versions from ``source`` mid-generation
    (module docstring); ``version`` is the engine's version at the start. ``chunk_tokens`` None: the engine
    takes ``interrupt=`` (HF); else generation runs in chunks of that many tokens. Returns the groups (of
    ``PartialCompletion``) and the engine's version at the end. With no newer version arriving, the HF path is one
    ``engine.generate`` call, the same samples as without partial rollouts."""
    validate_prompts(prompt_token_ids, n)
    budget = sampling.max_new_tokens
    taken = 0  # versions taken mid-generation

    def ask() -> bool:
        return taken < max_interruptions and source.newer()

    def call(prompts: list[list[int]], count: int, remaining: int, round_: int) -> list[CompletionGroup]:
        size = remaining if chunk_tokens is None else min(chunk_tokens, remaining)
        seed = None if sampling.seed is None else (sampling.seed + 1_000_003 * round_) % (1 << 31)
        params = dataclasses.replace(sampling, max_new_tokens=size, seed=seed)
        if chunk_tokens is None:
            return engine.generate(prompts, count, params, interrupt=ask)
        return engine.generate(prompts, count, params)

    rows = [PartialRow(p, list(ids)) for p, ids in enumerate(prompt_token_ids) for _ in range(n)]
    first = call([list(ids) for ids in prompt_token_ids], n, budget, 0)  # one call: the engine shares prefills
    for row, completion in zip(rows, (c for g in first for c in g.completions)):
        row.extend(completion, version, budget)
    round_ = 1
    while any(r.finish is None for r in rows):
        if ask():
            version = source.load_newer()
            taken += 1
            for r in rows:
                if r.finish is None:
                    r.interruptions += 1
        by_length: dict[int, list[PartialRow]] = {}
        for r in rows:
            if r.finish is None:
                by_length.setdefault(len(r.tokens), []).append(r)
        for done, group in sorted(by_length.items()):  # rows with equal budgets left share a call
            out = call([r.prompt_ids + r.tokens for r in group], 1, budget - done, round_)
            for r, g in zip(group, out):
                r.extend(g.completions[0], version, budget)
            round_ += 1
    groups = [CompletionGroup(list(ids)) for ids in prompt_token_ids]
    for r in rows:
        groups[r.prompt].completions.append(r.completion())
    return groups, version


def continue_rows(engine, groups: list[list[PartialRow]], sampling: SamplingParams, version: int, chunk_tokens: int,
                  enough: Callable[[], bool], source: WeightSource | None = None, max_interruptions: int = 0,
                  ) -> tuple[int, int]:
    """Over-provisioned generation (``rollout.overprovision``, train/overprovision.py): continue the unfinished rows
    of ``groups`` in chunks of ``chunk_tokens`` tokens until every row has finished or ``enough()`` holds after a
    chunk; the rows still running then stay as they are, to be continued by a later call. A group none of whose
    rows has a token yet starts with one call of n = its size (the engine shares the prompt's prefill); the others
    continue from prompt + partial completion, rows of equal remaining budget together. Between chunks a newer
    version from ``source`` is taken (at most ``max_interruptions``, partial rollouts); a row whose last token came
    from an older version than ``version`` (carried from an earlier call) counts that as an interruption. Returns
    (the engine's version at the end, versions taken)."""
    budget, taken, round_ = sampling.max_new_tokens, 0, 0
    for row in (r for g in groups for r in g):
        if row.finish is None and row.versions and row.versions[-1] != version:
            row.interruptions += 1

    def call(prompts: list[list[int]], count: int, remaining: int) -> list[CompletionGroup]:
        nonlocal round_
        seed = None if sampling.seed is None else (sampling.seed + 1_000_003 * round_) % (1 << 31)
        round_ += 1
        return engine.generate(prompts, count, dataclasses.replace(sampling, max_new_tokens=min(chunk_tokens,
                                                                                                remaining), seed=seed))

    def extend(row: PartialRow, completion: Completion) -> None:
        row.extend(completion, version, budget)
        if not completion.token_ids and row.finish is None:  # no progress possible (the engine's context is full)
            row.finish = "length"

    while any(r.finish is None for g in groups for r in g) and not enough():
        if source is not None and taken < max_interruptions and source.newer():
            version = source.load_newer()
            taken += 1
            for r in (r for g in groups for r in g):
                if r.finish is None and r.tokens:
                    r.interruptions += 1
        fresh = [g for g in groups if g and all(not r.tokens and r.finish is None for r in g)]
        sizes = {len(g) for g in fresh}
        for size in sorted(sizes):
            same = [g for g in fresh if len(g) == size]
            out = call([list(g[0].prompt_ids) for g in same], size, budget)
            for g, produced in zip(same, out):
                for r, c in zip(g, produced.completions):
                    extend(r, c)
        by_length: dict[int, list[PartialRow]] = {}
        started = {id(g) for g in fresh}
        for g in groups:
            for r in g:
                if r.finish is None and id(g) not in started:
                    by_length.setdefault(len(r.tokens), []).append(r)
        for done, rows in sorted(by_length.items()):
            out = call([r.prompt_ids + r.tokens for r in rows], 1, budget - done)
            for r, produced in zip(rows, out):
                extend(r, produced.completions[0])
    return version, taken


class InterruptibleEngine:
    """A rollout worker's engine with partial rollouts: ``generate`` runs ``generate_partial`` while ``active``
    (the worker turns it on around a batch's generation, off around an evaluation, which must use exactly its
    version), else the plain engine's. ``version`` is the version the engine holds (the worker sets it when it
    loads one; a load mid-batch updates it); ``take_count()`` is the number of versions loaded mid-generation
    since it was last asked. Everything else is the wrapped engine's."""

    def __init__(self, engine, source: WeightSource, max_interruptions: int, chunk_tokens: int | None):
        self.engine = engine
        self.max_interruptions, self.chunk_tokens = max_interruptions, chunk_tokens
        self.version: int | None = None
        self.active = False
        self._taken = 0

        def load_newer() -> int:
            self._taken += 1
            return source.load_newer()

        self.source = version_callables(source.newer, load_newer)

    def take_count(self) -> int:
        count, self._taken = self._taken, 0
        return count

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 **kwargs) -> list[CompletionGroup]:
        if not self.active:
            return self.engine.generate(prompt_token_ids, n, sampling, **kwargs)
        groups, self.version = generate_partial(self.engine, prompt_token_ids, n, sampling, self.version,
                                                self.source, self.max_interruptions, self.chunk_tokens)
        return groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def offpolicy_mask(versions: list[int]) -> list[int]:
    """``rollout.mask_offpolicy``: 1 on the tokens of the sample's last version, 0 on those sampled by an older
    one (slime's --mask-offpolicy-in-partial-rollout: only the segment after the last interruption is trained)."""
    last = versions[-1] if versions else 0
    return [int(v == last) for v in versions]


def version_callables(newer: Callable[[], bool], load_newer: Callable[[], int]) -> WeightSource:
    """A ``WeightSource`` from two functions."""

    class _Source:
        def newer(self) -> bool:
            return newer()

        def load_newer(self) -> int:
            return load_newer()

    return _Source()


def partial_metrics(token_versions: list[list[list[int]]], step: int) -> dict[str, float]:
    """Per-step metrics of a batch's per-token versions (trained at RL ``step``): async/token_staleness (the mean
    of step - version over the sampled tokens), async/interrupted_samples (the fraction of samples that ran under
    more than one version), async/offpolicy_tokens (the fraction of tokens older than their sample's last
    version: what rollout.mask_offpolicy masks)."""
    samples = [v for group in token_versions for v in group]
    tokens = sum(len(v) for v in samples) or 1
    return {"async/token_staleness": sum(step - t for v in samples for t in v) / tokens,
            "async/interrupted_samples": sum(len(set(v)) > 1 for v in samples) / max(1, len(samples)),
            "async/offpolicy_tokens": sum(len(v) - sum(offpolicy_mask(v)) for v in samples) / tokens}
