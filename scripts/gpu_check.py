"""Staged device check of the GPU path (written for the lent H200; <= 6 minutes). Every stage is guarded: a
failing or skipped stage is recorded and the next one runs. After every stage the JSON report is rewritten to
``<out>/gpu_check.json`` (``--out``, default ``$OUT``, else ``gpu_check_out/``), so a timeout keeps the figures so far.

Stages (pass/fail thresholds in each):

1. environment   versions, GPU, attention backends available; measured bf16 GEMM peak (8192^3, mean of 10).
2. dist          NCCL process group + Megatron model-parallel state, world of 1; an all-reduce.
3. varlen        torch varlen FlashAttention (through ``attention.varlen_attention``) == per-sequence SDPA,
                 forward and backward, GQA, bf16 and fp16 against an fp32 reference (must be within 2x of bf16
                 SDPA's own error); ``VarlenCoreAttention`` == ``SDPACoreAttention`` on a packed batch with padded
                 segments and tail padding.
4. hf_parity     llama / qwen2 / qwen3 random models: Megatron THD logits vs transformers per sequence, and the
                 Megatron -> HF export round trip (bit-exact).
5. train_step    ~1.1B Llama (TinyLlama shape), bf16, distributed optimizer: finite loss, fp32 master weights
                 changed, tokens/s, MFU against the measured peak, peak memory.
5b. moe         tiny Qwen3-MoE: Megatron THD logits (fp32) vs transformers, then a small 16-expert model's
                forward + backward + update in the training dtype (grouped-GEMM experts when TE is present).
6. checkpoint    save / load into a fresh engine: every tensor of the training state bit-exact, and the next
                 step equal.
7. quickstart    the CLI quickstart in bf16 on CUDA for a few steps, then resumed for more (subprocess).

``--cpu-smoke`` runs the same stages small in fp32 on the CPU (CPU reference kernel for varlen), in under a
minute: it is part of the default test suite so this script cannot rot. The device call (``run`` tool):

    command:   bash scripts/gpu_check.sh
    carry:     [".whl"]            (scripts/device_wheels.sh fills it here; ~3 MB)
    timeout_s: 420
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class Skip(Exception):
    """A stage that cannot run here (reason in the message)."""


class Check:
    def __init__(self, cpu_smoke: bool, out: Path):
        self.cpu_smoke = cpu_smoke
        self.out = out
        self.report: dict = {"stages": {}, "cpu_smoke": cpu_smoke}
        self.peak_flops = None
        self.parallel_ready = False

    # ------------------------------------------------------------------------------------------------------
    def run(self, name: str, fn) -> bool:
        t0 = time.perf_counter()
        entry: dict = {}
        try:
            entry.update(fn() or {})
            entry["status"] = "pass"
        except Skip as reason:
            entry["status"], entry["reason"] = "skip", str(reason)
        except Exception as err:  # noqa: BLE001 - every failure is recorded, the next stage runs
            entry["status"], entry["error"] = "fail", f"{type(err).__name__}: {err}"
            entry["traceback"] = traceback.format_exc(limit=8)[-3000:]
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        self.report["stages"][name] = entry
        self.write()
        shown = {k: v for k, v in entry.items() if k not in ("traceback",)}
        print(f"[{name}] {json.dumps(shown, default=str)}", flush=True)
        if entry["status"] == "fail":
            print(entry["traceback"], flush=True)
        return entry["status"] != "fail"

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str))

    @property
    def device(self):
        import torch

        return torch.device("cpu") if self.cpu_smoke else torch.device("cuda", torch.cuda.current_device())

    @property
    def dtype(self):
        import torch

        return torch.float32 if self.cpu_smoke else torch.bfloat16

    def need_parallel(self) -> None:
        if not self.parallel_ready:
            raise Skip("the dist stage did not set up the process group")


def require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------
# 1. environment
# ----------------------------------------------------------------------------------------------------------
def stage_environment(c: Check) -> dict:
    import importlib.metadata as md

    import torch

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": version("transformers"), "megatron_core": version("megatron-core"),
            "transformer_engine": version("transformer-engine") or version("transformer_engine"),
            "vllm": version("vllm"), "math_verify": version("math-verify")}
    if not c.cpu_smoke:
        require(torch.cuda.is_available(), "CUDA is not available")
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        from torch.nn.attention.varlen import varlen_attn

        import inspect

        info["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    except ImportError as err:
        info["varlen_attn_signature"] = f"unavailable: {err}"
    # measured dense GEMM peak: the MFU denominator
    n, dtype = (256, torch.float32) if c.cpu_smoke else (8192, torch.bfloat16)
    a = torch.randn(n, n, dtype=dtype, device=c.device)
    b = torch.randn(n, n, dtype=dtype, device=c.device)
    for _ in range(3):
        a @ b
    sync()
    reps = 3 if c.cpu_smoke else 10
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    seconds = (time.perf_counter() - t0) / reps
    c.peak_flops = 2 * n**3 / seconds
    info["gemm"] = f"{n}^3 {str(dtype).replace('torch.', '')}"
    info["gemm_tflops"] = round(c.peak_flops / 1e12, 3)
    if not c.cpu_smoke:
        require(c.peak_flops > 300e12, f"bf16 GEMM at {c.peak_flops / 1e12:.0f} TFLOP/s (< 300): GPU not healthy")
    return info


# ----------------------------------------------------------------------------------------------------------
# 2. dist
# ----------------------------------------------------------------------------------------------------------
def stage_dist(c: Check) -> dict:
    import torch

    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from megatron_dppo.launch import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    initialize_parallel(ParallelConfig(), seed=1234)
    backend = torch.distributed.get_backend()
    x = torch.full((4,), 3.0, device=c.device)
    torch.distributed.all_reduce(x)
    require(torch.equal(x, torch.full_like(x, 3.0)), f"all-reduce over a world of 1 changed the tensor: {x}")
    require(backend == ("gloo" if c.cpu_smoke else "nccl"), f"backend {backend}")
    c.parallel_ready = True
    return {"backend": backend, "world_size": torch.distributed.get_world_size()}


# ----------------------------------------------------------------------------------------------------------
# 3. varlen attention
# ----------------------------------------------------------------------------------------------------------
def per_sequence_attention(q, k, v, cu, scale):
    """Reference: one causal SDPA call per sequence (GQA by repeating key/value heads)."""
    import torch
    import torch.nn.functional as F

    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out, bounds = [], cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out)


def cpu_reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False):
    """--cpu-smoke stand-in for torch's varlen_attn (its 2.12+ signature; the kernel itself is CUDA only)."""
    assert tuple(window_size) == (-1, 0)
    return per_sequence_attention(query, key, value, cu_seq_q, scale)


