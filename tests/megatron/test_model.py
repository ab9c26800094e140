"""GPTModel from HF configs: architecture parsing, sharding validation, packed THD == sequences run alone."""
from __future__ import annotations

import pytest
import torch
from _dist import run_distributed, single_process_world
from _tiny import TINY_CONFIGS, packed_batches, random_sequences

from megatron_dppo.megatron.model import ModelArch
from megatron_dppo.megatron.parallel import ParallelConfig, validate_parallel

# Published configs (config.json) of real checkpoints.
SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192, hidden_act="silu")
QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768, hidden_act="silu",
                  use_sliding_window=False, sliding_window=32768, max_window_layers=21)
QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=40960,
                 hidden_act="silu", attention_bias=False)


# ------------------------------------------------------------------------------------------------------------
# ModelArch.from_hf_config
# ------------------------------------------------------------------------------------------------------------
def test_arch_smollm2_llama():
    arch = ModelArch.from_hf_config(SMOLLM2_135M)
    assert (arch.family, arch.num_kv_heads, arch.head_dim, arch.rope_theta) == ("llama", 3, 64, 100000.0)
    assert arch.tie_embeddings and not arch.qkv_bias and not arch.qk_norm
    assert arch.num_parameters == 134_515_008  # the published SmolLM2-135M parameter count


def test_arch_qwen2_has_qkv_bias():
    arch = ModelArch.from_hf_config(QWEN25_05B)
    assert arch.family == "qwen2" and arch.qkv_bias and not arch.qk_norm
    assert (arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (14, 2, 64)
    assert arch.num_parameters == 494_032_768  # Qwen2.5-0.5B


def test_arch_qwen3_qk_norm_and_explicit_head_dim():
    arch = ModelArch.from_hf_config(QWEN3_06B)
    assert arch.family == "qwen3" and arch.qk_norm and not arch.qkv_bias
    assert arch.head_dim == 128 and arch.head_dim * arch.num_attention_heads != arch.hidden_size
    assert arch.num_parameters == 596_049_920  # Qwen3-0.6B


def test_arch_from_transformers_config_equals_dict():
    from transformers import AutoConfig

    for cfg in (SMOLLM2_135M, QWEN25_05B, QWEN3_06B):
        assert ModelArch.from_hf_config(AutoConfig.for_model(**cfg)) == ModelArch.from_hf_config(cfg)


def test_arch_rope_scaling():
    llama3 = dict(SMOLLM2_135M, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                  high_freq_factor=4.0, original_max_position_embeddings=8192))
    arch = ModelArch.from_hf_config(llama3)
    assert (arch.rope_scaling_type, arch.rope_scaling_factor) == ("llama3", 32.0)
    linear = ModelArch.from_hf_config(dict(SMOLLM2_135M, rope_scaling=dict(type="linear", factor=2.0)))
    assert (linear.rope_scaling_type, linear.rope_scaling_factor) == ("linear", 2.0)
    with pytest.raises(ValueError, match="'yarn'"):
        ModelArch.from_hf_config(dict(QWEN3_06B, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                                    original_max_position_embeddings=32768)))
    with pytest.raises(ValueError, match="high_freq_factor=2"):
        ModelArch.from_hf_config(dict(llama3, rope_scaling=dict(llama3["rope_scaling"], high_freq_factor=2.0)))


