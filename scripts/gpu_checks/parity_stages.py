"""Stages 4 and 5b: Megatron against transformers. Random llama / qwen2 / qwen3 models: THD logits per sequence and
the export round trip (bit-exact), every tensor on the device in the run's dtype. A tiny Qwen3-MoE: fp32 logits,
then a small MoE engine's forward + backward + update in the training dtype."""
from __future__ import annotations

import math
import time

from .harness import Check, require, sync
from .shapes import build_engine, master_weights, per_expert_hf_tensors, random_micro_batches

HF_FAMILIES = {
    "llama": dict(model_type="llama", tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False, rope_theta=1e6),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=48, rope_theta=1e6),
}


def stage_hf_parity(c: Check) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_dppo.convert import export_hf_weights
    from megatron_dppo.convert.weights import load_hf_weights
    from megatron_dppo.megatron.logprobs import forward_thd
    from megatron_dppo.megatron.model import ModelArch, build_gpt_model, device_dtype_audit
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.packing import build_thd_batch

    c.need_parallel()
    common = dict(vocab_size=512, hidden_size=128 if c.cpu_smoke else 512, intermediate_size=256 if c.cpu_smoke
                  else 1024, num_hidden_layers=2, num_attention_heads=4 if c.cpu_smoke else 8,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6)
    lengths = [5, 17, 40] if c.cpu_smoke else [37, 300, 129, 512]
    figures: dict = {}
    for family, extra in HF_FAMILIES.items():
        cfg = AutoConfig.for_model(**common, **extra)
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(c.device).eval()
        with torch.no_grad():  # non-trivial norms and biases, so a mis-laid tensor shows
            for name, p in hf.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
        arch = ModelArch.from_hf_config(cfg)
        model = build_gpt_model(arch, ParallelConfig(), c.dtype).eval()  # auto backend, placed by the builder
        figures["attention_backend"] = model.attention_backend
        misplaced = device_dtype_audit(model, c.device, c.dtype)
        require(not misplaced, f"{family}: tensors not on {c.device} in {c.dtype}: {misplaced[:5]}")
        load_hf_weights([model], arch, {k: v.detach() for k, v in hf.state_dict().items()})
        g = torch.Generator().manual_seed(1)
        seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
        batch = build_thd_batch(seqs, [1] * len(seqs), list(range(len(seqs))), [0.0] * len(seqs),
                                [1.0] * len(seqs), pad_multiple=8).to(c.device)
        worst, baseline = 0.0, 0.0
        hf_low = None
        if c.dtype != torch.float32:
            hf_low = AutoModelForCausalLM.from_config(cfg, dtype=c.dtype).to(c.device).eval()
            hf_low.load_state_dict(hf.state_dict())
        with torch.no_grad():
            logits = forward_thd(model, batch).float()
            bounds = batch.cu_seqlens_padded.tolist()
            for i, seq in enumerate(seqs):
                ids = torch.tensor([seq], device=c.device)
                ref = hf(ids).logits[0].float()
                mine = logits[bounds[i]:bounds[i] + len(seq)]
                worst = max(worst, (mine - ref).abs().max().item())
                if hf_low is not None:
                    baseline = max(baseline, (hf_low(ids).logits[0].float() - ref).abs().max().item())
        limit = 1e-3 if c.dtype == torch.float32 else 3 * baseline + 2e-2
        figures[f"{family}_logits_max_diff"] = worst
        figures[f"{family}_hf_{str(c.dtype).replace('torch.', '')}_max_diff"] = baseline
        require(worst <= limit, f"{family}: Megatron THD logits vs transformers max |diff| {worst:.3e} > {limit:.3e}")
        # export round trip: the HF weights come back exactly (in the model's dtype)
        exported = dict(export_hf_weights([model], arch))
        expected = {k: v.detach().to(c.dtype) for k, v in hf.state_dict().items()
                    if not (arch.tie_embeddings and k == "lm_head.weight")}
        missing = sorted(set(expected) - set(exported))
        require(not missing, f"{family}: export lacks {missing[:3]}")
        bad = [k for k in expected if not torch.equal(exported[k].to(c.device), expected[k])]
        require(not bad, f"{family}: export round trip differs for {bad[:3]}")
        figures[f"{family}_export_tensors"] = len(expected)
        del model, hf, hf_low
    return figures


