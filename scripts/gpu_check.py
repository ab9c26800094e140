"""One short GPU check of the Megatron engine on a single GPU (written for one H200). Prints its figures.

    bash scripts/gpu_check.sh            # or: python scripts/gpu_check.py [--quick] [--json out.json]

1. THD attention: Transformer Engine's fused attention (TE layer spec) vs our SDPA twin (local spec +
   ``attention.SDPACoreAttention``) with the SAME weights on the SAME packed batch, bf16: max / mean abs
   difference of the logits and of the completion log-probs (skipped, with the reason, when TE is missing).
2. Train step of a ~1.1B Llama-like model (TinyLlama shape, random init, no downloads), bf16 params with fp32
   main params / Adam, packed THD micro-batches through ``PolicyEngine``: old-policy log-probs (forward only)
   and a GRPO train step; tokens/s and MFU (model FLOPs incl. causal attention / peak bf16 dense FLOP/s).

CI never runs this (no GPU there); it must import on CPU (``--help`` works without CUDA).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

H200_BF16_DENSE_PEAK = 989e12  # FLOP/s, NVIDIA spec (H100/H200 SXM, dense)


def log(msg: str) -> None:
    print(msg, flush=True)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tiny_arch():
    """--cpu-smoke: exercises this script's code paths on a CPU (fp32, seconds)."""
    from megatron_dppo.megatron.model import ModelArch

    return ModelArch(family="llama", vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                     num_attention_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, norm_eps=1e-5,
                     tie_embeddings=False, qkv_bias=False, qk_norm=False, max_position_embeddings=4096)


# ----------------------------------------------------------------------------------------------------------
def llama_1b():
    from megatron_dppo.megatron.model import ModelArch

    # TinyLlama-1.1B shape, vocab rounded to a multiple of 128
    return ModelArch(family="llama", vocab_size=32000, hidden_size=2048, ffn_hidden_size=5632, num_layers=22,
                     num_attention_heads=32, num_kv_heads=4, head_dim=64, rope_theta=10000.0, norm_eps=1e-5,
                     tie_embeddings=False, qkv_bias=False, qk_norm=False, max_position_embeddings=4096)


def small_arch():
    from megatron_dppo.megatron.model import ModelArch

    return ModelArch(family="qwen3", vocab_size=8192, hidden_size=512, ffn_hidden_size=1536, num_layers=4,
                     num_attention_heads=8, num_kv_heads=4, head_dim=64, rope_theta=1e6, norm_eps=1e-6,
                     tie_embeddings=True, qkv_bias=False, qk_norm=True, max_position_embeddings=4096)


def training_flops_per_step(arch, seq_lengths) -> float:
    """Model FLOPs of one forward+backward: 6 * (matmul params) per token + causal attention
    (QK^T and AV: 2 * 2 * s^2/2 * heads*head_dim per layer forward, x3 for forward+backward)."""
    h, f, L = arch.hidden_size, arch.ffn_hidden_size, arch.num_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    matmul_params = L * (h * (q + 2 * kv) + q * h + 3 * h * f) + arch.vocab_size * h  # + output layer
    tokens = sum(seq_lengths)
    attention = sum(3 * 2 * L * q * s * s for s in seq_lengths)  # 3 x (2 matmuls x 2 FLOP x s^2/2 x q)
    return 6.0 * matmul_params * tokens + attention


