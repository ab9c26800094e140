"""Activation memory per rank of one long sequence at context parallelism cp=1 vs cp=2 (``parallel.cp``).

Workload: ONE sequence of ``--tokens`` tokens (default 8192: prompt 512, the rest completion) through a tiny dense
decoder (``--hidden`` 256, 8 heads / 4 KV heads, head dim 32, ``--layers`` 2, vocab 256, fp32), the engine's own
path: ``logprobs.forward_thd`` (each CP rank gets its zigzag half, ``packing.context_parallel``), the SDPA
backend's context-parallel attention (``megatron/cp_attention.py``), ``logprobs.batch_logprobs`` (gathered over
CP), a loss over the completion tokens, backward. One process per CP rank, gloo, one torch thread each.

Measured per rank:
* ``saved_mib``: bytes of the tensors autograd saves for the backward during the forward (unique storages,
  parameters excluded): the activation memory that must live until the backward, which CP is meant to divide.
  Counted with ``torch.autograd.graph.saved_tensors_hooks``, so it is exact and device independent.
* ``peak_rss_growth_mib``: growth of the process's peak resident memory over forward + backward (``ru_maxrss``;
  includes transients and allocator slack; noisier).

What to expect: the per-token activations halve at cp=2. The CP attention adds, per layer, the K/V segments it
attends to (``(2cp+1)/(2cp)`` of the sequence's K/V per rank, GQA heads repeated); its bottom-right causal masks
are rebuilt in the backward rather than held (``cp_attention._MaskedSDPA``), so they show in the peak (a transient
``Q x K`` float mask per SDPA call), not in the saved activations. For a model this narrow the K/V term is a
visible share; it grows with ``L x kv heads``, the per-token activations with ``L x hidden x layers``, so the ratio
approaches 1/2 for wide models (the arithmetic in ``examples/long_context_qwen3_4b.yaml``).

Measured (docs/benchmarks/cp_memory.json; 2-core shared CPU, 8192 tokens, the defaults): saved activations
377.1 MiB at cp=1, 208.7 / 204.6 MiB on the two cp=2 ranks (0.55); peak RSS growth 651.9 vs 463.9 / 422.8 MiB
(0.71); the loss is the same to the last printed digit (42996.9688).

Run: ``.venv/bin/python benchmarks/cp_memory.py [--tokens 8192] [--out docs/benchmarks/cp_memory.json]``
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

if not __package__:  # `python benchmarks/cp_memory.py`: the repository joins sys.path (this checkout's library)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _arch(hidden: int, layers: int, tokens: int):
    from megatron_dppo.megatron.arch import ModelArch

    return ModelArch(family="qwen2", vocab_size=256, hidden_size=hidden, ffn_hidden_size=2 * hidden,
                     num_layers=layers, num_attention_heads=8, num_kv_heads=4, head_dim=32, rope_theta=10000.0,
                     norm_eps=1e-6, tie_embeddings=False, qkv_bias=True, qk_norm=False,
                     max_position_embeddings=tokens)


def measure(cp: int, tokens: int, hidden: int, layers: int) -> dict:
    """One rank's measurement (run under ``megatron_dppo.distributed.spawn.run_distributed`` with ``cp`` processes)."""
    import torch.distributed as dist

    from megatron_dppo.megatron.logprobs import batch_logprobs, forward_thd
    from megatron_dppo.megatron.model import build_gpt_model
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel
    from megatron_dppo.packing import build_thd_batch, thd_pad_multiple

    torch.set_num_threads(1)
    arch = _arch(hidden, layers, tokens)
    parallel = ParallelConfig(cp=cp)
    initialize_parallel(parallel, 1234, arch)
    model = build_gpt_model(arch, parallel, torch.float32, attention_backend="sdpa")
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(1, arch.vocab_size, (tokens,), generator=g).tolist()
    batch = build_thd_batch([seq], [512], [0], [1.0], [1.0], pad_multiple=thd_pad_multiple(1, cp, False))

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    dist.barrier()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = forward_thd(model, batch)
        logp, _ = batch_logprobs(logits, batch, with_entropy=False)
        loss = -(logp * batch.loss_mask).sum()
    loss.backward()
    seconds = time.perf_counter() - start
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"cp": cp, "rank": dist.get_rank(), "local_tokens": int(logits.shape[0]), "loss": float(loss),
            "saved_mib": sum(saved.values()) / 2**20, "peak_rss_growth_mib": (rss1 - rss0) / 1024,
            "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from megatron_dppo.distributed.spawn import run_distributed

    rows = []
    for cp in (1, 2):
        ranks = run_distributed(measure, cp, args=(cp, args.tokens, args.hidden, args.layers), timeout=1800)
        rows += ranks
        for r in ranks:
            print(f"cp={r['cp']} rank {r['rank']}: {r['local_tokens']} local tokens, saved activations "
                  f"{r['saved_mib']:.1f} MiB, peak RSS growth {r['peak_rss_growth_mib']:.1f} MiB, "
                  f"loss {r['loss']:.4f}, {r['seconds']:.1f} s", flush=True)
    one = [r for r in rows if r["cp"] == 1][0]
    two = [r for r in rows if r["cp"] == 2]
    ratio = max(r["saved_mib"] for r in two) / one["saved_mib"]
    print(f"saved activations per rank, cp=2 / cp=1: {ratio:.2f} (largest rank); loss cp=1 {one['loss']:.6f}, "
          f"cp=2 {two[0]['loss']:.6f}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"},
                                        "rows": rows, "ratio_saved": ratio}, indent=1) + "\n")


if __name__ == "__main__":
    main()
