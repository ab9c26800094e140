"""The HF (CPU) rollout engine on tiny random models: sampling log-probs equal a teacher-forced forward of the
same model, samples follow the distribution the log-probs describe, seeding, stop tokens, weight loading."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from _sampling_reference import teacher_forced  # isort: skip
from megatron_dppo.rollout import HFRolloutEngine, RolloutEngine, SamplingParams, create_engine

EOS = 3


def tiny_model(family="llama", vocab=48, seed=0, tie=False):
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, eos_token_id=EOS, pad_token_id=0,
                  bos_token_id=2, tie_word_embeddings=tie)
    config = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger logits than the default init, so distributions are far from uniform
        model.get_output_embeddings().weight.mul_(8.0)
    return model


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # different lengths: exercises left padding


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logprobs_equal_teacher_forced_forward_at_temperature_1(family):
    model = tiny_model(family)
    engine = HFRolloutEngine(model, max_batch_size=4)  # 3 prompts x 3 samples: several padded batches
    groups = engine.generate(PROMPTS, n=3, sampling=SamplingParams(max_new_tokens=10, seed=1))
    assert [g.prompt_token_ids for g in groups] == PROMPTS
    worst = 0.0
    for group in groups:
        assert len(group.completions) == 3
        for c in group.completions:
            reference = teacher_forced(model, group.prompt_token_ids, c.token_ids)
            worst = max(worst, (reference - torch.tensor(c.logprobs)).abs().max().item())
    assert worst < 1e-5, worst


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 12, 0.9), (0.7, 0, 0.8), (1.3, 5, 1.0)])
def test_logprobs_are_those_of_the_truncated_distribution_that_was_sampled(temperature, top_k, top_p):
    """With top-k and/or top-p the log-probs are log_softmax of the processed logits (logits / T, tokens outside
    the kept set at -inf), an independent teacher-forced computation; not the tempered untruncated log-probs the
    trainer computes, which are lower by log Z_K (the kept set's tempered mass) wherever truncation removed mass."""
    model = tiny_model()
    engine = HFRolloutEngine(model)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10, seed=2)
    gaps = []
    for group in engine.generate(PROMPTS, n=2, sampling=sampling):
        for c in group.completions:
            processed = teacher_forced(model, group.prompt_token_ids, c.token_ids, temperature, top_k, top_p)
            tempered = teacher_forced(model, group.prompt_token_ids, c.token_ids, temperature)
            assert torch.allclose(torch.tensor(c.logprobs), processed, atol=1e-5)
            gaps.append(processed - tempered)
    gaps = torch.cat(gaps)
    assert bool((gaps >= -1e-6).all()) and float(gaps.max()) > 1e-2  # -log Z_K >= 0, > 0 where mass was cut


def test_temperature_only_logprobs_are_the_tempered_policy():
    """Temperature alone (no truncation): the sampled distribution IS the tempered policy softmax(logits / T), the
    one the trainer's log-probs describe at rollout.temperature; it differs from the temperature-1 policy."""
    model = tiny_model()
    engine = HFRolloutEngine(model)
    for group in engine.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=0.7, max_new_tokens=10, seed=4)):
        for c in group.completions:
            tempered = teacher_forced(model, group.prompt_token_ids, c.token_ids, 0.7)
            assert torch.allclose(torch.tensor(c.logprobs), tempered, atol=1e-5)
            assert not torch.allclose(tempered, teacher_forced(model, group.prompt_token_ids, c.token_ids), atol=1e-3)