def random_packed_batches(arch, n_micro: int, capacity: int, min_len: int, max_len: int, seed: int):
    import torch

    from megatron_dppo.packing import build_rank_micro_batches, pack_sequences

    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < n_micro * capacity * 0.97:
        lengths.append(int(torch.randint(min_len, max_len + 1, (1,), generator=g)))
    tokens = [torch.randint(1, arch.vocab_size, (n,), generator=g).tolist() for n in lengths]
    prompt = [max(1, n // 4) for n in lengths]
    adv = torch.randn(len(lengths), generator=g)
    weight = torch.full((len(lengths),), 1.0 / 64)
    plan = pack_sequences(lengths, capacity, 1)
    return build_rank_micro_batches(plan[0], tokens, prompt, adv, weight), lengths


# ----------------------------------------------------------------------------------------------------------
def check_thd_attention(report: dict) -> None:
    import torch

    from megatron_dppo.megatron import compat
    from megatron_dppo.megatron.logprobs import forward_thd, vocab_parallel_logprobs
    from megatron_dppo.megatron.model import build_gpt_model
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    if not compat.have_transformer_engine():
        report["thd_attention"] = {"skipped": "transformer_engine not importable"}
        log("[1] TE THD attention vs SDPA: SKIPPED (transformer_engine not importable)")
        return
    arch = small_arch()
    seed_everything(1)
    sdpa = build_gpt_model(arch, ParallelConfig(), torch.bfloat16, te=False).cuda().eval()
    te = build_gpt_model(arch, ParallelConfig(), torch.bfloat16, te=True).cuda().eval()
    rename = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    te_params = dict(te.named_parameters())
    copied = set()
    with torch.no_grad():
        for name, p in sdpa.named_parameters():
            target = name
            for old, new in rename.items():
                if name.endswith(old):
                    target = name[: -len(old)] + new
            te_params[target].copy_(p)
            copied.add(target)
    missing = sorted(set(te_params) - copied)
    if missing:
        raise RuntimeError(f"TE parameters without a local-spec counterpart: {missing[:5]}")
    batches, lengths = random_packed_batches(arch, 2, 4096, 64, 1024, seed=2)
    worst = {"logits_max": 0.0, "logits_mean": 0.0, "logp_max": 0.0, "logp_mean": 0.0}
    with torch.no_grad():
        for b in batches:
            b = b.to("cuda")
            z_sdpa, z_te = forward_thd(sdpa, b).float(), forward_thd(te, b).float()
            mask = b.loss_mask > 0
            lp_sdpa, _ = vocab_parallel_logprobs(z_sdpa, b.labels, with_entropy=False)
            lp_te, _ = vocab_parallel_logprobs(z_te, b.labels, with_entropy=False)
            real = b.seq_index >= 0
            dz = (z_sdpa - z_te)[real].abs()
            dl = (lp_sdpa - lp_te)[mask].abs()
            worst["logits_max"] = max(worst["logits_max"], dz.max().item())
            worst["logits_mean"] = max(worst["logits_mean"], dz.mean().item())
            worst["logp_max"] = max(worst["logp_max"], dl.max().item())
            worst["logp_mean"] = max(worst["logp_mean"], dl.mean().item())
    worst.update(sequences=len(lengths), tokens=sum(lengths), dtype="bf16", arch="qwen3-small (h512, 4 layers)")
    report["thd_attention"] = worst
    log(f"[1] TE THD fused attention vs SDPA twin, bf16, {len(lengths)} packed sequences / {sum(lengths)} tokens:")
    log(f"    logits   max |diff| {worst['logits_max']:.3e}   mean |diff| {worst['logits_mean']:.3e}")
    log(f"    log-prob max |diff| {worst['logp_max']:.3e}   mean |diff| {worst['logp_mean']:.3e}")


def check_train_step(report: dict, quick: bool, cpu_smoke: bool = False) -> None:
    import torch

    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.model import use_transformer_engine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything
    from megatron_dppo.megatron.train_step import OptimConfig, PolicyEngine

    arch = tiny_arch() if cpu_smoke else small_arch() if quick else llama_1b()
    quick = quick or cpu_smoke
    seed_everything(3)
    t0 = time.perf_counter()
    engine = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=1e-6, clip_grad=1.0),
                          LossConfig(kl_coef=0.0), dtype=torch.float32 if cpu_smoke else torch.bfloat16)
    sync()
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for m in engine.modules for p in m.parameters())
    capacity = 512 if cpu_smoke else 4096 if quick else 16384
    n_micro = 2 if quick else 4
    batches, lengths = random_packed_batches(arch, n_micro, capacity, 32 if cpu_smoke else 128,
                                             256 if cpu_smoke else 2048, seed=4)
    denominator = float(len(lengths))

    def one_step():
        sync()
        a = time.perf_counter()
        engine.fill_logprobs(batches, old=True)
        sync()
        b = time.perf_counter()
        metrics = engine.train_step(batches, denominator)
        sync()
        return b - a, time.perf_counter() - b, metrics

    one_step()  # warm-up (allocator, kernels)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    steps = 2 if quick else 3
    times = [one_step() for _ in range(steps)]
    fwd_s = sum(t[0] for t in times) / steps
    train_s = sum(t[1] for t in times) / steps
    metrics = times[-1][2]
    tokens = sum(lengths)
    flops = training_flops_per_step(arch, lengths)
    fwd_flops = flops / 3.0
    result = {
        "arch": "tiny (cpu smoke)" if cpu_smoke else "qwen3-small" if quick else "llama-1.1b (TinyLlama shape)",
        "params": n_params, "attention": "TE fused" if use_transformer_engine() else "SDPA twin",
        "micro_batches": len(batches), "sequences": len(lengths), "tokens_per_step": tokens,
        "build_s": build_s, "logprob_s": fwd_s, "train_step_s": train_s,
        "train_tokens_per_s": tokens / train_s, "logprob_tokens_per_s": tokens / fwd_s,
        "train_tflops": flops / train_s / 1e12, "train_mfu": flops / train_s / H200_BF16_DENSE_PEAK,
        "logprob_mfu": fwd_flops / fwd_s / H200_BF16_DENSE_PEAK,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
    }
    report["train_step"] = result
    log(f"[2] {result['arch']}: {n_params / 1e9:.2f}B params, {result['attention']} attention, "
        f"{len(batches)} micro-batches x {capacity} tokens, {len(lengths)} sequences, {tokens} tokens/step")
    log(f"    train step   {train_s:.3f} s  {tokens / train_s:,.0f} tokens/s  {result['train_tflops']:.0f} TFLOP/s  "
        f"MFU {100 * result['train_mfu']:.1f}% (of {H200_BF16_DENSE_PEAK / 1e12:.0f} TFLOP/s bf16 dense)")
    log(f"    log-probs    {fwd_s:.3f} s  {tokens / fwd_s:,.0f} tokens/s  MFU {100 * result['logprob_mfu']:.1f}%")
    log(f"    peak memory  {result['peak_mem_gib']:.1f} GiB; loss {metrics['loss']:.4g}, grad norm "
        f"{metrics['grad_norm']:.4g}; engine build {build_s:.1f} s")
    if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
        raise RuntimeError(f"non-finite loss / grad norm: {metrics}")


