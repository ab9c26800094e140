"""Token-in-token-out episodes: one token stream per episode, built without ever re-tokenizing what was sampled.

The stream of an episode is ``prompt ids + turn_1 + obs_1 + turn_2 + ... + turn_k`` where

* ``turn_j`` are the engine's sampled ids, verbatim, with their log-probs (loss mask 1);
* ``obs_j`` are the ids of the observation messages as the chat template renders them after an assistant turn,
  up to and including the next generation prompt (loss mask 0, log-prob 0.0).

Observation ids (:meth:`ChatTokens.observation_ids`) come from the chat template alone, as a suffix difference on
a SYNTHETIC conversation (``[system, user, assistant("")]`` with and without the observation messages and the
generation prompt), cut right after the token that ended the sampled turn. That token (``<|im_end|>`` in ChatML,
``</s>`` in the project's SentencePiece template) closes the synthetic assistant message too, so everything the
template puts after it is part of the observation: ChatML's ``\\n`` after ``<|im_end|>``, which generation never
emits and which verl #6921 dropped at every turn, lands in ``obs_j`` with mask 0. Neither the model's text nor the
real history is rendered, so a template that rewrites history (thinking stripped from old turns) cannot shift a
sampled token. A template that is not append-only (the synthetic render with the observation does not extend the
one without) raises :class:`TokenDriftError`.

Checks (:func:`check_episode`, always on; :func:`audit_render`, ``env.token_check``):

* token identity: every sampled segment equals the engine's output, every turn's context (the ids handed to the
  engine) equals the stream up to that turn, the mask is 1 exactly on sampled tokens. A decode -> re-encode loop
  (the TRL #5224 / prime-rl #1334 class) changes the ids of some sampled text and fails it.
* render audit: the conversation rendered by the chat template as TEXT (the assistant contents decoded from the
  sampled ids) must start with the decoded stream. Text, not ids, because a sampled tokenization need not be the
  canonical one; a missing or doubled template piece between turns fails it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

_SYNTHETIC_SYSTEM = {"role": "system", "content": "synthetic system"}
_SYNTHETIC_USER = {"role": "user", "content": "synthetic user"}


class TokenDriftError(RuntimeError):
    """The token stream of an episode is not what the model sampled and conditioned on, or the chat template
    cannot be extended append-only."""


def _as_ids(rendered: Any) -> list[int]:
    if hasattr(rendered, "keys") and "input_ids" in rendered:
        rendered = rendered["input_ids"]
    ids = list(rendered)
    if ids and isinstance(ids[0], (list, tuple)):  # a batched render of one conversation
        ids = list(ids[0])
    return [int(t) for t in ids]


class ChatTokens:
    """Observation and prompt ids from a tokenizer's chat template (module docstring).

    Args: tokenizer (a transformers tokenizer with a chat template), chat_template_kwargs (extra keyword arguments
    of ``apply_chat_template``, e.g. ``tools``)."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn episodes need a tokenizer with a chat template (observation tokens come from "
                             "it); set one on the tokenizer or use a single-turn run")
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self._system_ok = self._renders([_SYNTHETIC_SYSTEM, _SYNTHETIC_USER])
        self._close_cache: dict[str, tuple[list[int], int]] = {}

    # -- rendering -----------------------------------------------------------------------------------------------
    def render_ids(self, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
        return _as_ids(self.tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False,
                                                          add_generation_prompt=add_generation_prompt,
                                                          **self.kwargs))

    def render_text(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.kwargs)

    def _renders(self, messages: list[dict]) -> bool:
        try:
            self.render_ids(messages, False)
            return True
        except Exception:  # noqa: BLE001 - a template that rejects a system role raises anything (jinja, ValueError)
            return False

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The prompt of a conversation: the messages rendered with the generation prompt."""
        return self.render_ids(messages, True)

    # -- observations --------------------------------------------------------------------------------------------
    def _synthetic_head(self) -> list[dict]:
        return [_SYNTHETIC_SYSTEM, _SYNTHETIC_USER] if self._system_ok else [_SYNTHETIC_USER]

    @staticmethod
    def _synthetic_assistant(observation: Sequence[dict]) -> dict:
        """An empty assistant turn; with tool calls (named after the tool messages) when the observation holds tool
        messages, since some templates (Qwen2.5, GPT-OSS) render tool responses from the calls they answer."""
        tools = [m for m in observation if m.get("role") == "tool"]
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if tools:
            message["tool_calls"] = [{"id": m.get("tool_call_id", f"call_{i}"), "type": "function",
                                      "function": {"name": m.get("name", "tool"), "arguments": {}}}
                                     for i, m in enumerate(tools)]
        return message

    def _closed_assistant(self, assistant: dict) -> tuple[list[int], int, int, list[int]]:
        """(ids of the synthetic conversation ending with ``assistant``, where the assistant's content and closing
        tokens start, where the message starts, the generation prompt's ids): the part before the message and, when
        the rendered message begins with the template's generation prompt (``<|im_start|>assistant\\n``), that
        header are skipped, so a header token is never taken for an end of turn."""
        key = repr(assistant)
        if key not in self._close_cache:
            head = self._synthetic_head()
            before = self.render_ids(head, False)
            closed = self.render_ids(head + [assistant], False)
            if closed[: len(before)] != before:
                raise TokenDriftError("the chat template is not append-only: appending an assistant message changes "
                                      "the tokens of the conversation before it")
            header = self.render_ids(head, True)[len(before):]
            start = len(before)
            if header and closed[start: start + len(header)] == header:
                start += len(header)
            self._close_cache[key] = (closed, start, len(before), header)
        return self._close_cache[key]

    def ends_turn(self, token_id: int) -> bool:
        """Whether a turn that stopped at ``token_id`` can be continued: the template closes assistant turns with
        that token (e.g. ``<|im_end|>``; not a bare EOS like ``<|endoftext|>`` that ChatML never renders)."""
        closed, start, _, _ = self._closed_assistant(self._synthetic_assistant([]))
        return int(token_id) in closed[start:]

    def observation_ids(self, messages: Sequence[dict], turn_end_id: int) -> list[int]:
        """The ids that follow an assistant turn ending with ``turn_end_id`` when ``messages`` are appended: the
        template's junction after that token, the messages, the next generation prompt (module docstring)."""
        if not messages:
            raise ValueError("observation_ids needs at least one message")
        assistant = self._synthetic_assistant(messages)
        closed, start, message_start, header = self._closed_assistant(assistant)
        ends = [i for i in range(start, len(closed)) if closed[i] == int(turn_end_id)]
        if not ends:
            raise TokenDriftError(f"token {turn_end_id} does not close an assistant turn in this chat template; an "
                                  "episode can only continue after a turn ended by the template's end-of-turn token")
        full = self.render_ids(self._synthetic_head() + [assistant] + list(messages), True)
        roles = [m.get("role") for m in messages]
        # Only the ids AFTER the assistant's end-of-turn token are used (the sampled turn stands verbatim in the
        # stream). The assistant message itself may render differently once it is no longer the last one (Qwen3
        # writes an empty <think> block into the last assistant message only): that part is not compared.
        if full[:message_start] != closed[:message_start]:
            raise TokenDriftError(f"the chat template is not append-only: appending {roles} messages changes the "
                                  "tokens of the conversation before them")
        body = message_start + _first_difference(header, full[message_start:])
        closing = [i for i in range(body, len(full)) if full[i] == int(turn_end_id)]
        tail = closed[ends[-1] + 1:]  # what the template writes after the end-of-turn token (ChatML: "\n")
        if len(closing) < len(ends) or full[closing[len(ends) - 1] + 1:][: len(tail)] != tail:
            raise TokenDriftError(f"the chat template is not append-only: appending {roles} messages changes what "
                                  f"follows the end-of-turn token {turn_end_id} of the assistant turn before them")
        return full[closing[len(ends) - 1] + 1:]

    def probe(self, stop_ids: Sequence[int], token_check: str = "strict") -> list[str]:
        """Start-up check that episodes can run on this chat template, before step 0 (not at the first tool step,
        mid-run): for every stop id that closes assistant turns, observation ids for a ``tool`` and a ``user``
        message (a role the template cannot render at all is skipped), and the render audit of a synthetic two-turn
        episode built as the episode loop builds one. Raises TokenDriftError when no observation role can follow an
        assistant turn, or (``token_check="strict"``) when the render audit fails for every role: a template that
        rewrites earlier turns (Qwen3 writes an empty <think> block into the last assistant message only) makes that
        audit fail on every multi-turn episode while the streams themselves are right. Returns the problems found
        otherwise (for a warning)."""
        problems: list[str] = []
        passed = 0
        for end in [int(t) for t in stop_ids if self.ends_turn(int(t))][:1]:
            drift: list[str] = []
            for role in ("tool", "user"):
                message = [{"role": role, "content": "2"}]
                try:
                    self.observation_ids(message, end)
                except TokenDriftError as err:
                    drift.append(f"{role}: {err}")
                    continue
                except Exception:  # noqa: BLE001 - the template does not render this role (jinja raises anything)
                    continue
                problem = self._probe_audit(message, end)
                if problem is not None:
                    problems.append(f"a {role} observation: {problem}")
                else:
                    passed += 1
            if len(drift) == 2:
                raise TokenDriftError("episodes cannot continue after a turn on this chat template "
                                      f"({'; '.join(drift)})")
            problems += drift
        # strict: only when no role passes (an environment answers in one role; a tokenizer may lack another's
        # marker, as the tiny SentencePiece one lacks <|tool|>): the problems of the others are returned
        if problems and not passed and token_check == "strict":
            raise TokenDriftError("the render audit (env.token_check=strict) fails on a synthetic two-turn episode "
                                  f"with this chat template: {'; '.join(problems)}. The chat template renders a "
                                  "conversation differently from the token stream the episode loop builds (e.g. it "
                                  "rewrites earlier assistant turns); set env.token_check=warn or off if that is "
                                  "expected")
        return problems

    def _probe_audit(self, observation: list[dict], end: int) -> str | None:
        """The render audit of a synthetic episode: turn "1", the observation, turn "3", each sampled as the
        canonical ids of its text + ``end``."""
        head = self._synthetic_head()
        trajectory = Trajectory(self.prompt_ids(head))
        encode = lambda text: list(self.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        trajectory.append_sampled(encode("1") + [end], [0.0] * (len(encode("1")) + 1))
        trajectory.append_observation(self.observation_ids(observation, end))
        trajectory.append_sampled(encode("3") + [end], [0.0] * (len(encode("3")) + 1))
        conversation = conversation_messages(self.tokenizer, trajectory, [observation], [end])
        return audit_render(self, trajectory, head, conversation, final_stop=True)


# --------------------------------------------------------------------------------------------------------------
# The token stream of one episode
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Trajectory:
    """One episode's tokens after its prompt, with a loss mask and per-token log-probs (module docstring).

    token_ids:       assistant turns verbatim and observation ids, in order (the "completion" of the episode)
    loss_mask:       1 on sampled tokens, 0 on observation tokens
    logprobs:        the engine's behaviour log-probs (of the distribution sampled: rollout/base.py) on sampled
                     tokens, 0.0 on observation tokens
    segments:        (kind, start, end) spans of ``token_ids``, kind "assistant" or "observation"
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[tuple[str, int, int]] = field(default_factory=list)

    def context(self) -> list[int]:
        """The ids the engine conditions the next turn on: the prompt and the stream so far."""
        return self.prompt_ids + self.token_ids

    def append_sampled(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if len(logprobs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} sampled tokens with {len(logprobs)} log-probs")
        self._append("assistant", token_ids, 1, logprobs)

    def append_observation(self, token_ids: Sequence[int]) -> None:
        self._append("observation", token_ids, 0, [0.0] * len(token_ids))

    def _append(self, kind, token_ids, mask, logprobs) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([mask] * len(token_ids))
        self.logprobs.extend(float(x) for x in logprobs)
        self.segments.append((kind, start, len(self.token_ids)))

    @property
    def num_trained(self) -> int:
        """Tokens with loss mask 1 (the sampled ones)."""
        return sum(self.loss_mask)

    def assistant_spans(self) -> list[tuple[int, int]]:
        return [(a, b) for kind, a, b in self.segments if kind == "assistant"]


def check_episode(trajectory: Trajectory, sampled: Sequence[tuple[Sequence[int], Sequence[float]]],
                  contexts: Sequence[Sequence[int]]) -> None:
    """Token identity of an episode (module docstring): ``sampled[j]`` = (ids, log-probs) the engine returned for
    turn j, ``contexts[j]`` = the ids the engine was given for turn j. Raises TokenDriftError naming the first
    difference."""
    t = trajectory
    spans = t.assistant_spans()
    if not (len(spans) == len(sampled) == len(contexts)):
        raise TokenDriftError(f"{len(spans)} assistant segments, {len(sampled)} sampled turns, {len(contexts)} "
                              "contexts: every turn must be appended exactly once")
    n = len(t.token_ids)
    if not len(t.loss_mask) == len(t.logprobs) == n:
        raise TokenDriftError("token ids, loss mask and log-probs of the episode differ in length")
    expected_mask = [0] * n
    for j, ((a, b), (ids, logprobs), context) in enumerate(zip(spans, sampled, contexts)):
        if list(context) != t.prompt_ids + t.token_ids[:a]:
            at = _first_difference(list(context), t.prompt_ids + t.token_ids[:a])
            raise TokenDriftError(f"turn {j}: the engine was given a context that differs from the episode's stream "
                                  f"at position {at} (re-tokenized history?)")
        if t.token_ids[a:b] != [int(x) for x in ids]:
            at = _first_difference(t.token_ids[a:b], [int(x) for x in ids])
            raise TokenDriftError(f"turn {j}: the stream holds other ids than the engine sampled (first difference "
                                  f"at token {at} of the turn): sampled text was re-tokenized")
        if t.logprobs[a:b] != [float(x) for x in logprobs]:
            raise TokenDriftError(f"turn {j}: the stream's log-probs are not the engine's")
        expected_mask[a:b] = [1] * (b - a)
    if t.loss_mask != expected_mask:
        raise TokenDriftError(f"loss mask is not 1 exactly on the sampled tokens (first difference at token "
                              f"{_first_difference(t.loss_mask, expected_mask)})")
    if any(x != 0.0 for x, m in zip(t.logprobs, t.loss_mask) if not m):
        raise TokenDriftError("observation tokens must carry log-prob 0.0")


def _first_difference(a: Sequence, b: Sequence) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def conversation_messages(tokenizer: Any, trajectory: Trajectory, observations: Sequence[Sequence[dict]],
                          turn_end_ids: Sequence[int]) -> list[dict]:
    """The episode as chat messages after the prompt: each assistant turn's content decoded from its sampled ids
    (its final end-of-turn token left to the template), then that turn's observation messages."""
    messages: list[dict] = []
    ends = {int(t) for t in turn_end_ids}
    for j, (a, b) in enumerate(trajectory.assistant_spans()):
        ids = trajectory.token_ids[a:b]
        if ids and ids[-1] in ends:
            ids = ids[:-1]
        messages.append({"role": "assistant", "content": _decode(tokenizer, ids)})
        if j < len(observations):
            messages.extend(observations[j])
    return messages


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def audit_render(chat: ChatTokens, trajectory: Trajectory, prompt_messages: Sequence[dict],
                 conversation: Sequence[dict], final_stop: bool) -> str | None:
    """The render audit (module docstring): None when the chat template renders ``prompt_messages +
    conversation`` as text that starts with the decoded stream, else a description of the first difference.
    ``final_stop``: the stream ends with the last turn's stop token (left out of the comparison: the template
    closes the last assistant message itself, with whatever end-of-turn it uses)."""
    prompt = list(prompt_messages) or [_SYNTHETIC_USER]
    head = chat.render_text(prompt, True)
    full = chat.render_text(prompt + list(conversation), False)
    if not full.startswith(head):
        return "the chat template is not append-only for this conversation"
    expected = full[len(head):]
    ids = trajectory.token_ids[:-1] if final_stop and trajectory.token_ids else trajectory.token_ids
    actual = _decode(chat.tokenizer, ids)
    if expected.startswith(actual):
        return None
    at = _first_difference(actual, expected)
    return (f"the token stream decodes to {actual[max(0, at - 20): at + 20]!r} where the chat template renders "
            f"{expected[max(0, at - 20): at + 20]!r} (character {at} after the prompt)")
