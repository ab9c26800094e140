"""Peer parity of reward-model scoring (issue 33) with the peers' real code, on a tiny Qwen2 sequence classifier:

* TRL 1.16 ``GRPOTrainer._calculate_rewards`` (its sequence-classifier reward path: texts prompt + completion, or
  the RM's chat template for conversational prompts, right-padded, ``.logits[:, 0]``), called unmodified on a
  trainer object that holds only the attributes that method reads;
* verl 0.9.1 ``RewardLoopWorker._preprocess_reward_inputs`` (decode the response, drop EOS, the RM's chat template
  over raw_prompt + the assistant turn, strip a leading BOS), its source read from the installed wheel and compiled
  unmodified (verl is installed with --no-deps: importing its module would need Ray, aiohttp and tensordict); the
  text is then tokenized as verl's vLLM /classify server does and scored by the HF model.

Ours: ``RewardModel`` with template ``text`` (TRL's non-conversational path) and ``chat`` (TRL's conversational
path, verl's). Each test also shows a rendering that differs (so the comparison can fail). Skipped when the peers
are not installed (TRL is pinned in requirements/cpu.txt; verl 0.9.1 lives in .peers/verl: ``make peers``).
"""
from __future__ import annotations

import ast
import asyncio
from types import SimpleNamespace

import pytest
import torch
from _reward_models import TASK, arithmetic_tokenizer, random_classifier

from megatron_dppo.rewards.hf_model import HFRewardEngine, load_tokenizer
from megatron_dppo.rewards.model import RewardModel
from megatron_dppo.rewards.model_inputs import Sample
from tests._peers import VERL_PACKAGE


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rm")
    random_classifier(folder, arithmetic_tokenizer(folder / "tok"))
    return folder


def pairs(tok, n=8):
    """(prompt text, completion text, completion ids as sampled: with EOS) of several lengths."""
    out = []
    for i in range(n):
        r = TASK.record(i)
        answer = (r.gold + str(i % 10) * (i % 3))[: 1 + i % 4]
        out.append((r.prompt, answer, list(tok(answer, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]))
    return out


def ours(rm_path, template, items, prompt_ids=None):
    tok = load_tokenizer(rm_path)
    model = RewardModel(HFRewardEngine(rm_path, batch_size=3), tok, tok, template=template)
    samples = [Sample(prompt_ids[i] if prompt_ids else [], ids, p, c) for i, (p, c, ids) in enumerate(items)]
    return torch.tensor(model.score([samples]).scores[0])


# ----------------------------------------------------------------------------------------------------------------
# TRL
# ----------------------------------------------------------------------------------------------------------------
def trl_rewards(rm_path, prompts, completions, completion_ids):
    """TRL 1.16's GRPOTrainer._calculate_rewards with one reward model, loaded as TRL loads it."""
    trl = pytest.importorskip("trl")
    if not trl.__version__.startswith("1.16"):
        pytest.skip(f"TRL {trl.__version__} installed; the parity is pinned to 1.16")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForSequenceClassification, TrainerState
    from trl import GRPOTrainer

    # accelerate keeps its state in process-wide singletons: an earlier test of the session that ran under an
    # initialized torch.distributed leaves it "distributed", and TRL's gather would then call all_gather on a
    # process group that is gone. One process, one CPU, as a user's single-process TRL run is.
    AcceleratorState._reset_state(reset_partial_state=True)

    tok = load_tokenizer(rm_path)
    model = AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=1).eval()  # (as in __init__)
    model.config.get_text_config().pad_token_id = tok.pad_token_id  # (as in __init__)
    trainer = object.__new__(GRPOTrainer)  # only the attributes _calculate_rewards reads
    trainer.__dict__.update(
        accelerator=Accelerator(cpu=True), state=TrainerState(), is_deepspeed_enabled=False,
        args=SimpleNamespace(device=torch.device("cpu"), report_to=[]), reward_funcs=[model],
        reward_processing_classes=[tok], reward_func_names=["rm"], chat_template_kwargs={}, environments=None,
        _log_completion_extra=lambda *a, **k: None, _log_metric=lambda *a, **k: None)
    inputs = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions)]
    return GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, completion_ids)[:, 0]


