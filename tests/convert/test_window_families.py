"""Mistral / Ministral / Phi-3 (sliding-window attention; Phi-3's fused projections and partial rotary) against
transformers: packed (THD) logits and log-probs of sequences longer than the window equal transformers'
per-sequence ones; turning a feature off in the Megatron config (the window, Ministral's per-layer choice, Phi-3's
partial rotary) fails the same check (negative controls); these families reshard at TP2 / PP2 bit-exactly; refused
families are refused by name."""
from __future__ import annotations

import pytest
import torch
from _dist import single_process_world
from _hf_models import TINY, build_hf_model

from megatron_dppo.convert import load_hf_weights
from megatron_dppo.megatron.model import ModelArch, build_model_chunks
from megatron_dppo.megatron.parallel import ParallelConfig

WINDOW_MODELS = ("mistral_tied", "ministral_untied", "phi3_tied")
ATOL = 2e-5  # fp32
# packed sequences of different lengths, most longer than the windows (4 and 5), one shorter
LENGTHS = (11, 3, 13, 7)


def _packed(pad_multiple: int):
    from megatron_dppo.packing import build_thd_batch

    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 127, (n,), generator=g).tolist() for n in LENGTHS]
    n = len(seqs)
    return seqs, build_thd_batch(seqs, [2] * n, list(range(n)), [0.0] * n, [1.0] * n, pad_multiple=pad_multiple)


def _thd_vs_transformers(name: str, pad_multiple: int = 1, arch_changes=None,
                         **config_overrides) -> tuple[float, float]:
    """(max |logit diff|, max |log-prob diff|) of the Megatron model's packed forward vs transformers run on each
    sequence alone, with ``config_overrides`` applied to the Megatron TransformerConfig (``arch_changes`` to the
    ModelArch the model is built from)."""
    import dataclasses

    from megatron_dppo.megatron.logprobs import forward_thd, vocab_parallel_logprobs

    hf = build_hf_model(name)
    arch = dataclasses.replace(ModelArch.from_hf_config(TINY[name]), **(arch_changes or {}))
    seqs, batch = _packed(pad_multiple)
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0] for s in seqs]
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32, attention_backend="sdpa",
                                    **config_overrides)
        load_hf_weights(chunks, arch, hf.state_dict())
        with torch.no_grad():
            logits = forward_thd(chunks[0], batch)
            logp, _ = vocab_parallel_logprobs(logits, batch.labels)
    starts = batch.cu_seqlens_padded[:-1].tolist()
    got = torch.cat([logits[s:s + len(q)] for s, q in zip(starts, seqs)])
    want = torch.cat(expected)
    got_logp = torch.cat([logp[s:s + len(q) - 1] for s, q in zip(starts, seqs)])
    want_logp = torch.cat([torch.log_softmax(e[:-1], -1).gather(-1, torch.tensor(q[1:])[:, None])[:, 0]
                           for e, q in zip(expected, seqs)])
    return (got - want).abs().max().item(), (got_logp - want_logp).abs().max().item()


@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_packed_logits_and_logprobs_match_transformers(name, pad_multiple):
    assert max(LENGTHS) > TINY[name]["sliding_window"]
    logit_diff, logp_diff = _thd_vs_transformers(name, pad_multiple)
    assert logit_diff < ATOL and logp_diff < ATOL, (logit_diff, logp_diff)


@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_negative_control_window_off_fails(name):
    """The same check with the window removed from the Megatron config: the logits differ."""
    logit_diff, _ = _thd_vs_transformers(name, window_size=None, window_attn_skip_freq=None)
    assert logit_diff > 1e-3, logit_diff


def test_negative_control_window_on_every_layer_fails():
    """Ministral: the window on the full-attention layers too (Megatron's per-layer choice dropped) differs."""
    logit_diff, _ = _thd_vs_transformers("ministral_untied", window_attn_skip_freq=None)
    assert logit_diff > 1e-3, logit_diff


def test_negative_control_window_off_by_one_fails():
    """Megatron's window_size counts the keys besides the query: (W, 0) instead of (W - 1, 0) differs."""
    window = TINY["mistral_tied"]["sliding_window"]
    logit_diff, _ = _thd_vs_transformers("mistral_tied", window_size=(window, 0))
    assert logit_diff > 1e-3, logit_diff