def stage_varlen(c: Check) -> dict:
    import torch

    from megatron_dppo.megatron.attention import varlen_attention

    kernel = cpu_reference_kernel if c.cpu_smoke else None
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, hd = (4, 2, 16) if c.cpu_smoke else (32, 8, 128)
    lengths = [1, 7, 33, 64, 5] if c.cpu_smoke else [1, 17, 128, 1000, 333, 2048, 7, 640]
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(c.device)
    t = sum(lengths)
    base = [torch.randn(t, h, hd, generator=g).to(c.device) for h in (heads, kv_heads, kv_heads)]
    w = torch.randn(t, heads, hd, generator=g).to(c.device)
    scale = 1.0 / math.sqrt(hd)

    def run(fn, dtype):
        q, k, v = (x.to(dtype).requires_grad_(True) for x in base)
        out = fn(q, k, v)
        grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
        return [out.float()] + [gr.float() for gr in grads]

    ref = run(lambda q, k, v: per_sequence_attention(q, k, v, cu, scale), torch.float32)
    figures = {"sequences": len(lengths), "tokens": t, "heads": f"{heads}:{kv_heads}", "head_dim": hd}
    for dtype in ([torch.float32] if c.cpu_smoke else [torch.bfloat16, torch.float16]):
        name = str(dtype).replace("torch.", "")
        fused = run(lambda q, k, v: varlen_attention(q, k, v, cu, max(lengths), causal=True, scale=scale,
                                                     kernel=kernel), dtype)
        sdpa = run(lambda q, k, v: per_sequence_attention(q, k, v, cu, scale), dtype)
        for i, part in enumerate(("out", "dq", "dk", "dv")):
            err = (fused[i] - ref[i]).abs().max().item()
            base_err = (sdpa[i] - ref[i]).abs().max().item()
            figures[f"{name}_{part}_max_diff"] = err
            figures[f"{name}_{part}_sdpa_max_diff"] = base_err
            limit = 1e-4 if dtype == torch.float32 else 2 * base_err + 1e-3
            require(math.isfinite(err) and err <= limit,
                    f"varlen {name} {part}: max |diff| {err:.3e} vs fp32 reference exceeds {limit:.3e}")
    figures.update(_module_level_varlen(c, kernel))
    return figures


