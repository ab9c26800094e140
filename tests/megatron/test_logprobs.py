"""Vocab-parallel log-probs/entropy == full-vocabulary softmax (also at a sampling temperature T != 1: of
softmax(logits / T)), and equal across TP / SP / PP / VPP layouts."""
from __future__ import annotations

import pytest
import torch
from _dist import run_distributed, single_process_world
from _tiny import TINY_CONFIGS, packed_batches


def _reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _random_problem(seed=0, shape=(3, 7), vocab=256):
    g = torch.Generator().manual_seed(seed)
    logits = 4.0 * torch.randn(*shape, vocab, generator=g)
    labels = torch.randint(0, vocab, shape, generator=g)
    w_logp = torch.randn(*shape, generator=g)
    w_ent = torch.randn(*shape, generator=g)
    return logits, labels, w_logp, w_ent


@pytest.fixture(scope="module")
def world():
    with single_process_world():
        yield


def test_logprobs_equal_log_softmax_gather(world):
    from megatron_dppo.megatron.logprobs import vocab_parallel_logprobs

    logits, labels, w_logp, w_ent = _random_problem()
    x = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(x, labels, entropy_grad=True)
    ref_x = logits.double().requires_grad_(True)
    ref_logp, ref_entropy = _reference(ref_x, labels)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=1e-5)
    # gradients of log-probs (Megatron's backward) and of the entropy (autograd through the shard)
    ((logp * w_logp).sum() + (entropy * w_ent).sum()).backward()
    ((ref_logp * w_logp).sum() + (ref_entropy * w_ent).sum()).backward()
    torch.testing.assert_close(x.grad.double(), ref_x.grad, atol=1e-5, rtol=1e-4)
    # the caller's logits are untouched (Megatron's kernel works in place on its own fp32 copy)
    assert torch.equal(x.detach(), logits)


def test_entropy_is_a_metric_by_default(world):
    from megatron_dppo.megatron.logprobs import vocab_parallel_logprobs

    logits, labels, _, _ = _random_problem(seed=1)
    logp, entropy = vocab_parallel_logprobs(logits.clone().requires_grad_(True), labels)
    assert logp.requires_grad and not entropy.requires_grad
    assert vocab_parallel_logprobs(logits, labels, with_entropy=False)[1] is None
    bf16 = vocab_parallel_logprobs(logits.bfloat16(), labels)[0]
    assert bf16.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_unchunked_values_and_grads(world, dtype):
    """Chunks of 1, 4 (uneven: 21 = 5*4 + 1) and automatic give the unchunked (Megatron) values and gradients."""
    from megatron_dppo.megatron.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs

    logits, labels, w_logp, _ = _random_problem(seed=4)
    logits = logits.to(dtype)
    x0 = logits.clone().requires_grad_(True)
    ref_logp, ref_entropy = vocab_parallel_logprobs(x0, labels, chunk_tokens=0)
    (ref_logp * w_logp).sum().backward()
    for chunk in (1, 4, None):
        x = logits.clone().requires_grad_(True)
        logp, entropy = vocab_parallel_logprobs(x, labels, chunk_tokens=chunk)
        (logp * w_logp).sum().backward()
        torch.testing.assert_close(logp, ref_logp, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-6, rtol=1e-6)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(x.grad.float(), x0.grad.float(), atol=tol, rtol=tol)
        assert x.grad.dtype == dtype and torch.equal(x.detach(), logits)  # caller's logits untouched
        assert not entropy.requires_grad
    # the entropy under no_grad by default, with autograd only when asked
    assert not vocab_parallel_entropy(logits.clone().requires_grad_(True), chunk_tokens=2).requires_grad
    assert vocab_parallel_entropy(logits.float().requires_grad_(True), grad=True).requires_grad
    with pytest.raises(ValueError, match="chunk_tokens=-1"):
        vocab_parallel_logprobs(logits, labels, chunk_tokens=-1)


TEMPERATURE = 0.7


@pytest.mark.parametrize("chunk", [0, 1, 4, None])
def test_tempered_logprobs_entropy_and_grads_equal_log_softmax_of_logits_over_t(world, chunk):
    """temperature=T: log p, entropy and d(log p)/d logits are those of log_softmax(logits / T) (the 1/T factor in
    the gradient included), unchunked (Megatron's kernel on z / T) and chunked alike; they differ from T = 1's."""
    from megatron_dppo.megatron.logprobs import vocab_parallel_logprobs

    logits, labels, w_logp, w_ent = _random_problem(seed=5)
    x = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(x, labels, chunk_tokens=chunk, temperature=TEMPERATURE,
                                            entropy_grad=chunk == 0)
    loss = (logp * w_logp).sum() + ((entropy * w_ent).sum() if chunk == 0 else 0.0)
    loss.backward()
    ref_x = logits.double().requires_grad_(True)
    ref_logp, ref_entropy = _reference(ref_x, labels, TEMPERATURE)
    ((ref_logp * w_logp).sum() + ((ref_entropy * w_ent).sum() if chunk == 0 else 0.0)).backward()
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, atol=1e-5, rtol=1e-4)
    assert torch.equal(x.detach(), logits)  # the division is on a copy
    untempered = vocab_parallel_logprobs(logits, labels, chunk_tokens=chunk)  # the negative: T = 1 differs
    assert (untempered[0] - logp).abs().max() > 0.1 and (untempered[1] - entropy).abs().max() > 0.1


