"""The engine-level episode loop (megatron_dppo/rollout/episodes.py) with scripted turns and real environments:
tool flows, every bound and finish reason, failures of environments (exceptions, hangs, malformed steps, a sandbox
that cannot start) ending only their own episode, reset messages, seeds, one batched generate per turn, metrics."""
from __future__ import annotations

import re
import time

import pytest
from _scripted import ScriptedEngine

from megatron_dppo.distributed import collectives as D
from megatron_dppo.env.calculator import CalculatorEnv
from megatron_dppo.env.config import EnvConfig
from megatron_dppo.env.protocol import Step, Task
from megatron_dppo.env.python_tool import PythonToolEnv
from megatron_dppo.env.tokens import ChatTokens
from megatron_dppo.rollout.base import SamplingParams
from megatron_dppo.rollout.episodes import episode_metrics, generate_episodes

QUESTIONS = ["What is 12*34?", "What is 99*99?"]


@pytest.fixture(scope="module")
def setup(smol_tokenizer):
    tok = smol_tokenizer
    chat = ChatTokens(tok)
    tasks = [Task(f"q{i}", q, gold=None, messages=({"role": "user", "content": q},)) for i, q in enumerate(QUESTIONS)]
    prompts = [chat.prompt_ids(list(t.messages)) for t in tasks]
    return tok, chat, tasks, prompts


