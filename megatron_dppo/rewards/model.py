"""A learned reward model scored beside the rule reward: a sequence classifier or a generative judge.

    rm = RewardModel(engine, tokenizer, policy_tokenizer, kind="classifier", name="runs/rm")
    scores = rm.score(groups)          # groups: [prompt][completion] of model_inputs.Sample -> GroupScores

Kinds (``reward.model.kind``):

``classifier``  a 1-label sequence classifier (``*ForSequenceClassification``, the Bradley-Terry reward models of
                TRL, OpenRLHF, NeMo-RL and ``megatron-dppo rm train``): the score is its logit at the last token of
                the input (``model_inputs``: the policy's ids or a re-render).
``judge``       a causal LM asked a question about the completion (``judge_template``), in one of two modes:
                ``yes_prob``: one forward pass, score = p(yes | yes or no) = sigmoid(log p(yes) - log p(no)) of the
                first answer token (the judge tokens, ``judge_tokens``): deterministic, the verifier-style GenRM.
                ``verdict``: a sampled reply (``judge_max_new_tokens``, seeds from (seed, step, shard)) whose last
                number (``judge_pattern``) is the score; a reply without one scores ``unparsed_score`` and is
                counted (``GroupScores.unparsed``).
                With ``judge_group`` the question also lists the whole group (``{group}``, ``{index}``): a
                completion's score may then depend on its group, which GRPO and DPPO allow (scoring precedes the
                advantages and the pruning of the completions).

Engines (the ``engine`` argument; one per process) all take token ids and expose what the kinds need:

    classify(inputs: list[list[int]]) -> Tensor[N] float32            # classifier: logit of label 0, last token
    next_token_logprobs(inputs, token_ids: list[int]) -> Tensor[N, K]   # judge yes_prob
    generate(inputs, max_new_tokens, temperature, seed) -> list[list[int]]   # judge verdict
    wake_up(); sleep()                                                  # accelerator memory around scoring
    shard() -> (index, count)                                           # who scores which groups

``rewards.hf_model.HFRewardEngine`` (any device), ``rewards.vllm_model.VLLMRewardEngine`` (pooling for classifiers,
generate for judges) and ``megatron.reward_engine.MegatronRewardEngine`` (classifier under the policy's TP/PP).

Failures. A reward model is infrastructure: when it raises, runs past ``timeout_s`` or returns a score that is not
finite, ``score`` returns no scores and the error (``GroupScores.error``, naming the model and the groups); the
caller (``train.rollouts.score``) stops the run by default (``reward.model.on_error=stop``, ``RewardModelError``) or
scores those groups 0 and counts them (``on_error=zero``). It never silently scores 0: a zero would enter every
advantage of the group.
"""
from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from megatron_dppo.rewards.model_inputs import (
    DEFAULT_GROUP_JUDGE_TEMPLATE,
    DEFAULT_JUDGE_TEMPLATE,
    InputBuilder,
    Sample,
    judge_question,
    resolve_template,
)

KINDS = ("classifier", "judge")
JUDGE_MODES = ("yes_prob", "verdict")
DEFAULT_JUDGE_PATTERN = r"-?\d+(?:\.\d+)?"


class RewardModelError(RuntimeError):
    """A reward model failed and ``reward.model.on_error=stop``: the run stops with this one message."""


@dataclass
class GroupScores:
    """Scores of some groups ([group][completion], float), or ``error`` (then ``scores`` is None)."""

    scores: list[list[float]] | None
    error: str | None = None
    seconds: float = 0.0
    unparsed: int = 0  # judge verdicts without a number, scored ``unparsed_score``


@dataclass
class JudgeOptions:
    """How a judge is asked (the ``reward.model.judge_*`` options)."""

    mode: str = "yes_prob"
    template: str | None = None  # None: the default (group) template
    group: bool = False
    tokens: tuple[str, str] = ("yes", "no")
    max_new_tokens: int = 16
    temperature: float = 1.0
    pattern: str = DEFAULT_JUDGE_PATTERN
    unparsed_score: float = 0.0

    def __post_init__(self):
        if self.mode not in JUDGE_MODES:
            raise ValueError(f"reward.model.judge_mode={self.mode!r} is invalid: expected one of {JUDGE_MODES}")
        if self.template is None:
            self.template = DEFAULT_GROUP_JUDGE_TEMPLATE if self.group else DEFAULT_JUDGE_TEMPLATE
        if self.group and "{index}" not in self.template:
            raise ValueError("reward.model.judge_group=true needs a judge_template with {index} (which answer of "
                             "the {group} list is judged)")
        re.compile(self.pattern)