def _module_level_varlen(c: Check, kernel) -> dict:
    """VarlenCoreAttention == SDPACoreAttention (the CPU-verified twin) on a padded THD batch with tail padding."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_dppo.megatron.attention import SDPACoreAttention, VarlenCoreAttention
    from megatron_dppo.megatron.model import build_transformer_config
    from megatron_dppo.megatron.parallel import ParallelConfig

    c.need_parallel()
    arch = small_arch(c)
    config = build_transformer_config(arch, ParallelConfig(), c.dtype, attention_backend="sdpa")
    padded = [8, 24, 16, 64] if c.cpu_smoke else [128, 512, 2048, 384]
    cu = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(c.device)
    total = int(cu[-1]) + 16  # tail padding after the last segment
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    g = torch.Generator().manual_seed(1)
    hq, hkv, hd = arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    q, k, v = (torch.randn(total, h, hd, generator=g).to(c.device, c.dtype) for h in (hq, hkv, hkv))
    outs = []
    for cls in (SDPACoreAttention, VarlenCoreAttention):
        module = cls(config, 1, AttnMaskType.causal, "self")
        if cls is VarlenCoreAttention:
            module.kernel = kernel
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        out = module(qq, kk, vv, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        grads = torch.autograd.grad(out.float().sum(), (qq, kk, vv))
        outs.append([out.float()] + [gr.float() for gr in grads])
    diffs = [(a - b).abs().max().item() for a, b in zip(outs[0], outs[1])]
    tail = outs[1][0][int(cu[-1]):].abs().max().item()
    limit = 1e-5 if c.cpu_smoke else 5e-2
    require(tail == 0.0, f"tail positions after the last segment are not zero ({tail})")
    require(max(diffs) <= limit, f"VarlenCoreAttention vs SDPA twin: max |diff| {diffs} > {limit}")
    return {"module_out_max_diff": diffs[0], "module_grad_max_diff": max(diffs[1:]), "module_tail_zero": True}


# ----------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------
def small_arch(c: Check):
    from megatron_dppo.megatron.model import ModelArch

    if c.cpu_smoke:
        return ModelArch(family="qwen3", vocab_size=256, hidden_size=64, ffn_hidden_size=96, num_layers=2,
                         num_attention_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6, norm_eps=1e-6,
                         tie_embeddings=True, qkv_bias=False, qk_norm=True, max_position_embeddings=4096)
    return ModelArch(family="qwen3", vocab_size=8192, hidden_size=512, ffn_hidden_size=1536, num_layers=4,
                     num_attention_heads=8, num_kv_heads=4, head_dim=64, rope_theta=1e6, norm_eps=1e-6,
                     tie_embeddings=True, qkv_bias=False, qk_norm=True, max_position_embeddings=4096)


def train_arch(c: Check):
    from megatron_dppo.megatron.model import ModelArch

    if c.cpu_smoke:
        return small_arch(c)
    # TinyLlama-1.1B shape, vocab rounded to a multiple of 128
    return ModelArch(family="llama", vocab_size=32000, hidden_size=2048, ffn_hidden_size=5632, num_layers=22,
                     num_attention_heads=32, num_kv_heads=4, head_dim=64, rope_theta=10000.0, norm_eps=1e-5,
                     tie_embeddings=False, qkv_bias=False, qk_norm=False, max_position_embeddings=4096)


def training_flops(arch, seq_lengths) -> float:
    """Model FLOPs of one forward+backward: 6 x matmul params per token + causal attention (3 x 2 matmuls x
    2 FLOP x s^2/2 x heads*head_dim per layer)."""
    h, f, layers = arch.hidden_size, arch.ffn_hidden_size, arch.num_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    matmul_params = layers * (h * (q + 2 * kv) + q * h + 3 * h * f) + arch.vocab_size * h
    return 6.0 * matmul_params * sum(seq_lengths) + sum(3 * 2 * layers * q * s * s for s in seq_lengths)


def random_micro_batches(arch, n_micro: int, capacity: int, min_len: int, max_len: int, seed: int):
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
# 4. HF parity
# ----------------------------------------------------------------------------------------------------------
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
    from megatron_dppo.megatron.model import ModelArch, build_gpt_model, resolve_backend
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.packing import build_thd_batch

    c.need_parallel()
    backend = "sdpa" if c.cpu_smoke else resolve_backend("auto")
    common = dict(vocab_size=512, hidden_size=128 if c.cpu_smoke else 512, intermediate_size=256 if c.cpu_smoke
                  else 1024, num_hidden_layers=2, num_attention_heads=4 if c.cpu_smoke else 8,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6)
    lengths = [5, 17, 40] if c.cpu_smoke else [37, 300, 129, 512]
    figures: dict = {"attention_backend": backend}
    for family, extra in HF_FAMILIES.items():
        cfg = AutoConfig.for_model(**common, **extra)
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(c.device).eval()
        with torch.no_grad():  # non-trivial norms and biases, so a mis-laid tensor shows
            for name, p in hf.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
        arch = ModelArch.from_hf_config(cfg)
        model = build_gpt_model(arch, ParallelConfig(), c.dtype, attention_backend=backend).to(c.device).eval()
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


# ----------------------------------------------------------------------------------------------------------
# 5. train step
# ----------------------------------------------------------------------------------------------------------
def build_engine(c: Check, arch, seed: int, distributed_optimizer: bool = True):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything
    from megatron_dppo.megatron.train_step import OptimConfig, PolicyEngine

    seed_everything(seed)
    return PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=1e-5, clip_grad=1.0,
                                                            use_distributed_optimizer=distributed_optimizer),
                        LossConfig(kl_coef=0.0), dtype=c.dtype, reference=False)


def master_weights(engine) -> list:
    from megatron_dppo.megatron.offload import _inner_optimizers

    return [p for inner in _inner_optimizers(engine.optimizer) for group in inner.param_groups
            for p in group["params"]]


def stage_train_step(c: Check) -> dict:
    import torch

    from megatron_dppo.megatron.model import resolve_backend

    c.need_parallel()
    arch = train_arch(c)
    t0 = time.perf_counter()
    engine = build_engine(c, arch, seed=3)
    sync()
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for m in engine.modules for p in m.parameters())
    masters = master_weights(engine)
    master_dtypes = sorted({str(p.dtype) for p in masters})
    require(master_dtypes == ["torch.float32"], f"optimizer master weights are {master_dtypes}, not fp32")
    sample = [p.detach().clone() for p in masters[:4]]
    capacity, n_micro = (256, 2) if c.cpu_smoke else (16384, 4)
    batches, lengths = random_micro_batches(arch, n_micro, capacity, 16 if c.cpu_smoke else 128,
                                            128 if c.cpu_smoke else 2048, seed=4)

    def one_step():
        sync()
        a = time.perf_counter()
        engine.fill_logprobs(batches, old=True)
        sync()
        b = time.perf_counter()
        metrics = engine.train_step(batches, float(len(lengths)))
        sync()
        return b - a, time.perf_counter() - b, metrics

    one_step()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    steps = 2 if c.cpu_smoke else 3
    times = [one_step() for _ in range(steps)]
    fwd_s = sum(t[0] for t in times) / steps
    train_s = sum(t[1] for t in times) / steps
    metrics = times[-1][2]
    tokens = sum(lengths)
    flops = training_flops(arch, lengths)
    changed = any(not torch.equal(a, p.detach()) for a, p in zip(sample, masters[:4]))
    figures = {
        "arch": "small (cpu smoke)" if c.cpu_smoke else "llama-1.1b (TinyLlama shape)", "params": n_params,
        "attention_backend": resolve_backend("auto") if not c.cpu_smoke else "sdpa",
        "dtype": str(c.dtype), "master_weights": master_dtypes[0], "master_weights_changed": changed,
        "distributed_optimizer": True, "micro_batches": len(batches), "tokens_per_step": tokens,
        "build_s": round(build_s, 2), "logprob_s": fwd_s, "train_step_s": train_s,
        "train_tokens_per_s": tokens / train_s, "logprob_tokens_per_s": tokens / fwd_s,
        "train_tflops": flops / train_s / 1e12, "train_mfu": flops / train_s / c.peak_flops if c.peak_flops else None,
        "logprob_mfu": flops / 3 / fwd_s / c.peak_flops if c.peak_flops else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
    }
    require(math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]), f"non-finite: {metrics}")
    require(changed, "the fp32 master weights did not change after the optimizer steps")
    return figures


# ----------------------------------------------------------------------------------------------------------
# 5b. Mixture-of-Experts: HF parity of a tiny Qwen3-MoE, then forward + backward + update of a small one
# ----------------------------------------------------------------------------------------------------------
def stage_moe(c: Check) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_dppo.convert.weights import load_hf_weights
    from megatron_dppo.megatron.logprobs import forward_thd
    from megatron_dppo.megatron.model import ModelArch, build_gpt_model, resolve_backend
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.packing import build_thd_batch

    c.need_parallel()
    backend = "sdpa" if c.cpu_smoke else resolve_backend("auto")
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
    figures: dict = {"attention_backend": backend, "experts": arch.moe.num_experts, "topk": arch.moe.topk}
    # parity in fp32 (routing is discrete: bf16 logits may pick other experts for near-ties)
    model = build_gpt_model(arch, ParallelConfig(), torch.float32, attention_backend=backend).to(c.device).eval()
    figures["grouped_gemm"] = bool(model.config.moe_grouped_gemm)
    with torch.no_grad():
        hf_state = {k: v.detach() for k, v in hf.state_dict().items()}
    load_hf_weights([model], arch, _per_expert_hf_tensors(hf_state))
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


def _per_expert_hf_tensors(state: dict) -> dict:
    """transformers 5 keeps a Qwen3-MoE layer's experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2F, H],
    ``mlp.experts.down_proj`` [E, H, F]); checkpoints and our converter use one tensor per expert."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


