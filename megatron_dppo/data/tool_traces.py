"""Tool-use traces of the arithmetic task, for the supervised warm start of a calculator-using policy
(``data.arithmetic_warm_start=calculator``; the example ``examples/calculator_multiplication.yaml``).

A trace is the episode a calculator-using policy should produce for a problem (``env.calculator``):

    prompt      "482*97="                                       (the task's prompt, as the run renders it)
    assistant   "<calc>482*97</calc>" + end of turn             trained (mask 1)
    tool        "46754"                                         observation (mask 0): the calculator's answer
    assistant   "46754" + end of turn                           trained (mask 1)

Its token stream is built the way the episode loop builds one (``env.tokens``): the assistant turns are their own
ids plus the end-of-turn token, the observation ids come from the chat template (``ChatTokens.observation_ids``),
so the warm start trains on exactly the layout RL samples and trains later, observation tokens masked out.
``corpus`` gives the traces as text, for training the tiny tokenizer on them, and ``SYMBOLS`` the pieces that
tokenizer must keep whole.
"""
from __future__ import annotations

from typing import Any, Sequence

from megatron_dppo.data.datasets import PromptRecord
from megatron_dppo.env.calculator import evaluate as calculate
from megatron_dppo.env.calculator import format_value

TAG = "calc"
SYMBOLS = ("<|tool|>", f"<{TAG}>", f"</{TAG}>")  # the tool role of the project's chat template, the call tags


def trace_messages(record: PromptRecord, tag: str = TAG) -> list[dict]:
    """The conversation after the prompt of a calculator-using answer to ``record`` (an arithmetic problem): the
    call, the tool's result (computed by the calculator environment itself), the answer."""
    expression = record.raw["expression"]
    result = format_value(calculate(expression))
    return [{"role": "assistant", "content": f"<{tag}>{expression}</{tag}>"},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": result}]


def trace_tokens(chat: Any, prompt_ids: Sequence[int], messages: Sequence[dict], end_of_turn: int
                 ) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, loss mask) of a trace: each assistant message's ids (encoded without special
    tokens) + ``end_of_turn`` with mask 1, each run of observation messages as the chat template's ids after that
    token (``chat.observation_ids``) with mask 0. ``chat``: an ``env.tokens.ChatTokens``."""
    completion, mask, pending = [], [], []
    for message in messages:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            ids = chat.observation_ids(pending, end_of_turn)
            completion += ids
            mask += [0] * len(ids)
            pending = []
        ids = list(chat.tokenizer(message["content"], add_special_tokens=False)["input_ids"]) + [int(end_of_turn)]
        completion += ids
        mask += [1] * len(ids)
    if pending:
        raise ValueError("a trace must end with an assistant turn")
    return list(prompt_ids), completion, mask


# calls whose answers are the calculator's error messages: their text joins the tokenizer's corpus, so a policy's
# bad call is answered in pieces the tokenizer has (an unknown piece would fail the episode's render audit)
BAD_CALLS = ("1/0", "(1", "9**99", "2**0.5", "x", "1;2", "10**70", "1" * 300)


def corpus(records: Sequence[PromptRecord]) -> list[str]:
    """Each trace as text (the prompt and the messages' contents; the role markers and tags are ``SYMBOLS`` /
    the template's own pieces), and the calculator's answers to ``BAD_CALLS`` (its error messages), for training
    a tokenizer on everything a calculator episode can contain."""
    from megatron_dppo.env.calculator import CalculatorEnv
    from megatron_dppo.env.protocol import Turn

    calculator = CalculatorEnv(tag=TAG, max_calls=1)
    errors = [calculator.step(Turn(0, (), f"<{TAG}>{call}</{TAG}><{TAG}>1</{TAG}>", "stop")).messages[0]["content"]
              for call in BAD_CALLS]
    return [record.prompt + "".join(m["content"] for m in trace_messages(record)) for record in records] + errors
