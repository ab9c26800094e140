"""Peer parity of episode token streams: for the same scripted turns, the token ids, loss mask and log-probs of our
episode loop equal, bit for bit, those built by

* TRL 1.16's tool loop (``GRPOTrainer._tool_call_loop`` with ``_get_tool_suffix_ids``; the real methods, called
  on a trainer object holding only the attributes they read, with ``_generate_single_turn`` replaced by the
  scripted turns and TRL's own ``parse_response`` parsing the tool calls), and
* verl 0.9.1's agent-loop token builder (``QwenContinuousTokenBuilder``: ``build_initial_tokens``,
  ``merge_assistant_tokens``, ``merge_context_tokens``, ``align_response_metadata``, called in the order of
  ``ToolAgentLoop``).

Tokenizer: SmolLM2-135M-Instruct's ChatML (conftest). Peers: trl 1.16 (requirements/cpu.txt) and verl 0.9.1
(``make peers``, tests/_peers.py); skipped when absent.

Also shown: verl's automatic builder choice for SmolLM2 (config ``model_type`` "llama" -> the generic builder)
drops ChatML's ``\\n`` after ``<|im_end|>`` at every tool turn; our render audit flags that stream.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from _scripted import ScriptedEngine

from megatron_dppo.env.config import EnvConfig
from megatron_dppo.env.protocol import Step, Task
from megatron_dppo.env.tokens import ChatTokens, Trajectory, audit_render, conversation_messages
from megatron_dppo.rollout.base import SamplingParams
from megatron_dppo.rollout.episodes import generate_episodes

QUESTION = "What is 123*45 and then 99*99?"
G = 3


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. 12*34
    """
    from megatron_dppo.env.calculator import evaluate, format_value

    return format_value(evaluate(expression))


def tool_call(expression: str) -> str:
    return '<tool_call>\n' + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        '\n</tool_call>'