def encoder(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return lambda text, stop=True: tok.encode(text, add_special_tokens=False) + ([end] if stop else [])


def calc_respond(tok):
    """Call the calculator on the question's product, then answer with the tool's result."""
    enc = encoder(tok)

    def respond(context, sample):
        text = tok.decode(context)
        result = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
        if result:
            return enc(f"The answer is {result[-1]}.")
        expression = re.findall(r"What is (\S+)\?", text)[-1]
        return enc(f"<calc>{expression}</calc>")

    return respond


def run(setup, respond, make_env, n=2, sampling=None, **cfg):
    tok, chat, tasks, prompts = setup
    cfg = EnvConfig(**{"name": "test", "max_turns": 4, "max_tokens": 256, **cfg})
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    engine = ScriptedEngine(respond, stop_ids=stops)
    sampling = sampling or SamplingParams(max_new_tokens=64, seed=11)
    episodes = generate_episodes(engine, tasks, prompts, n, sampling, cfg, make_env, chat, stop_token_ids=stops)
    return episodes, engine


def test_calculator_episodes(setup):
    tok = setup[0]
    episodes, engine = run(setup, calc_respond(tok), CalculatorEnv)
    for p, answer in enumerate(["408", "9801"]):
        for e in episodes[p]:
            assert (e.finish_reason, e.turns, e.tool_calls, e.tool_errors) == ("stop", 2, 1, 0)
            assert e.final_text == f"The answer is {answer}."
            assert e.messages[1] == {"role": "tool", "content": answer}
            assert e.loss_mask.count(0) == len(tok.encode(f"\n<|im_start|>tool\n{answer}<|im_end|>\n"
                                                          "<|im_start|>assistant\n", add_special_tokens=False))
    # turn 1: ONE call with the task prompts and n, the caller's seed and bound (what a single-turn run does);
    # turn 2: ONE call over all four running episodes with n = 1
    (first, n1, s1), (second, n2, s2) = engine.calls
    assert first == setup[3] and n1 == 2 and s1.seed == 11 and s1.max_new_tokens == 64
    assert len(second) == 4 and n2 == 1 and s2.seed == D.derive_seed("turn", 11, 1, 0) % (1 << 31)  # (turn 1, group 0)
    assert second[0] == episodes[0][0].prompt_ids + episodes[0][0].token_ids[: len(second[0]) - len(setup[3][0])]


def test_bounds_and_finish_reasons(setup):
    tok = setup[0]
    enc = encoder(tok)
    always_call = lambda context, sample: enc("<calc>1+1</calc>")  # noqa: E731
    episodes, _ = run(setup, always_call, CalculatorEnv, max_turns=3)
    assert {(e.finish_reason, e.turns, e.tool_calls) for p in episodes for e in p} == {("max_turns", 3, 3)}
    assert episodes[0][0].loss_mask.count(0) > 0 and episodes[0][0].token_ids[-1] == enc("")[-1]  # no trailing obs
    # the episode token bound: the third observation would not fit
    turn, obs = len(enc("<calc>1+1</calc>")), 13
    episodes, _ = run(setup, always_call, CalculatorEnv, max_turns=8, max_tokens=2 * (turn + obs) + turn + 5)
    assert {(e.finish_reason, e.turns) for p in episodes for e in p} == {("context", 3)}
    # a cut turn: the per-turn bound
    long = lambda context, sample: enc("word " * 50)  # noqa: E731
    episodes, engine = run(setup, long, CalculatorEnv, sampling=SamplingParams(max_new_tokens=8, seed=0))
    assert {(e.finish_reason, e.turns, len(e.token_ids)) for p in episodes for e in p} == {("length", 1, 8)}
    # the trained-token bound shrinks later turns' generation bound
    episodes, engine = run(setup, always_call, CalculatorEnv, max_turns=4, max_assistant_tokens=2 * turn + 3)
    assert {(e.finish_reason, e.turns, e.num_trained) for p in episodes for e in p} == {("length", 3, 2 * turn + 3)}
    assert [c[2].max_new_tokens for c in engine.calls] == [2 * turn + 3, turn + 3, 3]


def test_a_bare_eos_ends_the_episode(setup):
    tok = setup[0]
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    respond = lambda context, sample: tok.encode("<calc>2*3</calc>", add_special_tokens=False) + [eos]  # noqa: E731
    episodes, _ = run(setup, respond, CalculatorEnv)
    assert {(e.finish_reason, e.turns, e.tool_calls) for p in episodes for e in p} == {("stop", 1, 1)}


class FlakyEnv:
    """Sample behaviour by task id and seed parity: raise, hang, return garbage, or work."""

    def __init__(self, mode="ok"):
        self.mode = mode

    def reset(self, task, seed):
        if self.mode == "reset-raises":
            raise RuntimeError("no sandbox")
        return []

    def step(self, turn):
        if self.mode == "raises":
            raise KeyError("boom")
        if self.mode == "hangs":
            time.sleep(30)
        if self.mode == "garbage":
            return {"done": True}
        return Step(done=True, reward=1.0)


def test_environment_failures_end_only_their_episode(setup):
    tok = setup[0]
    modes = iter(["ok", "raises", "hangs", "garbage", "reset-raises", "factory-raises"])

    def make_env():
        mode = next(modes)
        if mode == "factory-raises":
            raise OSError("cannot build")
        return FlakyEnv(mode)

    start = time.monotonic()
    episodes, _ = run(setup, calc_respond(tok), make_env, n=3, step_timeout_s=1.0)
    assert time.monotonic() - start < 10  # the hanging step was abandoned at its deadline
    flat = [e for p in episodes for e in p]
    assert [e.finish_reason for e in flat] == ["stop"] + ["env_error"] * 5
    assert flat[0].reward == 1.0
    errors = [e.error for e in flat[1:]]
    assert "KeyError" in errors[0] and "timed out" in errors[1] and "must return a Step" in errors[2]
    assert "RuntimeError: no sandbox" in errors[3] and "cannot build" in errors[4]
    assert [e.turns for e in flat] == [1, 1, 1, 1, 0, 0]  # failed resets never generate


def test_python_tool_hang_is_an_observation_and_a_missing_interpreter_an_env_error(setup):
    tok = setup[0]
    enc = encoder(tok)

    def respond(context, sample):
        text = tok.decode(context)
        if "<|im_start|>tool" in text:
            return enc("done")
        return enc("<python>import time; time.sleep(20)</python>")

    episodes, _ = run(setup, respond, lambda: PythonToolEnv(timeout_s=0.5), n=1)
    for [e] in episodes:
        assert (e.finish_reason, e.turns, e.tool_timeouts) == ("stop", 2, 1)
        assert "TimeoutError" in e.messages[1]["content"]

    class Missing(PythonToolEnv):
        def step(self, turn):
            import megatron_dppo.env.sandbox as sandbox

            return Step(messages=[{"role": "tool", "content": sandbox.run_python("1", python="/nonexistent").stdout}])

    episodes, _ = run(setup, respond, Missing, n=1)
    assert {(e.finish_reason, "SandboxError" in e.error) for [e] in episodes} == {("env_error", True)}


class GreetingEnv:
    """Adds a system-style hint after the prompt at reset (so turn 1 needs the re-rendered prompt)."""

    def reset(self, task, seed):
        return [{"role": "user", "content": f"hint {seed % 7}"}]

    def step(self, turn):
        return Step(done=True)


def test_reset_messages_extend_the_prompt(setup):
    tok, chat, tasks, prompts = setup
    episodes, engine = run(setup, calc_respond(tok), GreetingEnv)
    for p, group in enumerate(episodes):
        for e in group:
            assert e.prompt_ids[: len(prompts[p]) - 3] == prompts[p][: len(prompts[p]) - 3]
            hint = re.findall(r"hint \d", tok.decode(e.prompt_ids))
            assert len(hint) == 1 and e.prompt_ids == chat.prompt_ids(
                list(tasks[p].messages) + [{"role": "user", "content": hint[0]}])
    assert len(engine.calls) == 1 and engine.calls[0][1] == 1 and len(engine.calls[0][0]) == 4


def test_seeds_reproduce_episodes_and_differ_per_episode(setup):
    tok = setup[0]
    seen = []

    class SeedEnv(GreetingEnv):
        def reset(self, task, seed):
            seen.append(seed)
            return []

    a, _ = run(setup, calc_respond(tok), SeedEnv)
    b, _ = run(setup, calc_respond(tok), SeedEnv)
    assert seen[:4] == seen[4:] and len(set(seen[:4])) == 4
    # one derive_seed for every seed of a run (the process layer's), to 31 bits: environment p, sample i
    assert seen[:4] == [D.derive_seed("env", 0, p, i) % (1 << 31) for p in range(2) for i in range(2)]
    assert [[e.token_ids for e in g] for g in a] == [[e.token_ids for e in g] for g in b]


def test_metrics(setup):
    tok = setup[0]
    episodes, _ = run(setup, calc_respond(tok), CalculatorEnv)
    flat = [e for p in episodes for e in p]
    m = episode_metrics(flat)
    assert m["env/turns_mean"] == 2 and m["env/tool_calls_mean"] == 1 and m["env/finish_stop"] == 1.0
    assert m["env/finish_env_error"] == 0.0 and m["env/tool_errors"] == 0 and m["env/tool_timeouts"] == 0
    trained = sum(e.num_trained for e in flat) / sum(len(e.token_ids) for e in flat)
    assert m["tokens/trained_share"] == pytest.approx(trained) and 0 < trained < 1
    assert 0 < m["time/episode_p50"] <= m["time/episode_p99"]
    assert episode_metrics([]) == {}


def test_call_all_bounds_concurrency_and_frees_the_slot_of_a_hung_call():
    from megatron_dppo.rollout.episodes import _TIMED_OUT, call_all

    active, peak = [0], [0]
    import threading

    lock = threading.Lock()

    def work(value, seconds):
        def fn():
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(seconds)
            with lock:
                active[0] -= 1
            if value == "raise":
                raise ValueError("bad")
            return value
        return fn

    start = time.monotonic()
    calls = [work("hang", 60)] + [work(i, 0.05) for i in range(6)] + [work("raise", 0.0)]
    results = call_all(calls, timeout_s=0.5, max_parallel=2)
    assert results[0] is _TIMED_OUT and results[1:7] == list(range(6)) and isinstance(results[7], ValueError)
    assert peak[0] <= 2 and time.monotonic() - start < 5


def test_a_spent_trained_token_budget_ends_the_episode_without_a_trailing_observation(setup):
    tok = setup[0]
    enc = encoder(tok)
    call = enc("<calc>1+1</calc>")
    episodes, engine = run(setup, lambda context, sample: call, CalculatorEnv, max_assistant_tokens=2 * len(call))
    for e in (e for g in episodes for e in g):
        assert (e.finish_reason, e.turns, e.num_trained) == ("length", 2, 2 * len(call))
        assert e.loss_mask[-1] == 1 and e.token_ids[-len(call):] == call


def test_reset_messages_need_the_tasks_chat_messages(setup):
    tok, chat, tasks, prompts = setup
    bare = [Task(t.id, t.text) for t in tasks]
    engine = ScriptedEngine(calc_respond(tok))
    with pytest.raises(ValueError, match="no chat messages"):
        generate_episodes(engine, bare, prompts, 1, SamplingParams(max_new_tokens=8), EnvConfig(name="g"),
                          GreetingEnv, chat)
