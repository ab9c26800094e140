"""Turning a prompt record into model input: chat templates, plain templates, and the context-length check.

``PromptFormatter(tokenizer, template=...)`` renders a question as text and token ids:
    "chat"   the tokenizer's own chat template (system message if given, then the user turn, then the generation
             prompt). A tokenizer without a chat template raises ValueError naming the alternatives.
    "plain"  the built-in "Question: {prompt}\\nAnswer:" (a system prompt, if any, goes first on its own line)
    "raw"    the prompt text unchanged (the arithmetic quickstart: "12+7*3=")
    any other string containing "{prompt}" is used as a format template, e.g. "Q: {prompt}\\nA:".
An ``instruction`` (e.g. ``MATH_INSTRUCTION``) is appended to the question after a blank line, in every mode.

Chat-rendered text already contains the template's special tokens, so it is encoded without adding more; the
other modes encode with the tokenizer's default special tokens (a BOS where the tokenizer adds one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PLAIN_TEMPLATE = "Question: {prompt}\nAnswer:"
TEMPLATE_MODES = ("chat", "plain", "raw")
PREFIX_CHARS_PER_TOKEN = 16  # text averages ~4 characters per token: such a prefix holds ~4x the allowed tokens
PREFIX_MARGIN = 2


@dataclass
class PromptFormatter:
    """Renders and tokenizes prompts; see the module docstring. ``tokenizer`` is a transformers tokenizer."""

    tokenizer: Any
    template: str = "chat"
    system_prompt: str | None = None
    instruction: str | None = None

    def __post_init__(self):
        if self.template not in TEMPLATE_MODES and "{prompt}" not in self.template:
            raise ValueError(f"prompt template {self.template!r} must be one of {TEMPLATE_MODES} or a format string "
                             "containing '{prompt}'")
        if self.template == "chat" and not getattr(self.tokenizer, "chat_template", None):
            name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
            raise ValueError(f"tokenizer {name!r} has no chat template; set the prompt template to 'plain' "
                             f"(built-in {PLAIN_TEMPLATE!r}), 'raw', or a format string containing '{{prompt}}'")

    def _question(self, prompt: str) -> str:
        return f"{prompt}\n\n{self.instruction}" if self.instruction else prompt

    def messages(self, prompt: str) -> list[dict]:
        """The chat messages ``render`` renders with the chat template (system message if given, the user turn);
        empty for the other templates, whose prompt is not a chat."""
        if self.template != "chat":
            return []
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": self._question(prompt)})
        return messages

    def render(self, prompt: str) -> str:
        """The full prompt text fed to the model."""
        question = self._question(prompt)
        if self.template == "chat":
            return self.tokenizer.apply_chat_template(self.messages(prompt), tokenize=False,
                                                      add_generation_prompt=True)
        system = f"{self.system_prompt}\n" if self.system_prompt else ""
        if self.template == "raw":
            return system + question
        pattern = PLAIN_TEMPLATE if self.template == "plain" else self.template
        return system + pattern.format(prompt=question)

    def too_long(self, prompt: str, max_tokens: int) -> int | None:
        """A token count > ``max_tokens`` that ``encode(prompt)`` provably reaches, found by tokenizing only a
        prefix of ``PREFIX_CHARS_PER_TOKEN * (max_tokens + 1)`` characters (cut at whitespace); None when the
        prefix does not settle it (then encode the whole prompt). A 20 MB row is refused in milliseconds instead
        of tokenized for half a minute with gigabytes of memory. Tokens of a prefix cut at whitespace are the
        full text's first tokens, up to the last one or two (``PREFIX_MARGIN``)."""
        limit = PREFIX_CHARS_PER_TOKEN * (max_tokens + 1)
        if len(prompt) <= limit:
            return None
        prefix = prompt[:limit]
        cut = max(prefix.rfind(" "), prefix.rfind("\n"))
        prefix = prefix[:cut] if cut > limit // 2 else prefix
        count = len(self.encode(prefix)) - PREFIX_MARGIN
        return count if count > max_tokens else None

    def encode(self, prompt: str) -> list[int]:
        """Token ids of ``render(prompt)``."""
        text = self.render(prompt)
        add_special = self.template != "chat"
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])


def check_prompt_fits(prompt_tokens: int, max_new_tokens: int, context_length: int, prompt_id: Any = "",
                      at_least: bool = False) -> None:
    """Raise ValueError unless prompt_tokens + max_new_tokens <= context_length, naming both lengths.
    ``at_least``: ``prompt_tokens`` is a lower bound (:meth:`PromptFormatter.min_tokens`), not a count."""
    if max_new_tokens < 0 or context_length <= 0:
        raise ValueError(f"invalid lengths: max_new_tokens={max_new_tokens}, context_length={context_length}")
    if prompt_tokens + max_new_tokens > context_length:
        label = f"prompt {prompt_id!r}" if prompt_id != "" else "a prompt"
        room = context_length - max_new_tokens
        raise ValueError(
            f"{label} is {'at least ' if at_least else ''}{prompt_tokens} tokens long but the context length is "
            f"{context_length} tokens and "
            f"{max_new_tokens} are reserved for the completion (max_new_tokens), so prompts may have at most {room} "
            "tokens; raise the context length, lower max_new_tokens, or drop long prompts from the dataset")


def encode_prompts(formatter: PromptFormatter, records, *, max_new_tokens: int, context_length: int) -> list[list[int]]:
    """Token ids of each record's prompt, checking that every prompt leaves room for ``max_new_tokens``."""
    encoded = []
    for record in records:
        if (at_least := formatter.too_long(record.prompt, context_length - max_new_tokens)) is not None:
            check_prompt_fits(at_least, max_new_tokens, context_length, record.id, at_least=True)
        ids = formatter.encode(record.prompt)
        check_prompt_fits(len(ids), max_new_tokens, context_length, record.id)
        encoded.append(ids)
    return encoded