class RewardModel:
    """Scores groups of completions with one reward-model engine (module docstring).

    Args:
        engine: the scoring engine (module docstring).
        tokenizer: the reward model's tokenizer.
        policy_tokenizer: the policy's (``template=auto|tokens`` reuses its ids when the two match).
        kind: classifier | judge.
        template: auto | tokens | chat | text (classifiers; ``model_inputs``).
        judge: JudgeOptions (kind=judge).
        name: how errors and logs name the model (its folder).
        timeout_s: wall-clock limit of one ``score`` call (None = none); past it the call fails.
        max_length: the reward model's context in tokens.
        vocab_size: the rows of its embedding (an input id past them is an error naming it).
    """

    def __init__(self, engine: Any, tokenizer: Any, policy_tokenizer: Any = None, *, kind: str = "classifier",
                 template: str = "auto", judge: JudgeOptions | None = None, name: str = "reward model",
                 timeout_s: float | None = None, max_length: int | None = None, vocab_size: int | None = None):
        if kind not in KINDS:
            raise ValueError(f"reward.model.kind={kind!r} is invalid: expected one of {KINDS}")
        if timeout_s is not None and not 0 < timeout_s < math.inf:
            raise ValueError(f"reward.model.timeout_s={timeout_s!r} is invalid: expected a number of seconds > 0")
        self.engine, self.tokenizer, self.kind, self.name = engine, tokenizer, kind, name
        self.timeout_s = timeout_s
        self.judge = judge or JudgeOptions()
        resolved = resolve_template(template, tokenizer, policy_tokenizer) if kind == "classifier" else "text"
        self.template = resolved
        self.inputs = InputBuilder(resolved, tokenizer, max_length, vocab_size)
        self._judge_ids: list[int] = []
        if kind == "judge" and self.judge.mode == "yes_prob":
            self._judge_ids = [single_token_id(tokenizer, t) for t in self.judge.tokens]

    # ------------------------------------------------------------------------------------------------------------
    def score(self, groups: Sequence[Sequence[Sample]], *, seed: int = 0, label: str = "") -> GroupScores:
        """Scores of every completion of ``groups``, or the error (module docstring). ``label`` names the groups
        in the error (e.g. the step and prompt ids); ``seed`` seeds sampled verdicts."""
        start = time.perf_counter()
        where = f" ({label})" if label else ""
        try:
            scores, unparsed = self._within_timeout(lambda: self._score(groups, seed))
        except Exception as err:  # noqa: BLE001 - returned to the caller, who applies reward.model.on_error
            return GroupScores(None, f"reward model {self.name!r} failed{where}: {type(err).__name__}: {err}",
                               time.perf_counter() - start)
        flat = [s for g in scores for s in g]
        bad = next((i for i, s in enumerate(flat) if not math.isfinite(s)), None)
        if bad is not None:
            return GroupScores(None, f"reward model {self.name!r} returned a non-finite score {flat[bad]} for "
                                     f"completion {bad} of the batch{where}", time.perf_counter() - start)
        return GroupScores(scores, None, time.perf_counter() - start, unparsed)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------------------------------------------------
    def _within_timeout(self, fn):
        """``fn()``, failing past ``timeout_s``: in a thread that is abandoned at the limit for engines that run in
        this process alone (``engine.interruptible``: HF); engines whose calls other ranks or processes take part in
        (vLLM, Megatron) are not interrupted (their peers would wait forever) and fail after the call instead."""
        if self.timeout_s is None:
            return fn()
        if not getattr(self.engine, "interruptible", False):
            start = time.perf_counter()
            value = fn()
            if time.perf_counter() - start > self.timeout_s:
                raise TimeoutError(f"scoring took {time.perf_counter() - start:.1f}s, more than "
                                   f"reward.model.timeout_s={self.timeout_s:g}s")
            return value
        box: dict[str, Any] = {}

        def run():
            try:
                box["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = err

        thread = threading.Thread(target=run, name="reward-model", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"scoring took longer than reward.model.timeout_s={self.timeout_s:g}s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _score(self, groups: Sequence[Sequence[Sample]], seed: int) -> tuple[list[list[float]], int]:
        sizes = [len(g) for g in groups]
        samples = [s for g in groups for s in g]
        unparsed = 0
        if not samples:
            return [[] for _ in groups], 0
        if self.kind == "classifier":
            flat = self.engine.classify([self.inputs.classifier_input(s) for s in samples]).double().tolist()
        else:
            questions = []
            for g in groups:
                texts = [s.completion_text for s in g] if self.judge.group else None
                questions += [judge_question(self.judge.template, s.prompt_text, s.completion_text, texts, i)
                              for i, s in enumerate(g)]
            inputs = [self.inputs.judge_input(q) for q in questions]
            if self.judge.mode == "yes_prob":
                flat = yes_probability(self.engine.next_token_logprobs(inputs, self._judge_ids)).tolist()
            else:
                replies = self.engine.generate(inputs, self.judge.max_new_tokens, self.judge.temperature, seed)
                flat = []
                for reply in replies:
                    value = parse_verdict(self.tokenizer.decode(reply, skip_special_tokens=True), self.judge.pattern)
                    unparsed += value is None
                    flat.append(self.judge.unparsed_score if value is None else value)
        out, i = [], 0
        for n in sizes:
            out.append([float(x) for x in flat[i:i + n]])
            i += n
        return out, unparsed


# ----------------------------------------------------------------------------------------------------------------
def yes_probability(logprobs: torch.Tensor) -> torch.Tensor:
    """p(yes | yes or no) = sigmoid(log p(yes) - log p(no)) from [N, 2] next-token log-probs (yes, no), float64."""
    logprobs = logprobs.double()
    return torch.sigmoid(logprobs[:, 0] - logprobs[:, 1])


def parse_verdict(text: str, pattern: str = DEFAULT_JUDGE_PATTERN) -> float | None:
    """The last match of ``pattern`` in a judge's reply as a float, or None."""
    found = re.findall(pattern, text)
    if not found:
        return None
    last = found[-1]
    try:
        return float(last if isinstance(last, str) else last[0])
    except ValueError:
        return None


def single_token_id(tokenizer: Any, text: str) -> int:
    """The id of ``text`` as ONE token of ``tokenizer``; ValueError otherwise (judge tokens must be single)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) != 1:
        raise ValueError(f"reward.model.judge_tokens: {text!r} is {len(ids)} tokens for the judge's tokenizer "
                         f"({ids}); choose strings that are one token each (e.g. with or without a leading space)")
    return int(ids[0])