def test_negative_control_full_rotary_fails():
    """Phi-3 with partial_rotary_factor 0.75: rotating every channel instead differs."""
    assert ModelArch.from_hf_config(TINY["phi3_tied"]).rotary_percent == 0.75
    logit_diff, _ = _thd_vs_transformers("phi3_tied", arch_changes={"rotary_percent": 1.0})
    assert logit_diff > 1e-3, logit_diff


def test_phi3_without_a_window_matches_and_lora_is_refused():
    from megatron_dppo.megatron.lora import LoraConfig, check_lora_supported

    logit_diff, logp_diff = _thd_vs_transformers("phi3_untied")
    assert logit_diff < ATOL and logp_diff < ATOL
    arch = ModelArch.from_hf_config(TINY["phi3_untied"])
    with pytest.raises(ValueError, match="family 'phi3' stores q/k/v and gate/up fused"):
        check_lora_supported(arch, ParallelConfig(), LoraConfig(target_modules=("qkv",)))


# ------------------------------------------------------------------------------------------------------------
# the architecture read from the config, and what is refused
# ------------------------------------------------------------------------------------------------------------
def test_arch_reads_the_window_and_the_layer_types():
    from megatron_dppo.megatron.dense_families import window_config_kwargs

    mistral = ModelArch.from_hf_config(TINY["mistral_tied"])
    assert (mistral.family, mistral.sliding_window, mistral.window_layers) == ("mistral", 4, None)
    assert window_config_kwargs(mistral.sliding_window, mistral.window_layers) == {"window_size": (3, 0)}
    ministral = ModelArch.from_hf_config(TINY["ministral_untied"])
    assert ministral.window_layers == (True, False, True, False) and ministral.head_dim == 24
    assert window_config_kwargs(ministral.sliding_window, ministral.window_layers)["window_attn_skip_freq"] == [
        1, 0, 1, 0]
    no_window = ModelArch.from_hf_config(dict(TINY["mistral_tied"], sliding_window=None))
    assert no_window.sliding_window is None and no_window.family == "mistral"


@pytest.mark.parametrize("model_type, words", [("gpt_oss", "attention sinks"), ("gemma3_text", "RoPE base"),
                                                ("gemma3", "RoPE base"), ("gemma2", "soft-capping")])
def test_refused_families_are_named(model_type, words):
    with pytest.raises(ValueError, match=f"model_type='{model_type}' is refused: .*{words}"):
        ModelArch.from_hf_config({"model_type": model_type})


def test_context_parallel_with_a_window_is_refused():
    from megatron_dppo.megatron.model import build_transformer_config

    arch = ModelArch.from_hf_config(TINY["mistral_tied"])
    with pytest.raises(ValueError, match=r"sliding_window=4 \(mistral\) with cp=2"):
        build_transformer_config(arch, ParallelConfig(cp=2), torch.float32, attention_backend="sdpa")


def test_varlen_kernel_gets_the_window():
    """The varlen (FlashAttention) path passes window_size=(W - 1, 0); a kernel without window_size refuses."""
    from megatron_dppo.megatron.attention import varlen_attention

    seen = {}

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        seen["window_size"] = window_size
        return q

    q = torch.zeros(6, 2, 8)
    varlen_attention(q, q, q, torch.tensor([0, 6], dtype=torch.int32), 6, causal=True, scale=0.3, kernel=kernel,
                     window_left=3)
    assert seen["window_size"] == (3, 0)

    def old_kernel(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
        return q

    with pytest.raises(ValueError, match="sliding window"):
        varlen_attention(q, q, q, torch.tensor([0, 6], dtype=torch.int32), 6, causal=True, scale=0.3,
                         kernel=old_kernel, window_left=3)


# ------------------------------------------------------------------------------------------------------------
# TP2 / PP2: logits, the gathered export, and the checkpoint resharded back to HF, bit-exact
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # ~75 s each on the shared 2-core box
@pytest.mark.multiproc
@pytest.mark.parametrize("name, tp, pp", [("mistral_tied", 2, 1), ("ministral_untied", 1, 2), ("phi3_tied", 2, 1),
                                          ("phi3_untied", 1, 2)])
def test_window_families_tp2_pp2_round_trip(name, tp, pp, tmp_path):
    from test_convert_dist import _check

    _check(name, tmp_path, tp=tp, pp=pp, save=True)