def test_samples_follow_the_distribution_of_their_logprobs():
    """Monte Carlo: first-token frequencies over N samples match exp(logprob) within 5 standard errors."""
    model = tiny_model(vocab=16)
    engine = HFRolloutEngine(model, max_batch_size=500)
    n = 2000
    sampling = SamplingParams(temperature=1.5, top_p=0.95, max_new_tokens=1, seed=3)
    completions = engine.generate([[5, 6, 7]], n=n, sampling=sampling)[0].completions
    probs = torch.zeros(16)
    counts = torch.zeros(16)
    for c in completions:
        counts[c.token_ids[0]] += 1
        probs[c.token_ids[0]] = math.exp(c.logprobs[0])
    seen = counts > 0
    assert abs(probs[seen].sum().item() - 1.0) < 0.02  # every token with mass > ~1/n was drawn
    freq = counts / n
    stderr = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * stderr + 1e-3).all(), (freq, probs)


def test_seeded_generation_is_reproducible_and_leaves_the_global_rng_alone():
    engine = HFRolloutEngine(tiny_model())
    sampling = SamplingParams(max_new_tokens=8, seed=5)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = engine.generate(PROMPTS, 2, sampling)
    after = torch.rand(1)
    second = engine.generate(PROMPTS, 2, sampling)
    other = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=8, seed=6))
    tokens = lambda groups: [c.token_ids for g in groups for c in g.completions]  # noqa: E731
    assert tokens(first) == tokens(second)
    assert tokens(first) != tokens(other)
    assert torch.equal(before, after)


def test_completions_end_at_the_first_stop_token_or_at_max_new_tokens():
    model = tiny_model(vocab=8)  # small vocabulary: EOS (3) and the extra stop token (5) come up often
    engine = HFRolloutEngine(model)
    prompts = [[4, 6, 7], [1, 2], [7, 4, 6, 1]]
    groups = engine.generate(prompts, n=8, sampling=SamplingParams(max_new_tokens=6, seed=0, stop_token_ids=(5,)))
    reasons = set()
    for group in groups:
        for c in group.completions:
            reasons.add(c.finish_reason)
            inner = c.token_ids[:-1]
            assert EOS not in inner and 5 not in inner
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in (EOS, 5) and len(c.logprobs) == len(c.token_ids)
            else:
                assert len(c.token_ids) == 6 and c.token_ids[-1] not in (EOS, 5)
    assert reasons == {"stop", "length"}


def test_load_weights_changes_outputs_to_the_new_model():
    engine = HFRolloutEngine(tiny_model(seed=0))
    sampling = SamplingParams(max_new_tokens=8, seed=7)
    before = engine.generate(PROMPTS, 2, sampling)
    target = tiny_model(seed=1)
    pushed = {name: t.to(torch.bfloat16) for name, t in target.state_dict().items()}  # the engine casts to fp32
    target.load_state_dict({name: t.float() for name, t in pushed.items()})
    assert engine.load_weights(pushed.items()) == len(pushed)
    after = engine.generate(PROMPTS, 2, sampling)
    assert [c.logprobs for g in before for c in g.completions] != [c.logprobs for g in after for c in g.completions]
    for group in after:  # the engine now samples from the new model
        for c in group.completions:
            reference = teacher_forced(target, group.prompt_token_ids, c.token_ids)
            assert torch.allclose(torch.tensor(c.logprobs), reference, atol=1e-5)


def test_load_weights_rejects_bad_names_shapes_and_gaps():
    engine = HFRolloutEngine(tiny_model())
    good = dict(tiny_model(seed=1).state_dict())
    with pytest.raises(ValueError, match="unknown weight 'model.layers.0.self_attn.qkv_proj.weight'"):
        engine.load_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(31,\) but the model expects \(32,\)"):
        engine.load_weights([("model.norm.weight", torch.ones(31))])
    with pytest.raises(ValueError, match="did not cover 1 parameters, e.g. \\['lm_head.weight'\\]"):
        engine.load_weights((k, v) for k, v in good.items() if k != "lm_head.weight")
    tied = HFRolloutEngine(tiny_model(tie=True))  # a tied output layer is covered by the embedding
    tied.load_weights((k, v) for k, v in tiny_model(seed=1, tie=True).state_dict().items() if k != "lm_head.weight")