# ----------------------------------------------------------------------------------------------------------
# 6. checkpoint
# ----------------------------------------------------------------------------------------------------------
def stage_checkpoint(c: Check) -> dict:
    import shutil

    import torch

    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dppo.megatron.offload import train_state_tensors

    c.need_parallel()
    arch = small_arch(c)
    batches, lengths = random_micro_batches(arch, 2, 256 if c.cpu_smoke else 4096, 16, 128 if c.cpu_smoke
                                            else 1024, seed=5)
    engine = build_engine(c, arch, seed=7)
    engine.train_step(batches, float(len(lengths)))
    root = c.out / "checkpoint_stage"
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    path = save_checkpoint(engine, root)
    save_s = time.perf_counter() - t0
    fresh = build_engine(c, arch, seed=99)
    fresh.train_step(batches, float(len(lengths)))  # optimizer state exists, different from the saved one
    t0 = time.perf_counter()
    load_checkpoint(fresh, path)
    load_s = time.perf_counter() - t0
    a = list(train_state_tensors(engine.model_chunks, engine.optimizer, grads=False))
    b = list(train_state_tensors(fresh.model_chunks, fresh.optimizer, grads=False))
    require(len(a) == len(b), f"{len(a)} vs {len(b)} state tensors")
    bad = sum(not torch.equal(x, y) for x, y in zip(a, b) if x.shape == y.shape)
    require(bad == 0, f"{bad} state tensors differ after load")
    m1 = engine.train_step(batches, float(len(lengths)))
    m2 = fresh.train_step(batches, float(len(lengths)))
    require(m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"], f"next step differs: {m1} vs {m2}")
    shutil.rmtree(root, ignore_errors=True)
    return {"state_tensors": len(a), "bit_exact": True, "save_s": round(save_s, 2), "load_s": round(load_s, 2),
            "next_step_equal": True}


# ----------------------------------------------------------------------------------------------------------
# 7. quickstart (CLI, subprocess: its own process group)
# ----------------------------------------------------------------------------------------------------------
def stage_quickstart(c: Check) -> dict:
    out = c.out / "quickstart"
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    base = [sys.executable, "-m", "megatron_dppo.cli", "train", "--config", str(REPO / "examples" / "quickstart.yaml"),
            f"train.output_dir={out}", "eval.every=0", "logging.progress_bar=false"]
    if c.cpu_smoke:
        base += ["train.sft_steps=1", "train.prompts_per_step=4", "train.group_size=2", "train.sft_batch_size=8",
                 "data.arithmetic_train_size=16", "rollout.max_new_tokens=3"]
        first, second = 1, 2
    else:
        base += ["model.dtype=bfloat16", "train.sft_steps=20", "train.cpu_threads=4"]
        first, second = 4, 8
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    timings = []
    logs = []
    for steps in (first, second):
        t0 = time.perf_counter()
        proc = subprocess.run(base + [f"train.steps={steps}"], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=150 if not c.cpu_smoke else 120)
        timings.append(round(time.perf_counter() - t0, 1))
        logs.append(proc.stdout[-1500:] + proc.stderr[-1500:])
        require(proc.returncode == 0, f"quickstart train.steps={steps} exited {proc.returncode}:\n{logs[-1]}")
    require("resuming" in logs[1], "the second run did not resume from the first run's checkpoint")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [m for m in metrics if m.get("phase") == "rl" and "reward/mean" in m]
    steps_seen = sorted({m.get("step") for m in rl})
    require(steps_seen == list(range(second)), f"RL steps logged {steps_seen}, expected 0..{second - 1}")
    rewards = [m["reward/mean"] for m in rl]
    require(all(math.isfinite(r) for r in rewards), f"non-finite rewards {rewards}")
    return {"runs_s": timings, "rl_steps": len(steps_seen), "reward_mean_last": rewards[-1],
            "banner": next((line for line in logs[0].splitlines() if line.startswith("megatron-dppo:")), None)}


# ----------------------------------------------------------------------------------------------------------
STAGES = [("environment", stage_environment), ("dist", stage_dist), ("varlen", stage_varlen),
          ("hf_parity", stage_hf_parity), ("train_step", stage_train_step), ("moe", stage_moe),
          ("checkpoint", stage_checkpoint),
          ("quickstart", stage_quickstart)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="the same stages, small, fp32, on the CPU")
    parser.add_argument("--out", default=None, help="report folder (default: $OUT, else gpu_check_out/)")
    parser.add_argument("--only", default=None, help="comma-separated stage names (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated stage names not to run")
    args = parser.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or REPO / "gpu_check_out")
    check = Check(args.cpu_smoke, out)
    wanted = set(args.only.split(",")) if args.only else None
    skipped = set(filter(None, args.skip.split(",")))
    try:
        import torch

        if not args.cpu_smoke and not torch.cuda.is_available():
            check.report["error"] = "no CUDA device visible (use --cpu-smoke on a CPU)"
            check.write()
            print("gpu_check: no CUDA device visible; nothing to check (--cpu-smoke runs the CPU variant)")
            return 2
        if args.cpu_smoke:
            torch.set_num_threads(1)
    except ImportError as err:
        check.report["error"] = f"torch does not import: {err}"
        check.write()
        return 2
    ok = True
    for name, fn in STAGES:
        if name in skipped:
            check.report["stages"][name] = {"status": "skip", "reason": "--skip"}
        elif wanted is None or name in wanted or name in ("environment", "dist"):
            ok = check.run(name, lambda fn=fn: fn(check)) and ok
    try:
        from megatron_dppo.megatron.parallel import destroy_parallel

        destroy_parallel()
    except Exception:  # noqa: BLE001 - teardown of a failed setup
        pass
    statuses = {k: v["status"] for k, v in check.report["stages"].items()}
    check.report["summary"] = statuses
    check.write()
    print(f"gpu_check: {statuses} -> {out / 'gpu_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
