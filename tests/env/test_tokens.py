"""Token-in-token-out streams (megatron_dppo/env/tokens.py) on two real chat templates: SmolLM2's ChatML and the
project's SentencePiece template. Observation ids carry the template's junction after the end-of-turn token, the
sampled ids stay verbatim, and both checks fail on planted drift: a decode -> re-encode loop (token identity) and
a dropped turn separator (render audit)."""
from __future__ import annotations

import pytest

from megatron_dppo.env.tokens import (
    ChatTokens,
    TokenDriftError,
    Trajectory,
    audit_render,
    check_episode,
    conversation_messages,
)

IM_END = "<|im_end|>"


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_chatml_observation_ids_include_the_newline_after_im_end(smol_tokenizer):
    tok = smol_tokenizer
    chat = ChatTokens(tok)
    end = tok.convert_tokens_to_ids(IM_END)
    ids = chat.observation_ids([{"role": "tool", "content": "408"}], end)
    assert ids == encode(tok, "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == encode(tok, "\n")[0]  # the junction generation never emits (verl #6921)
    two = chat.observation_ids([{"role": "tool", "content": "1"}, {"role": "user", "content": "go on"}], end)
    assert tok.decode(two) == ("\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert chat.ends_turn(end)
    assert not chat.ends_turn(tok.convert_tokens_to_ids("<|endoftext|>"))  # ChatML never renders a bare EOS


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    from megatron_dppo.data.tokenizer import train_sentencepiece_tokenizer

    corpus = ["12+7*3=33", "the answer is 408", "<calc>12*34</calc>", "tool result 408", "hello world"] * 4
    return train_sentencepiece_tokenizer(corpus, tmp_path_factory.mktemp("spm"), byte_fallback=True,
                                         vocab_size=320)


def test_sentencepiece_template_observation_ids(spm_tokenizer):
    tok = spm_tokenizer
    chat = ChatTokens(tok)
    eos = tok.eos_token_id
    ids = chat.observation_ids([{"role": "tool", "content": "408"}], eos)
    assert tok.decode(ids, skip_special_tokens=False) == "<|tool|>408</s><|assistant|>"
    assert chat.ends_turn(eos)


def _episode(tok, chat, turns, observations):
    """Build a trajectory the way the episode loop does: sampled ids verbatim, observation ids in between."""
    prompt = chat.prompt_ids([{"role": "user", "content": "What is 12*34?"}])
    traj = Trajectory(list(prompt))
    sampled, contexts = [], []
    for j, ids in enumerate(turns):
        logprobs = [-0.5 - 0.01 * k for k in range(len(ids))]
        contexts.append(traj.context())
        sampled.append((ids, logprobs))
        traj.append_sampled(ids, logprobs)
        if j < len(observations):
            traj.append_observation(chat.observation_ids(observations[j], ids[-1]))
    return traj, sampled, contexts


def _turns(tok):
    end = tok.convert_tokens_to_ids(IM_END)
    # a non-canonical tokenization of sampled text: "12*34" spelled one character per token; decode -> encode
    # of the turn gives other ids
    chars = [i for ch in "<calc>12*34</calc>" for i in encode(tok, ch)]
    assert encode(tok, tok.decode(chars)) != chars
    return [chars + [end], encode(tok, "The answer is 408.") + [end]]


def test_episode_stream_passes_both_checks(smol_tokenizer):
    tok = smol_tokenizer
    chat = ChatTokens(tok)
    observations = [[{"role": "tool", "content": "408"}]]
    traj, sampled, contexts = _episode(tok, chat, _turns(tok), observations)
    check_episode(traj, sampled, contexts)
    assert traj.loss_mask == [1] * len(sampled[0][0]) + [0] * (len(traj.token_ids) - len(sampled[0][0])
                                                                  - len(sampled[1][0])) + [1] * len(sampled[1][0])
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if m == 0)
    messages = conversation_messages(tok, traj, observations, [tok.convert_tokens_to_ids(IM_END)])
    assert messages[0] == {"role": "assistant", "content": "<calc>12*34</calc>"}
    prompt = [{"role": "user", "content": "What is 12*34?"}]
    assert audit_render(chat, traj, prompt, messages, final_stop=True) is None


def test_planted_decode_reencode_loop_is_caught(smol_tokenizer):
    """The TRL #5224 class: a builder that keeps sampled turns as text and re-encodes them."""
    tok = smol_tokenizer
    chat = ChatTokens(tok)
    turns = _turns(tok)
    traj, sampled, contexts = _episode(tok, chat, turns, [[{"role": "tool", "content": "408"}]])

    class ReencodingTrajectory(Trajectory):
        def append_sampled(self, token_ids, logprobs):
            ids = encode(tok, tok.decode(token_ids, skip_special_tokens=False))
            pad = (list(logprobs) + [0.0] * len(ids))[: len(ids)]
            super().append_sampled(ids, pad)

    bad = ReencodingTrajectory(list(traj.prompt_ids))
    bad_contexts = []
    for j, (ids, logprobs) in enumerate(sampled):
        bad_contexts.append(bad.context())
        bad.append_sampled(ids, logprobs)
        if j == 0:
            bad.append_observation(chat.observation_ids([{"role": "tool", "content": "408"}], ids[-1]))
    with pytest.raises(TokenDriftError, match="re-tokenized"):
        check_episode(bad, sampled, bad_contexts)
    # the engine conditioned on a re-rendered history (the loop fed decode -> apply_chat_template ids back)
    rerendered = list(contexts)
    rerendered[1] = chat.render_ids([{"role": "user", "content": "What is 12*34?"},
                                     {"role": "assistant", "content": tok.decode(turns[0][:-1])},
                                     {"role": "tool", "content": "408"}], True)
    assert rerendered[1] != contexts[1]
    with pytest.raises(TokenDriftError, match="context"):
        check_episode(traj, sampled, rerendered)


def test_dropped_turn_separator_is_caught_by_the_render_audit(smol_tokenizer):
    """The verl #6921 class: observation ids rendered after a prefix that ends with ``<|im_end|>\\n`` while the
    sampled turn ends with ``<|im_end|>``: the ``\\n`` between them is lost. Token identity cannot see it (the
    sampled ids are intact); the render audit does."""
    tok = smol_tokenizer
    chat = ChatTokens(tok)
    turns = _turns(tok)
    observations = [[{"role": "tool", "content": "408"}]]
    traj, sampled, contexts = _episode(tok, chat, turns, observations)
    a, b = traj.segments[1][1:]
    assert tok.decode(traj.token_ids[a:a + 1]) == "\n"
    broken = Trajectory(list(traj.prompt_ids))
    broken_contexts = []
    for j, (ids, logprobs) in enumerate(sampled):
        broken_contexts.append(broken.context())
        broken.append_sampled(ids, logprobs)
        if j == 0:
            broken.append_observation(traj.token_ids[a + 1:b])  # the separator dropped
    check_episode(broken, sampled, broken_contexts)  # identity holds ...
    messages = conversation_messages(tok, broken, observations, [tok.convert_tokens_to_ids(IM_END)])
    problem = audit_render(chat, broken, [{"role": "user", "content": "What is 12*34?"}], messages, final_stop=True)
    assert problem is not None and "\\n" in problem  # ... the audit does not


def test_a_template_that_is_not_append_only_is_refused(smol_tokenizer):
    tok = smol_tokenizer
    # renders the LAST message differently (as some templates strip reasoning from all but the last turn)
    template = ("{% for m in messages %}{% if loop.last %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = ChatTokens(tok, chat_template_kwargs={"chat_template": template})
    with pytest.raises(TokenDriftError, match="append-only"):
        chat.observation_ids([{"role": "tool", "content": "408"}], tok.convert_tokens_to_ids(IM_END))


def test_a_stop_token_that_does_not_close_turns_cannot_be_continued(smol_tokenizer):
    tok = smol_tokenizer
    with pytest.raises(TokenDriftError, match="does not close an assistant turn"):
        ChatTokens(tok).observation_ids([{"role": "tool", "content": "1"}], tok.convert_tokens_to_ids("<|endoftext|>"))


def test_trajectory_bookkeeping():
    traj = Trajectory([1, 2])
    traj.append_sampled([5, 6], [-1.0, -2.0])
    traj.append_observation([7])
    assert traj.context() == [1, 2, 5, 6, 7]
    assert traj.loss_mask == [1, 1, 0] and traj.logprobs == [-1.0, -2.0, 0.0]
    assert traj.num_trained == 2 and traj.assistant_spans() == [(0, 2)]
    with pytest.raises(ValueError, match="log-probs"):
        traj.append_sampled([1], [])


def test_a_header_token_is_not_an_end_of_turn(smol_tokenizer):
    tok = smol_tokenizer
    chat = ChatTokens(tok)
    assert not chat.ends_turn(tok.convert_tokens_to_ids("<|im_start|>"))
    assert chat.ends_turn(tok.convert_tokens_to_ids(IM_END))


# A Qwen3-family chat template, written for this test with the behaviour that matters: the assistant message after
# the last user query gets a <think> block when it is the LAST message (empty when it has no reasoning) or has
# reasoning; earlier ones are rendered plain; tool results are user turns wrapped in <tool_response>; assistant
# tool calls are <tool_call> JSON; enable_thinking=false writes an empty <think> block into the generation prompt.
QWEN3_STYLE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and not (message.content.startswith('<tool_response>')"
    " and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": '"
    " + (call.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


@pytest.mark.parametrize("thinking", [True, False])
def test_a_qwen3_style_template_gives_observation_ids_at_the_first_tool_step(smol_tokenizer, thinking):
    """The synthetic assistant message renders differently once it is no longer the last one (its empty <think>
    block goes), but only the ids after its <|im_end|> are used, and those are what the template writes after any
    assistant turn: the observation, then the next generation prompt. They equal the real conversation's."""
    tok = smol_tokenizer
    kwargs = {"chat_template": QWEN3_STYLE, **({} if thinking else {"enable_thinking": False})}
    chat = ChatTokens(tok, chat_template_kwargs=kwargs)
    end = tok.convert_tokens_to_ids(IM_END)
    gen = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    tool = chat.observation_ids([{"role": "tool", "content": "408"}], end)
    assert tok.decode(tool) == f"\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n{gen}"
    user = chat.observation_ids([{"role": "user", "content": "go on"}], end)
    assert tok.decode(user) == f"\n<|im_start|>user\ngo on<|im_end|>\n{gen}"
    # the same ids follow a real sampled turn with reasoning in the real conversation
    prompt = [{"role": "user", "content": "12*34?"}]
    turn = {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\n<calc>12*34</calc>"}
    real = chat.render_ids(prompt + [turn, {"role": "tool", "content": "408"}], True)
    assert real[-len(tool):] == tool and tok.decode(real[:-len(tool)]).endswith(IM_END)


def test_a_template_whose_render_audit_cannot_hold_fails_at_start_up(smol_tokenizer):
    """The start-up probe: ChatML passes; the Qwen3-style template (it writes an empty <think> block into the last
    assistant message, which the sampled turn need not have) fails the strict render audit before step 0, and
    with token_check=warn the problem is returned instead; a template that changes the conversation before an
    observation fails whatever token_check says."""
    tok = smol_tokenizer
    end = tok.convert_tokens_to_ids(IM_END)
    assert ChatTokens(tok).probe([end]) == []
    qwen = ChatTokens(tok, chat_template_kwargs={"chat_template": QWEN3_STYLE})
    with pytest.raises(TokenDriftError, match="env.token_check=warn or off"):
        qwen.probe([tok.convert_tokens_to_ids("<|endoftext|>"), end])
    assert qwen.probe([end], token_check="warn")
    upper = ("{% for m in messages %}{% if loop.last %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TokenDriftError, match="append-only"):
        ChatTokens(tok, chat_template_kwargs={"chat_template": upper}).probe([end], token_check="off")