class HermesCalculatorEnv:
    """Answers ``<tool_call>{"name": "calculator", ...}</tool_call>`` with a tool message, as TRL's loop does
    (``{"role": "tool", "name": name, "content": str(result)}``); a turn without a call ends the episode."""

    def reset(self, task, seed):
        return []

    def step(self, turn):
        calls = re.findall(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", turn.text, re.DOTALL)
        if not calls:
            return Step(done=True)
        messages = []
        for call in calls:
            data = json.loads(call)
            messages.append({"role": "tool", "name": data["name"], "content": calculator(**data["arguments"])})
        return Step(messages=messages, tool_calls=len(calls))


@pytest.fixture(scope="module")
def scripted(smol_tokenizer):
    """Turns scripted per sample index: the first turn of sample i decides its plan (sample 0 marks its call
    with a tag the respond function reads back to keep the plan across turns)."""
    tok = smol_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    plans = {0: ["123*45", "99*99"], 1: ["123*45"], 2: []}

    def respond(context, sample):
        text = tok.decode(context)
        made = re.findall(r'"expression": "([^"]+)"', text)
        if not made:
            plan = plans[sample]
        else:
            plan = plans[0] if text.count("[plan-0]") else plans[1]
        if len(made) < len(plan):
            body = ("[plan-0]" if sample == 0 and not made else "") + tool_call(plan[len(made)])
        else:
            results = re.findall(r"tool\n(\d+)", text)
            body = f"The answer is {' and '.join(results) or 'unknown'}."
        return tok.encode(body, add_special_tokens=False) + [end]

    return respond


def our_episodes(tok, respond, max_turns=4):
    chat = ChatTokens(tok)
    prompt = [{"role": "user", "content": QUESTION}]
    engine = ScriptedEngine(respond, stop_ids=(tok.convert_tokens_to_ids("<|im_end|>"),))
    cfg = EnvConfig(name="hermes", max_turns=max_turns, max_tokens=512)
    [episodes] = generate_episodes(engine, [Task("q", QUESTION, messages=tuple(prompt))], [chat.prompt_ids(prompt)],
                                   G, SamplingParams(max_new_tokens=128, seed=0), cfg, HermesCalculatorEnv, chat,
                                   stop_token_ids=[tok.eos_token_id])
    return episodes, engine


def test_our_scripted_episodes_have_the_planned_shapes(smol_tokenizer, scripted):
    episodes, _ = our_episodes(smol_tokenizer, scripted)
    assert [e.turns for e in episodes] == [3, 2, 1]
    assert [e.tool_calls for e in episodes] == [2, 1, 0]
    assert [e.finish_reason for e in episodes] == ["stop"] * 3
    assert episodes[0].final_text == "The answer is 5535 and 9801."


# ------------------------------------------------------------------------------------------------------------
# TRL 1.16
# ------------------------------------------------------------------------------------------------------------
def trl_episodes(tok, respond, iterations=3):
    pytest.importorskip("trl", reason="pip install 'trl==1.16.*'")
    import trl
    from trl.chat_template_utils import parse_response, qwen3_template
    from trl.trainer.grpo_trainer import GRPOTrainer

    if not trl.__version__.startswith("1.16"):
        pytest.skip(f"parity is pinned to trl 1.16, found {trl.__version__}")
    tok.response_template = qwen3_template  # the hermes <tool_call> JSON parser (TRL's add_response_schema)
    try:
        prompts = [[{"role": "user", "content": QUESTION}] for _ in range(G)]
        prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
                      for p in prompts]
        engine = ScriptedEngine(respond, stop_ids=(tok.convert_tokens_to_ids("<|im_end|>"),))
        groups = engine.generate([list(prompt_ids[0])], G, SamplingParams(max_new_tokens=128, seed=0))
        completion_ids = [list(c.token_ids) for c in groups[0].completions]
        logprobs = [list(c.logprobs) for c in groups[0].completions]

        def generate_single_turn(ids_list, images, multimodal_fields, num_generations, has_tool_images=False):
            groups = engine.generate([list(ids) for ids in ids_list], 1, SamplingParams(max_new_tokens=128))
            return ([list(g.completions[0].token_ids) for g in groups],
                    [list(g.completions[0].logprobs) for g in groups])

        trainer = object.__new__(GRPOTrainer)
        attributes = dict(
            _is_vlm=False, processing_class=tok, _tokenizer=tok, chat_template=None, chat_template_kwargs={},
            tools=[calculator], environment_factories=None, max_tool_calling_iterations=iterations,
            _sync_tool_dicts=[{"calculator": calculator} for _ in range(G)], _async_tool_dicts=[{} for _ in range(G)],
            use_vllm=False, max_completion_length=4096,
            model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1 << 16)),
            _generate_single_turn=generate_single_turn,
        )
        for name, value in attributes.items():
            object.__setattr__(trainer, name, value)
        completions = [[parse_response(tok, ids, prefix=prompt_ids[i], tools=[calculator])]
                       for i, ids in enumerate(completion_ids)]
        tool_mask, _, completion_ids, logprobs, calls, failures, _ = GRPOTrainer._tool_call_loop(
            trainer, prompts, prompt_ids, completion_ids, completions, logprobs, None, {})
    finally:
        del tok.response_template
    return [list(p) for p in prompt_ids], completion_ids, tool_mask, logprobs, calls, failures


def test_token_ids_mask_and_logprobs_equal_trls_tool_loop(smol_tokenizer, scripted):
    tok = smol_tokenizer
    prompt_ids, completion_ids, tool_mask, logprobs, calls, failures = trl_episodes(tok, scripted)
    episodes, _ = our_episodes(tok, scripted)
    assert (calls, failures) == (3, 0)
    for i, e in enumerate(episodes):
        assert e.prompt_ids == prompt_ids[i]
        assert e.token_ids == completion_ids[i]
        assert e.loss_mask == tool_mask[i]
        assert e.logprobs == logprobs[i]
    assert sum(e.loss_mask.count(0) for e in episodes) > 0  # tool tokens exist and are masked