@pytest.mark.parametrize("bad, match", [
    (dict(SMOLLM2_135M, model_type="gpt2"), "model_type='gpt2' is not supported; supported: "),  # (mistral is)
    (dict(SMOLLM2_135M, model_type="gemma2"), "model_type='gemma2' is refused: Gemma 2"),
    (dict(SMOLLM2_135M, partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not supported for 'llama'"),
    (dict(SMOLLM2_135M, hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(SMOLLM2_135M, attention_bias=True), "attention_bias"),
    (dict(QWEN25_05B, use_sliding_window=True), "use_sliding_window"),
])
def test_arch_rejects_unsupported(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config(bad)


# ------------------------------------------------------------------------------------------------------------
# Sharding validation happens before any process group exists
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, world, expected", [
    (ParallelConfig(tp=3), 3, ["num_attention_heads=4 is not divisible by tp=3"]),
    (ParallelConfig(tp=8), 8, ["num_attention_heads=4 is not divisible by tp=8"]),
    (ParallelConfig(pp=3), 3, ["num_layers=4 is not divisible by pp=3"]),
    (ParallelConfig(pp=2, vpp=3), 2, ["num_layers=4 is not divisible by pp*vpp=2*3=6"]),
    (ParallelConfig(tp=2, pp=2), 6, ["world size 6 is not divisible by tp*pp*cp = 2*2*1 = 4"]),
])
def test_validate_parallel_names_the_numbers(cfg, world, expected):
    arch = ModelArch.from_hf_config(TINY_CONFIGS["qwen3"])
    with pytest.raises(ValueError) as err:
        validate_parallel(arch, cfg, world)
    for text in expected:
        assert text in str(err.value)


def test_validate_parallel_vocab_and_ok_layouts():
    """A vocabulary tp does not divide is padded; fewer KV heads than TP ranks are served as Megatron-Core does
    (Qwen2.5-1.5B: 12 heads / 2 KV heads at TP4). Query heads must still divide over TP (Qwen2.5-7B's 28 heads
    do not at TP8, in Megatron-Core too)."""
    from megatron_dppo.megatron.model import padded_vocab_size

    arch = ModelArch.from_hf_config(dict(TINY_CONFIGS["llama"], vocab_size=250))
    assert validate_parallel(arch, ParallelConfig(tp=4), 4) == 1
    assert [padded_vocab_size(250, tp) for tp in (1, 2, 4, 8)] == [250, 250, 256, 256]
    assert [padded_vocab_size(257, tp) for tp in (1, 2, 4, 3)] == [257, 384, 384, 384]
    assert padded_vocab_size(151936, 8) == 151936  # Qwen2.5: divisible, unpadded
    arch = ModelArch.from_hf_config(TINY_CONFIGS["qwen3"])
    assert validate_parallel(arch, ParallelConfig(tp=2, pp=2, vpp=2, sp=True), 8) == 2  # dp = 8 / 4
    assert validate_parallel(arch, ParallelConfig(tp=4), 4) == 1  # 2 KV heads over 4 ranks
    qwen25_15b = ModelArch.from_hf_config(dict(QWEN25_05B, hidden_size=1536, num_attention_heads=12,
                                               num_key_value_heads=2, intermediate_size=8960))
    assert validate_parallel(qwen25_15b, ParallelConfig(tp=4), 4) == 1
    qwen25_7b = ModelArch.from_hf_config(dict(QWEN25_05B, hidden_size=3584, num_attention_heads=28,
                                              num_key_value_heads=4, intermediate_size=18944))
    with pytest.raises(ValueError, match="num_attention_heads=28 is not divisible by tp=8"):
        validate_parallel(qwen25_7b, ParallelConfig(tp=8), 8)
    assert validate_parallel(qwen25_7b, ParallelConfig(tp=4), 4) == 1
    six_heads = ModelArch.from_hf_config(dict(TINY_CONFIGS["qwen2"], num_attention_heads=6, num_key_value_heads=2,
                                              hidden_size=96))
    with pytest.raises(ValueError, match="tp=3 is not a multiple of num_kv_heads=2"):
        validate_parallel(six_heads, ParallelConfig(tp=3), 3)
    with pytest.raises(ValueError, match="num_kv_heads=3 .query groups. is not divisible by tp=2"):
        validate_parallel(ModelArch.from_hf_config(dict(TINY_CONFIGS["qwen2"], num_attention_heads=6,
                                                        num_key_value_heads=3, hidden_size=96)),
                          ParallelConfig(tp=2), 2)


def _bad_init_worker(cfg_kwargs):
    """Every rank of a 2-process job asks for tp=2 on a 3-head model: must raise before init_process_group."""
    import torch.distributed as dist

    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel

    arch = ModelArch(family="llama", vocab_size=256, hidden_size=48, ffn_hidden_size=96, num_layers=2,
                     num_attention_heads=3, num_kv_heads=3, head_dim=16, rope_theta=1e4, norm_eps=1e-5,
                     tie_embeddings=True, qkv_bias=False, qk_norm=False, max_position_embeddings=512)
    try:
        initialize_parallel(ParallelConfig(**cfg_kwargs), seed=0, arch=arch)
    except ValueError as err:
        return {"error": str(err), "pg": dist.is_initialized()}
    return {"error": None, "pg": dist.is_initialized()}


@pytest.mark.multiproc
def test_bad_sharding_fails_before_any_process_group():
    results = run_distributed(_bad_init_worker, world_size=2, args=(dict(tp=2),), timeout=120)
    for res in results:
        assert res["pg"] is False
        assert "num_attention_heads=3 is not divisible by tp=2" in res["error"]


# ------------------------------------------------------------------------------------------------------------
# Built models (one in-process world of size 1)
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=1234):
        yield


def _build(family, seed=0):
    from megatron_dppo.megatron.model import build_gpt_model
    from megatron_dppo.megatron.parallel import seed_everything

    seed_everything(seed)
    arch = ModelArch.from_hf_config(TINY_CONFIGS[family])
    model = build_gpt_model(arch, ParallelConfig())
    # Megatron zero-initializes biases and sets norm weights to 1; randomize them so a mistake would show.
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name:
                p.copy_(1.0 * (name.endswith("weight")) + 0.1 * torch.randn(p.shape, generator=g))
    return arch, model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_parameter_names_and_count(world, family):
    arch, model = _build(family)
    names = dict(model.named_parameters())
    assert sum(p.numel() for p in names.values()) == arch.num_parameters
    for expected in ("embedding.word_embeddings.weight", "decoder.layers.0.self_attention.linear_qkv.weight",
                     "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.input_layernorm.weight",
                     "decoder.layers.3.mlp.linear_fc1.weight", "decoder.layers.3.mlp.linear_fc2.weight",
                     "decoder.layers.3.pre_mlp_layernorm.weight", "decoder.final_layernorm.weight"):
        assert expected in names, expected
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    assert names["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (q + 2 * kv, arch.hidden_size)
    assert names["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * arch.ffn_hidden_size, arch.hidden_size)
    assert ("output_layer.weight" in names) == (not arch.tie_embeddings)
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in names) == arch.qkv_bias
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in names) == arch.qk_norm


def _separate_logits(model, batch):
    """Each real sequence of a THD batch run alone as a plain [1, s] batch; logits at its real positions."""
    out = []
    bounds, padded = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
    for i in range(len(bounds) - 1):
        n = bounds[i + 1] - bounds[i]
        tokens = batch.tokens[padded[i]:padded[i] + n]
        logits = model(tokens[None], torch.arange(n)[None], None)  # [1, n, V]
        out.append(logits[0])
    return out


def _real_positions(batch):
    return torch.cat([torch.arange(a, a + (e - s)) for a, s, e in zip(
        batch.cu_seqlens_padded[:-1].tolist(), batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_packed_thd_equals_sequences_alone(world, family, pad_multiple):
    """Logits, log-probs and parameter gradients of a packed batch equal those of its sequences run one by one."""
    from megatron_dppo.megatron.logprobs import forward_thd, vocab_parallel_logprobs

    _, model = _build(family)
    batch = packed_batches(pad_multiple=pad_multiple)[1]
    real = _real_positions(batch)
    weights = torch.randn(batch.tokens.numel(), generator=torch.Generator().manual_seed(3))

    model.zero_grad()
    logits = forward_thd(model, batch)
    logp, entropy = vocab_parallel_logprobs(logits, batch.labels)
    (logp * weights * batch.loss_mask).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    alone = torch.cat(_separate_logits(model, batch))
    labels, mask, w = batch.labels[real], batch.loss_mask[real], weights[real]
    logp_alone = torch.log_softmax(alone.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    (logp_alone * w * mask).sum().backward()

    torch.testing.assert_close(logits[real], alone, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logp[real], logp_alone, atol=2e-5, rtol=1e-5)
    probs = torch.softmax(alone.float(), dim=-1)
    torch.testing.assert_close(entropy[real], -(probs * probs.log()).sum(-1), atol=2e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)
    assert any(g.abs().sum() > 0 for g in packed_grads.values())


def test_packed_thd_detects_wrong_boundaries(world):
    """Control: the same packed tokens with one wrong boundary (two sequences merged) change the logits."""
    import dataclasses

    from megatron_dppo.megatron.logprobs import forward_thd

    _, model = _build("qwen3")
    batch = packed_batches()[0]
    merged = dataclasses.replace(batch, cu_seqlens=batch.cu_seqlens[[0, 2, 3]],
                                 cu_seqlens_padded=batch.cu_seqlens_padded[[0, 2, 3]],
                                 max_seqlen=int(batch.tokens.numel()))
    with torch.no_grad():
        a, b = forward_thd(model, batch), forward_thd(model, merged)
    second = slice(int(batch.cu_seqlens_padded[1]), int(batch.cu_seqlens_padded[2]))
    assert (a[second] - b[second]).abs().max() > 1e-3


def test_sbhd_batch_equals_sequences_alone(world):
    """A plain [b, s] batch (no packing) with a causal mask equals each row run alone."""
    _, model = _build("qwen3")
    tokens = torch.tensor(random_sequences([10, 10], seed=5))
    with torch.no_grad():
        both = model(tokens, torch.arange(10).expand(2, 10), None)
        alone = torch.stack([model(t[None], torch.arange(10)[None], None)[0] for t in tokens])
    torch.testing.assert_close(both, alone, atol=2e-5, rtol=1e-5)


def test_dummy_micro_batch_runs(world):
    """The packer's zero-token placeholder batch runs forward and backward (it must join every collective)."""
    from megatron_dppo.megatron.logprobs import thd_logprobs
    from megatron_dppo.packing import build_thd_batch

    _, model = _build("llama")
    dummy = build_thd_batch([], [], [], [], [], pad_multiple=2)
    logp, entropy = thd_logprobs(model, dummy)
    (logp * dummy.loss_mask).sum().backward()
    assert logp.shape == (2,) and torch.isfinite(logp).all() and torch.isfinite(entropy).all()


def test_sdpa_thd_equals_one_call_per_sequence(world):
    """The batched THD core (length buckets, one SDPA call each) == causal attention run on each segment alone,
    for outputs and input gradients: lengths 1..13 across several buckets, an empty segment, GQA (4 query /
    2 KV heads), positions after the last segment (zero output, zero gradient)."""
    import torch.nn.functional as F_
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dppo.megatron.attention import SDPACoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               kv_channels=8, attention_dropout=0.0)
    core = SDPACoreAttention(config, 1, AttnMaskType.causal, "self")
    bounds = [0, 1, 4, 4, 13, 15, 20]
    total = 23
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(total, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(total, 2, 8, generator=g, requires_grad=True)
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    out = core(q, k, v, None, packed_seq_params=params)
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))

    ref = torch.zeros(total, 4, 8)
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)))
            ref = ref.index_put((torch.arange(s, e),), F_.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
                                .transpose(0, 1))
    ref = ref.reshape(total, 32)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert out[20:].abs().sum() == 0 and grads[0][20:].abs().sum() == 0
