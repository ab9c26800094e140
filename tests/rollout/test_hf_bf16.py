"""The HF rollout engine in bfloat16 (``rollout.dtype``) and its weights freed between generations
(``release_weights_on_sleep``, ``rollout/hf_memory.py``), on tiny random models."""
import types
from pathlib import Path

import pytest
import torch

from _sampling_reference import teacher_forced  # isort: skip
from megatron_dppo.rollout import HFRolloutEngine, SamplingParams, hf_memory
from megatron_dppo.rollout.handover import MemoryHandover

from test_hf_engine import PROMPTS, tiny_model  # isort: skip

# The logits leave a bf16 model in bf16 (8 significant bits): for the tiny models' |logit| < 8 one ulp is 2^-5.
# Two bf16 computations of the same logits (the engine's, incremental with a KV cache and left padding, and one
# teacher-forced forward) round differently inside and differ by about an ulp; a log-prob (its logit minus the
# log-sum-exp) then by at most about two: 2^-4. (Measured: max 0.012, mean 4e-4; to the fp32 model: mean 3e-3.)
BF16_LOGPROB_BOUND = 2.0**-4


def _bf16(model):
    return model.to(torch.bfloat16)


def _logprob_gaps(engine, reference_model, groups):
    gaps = []
    for group in groups:
        for c in group.completions:
            gaps.append(torch.tensor(c.logprobs) - teacher_forced(reference_model, group.prompt_token_ids,
                                                                   c.token_ids))
    return torch.cat(gaps).abs()


def test_bf16_engine_samples_in_bf16_with_the_logprobs_of_a_bf16_forward():
    """The engine computes in bfloat16 (its parameters and logits are bf16) and its behaviour log-probs are those
    of a teacher-forced bf16 forward of the same model within BF16_LOGPROB_BOUND, closer to it than to the fp32
    model they were rounded from (the gap to fp32 is the rollout/train mismatch a bf16 rollout creates)."""
    fp32 = tiny_model(seed=3)
    model = _bf16(tiny_model(seed=3))
    engine = HFRolloutEngine(model, max_batch_size=4)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    seen = []
    hook = engine.model.lm_head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    groups = engine.generate(PROMPTS, n=3, sampling=SamplingParams(max_new_tokens=12, seed=5))
    hook.remove()
    assert set(seen) == {torch.bfloat16}
    to_bf16 = _logprob_gaps(engine, model, groups)
    to_fp32 = _logprob_gaps(engine, fp32, groups)
    assert float(to_bf16.max()) < BF16_LOGPROB_BOUND, float(to_bf16.max())
    assert float(to_bf16.mean()) < float(to_fp32.mean()), (float(to_bf16.mean()), float(to_fp32.mean()))
    assert float(to_fp32.max()) > 1e-3  # the mismatch is real: bf16 sampling is not the fp32 policy


def test_a_push_into_a_bf16_engine_is_the_trainer_weights_cast_to_bf16():
    """fp32 (trainer) weights pushed into a bf16 engine are exactly ``w.to(torch.bfloat16)`` (round to nearest
    even), tied embeddings included; bf16 weights arrive bit for bit."""
    engine = HFRolloutEngine(_bf16(tiny_model(seed=0, tie=True)))
    trainer = {k: v for k, v in tiny_model(seed=1, tie=True).state_dict().items() if k != "lm_head.weight"}
    engine.load_weights(trainer.items())
    held = engine.model.state_dict()
    for name, w in trainer.items():
        assert held[name].dtype == torch.bfloat16
        assert torch.equal(held[name], w.to(torch.bfloat16)), name
    assert torch.equal(held["lm_head.weight"], trainer["model.embed_tokens.weight"].to(torch.bfloat16))
    bf16_trainer = {k: v.to(torch.bfloat16) for k, v in tiny_model(seed=2, tie=True).state_dict().items()}
    engine.load_weights(bf16_trainer.items())
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in bf16_trainer.items())