def test_protocol_sleep_and_from_pretrained(tmp_path):
    model = tiny_model()
    model.config.save_pretrained(tmp_path)
    engine = create_engine("hf", tmp_path)
    assert isinstance(engine, RolloutEngine)
    engine.load_weights(model.state_dict().items())
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2))
    engine.wake_up(["weights"])
    out = engine.generate(PROMPTS, 1, SamplingParams(max_new_tokens=4, seed=0))
    reference = HFRolloutEngine(model).generate(PROMPTS, 1, SamplingParams(max_new_tokens=4, seed=0))
    assert [c.token_ids for g in out for c in g.completions] == [c.token_ids for g in reference for c in g.completions]
    with pytest.raises(ValueError, match="no config.json"):
        create_engine("hf", tmp_path / "missing")
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'"):
        create_engine("sglang", tmp_path)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], 1, SamplingParams())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_checkpoint_expert_tensors_fill_the_fused_in_memory_experts(tmp_path, family):
    """The weight stream speaks the checkpoint layout (one tensor per expert, Mixtral's block_sparse_moe names);
    a model built from another seed and loaded from the checkpoint files of the first ends with every parameter
    equal to the first model's, and a stream lacking one expert is refused."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = (dict(num_experts=4, moe_intermediate_size=16, head_dim=8) if family == "qwen3_moe"
             else dict(num_local_experts=4, intermediate_size=16))
    cfg = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(cfg).eval()
    source.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    expert = ".experts.3.down_proj.weight" if family == "qwen3_moe" else ".experts.3.w2.weight"
    assert any(k.endswith(expert) for k in on_disk)  # the checkpoint layout really is per expert
    torch.manual_seed(1)
    engine = HFRolloutEngine(AutoModelForCausalLM.from_config(cfg), eos_token_ids=[63])
    assert engine.load_weights(on_disk.items()) == len(on_disk)
    for (name, mine), theirs in zip(engine.model.state_dict().items(), source.state_dict().values()):
        assert torch.equal(mine, theirs), name
    with pytest.raises(ValueError, match="did not cover"):
        fresh = HFRolloutEngine(AutoModelForCausalLM.from_config(cfg), eos_token_ids=[63])
        fresh.load_weights((k, v) for k, v in on_disk.items() if not k.endswith(expert))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shared_prompt_prefill_gives_the_unshared_samples_and_computes_each_prompt_once(family):
    """The n samples of a prompt share one prefill of it (HFRolloutEngine.share_prompt_prefill): same seeded
    tokens, finish reasons and log-probs (fp32 rounding of other batch shapes aside) as n separate prefills, with
    left padding (prompts of 2-7 tokens) and a batch size that splits a group across generate calls; the model
    sees each distinct prompt's tokens once per call instead of once per sample."""
    model = tiny_model(family, tie=True)
    sampling = SamplingParams(temperature=0.9, max_new_tokens=10, seed=7)
    seen: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(int((kwargs.get("input_ids") if "input_ids" in kwargs else args[0])
                                                 .numel())), with_kwargs=True)
    try:
        results = {}
        for share in (False, True):
            seen.clear()
            engine = HFRolloutEngine(model, max_batch_size=5, share_prompt_prefill=share)  # 3 x 4 rows: 5, 5, 2
            results[share] = (engine.generate(PROMPTS, n=4, sampling=sampling), sum(seen))
    finally:
        hook.remove()
    (plain, plain_tokens), (shared, shared_tokens) = results[False], results[True]
    worst = 0.0
    for a, b in zip(plain, shared):
        for x, y in zip(a.completions, b.completions):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            worst = max(worst, max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)))
            reference = teacher_forced(model, b.prompt_token_ids, y.token_ids, 0.9)
            assert torch.allclose(torch.tensor(y.logprobs), reference, atol=1e-5)
    assert worst < 1e-5
    assert shared_tokens < plain_tokens  # the prompts were computed fewer times
