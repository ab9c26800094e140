"""The behaviour log-probs the trainer compares with are those of the distribution the rollout actually sampled, and
the trainer's are of the tempered policy (docs/algorithms.md, "Temperature and truncated sampling").

A real HF rollout engine samples through ``stages.generate`` with the behaviour weights W_b; a Megatron engine at
``LossConfig.temperature = T`` holds the proximal weights W_p (W_b a version later, as in an asynchronous step, or
W_b itself); ``stages.correct_rollout_mismatch`` and ``stages.logprob_mismatch`` report the behaviour / proximal
divergence. The reference values are independent teacher-forced computations on HF models of W_b (processed:
logits / T, top-k, top-p, log_softmax) and W_p (tempered, untruncated).
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))

from _dist import single_process_world
from _sampling_reference import teacher_forced

T = 0.7
EOS = 2
HF_CONFIG = dict(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, max_position_embeddings=64, eos_token_id=EOS, pad_token_id=0)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
G = 4


def _hf_model(seed: int, noise: float = 0.0, base=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**HF_CONFIG), dtype=torch.float32).eval()
    with torch.no_grad():
        if base is not None:
            model.load_state_dict(base.state_dict())
        else:
            model.lm_head.weight.mul_(8.0)  # sharp distributions: truncation removes mass that matters
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    return model


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(HF_CONFIG["vocab_size"])}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                   eos_token=f"t{EOS}", pad_token="t0", unk_token="t1")


def divergence(sampling: dict, stale: bool) -> dict:
    """Sample G completions per prompt from W_b through rollouts.generate (sampling: rollout.* overrides), compute the
    trainer's old log-probs at W_p (= W_b perturbed when ``stale``, else W_b) and return the stages' metrics and
    the independent per-token (log mu_b, log pi_p,T)."""
    from megatron_dppo.algo.losses import LossConfig, sequence_token_weights
    from megatron_dppo.config import load_config
    from megatron_dppo.convert.weights import export_hf_weights, load_hf_weights
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.packing import build_rank_micro_batches
    from megatron_dppo.rollout import HFRolloutEngine
    from megatron_dppo.rollout.handover import MemoryHandover
    from megatron_dppo.run.state import RolloutSide
    from megatron_dppo.train.rollouts import generate
    from megatron_dppo.train.stages import TrainBatch, correct_rollout_mismatch
    from megatron_dppo.train.step_metrics import logprob_mismatch

    behaviour = _hf_model(0)
    proximal = _hf_model(1, noise=0.02, base=behaviour) if stale else behaviour
    arch = ModelArch.from_hf_config(HF_CONFIG)
    overrides = [f"rollout.{k}={v}" for k, v in {**sampling, "temperature": T, "max_new_tokens": 6}.items()]
    cfg = load_config(None, overrides + ["train.seed=3"], validate=False)
    with single_process_world(arch=arch):
        loss_cfg = LossConfig(kl_coef=0.0, rollout_correction="tis", rollout_correction_cap=1e6).resolved(temperature=T)
        engine = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=0.0), loss_cfg)
        load_hf_weights(engine.modules, arch, proximal.state_dict())
        rollout_engine = HFRolloutEngine(behaviour, eos_token_ids=[EOS])
        side = RolloutSide(cfg=cfg, tokenizer=_tokenizer(), engine=rollout_engine, eos_ids=[EOS],
                           handover=MemoryHandover(rollout_engine, lambda: export_hf_weights(engine.modules, arch)),
                           scorer=None, train_prompts=[], sampler=None, pruner=None)
        prompts = [SimpleNamespace(id=f"q{q}", token_ids=p) for q, p in enumerate(PROMPTS)]
        rollout = generate(side, prompts, G, step=0, temperature=cfg.rollout.temperature)
        token_ids, origin = [], []
        for row, prompt in enumerate(PROMPTS):
            for i, completion in enumerate(rollout.completions[row]):
                token_ids.append(prompt + completion)
                origin.append((row, i))
        n = len(token_ids)
        lengths = torch.tensor([len(t) - len(PROMPTS[r]) for t, (r, _) in zip(token_ids, origin)], dtype=torch.float32)
        batch = TrainBatch(token_ids=token_ids, prompt_lengths=[len(PROMPTS[r]) for r, _ in origin],
                           advantages=torch.ones(n), token_weights=sequence_token_weights(
                               loss_cfg.aggregation, torch.ones(n), lengths),
                           seq_weights=torch.ones(n), rewards=torch.zeros(n), origin=origin, denominator=float(n))
        micro_batches = build_rank_micro_batches([list(range(0, n, 2)), list(range(1, n, 2))], token_ids,
                                                 batch.prompt_lengths, batch.advantages, batch.token_weights)
        engine.fill_logprobs(micro_batches, old=True)  # the proximal (trainer) log-probs, at T
        metrics = correct_rollout_mismatch(loss_cfg, rollout, [batch], [micro_batches])
        metrics.update(logprob_mismatch(rollout, [batch], [micro_batches]))
    top_k, top_p = int(sampling.get("top_k", -1)), float(sampling.get("top_p", 1.0))
    mu = torch.cat([teacher_forced(behaviour, PROMPTS[r], rollout.completions[r][i], T, max(top_k, 0), top_p)
                    for r, i in origin]).double()
    pi = torch.cat([teacher_forced(proximal, PROMPTS[r], rollout.completions[r][i], T) for r, i in origin]).double()
    return {"metrics": metrics, "mu": mu, "pi": pi}


def _expected(d):
    log_u = d["pi"] - d["mu"]  # u = pi_prox,T / mu_behav
    return {"rollout/kl_k1": float((-log_u).mean()), "rollout/is_ratio": float(log_u.exp().mean()),
            "rollout/kl_k3": float((log_u.exp() - log_u - 1).mean()),
            "rollout/logprob_abs_diff": float(log_u.abs().mean())}


@pytest.mark.parametrize("stale", [True, False], ids=["stale", "same_weights"])
def test_truncated_sample_reports_its_real_behaviour_proximal_divergence(stale):
    """top-k and top-p at T = 0.7: the correction's KL, ratio and the abs-diff metric are those between the
    truncated distribution that sampled (W_b) and the tempered trainer policy (W_p), not 0 and not 1 (the trainer's
    own log-probs in place of the engine's gave exactly that before). With the same weights the divergence is the
    truncation alone: log mu - log pi_T = -log Z_K >= 0 on every token."""
    d = divergence({"top_k": 20, "top_p": 0.9}, stale=stale)
    m, expected = d["metrics"], _expected(d)
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert m["rollout/kl_k1"] > 1e-2 and m["rollout/is_ratio"] < 0.99
    if not stale:
        assert bool((d["mu"] - d["pi"] >= -1e-5).all())


def test_temperature_only_sample_matches_the_trainer_at_the_same_weights():
    """T = 0.7 without truncation: the behaviour log-probs are the tempered policy's, so at the same weights they
    equal the trainer's (rollout/logprob_abs_diff ~ 1e-7, KL ~ 0, ratio 1), and a version apart they do not."""
    same = divergence({}, stale=False)["metrics"]
    assert same["rollout/logprob_abs_diff"] < 1e-5 and abs(same["rollout/kl_k1"]) < 1e-5
    assert same["rollout/is_ratio"] == pytest.approx(1.0, abs=1e-5)
    stale = divergence({}, stale=True)
    assert stale["metrics"]["rollout/kl_k1"] == pytest.approx(_expected(stale)["rollout/kl_k1"], rel=1e-4)
    assert stale["metrics"]["rollout/logprob_abs_diff"] > 1e-3
