"""What the stages build: the model shapes (small for ``--cpu-smoke``, device-sized otherwise), random packed
micro-batches, engines, their optimizer's master weights, the FLOP count behind the MFU figures, and the
per-expert view of a transformers-5 MoE state dict."""
from __future__ import annotations

from .harness import Check


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


def build_engine(c: Check, arch, seed: int, distributed_optimizer: bool = True):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    seed_everything(seed)
    return PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=1e-5, grad_clip=1.0,
                                                            distributed_optimizer=distributed_optimizer),
                        LossConfig(kl_coef=0.0).resolved(), dtype=c.dtype, reference=False)


def master_weights(engine) -> list:
    from megatron_dppo.megatron.offload import _inner_optimizers

    return [p for inner in _inner_optimizers(engine.optimizer) for group in inner.param_groups
            for p in group["params"]]


def per_expert_hf_tensors(state: dict) -> dict:
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