def test_temperature_keeps_masked_vocabulary_padding_at_zero_probability(world):
    """Padding rows of the vocabulary (mask_vocab_padding: dtype min / 2) stay finite and at probability 0 after
    the division, even where min / 2 / T overflows (T < 0.5): entropy and gradients have no NaN."""
    from megatron_dppo.megatron.logprobs import vocab_parallel_logprobs

    logits, labels, w_logp, _ = _random_problem(seed=6, vocab=64)
    padded = torch.cat([logits, torch.full((*logits.shape[:-1], 8), torch.finfo(torch.float32).min / 2)], -1)
    for chunk in (0, None):
        x = padded.clone().requires_grad_(True)
        logp, entropy = vocab_parallel_logprobs(x, labels, chunk_tokens=chunk, temperature=0.3)
        (logp * w_logp).sum().backward()
        ref_logp, ref_entropy = _reference(logits, labels, 0.3)
        torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(x.grad).all() and float(x.grad[..., 64:].abs().max()) == 0.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True])
def test_temperature_must_be_a_positive_finite_number(world, bad):
    from megatron_dppo.megatron.logprobs import vocab_parallel_logprobs

    logits, labels, _, _ = _random_problem()
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, labels, temperature=bad)


def _tp2_worker(seed, temperature=1.0):
    """Each rank holds one half of the vocabulary of the same logits."""
    from megatron.core import parallel_state

    from megatron_dppo.megatron.logprobs import vocab_parallel_logprobs
    from megatron_dppo.megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(tp=2), seed=0)
    rank = parallel_state.get_tensor_model_parallel_rank()
    logits, labels, w_logp, w_ent = _random_problem(seed)
    shard = logits.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(shard, labels, entropy_grad=True, temperature=temperature)
    ((logp * w_logp).sum() + (entropy * w_ent).sum()).backward()
    chunked_shard = shard.detach().clone().requires_grad_(True)  # chunks of 2 tokens: labels on either rank
    chunked_logp, chunked_entropy = vocab_parallel_logprobs(chunked_shard, labels, chunk_tokens=2,
                                                            temperature=temperature)
    (chunked_logp * w_logp).sum().backward()
    destroy_parallel()
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad": shard.grad,
            "chunked_logp": chunked_logp.detach(), "chunked_entropy": chunked_entropy,
            "chunked_logp_grad": chunked_shard.grad}