@pytest.mark.parametrize("rollout_dtype, model_dtype, expected", [
    ("bfloat16", "float32", torch.bfloat16), ("auto", "float32", torch.float32), ("auto", "bfloat16", torch.bfloat16),
    ("float32", "bfloat16", torch.float32),
])
def test_build_rollout_takes_the_rollout_dtype(tmp_path, rollout_dtype, model_dtype, expected):
    """rollout.dtype sets the HF engine's dtype; auto follows model.dtype. The colocated CPU engine frees its
    weights between generations (rollout.sleep_between_steps), a separate rollout worker's does not."""
    from megatron_dppo.config import load_config
    from megatron_dppo.run.build import build_rollout

    hf_config = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": 64, "eos_token_id": 3}
    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml",
                      [f"rollout.dtype={rollout_dtype}", f"model.dtype={model_dtype}",
                       f"train.output_dir={tmp_path}"], validate=False)
    tokenizer = types.SimpleNamespace(eos_token_id=3, pad_token_id=0)
    engine = build_rollout(cfg, hf_config, None, tokenizer)
    assert {p.dtype for p in engine.model.parameters()} == {expected}
    assert engine.release_weights_on_sleep
    cfg.rollout.placement = "separate"
    assert not build_rollout(cfg, hf_config, None, tokenizer).release_weights_on_sleep


def test_freed_weights_are_pushed_again_and_sample_the_same_tokens():
    """sleep() frees every weight (no parameter storage left), generation refuses until a complete push, and after
    the push (through the handover, which pushes because ``needs_weights``) the same seed gives the same tokens
    and log-probs, bit for bit, as the engine that kept its weights."""
    for dtype in (torch.float32, torch.bfloat16):
        trainer = tiny_model(seed=4, tie=True)
        kept = HFRolloutEngine(tiny_model(seed=4, tie=True).to(dtype))
        engine = HFRolloutEngine(tiny_model(seed=4, tie=True).to(dtype), release_weights_on_sleep=True)
        sampling = SamplingParams(max_new_tokens=10, seed=11)
        reference = kept.generate(PROMPTS, 3, sampling)
        handover = MemoryHandover(engine, lambda: iter(trainer.state_dict().items()))
        for _ in range(2):  # the second cycle runs on the flat buffer allocate() made
            assert hf_memory.resident_bytes(engine.model) > 0 and not engine.needs_weights
            engine.sleep()
            assert hf_memory.resident_bytes(engine.model) == 0 and engine.needs_weights
            engine.wake_up(["weights"])
            with pytest.raises(RuntimeError, match="freed by sleep"):
                engine.generate(PROMPTS, 1, sampling)
            handover.before_generation()  # pushes: the engine needs weights
            assert not engine.needs_weights
            again = engine.generate(PROMPTS, 3, sampling)
            assert [[(c.token_ids, c.logprobs) for c in g.completions] for g in again] == \
                [[(c.token_ids, c.logprobs) for c in g.completions] for g in reference]
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_freed_weights_leave_the_process():
    """The weights allocate() makes are one buffer, which release() gives back to the operating system: the
    resident memory drops by the weights' size (a 64 MiB model; not only the allocator's free lists)."""
    model = tiny_model()
    model.model.embed_tokens = torch.nn.Embedding(64 * 1024, 256)  # 64 MiB of fp32
    size = hf_memory.resident_bytes(model)
    hf_memory.release(model)
    hf_memory.allocate(model)
    for p in model.parameters():
        p.data.fill_(1.0)  # touch the pages
    before = _rss_bytes()
    hf_memory.release(model)
    assert before - _rss_bytes() > 0.9 * size, (before - _rss_bytes(), size)


def test_release_is_refused_with_lora():
    with pytest.raises(ValueError, match="release_weights_on_sleep with LoRA"):
        HFRolloutEngine(tiny_model(), lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]},
                        release_weights_on_sleep=True)
