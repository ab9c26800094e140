"""The Megatron reward model (issue 33): a Qwen2 sequence classifier served with the policy engine's code scores
exactly as transformers does, in one process and under TP2, TP2 + sequence parallelism and PP2 (gloo, CPU); its
weights come through the policy's conversion rules (``score.weight`` <-> the replicated score head); building it
leaves the run's random state untouched."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist import run_distributed

pytestmark = pytest.mark.multiproc
ATOL = 2e-5


def save_classifier(folder: Path, seed: int = 0) -> Path:
    """A random 4-layer Qwen2ForSequenceClassification (GQA 4:2, q/k/v bias) with one label, as an HF folder."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model("qwen2", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, num_labels=1,
                                  pad_token_id=0)
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def inputs(n: int = 11, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _worker(folder: str, tp: int, pp: int, sp: bool, batch_tokens: int, dtype: str = "float32"):
    from megatron.core import parallel_state as ps

    from megatron_dppo.convert.hf_io import HFCheckpoint
    from megatron_dppo.convert.mapping import validate_hf_tensors
    from megatron_dppo.convert.weights import load_hf_weights
    from megatron_dppo.megatron.arch import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel
    from megatron_dppo.megatron.reward_engine import MegatronRewardEngine

    arch = ModelArch.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))
    parallel = ParallelConfig(tp=tp, pp=pp, sp=sp)
    initialize_parallel(parallel, seed=3, arch=arch)
    checkpoint = HFCheckpoint(folder)
    validate_hf_tensors(checkpoint.shapes, arch)
    from megatron.core import tensor_parallel

    from megatron_dppo.megatron.model import build_model_chunks

    before = (torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states())
    engine = MegatronRewardEngine(arch, parallel, dtype=getattr(torch, dtype), batch_tokens=batch_tokens)
    dtypes = sorted({str(p.dtype) for c in engine.model_chunks for p in c.parameters()})
    rng_kept = torch.equal(before[0], torch.get_rng_state())
    build_model_chunks(arch, parallel, torch.float32)  # (what the engine builds, without the guard)
    rng_moved = not torch.equal(before[0], torch.get_rng_state())
    load_hf_weights(engine.model_chunks, arch, checkpoint.get)
    return {"scores": engine.classify(inputs()), "shard": engine.shard(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "rng_kept": rng_kept, "rng_moved": rng_moved,
            "dtypes": dtypes}


@pytest.mark.parametrize("tp, pp, sp", [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)])
def test_megatron_reward_model_equals_transformers(tmp_path, tp, pp, sp):
    from megatron_dppo.rewards.hf_model import HFRewardEngine

    folder = save_classifier(tmp_path / "rm")
    expected = HFRewardEngine(folder).classify(inputs())
    results = run_distributed(_worker, world_size=tp * pp, args=(str(folder), tp, pp, sp, 64), timeout=300)
    assert expected.std() > 1e-3
    for r in results:  # every rank (every TP rank, every pipeline stage) holds all the scores
        diff = (r["scores"] - expected).abs().max().item()
        print(f"tp={tp} pp={pp} sp={sp} rank of stage {r['pp_rank']}: max |score diff| = {diff:.2e}")
        assert diff < ATOL
        assert r["shard"] == (0, 1)  # one data-parallel replica: it scores every group
        # building it leaves the run's random state as it was (a bare build would move it: the policy built after
        # it would be initialized differently, found by tests/e2e/test_reward_model_run.py)
        assert r["rng_kept"] and r["rng_moved"]


def test_bf16_reward_model_under_tp2_scores_within_bf16_rounding_of_transformers(tmp_path):
    """reward.model.dtype=bfloat16 on CPU (TP2, gloo all-reducing bf16 partial sums): bf16 weights, fp32 scores
    within bf16's rounding of the fp32 transformers scores. Bound (tests/megatron/test_bf16.py's derivation):
    K = 12 L + 2 roundings in series (no output layer over a vocabulary: the score head is one), u = 2^-8, first
    order worst case |d score| <= K u S, S = the largest |score|; and not equal to fp32 (bf16 really ran)."""
    from megatron_dppo.rewards.hf_model import HFRewardEngine

    folder = save_classifier(tmp_path / "rm")
    expected = HFRewardEngine(folder).classify(inputs())
    bound = (12 * 4 + 2) * 2.0 ** -8 * float(expected.abs().max())
    for r in run_distributed(_worker, world_size=2, args=(str(folder), 2, 1, False, 64, "bfloat16"), timeout=300):
        assert r["dtypes"] == ["torch.bfloat16"] and r["scores"].dtype == torch.float32
        diff = (r["scores"] - expected).abs().max().item()
        print(f"bf16 TP2: max |score diff| = {diff:.2e} (bound {bound:.2e})")
        assert 1e-4 < diff <= bound


def test_the_policy_engine_refuses_a_classifier_and_a_classifier_has_no_lm_head():
    from megatron_dppo.convert.mapping import expected_hf_shapes
    from megatron_dppo.megatron.arch import ModelArch

    config = dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, num_labels=1,
                  architectures=["Qwen2ForSequenceClassification"])
    arch = ModelArch.from_hf_config(config)
    assert arch.num_labels == 1 and not arch.tie_embeddings  # a classifier ties nothing (it has no LM head)
    shapes = expected_hf_shapes(arch)
    assert shapes["score.weight"] == (1, 64) and "lm_head.weight" not in shapes
    lm = ModelArch.from_hf_config({k: v for k, v in config.items() if k not in ("architectures", "num_labels")})
    assert lm.num_labels is None and "score.weight" not in expected_hf_shapes(lm)
    from megatron_dppo.megatron.engine import PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig

    with pytest.raises(ValueError, match="policy must be a causal LM"):
        PolicyEngine.__init__(object.__new__(PolicyEngine), arch, ParallelConfig())