@pytest.mark.multiproc
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_tp2_vocab_parallel_equals_full_vocabulary(temperature):
    """TP2 shards == the full vocabulary, at T = 1 and at a sampling temperature (each rank divides its own shard
    before the parallel max / sums: exact, the gradient's 1/T included)."""
    results = run_distributed(_tp2_worker, world_size=2, args=(2, temperature), timeout=180)
    logits, labels, w_logp, w_ent = _random_problem(2)
    ref_x = logits.double().requires_grad_(True)
    ref_logp, ref_entropy = _reference(ref_x, labels, temperature)
    ((ref_logp * w_logp).sum() + (ref_entropy * w_ent).sum()).backward()
    for res in results:  # both TP ranks hold the full (replicated) values
        torch.testing.assert_close(res["logp"].double(), ref_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["entropy"].double(), ref_entropy, atol=1e-5, rtol=1e-5)
    grad = torch.cat([results[0]["grad"], results[1]["grad"]], dim=-1)
    torch.testing.assert_close(grad.double(), ref_x.grad, atol=1e-5, rtol=1e-4)
    # chunked log-probs under TP: same values; the log-prob gradient alone against the reference's
    ref_x2 = logits.double().requires_grad_(True)
    (_reference(ref_x2, labels, temperature)[0] * w_logp).sum().backward()
    chunked_grad = torch.cat([results[0]["chunked_logp_grad"], results[1]["chunked_logp_grad"]], dim=-1)
    torch.testing.assert_close(chunked_grad.double(), ref_x2.grad, atol=1e-5, rtol=1e-4)
    for res in results:
        torch.testing.assert_close(res["chunked_logp"].double(), ref_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res["chunked_entropy"].double(), ref_entropy, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# The same weights give the same log-probs under every parallel layout
# ------------------------------------------------------------------------------------------------------------
LAYOUTS_2PROC = {"tp2_sp": dict(tp=2, sp=True), "tp2": dict(tp=2), "pp2": dict(pp=2),
                 "pp2_vpp2": dict(pp=2, vpp=2)}
LAYOUTS_4PROC = {"tp2_pp2": dict(tp=2, pp=2), "tp2_sp_pp2": dict(tp=2, sp=True, pp=2)}


def _layouts_worker(ckpt_root: str, families: list[str], layouts: dict[str, dict]):
    """For each family: build the TP1/PP1 model (seeded), save it with dist_checkpointing and compute reference
    log-probs; then, for each layout, rebuild the parallel state, load the checkpoint resharded, and recompute.
    A freshly initialized (not loaded) model is the control that shows the comparison can fail."""
    import os

    from megatron.core import dist_checkpointing

    from megatron_dppo.megatron.logprobs import compute_logprobs
    from megatron_dppo.megatron.model import ModelArch, build_model_chunks
    from megatron_dppo.megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    batches = packed_batches(pad_multiple=2)  # pad multiple tp=2 serves sequence parallel; same layout for all
    out: dict = {}
    for family in families:
        arch = ModelArch.from_hf_config(TINY_CONFIGS[family])
        ckpt = os.path.join(ckpt_root, family)
        runs = [("reference", {})] + [("control", dict(tp=2))] + list(layouts.items())
        for name, layout in runs:
            cfg = ParallelConfig(**layout)
            initialize_parallel(cfg, seed=11 if name != "control" else 99, arch=arch)
            chunks = build_model_chunks(arch, cfg)
            sharded = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
            if name == "reference":
                if torch.distributed.get_rank() == 0:
                    os.makedirs(ckpt, exist_ok=True)
                torch.distributed.barrier()
                dist_checkpointing.save(sharded, ckpt)
            elif name != "control":
                state = dist_checkpointing.load(sharded, ckpt)
                for i, chunk in enumerate(chunks):
                    chunk.load_state_dict(state[f"model{i}"])
            out[(family, name)] = compute_logprobs(chunks, batches, with_entropy=True)
    destroy_parallel()
    return {"results": out, "real": [b.seq_index >= 0 for b in batches]}


def _check_layouts(results, families, layouts):
    for rank_result in results:
        res, real = rank_result["results"], rank_result["real"]
        for family in families:
            ref = res[(family, "reference")]
            for name in layouts:
                for mb, ((logp, ent), (ref_logp, ref_ent)) in enumerate(zip(res[(family, name)], ref)):
                    torch.testing.assert_close(logp[real[mb]], ref_logp[real[mb]], atol=2e-5, rtol=1e-5,
                                               msg=f"{family} {name} micro-batch {mb} log-probs")
                    torch.testing.assert_close(ent[real[mb]], ref_ent[real[mb]], atol=2e-5, rtol=1e-5,
                                               msg=f"{family} {name} micro-batch {mb} entropy")
            control = res[(family, "control")][0][0]
            assert (control - ref[0][0]).abs().max() > 1e-2, "control model should differ"


@pytest.mark.multiproc
def test_logprobs_equal_across_tp_sp_pp_vpp(tmp_path):
    """TP1 reference == TP2, TP2+SP, PP2, PP2 x VPP2 (2 processes; weights resharded by dist_checkpointing)."""
    families = ["qwen3"]
    results = run_distributed(_layouts_worker, world_size=2, args=(str(tmp_path), families, LAYOUTS_2PROC),
                              timeout=300)
    _check_layouts(results, families, LAYOUTS_2PROC)


@pytest.mark.multiproc
@pytest.mark.slow
def test_logprobs_equal_across_layouts_all_families(tmp_path):
    """Tied embeddings (llama/SmolLM2) and QKV bias (qwen2) under every 2-process layout."""
    families = ["llama", "qwen2"]
    results = run_distributed(_layouts_worker, world_size=2, args=(str(tmp_path), families, LAYOUTS_2PROC),
                              timeout=300)
    _check_layouts(results, families, LAYOUTS_2PROC)


@pytest.mark.multiproc
@pytest.mark.slow
def test_logprobs_equal_at_tp2_x_pp2(tmp_path):
    """TP1 reference == TP2 x PP2 (with and without SP) on 4 processes."""
    families = ["qwen3", "llama"]
    results = run_distributed(_layouts_worker, world_size=4, args=(str(tmp_path), families, LAYOUTS_4PROC),
                              timeout=600)
    _check_layouts(results, families, LAYOUTS_4PROC)