def test_trl_sequence_classifier_rewards_equal_ours_text(rm):
    tok = load_tokenizer(rm)
    items = pairs(tok)
    theirs = trl_rewards(rm, [p for p, _, _ in items], [c for _, c, _ in items], [i for _, _, i in items])
    assert torch.allclose(theirs, ours(rm, "text", items), atol=1e-5)
    # the policy's ids (with the EOS the policy sampled) are another input: TRL scores the text without it
    with_eos = ours(rm, "tokens", items, prompt_ids=[list(tok(p, add_special_tokens=False)["input_ids"])
                                                     for p, _, _ in items])
    assert (theirs - with_eos).abs().max() > 1e-3


def test_trl_conversational_rewards_equal_ours_chat(rm):
    tok = load_tokenizer(rm)
    items = pairs(tok)
    prompts = [[{"role": "user", "content": p}] for p, _, _ in items]
    completions = [[{"role": "assistant", "content": c}] for _, c, _ in items]
    theirs = trl_rewards(rm, prompts, completions, [i for _, _, i in items])
    assert torch.allclose(theirs, ours(rm, "chat", items), atol=1e-5)
    assert (theirs - ours(rm, "text", items)).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------------------
# verl
# ----------------------------------------------------------------------------------------------------------------
def verl_preprocess():
    """verl 0.9.1's RewardLoopWorker._preprocess_reward_inputs, compiled from the installed source unmodified."""
    if not VERL_PACKAGE.is_dir():
        pytest.skip(f"verl 0.9.1 is not installed in {VERL_PACKAGE.parent} (make peers)")
    root = VERL_PACKAGE
    version = (root / "version" / "version").read_text().strip() if (root / "version" / "version").is_file() else "?"
    if version != "0.9.1":
        pytest.skip(f"verl {version} installed; the parity is pinned to 0.9.1")
    source = (root / "experimental" / "reward_loop" / "reward_loop.py").read_text()
    tree = ast.parse(source)
    worker = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RewardLoopWorker")
    fn = next(n for n in worker.body if getattr(n, "name", "") == "_preprocess_reward_inputs")
    namespace: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(root / "reward_loop.py"), "exec"), namespace)  # noqa: S102 - the peer's real function, compiled unmodified for the parity
    return namespace["_preprocess_reward_inputs"]


class OneItem:
    """The part of verl's DataProto that the function reads, for one sample: ``data[0].non_tensor_batch`` and
    ``.batch`` (responses right-padded to a fixed length, the attention mask over prompt + response)."""

    def __init__(self, raw_prompt, response_ids, response_length):
        pad = response_length - len(response_ids)
        self.non_tensor_batch = {"raw_prompt": raw_prompt}
        self.batch = {"responses": torch.tensor(response_ids + [0] * pad),
                      "attention_mask": torch.tensor([1] * 5 + [1] * len(response_ids) + [0] * pad)}

    def __len__(self):
        return 1

    def __getitem__(self, index):
        return self


def test_verl_reward_model_inputs_score_as_ours_chat(rm):
    preprocess = verl_preprocess()
    tok = load_tokenizer(rm)
    items = pairs(tok)
    worker = SimpleNamespace(input_tokenizer=tok, reward_model_tokenizer=tok)
    texts = [asyncio.run(preprocess(worker, OneItem([{"role": "user", "content": p}], ids, 8))) for p, _, ids in items]
    # verl's vLLM /classify server tokenizes the text with the tokenizer's default special tokens
    model = HFRewardEngine(rm)
    theirs = model.classify([tok(t)["input_ids"] for t in texts])
    assert torch.allclose(theirs, ours(rm, "chat", items), atol=1e-5)
    assert (theirs - ours(rm, "text", items)).abs().max() > 1e-3
