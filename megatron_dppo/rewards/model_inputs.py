"""What a reward model reads: the token ids of one (prompt, completion), rendered one of three ways.

``tokens``  the policy's own ids, verbatim: the rendered prompt's ids, then the completion's ids as sampled (stop
            token included). Exact and free, and only meaningful when the reward model's tokenizer IS the
            policy's (an RM fine-tuned from the policy's base, or trained by ``megatron-dppo rm train`` on the run's
            tokenizer): ``same_tokenizer`` checks the vocabularies and special tokens.
``chat``    decode, then the reward model's chat template over [user: prompt text, assistant: completion text]
            (no generation prompt), tokenized without extra special tokens: verl's ``_preprocess_reward_inputs``
            and TRL's conversational path. A BOS the template writes is kept once, never doubled (verl strips it
            from the text because its server adds one; the ids are the same).
``text``    prompt text + completion text, tokenized without special tokens: TRL's non-conversational path.
``auto``    ``tokens`` when the tokenizers match, else ``chat`` when the reward model's tokenizer has a chat
            template, else ``text``.

The prompt text is the dataset's question (``Prompt.text``), without the instruction or system prompt the
policy's template may have added; the completion text is the policy's decoded completion without special tokens.
When the policy's prompts are rendered with the same chat template, ``tokens`` and ``chat`` give the same ids for
every completion that stopped (its stop token is the template's end of turn); a completion cut by
``rollout.max_new_tokens`` gets the end-of-turn token from ``chat`` but not from ``tokens``.

A judge (``kind=judge``) reads a question instead: ``judge_prompt`` fills the judge template with the prompt, the
completion and, in group mode, the numbered list of the group's completions, and renders it as the user turn of the
judge's chat template with the generation prompt (or as raw text when the judge has no chat template).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

TEMPLATES = ("auto", "tokens", "chat", "text")

DEFAULT_JUDGE_TEMPLATE = ("Question: {prompt}\nAnswer: {completion}\nIs the answer correct? Reply yes or no.")
DEFAULT_GROUP_JUDGE_TEMPLATE = ("Question: {prompt}\nCandidate answers:\n{group}\nIs answer {index} correct? Reply "
                                "yes or no.")


@dataclass(frozen=True)
class Sample:
    """One completion to score: the policy's ids and the texts a re-render needs."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    prompt_text: str
    completion_text: str


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map every string to the same ids: the same vocabulary and special tokens, and (fast
    tokenizers) the same pipeline (normalizer, pre-tokenizer, model): one vocabulary read by two pipelines can
    split a text differently. Strict on purpose: a false "differ" only costs a re-render."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    specials = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    if len(a) != len(b) or any(getattr(a, s, None) != getattr(b, s, None) for s in specials) \
            or a.get_vocab() != b.get_vocab():
        return False
    pipelines = [getattr(t, "backend_tokenizer", None) for t in (a, b)]
    if all(p is not None for p in pipelines):
        return pipelines[0].to_str() == pipelines[1].to_str()
    return True


def resolve_template(template: str, rm_tokenizer: Any, policy_tokenizer: Any) -> str:
    """The concrete rendering (tokens | chat | text) of ``template`` (module docstring); ValueError when ``tokens``
    is asked for with a tokenizer that is not the policy's, or ``chat`` without a chat template."""
    if template not in TEMPLATES:
        raise ValueError(f"reward.model.template={template!r} is invalid: expected one of {TEMPLATES}")
    if template == "auto":
        if same_tokenizer(rm_tokenizer, policy_tokenizer):
            return "tokens"
        return "chat" if getattr(rm_tokenizer, "chat_template", None) else "text"
    if template == "tokens" and not same_tokenizer(rm_tokenizer, policy_tokenizer):
        raise ValueError("reward.model.template=tokens reuses the policy's token ids, but the reward model's "
                         "tokenizer differs from the policy's (vocabulary or special tokens); use template=chat or "
                         "text (decode and re-render), or auto")
    if template == "chat" and not getattr(rm_tokenizer, "chat_template", None):
        raise ValueError("reward.model.template=chat: the reward model's tokenizer has no chat template; use "
                         "template=text or auto")
    return template


class InputBuilder:
    """Token ids of the reward model's input for each :class:`Sample` (module docstring).

    ``template``: tokens | chat | text (resolved, see ``resolve_template``); ``tokenizer``: the reward model's;
    ``max_length``: the reward model's context; ``vocab_size``: its embedding rows (a longer input, or an id past
    the rows, e.g. a policy token the reward model's vocabulary lacks, is an error naming it)."""

    def __init__(self, template: str, tokenizer: Any, max_length: int | None = None, vocab_size: int | None = None):
        if template not in ("tokens", "chat", "text"):
            raise ValueError(f"InputBuilder needs a resolved template (tokens, chat or text), got {template!r}")
        self.template = template
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.vocab_size = vocab_size

    def classifier_input(self, s: Sample) -> list[int]:
        if self.template == "tokens":
            ids = [int(t) for t in s.prompt_ids] + [int(t) for t in s.completion_ids]
        elif self.template == "chat":
            ids = self._chat([{"role": "user", "content": s.prompt_text},
                              {"role": "assistant", "content": s.completion_text}], generation_prompt=False)
        else:
            ids = self._encode(s.prompt_text + s.completion_text)
        return self._checked(ids)

    def judge_input(self, question: str) -> list[int]:
        """The judge's input for a filled-in question: its chat template's user turn and generation prompt, or the
        raw text when it has none."""
        if getattr(self.tokenizer, "chat_template", None):
            ids = self._chat([{"role": "user", "content": question}], generation_prompt=True)
        else:
            ids = self._encode(question)
        return self._checked(ids)

    # ------------------------------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return self._encode(text)

    def _checked(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("the reward model's input is empty")
        if self.max_length is not None and len(ids) > self.max_length:
            raise ValueError(f"a reward model input has {len(ids)} tokens, more than the reward model's context of "
                             f"{self.max_length} (max_position_embeddings)")
        if self.vocab_size is not None and max(ids) >= self.vocab_size:
            raise ValueError(f"a reward model input holds token id {max(ids)}, past the reward model's "
                             f"{self.vocab_size} embedding rows (the policy's vocabulary is larger than the reward "
                             "model's: give it vocab_size >= the policy's, or use template=chat/text)")
        return ids


def judge_question(template: str, prompt: str, completion: str, group: Sequence[str] | None = None,
                   index: int | None = None) -> str:
    """``template`` filled in: {prompt}, {completion}, and in group mode {group} (the completions numbered from 1,
    one per line) and {index} (this completion's number)."""
    fields = {"prompt": prompt, "completion": completion}
    if group is not None:
        fields["group"] = "\n".join(f"{i + 1}. {c}" for i, c in enumerate(group))
        fields["index"] = str((index or 0) + 1)
    try:
        return template.format(**fields)
    except (KeyError, IndexError) as err:
        raise ValueError(f"reward.model.judge_template {template!r} names {err} which is not one of "
                         f"{sorted('{' + k + '}' for k in fields)}") from None