# ------------------------------------------------------------------------------------------------------------
# verl 0.9.1
# ------------------------------------------------------------------------------------------------------------
def import_verl_continuous_token():
    """verl 0.9.1's continuous_token and continuous_token_wiring modules, from .peers/verl (``make peers``,
    tests/_peers.py)."""
    from tests._peers import verl_path

    with verl_path():
        import verl.utils.tokenizer.continuous_token as ct
        import verl.utils.tokenizer.continuous_token_wiring as wiring
    return ct, wiring


def verl_episode(builder, tok, respond, sample, max_turns=4):
    """ToolAgentLoop's token path for one sample: initial tokens, then per turn merge_assistant_tokens +
    align_response_metadata, and for tool turns merge_context_tokens + align_response_metadata."""
    messages = [{"role": "user", "content": QUESTION}]
    prompt_ids = builder.build_initial_tokens(messages)
    runtime, mask, logprobs = list(prompt_ids), [], []
    engine = ScriptedEngine(respond, stop_ids=(tok.convert_tokens_to_ids("<|im_end|>"),))
    for turn in range(max_turns):
        if turn == 0:  # the first turn of sample i comes from the batched call, as in our loop
            group = engine.generate([runtime], G, SamplingParams(max_new_tokens=128, seed=0))
            completion = group[0].completions[sample]
        else:
            completion = engine.generate([runtime], 1, SamplingParams(max_new_tokens=128))[0].completions[0]
        merge = builder.merge_assistant_tokens(runtime, completion.token_ids)
        mask, logprobs = builder.align_response_metadata(merge, mask, logprobs,
                                                         assistant_logprobs=list(completion.logprobs))
        runtime = merge.token_ids
        step = HermesCalculatorEnv().step(SimpleNamespace(text=tok.decode(completion.token_ids,
                                                                          skip_special_tokens=True)))
        content = tok.decode(completion.token_ids[:-1], skip_special_tokens=True)
        previous = messages + [{"role": "assistant", "content": content}]
        if step.done:
            break
        updated = previous + step.messages
        merge = builder.merge_context_tokens(previous, updated, runtime)
        mask, logprobs = builder.align_response_metadata(merge, mask, logprobs)
        runtime, messages = merge.token_ids, updated
    return prompt_ids, runtime[len(prompt_ids):], mask, logprobs


def test_token_ids_mask_and_logprobs_equal_verls_continuous_token_builder(smol_tokenizer, scripted):
    tok = smol_tokenizer
    ct, _ = import_verl_continuous_token()
    builder = ct.QwenContinuousTokenBuilder(tok)  # the ChatML (<|im_end|>\n) builder
    episodes, _ = our_episodes(tok, scripted)
    for i, e in enumerate(episodes):
        prompt_ids, response, mask, logprobs = verl_episode(builder, tok, scripted, i)
        assert e.prompt_ids == prompt_ids
        assert e.token_ids == response
        assert e.loss_mask == mask
        assert e.logprobs == logprobs


def test_verls_automatic_builder_for_a_llama_chatml_model_drops_the_separator(smol_tokenizer, scripted):
    tok = smol_tokenizer
    ct, wiring = import_verl_continuous_token()
    builder = wiring.create_continuous_token_builder(tok, hf_model_type="llama")  # SmolLM2's config.json
    assert type(builder) is ct.ContinuousTokenBuilder
    prompt_ids, response, mask, logprobs = verl_episode(builder, tok, scripted, 1)
    episodes, _ = our_episodes(tok, scripted)
    assert response != episodes[1].token_ids
    assert len(episodes[1].token_ids) - len(response) == 1  # one "\n" per tool turn (sample 1 makes one call)
    # our render audit sees it in verl's stream
    traj = Trajectory(prompt_ids, response, mask, logprobs, segments=_segments(mask))
    chat = ChatTokens(tok)
    observations = [[{"role": "tool", "name": "calculator", "content": "5535"}]]
    messages = conversation_messages(tok, traj, observations, [tok.convert_tokens_to_ids("<|im_end|>")])
    problem = audit_render(chat, traj, [{"role": "user", "content": QUESTION}], messages, final_stop=True)
    assert problem is not None and "<|im_end|><|im_start|>" in problem


def _segments(mask):
    out, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            out.append(("assistant" if mask[start] else "observation", start, k))
            start = k
    return out
