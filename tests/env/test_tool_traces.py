"""Tool-use traces for the warm start (``data/tool_traces.py``), with the tokenizer a calculator run trains
(``run.build.build_tokenizer`` for ``data.arithmetic_warm_start=calculator``: the project's SentencePiece model with
the call tags and the tool role kept whole, byte pieces for anything else):

* a trace's token stream and loss mask equal, token for token, those of the episode the episode loop builds when
  the engine samples exactly the trace's assistant turns and the real calculator answers: the warm start trains
  on the layout RL samples and trains;
* the calculator's error answers round-trip through that tokenizer, so a policy's bad call never fails the render
  audit (without byte pieces they became <unk>, which the audit caught in a real run).

The example's whole path (warm start on traces, calculator episodes, evaluation) runs in
tests/e2e/test_multiturn_run.py.
"""
from __future__ import annotations

import pytest
from _scripted import ScriptedEngine

from megatron_dppo.data import ArithmeticTask, tool_traces, train_sentencepiece_tokenizer
from megatron_dppo.data.tokenizer import ROLE_TOKENS
from megatron_dppo.env import EnvConfig, Task
from megatron_dppo.env.calculator import CalculatorEnv
from megatron_dppo.env.tokens import ChatTokens
from megatron_dppo.rollout.base import SamplingParams
from megatron_dppo.rollout.episodes import generate_episodes


@pytest.fixture(scope="module")
def task_and_tokenizer():
    task = ArithmeticTask(2, 2, 999, "*", seed=3)
    records = task.records(64)
    corpus = [r.prompt + r.raw["solution"] for r in records] + tool_traces.corpus(records)
    tok = train_sentencepiece_tokenizer(corpus, vocab_size=320, byte_fallback=True,
                                        user_symbols=ROLE_TOKENS + tool_traces.SYMBOLS)
    return task, records, tok


def test_a_trace_is_the_episode_the_loop_builds_for_the_same_turns(task_and_tokenizer):
    _, records, tok = task_and_tokenizer
    chat, eos = ChatTokens(tok), tok.eos_token_id
    prompts = [list(tok(r.prompt)["input_ids"]) for r in records[:8]]
    traces = [tool_traces.trace_tokens(chat, p, tool_traces.trace_messages(r), eos) for p, r in zip(prompts, records)]
    for (_, completion, mask), r in zip(traces, records):
        assert tok.convert_ids_to_tokens(completion[:2]) == ["<calc>", r.raw["expression"][0]]
        assert "<|tool|>" in tok.convert_ids_to_tokens(completion) and 0 in mask and mask[-1] == 1

    def respond(context, _i):  # the trace's assistant turn that follows this context
        for p, (_, completion, mask) in zip(prompts, traces):
            if context[: len(p)] == p:
                done = len(context) - len(p)
                end = next(k for k in range(done, len(mask)) if mask[k] == 0 or k == len(mask) - 1)
                end = len(mask) if mask[end] == 1 else end
                return completion[done:end]
        raise AssertionError("unknown context")

    engine = ScriptedEngine(respond, stop_ids=(eos,))
    tasks = [Task(id=r.id, text=r.prompt, gold=r.gold) for r in records[:8]]
    episodes = generate_episodes(engine, tasks, prompts, 1, SamplingParams(max_new_tokens=16, seed=0),
                                 EnvConfig(name="calculator", max_turns=2, max_tokens=48), CalculatorEnv, chat,
                                 stop_token_ids=[eos])
    for (_, completion, mask), (episode,), r in zip(traces, episodes, records):
        assert episode.token_ids == completion and episode.loss_mask == mask
        assert episode.finish_reason == "stop" and episode.turns == 2 and episode.tool_calls == 1
        assert episode.final_text == r.gold  # what the reward scores


def test_calculator_errors_round_trip_through_the_tokenizer(task_and_tokenizer):
    _, _, tok = task_and_tokenizer
    answers = tool_traces.corpus([])  # the calculator's answers to bad calls
    odd = "error: unsupported element Compare in '1<2' (Ω)"
    for text in answers + [odd]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