def stage_moe(c: Check) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_dppo.convert.weights import load_hf_weights
    from megatron_dppo.megatron.logprobs import forward_thd
    from megatron_dppo.megatron.model import ModelArch, build_gpt_model
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.packing import build_thd_batch

    c.need_parallel()
    small = c.cpu_smoke
    cfg = AutoConfig.for_model(
        model_type="qwen3_moe", vocab_size=512, hidden_size=64 if small else 512, intermediate_size=96 if small
        else 1024, moe_intermediate_size=32 if small else 256, num_experts=4 if small else 16,
        num_experts_per_tok=2 if small else 4, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=2 if
        small else 4, num_attention_heads=4 if small else 8, num_key_value_heads=2, head_dim=16 if small else 64,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e6)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(c.device).eval()
    arch = ModelArch.from_hf_config(cfg)
    figures: dict = {"experts": arch.moe.num_experts, "topk": arch.moe.topk}
    # parity in fp32 (routing is discrete: bf16 logits may pick other experts for near-ties); the auto backend
    # for an fp32 model is TE or the SDPA twin, never varlen (FlashAttention takes half precision only)
    model = build_gpt_model(arch, ParallelConfig(), torch.float32).eval()
    figures["attention_backend_fp32"] = model.attention_backend
    figures["grouped_gemm"] = bool(model.config.moe_grouped_gemm)
    with torch.no_grad():
        hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
    load_hf_weights([model], arch, per_expert_hf_tensors(hf_state))
    g = torch.Generator().manual_seed(1)
    lengths = [5, 17, 40] if small else [37, 300, 129]
    seqs = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    batch = build_thd_batch(seqs, [1] * len(seqs), list(range(len(seqs))), [0.0] * len(seqs), [1.0] * len(seqs),
                            pad_multiple=8).to(c.device)
    worst = 0.0
    with torch.no_grad():
        logits = forward_thd(model, batch).float()
        bounds = batch.cu_seqlens_padded.tolist()
        for i, seq in enumerate(seqs):
            ref = hf(torch.tensor([seq], device=c.device)).logits[0].float()
            worst = max(worst, (logits[bounds[i]:bounds[i] + len(seq)] - ref).abs().max().item())
    figures["logits_max_diff_fp32"] = worst
    require(worst <= 1e-3, f"MoE: Megatron THD logits vs transformers max |diff| {worst:.3e} > 1e-3")
    del model, hf
    # forward + backward + update in the training dtype
    engine = build_engine(c, arch, seed=5)
    figures["attention_backend"] = engine.modules[0].attention_backend
    masters = master_weights(engine)
    sample = [p.detach().clone() for p in masters[:8]]
    batches, lengths = random_micro_batches(arch, 2, 256 if small else 8192, 16, 128 if small else 1024, seed=6)
    engine.fill_logprobs(batches, old=True)
    sync()
    t0 = time.perf_counter()
    metrics = engine.train_step(batches, float(len(lengths)))
    sync()
    step_s = time.perf_counter() - t0
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(sample, masters[:8]))
    figures.update(params=arch.num_parameters, active_params=arch.num_active_parameters, dtype=str(c.dtype),
                   train_step_s=step_s, train_tokens_per_s=sum(lengths) / step_s, loss=metrics["loss"],
                   grad_norm=metrics["grad_norm"], master_weights_changed=changed)
    require(math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]), f"non-finite: {metrics}")
    require(changed, "the MoE engine's fp32 master weights did not change after the update")
    return figures