# ----------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model for the train step (smoke test)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 run on CPU (tests this script)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        log("gpu_check: no CUDA device visible; nothing to check")
        return 2
    from megatron_dppo.megatron import compat
    from megatron_dppo.megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    extras = compat.detect_gpu_extras()
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__,
              "megatron_core": ".".join(map(str, compat.mcore_version())),
              "transformer_engine": extras.transformer_engine, "apex": extras.apex}
    log(f"gpu_check: {report['device']}, torch {report['torch']}, megatron-core {report['megatron_core']}, "
        f"TE {extras.transformer_engine or 'not found'}, apex {extras.apex or 'not found'}")
    initialize_parallel(ParallelConfig(), seed=1234)
    status = 0
    checks = [] if args.skip_attention else [("thd_attention", lambda: check_thd_attention(report))]
    checks.append(("train_step", lambda: check_train_step(report, args.quick, args.cpu_smoke)))
    for name, fn in checks:
        t = time.perf_counter()
        try:
            fn()
        except Exception as err:  # report and go on with the next check
            import traceback

            traceback.print_exc()
            report[name] = {"error": f"{type(err).__name__}: {err}"}
            status = 1
        log(f"    ({name}: {time.perf_counter() - t:.1f} s)")
    destroy_parallel()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    log("gpu_check: " + ("OK" if status == 0 else "FAILED (see above)"))
    return status


if __name__ == "__main__":
    sys.exit(main())
