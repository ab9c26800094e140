"""Weight transfer of ``rollout.placement=separate``: how long the trainer's main rank spends sending one weight
version to the rollout workers, by bucket size (``rollout.weight_bucket_mb``), on the real channel
(``megatron_dppo.distributed.transfer``: versioned buckets over a gloo group, through host memory; docs/async.md).

One sender process (the trainer's main rank) and ``--receivers`` receiver processes (rollout workers) on this
host, over loopback TCP. The stream is a synthetic model of HF-named bf16 tensors with the shapes of a
decoder-only model of ``--params`` parameters (embedding, per-layer attention and MLP matrices, norms), made
once before timing. Per bucket size: ``--versions`` versions are sent back to back and the receivers acknowledge
the last one; reported are the sender's wall seconds per version (median), the rate in GB/s, the sender's CPU
seconds, and whether every receiver got every version in order with the exact bytes (a checksum of the last).

Then the same with ``background=True`` (what the trainer uses at ``train.max_staleness >= 1``): send() copies the
version to host buffers and returns, a thread transfers it. Between sends the sender sleeps ``--train-s`` seconds,
standing in for the next training step; reported is how long each send() blocked the trainer (the copy, plus
waiting for the previous version when the transfer outlasts a step).

Loopback measures the copy and serialization cost of the channel, not a network: across nodes the rate is bounded
by the link (gloo over TCP; an NCCL transfer is not built, docs/async.md). Wall seconds on a shared machine move
with its load: compare bucket sizes within one run.

Run: ``.venv/bin/python benchmarks/weight_transfer.py [--params 0.5e9] [--buckets 16,64,256,1024] [--versions 3]
[--receivers 1] [--out results.json]``
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not __package__:  # `python benchmarks/weight_transfer.py`: the repository joins sys.path (this checkout's library)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_dppo.distributed.transfer import (
    WeightReceiver,
    WeightSender,
    process_group,
    recv_object,
    send_object,
)


def model_shapes(params: float, hidden: int = 896, ffn_ratio: float = 5.4, vocab: int = 151936):
    """(name, shape) of a decoder-only model near ``params`` parameters (Qwen2.5-0.5B-like widths)."""
    ffn = int(hidden * ffn_ratio)
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden
    layers = max(1, round((params - vocab * hidden) / per_layer))
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (hidden, hidden)),
                   (p + "self_attn.v_proj.weight", (hidden, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "mlp.gate_proj.weight", (ffn, hidden)), (p + "mlp.up_proj.weight", (ffn, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, ffn)), (p + "input_layernorm.weight", (hidden,)),
                   (p + "post_attention_layernorm.weight", (hidden,))]
    return shapes + [("model.norm.weight", (hidden,))]


def checksum(tensors) -> float:
    return float(sum(t.float().sum().item() for _, t in tensors))


def worker(rank: int, world: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=600))
    sizes = [int(b) for b in args.buckets.split(",")]
    rows = []
    for index, (bucket_mb, background) in enumerate([(b, False) for b in sizes] + [(b, True) for b in sizes]):
        weights = process_group(store, f"weights{index}", rank, world, 600.0)
        acks = process_group(store, f"acks{index}", rank, world, 600.0)
        if rank == 0:
            torch.manual_seed(0)
            tensors = [(name, torch.randn(shape).to(torch.bfloat16)) for name, shape in model_shapes(args.params)]
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
            sender = WeightSender(weights, bucket_mb << 20, background=background)
            walls, cpus = [], []
            start = time.perf_counter()
            for version in range(1, args.versions + 1):
                wall, cpu = time.perf_counter(), time.process_time()
                sender.send(version, iter(tensors), extra={"step": version})
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
                if background:
                    time.sleep(args.train_s)
            got = [recv_object(acks, src) for src in range(1, world)]
            total = time.perf_counter() - start
            sender.stop()
            rows.append({"bucket_mb": bucket_mb, "background": background, "gbytes": nbytes / 1e9,
                         "wall_s_median": statistics.median(walls), "total_s": total,
                         "wall_s": walls, "gb_per_s": nbytes / 1e9 / statistics.median(walls),
                         "sender_cpu_s_median": statistics.median(cpus),
                         "receivers_ok": all(a["arrived"] == list(range(1, args.versions + 1))
                                             and a["checksum"] == checksum(tensors) for a in got)})
        else:
            receiver = WeightReceiver(weights, "the sender")
            newest = receiver.wait(args.versions)
            send_object(acks, {"arrived": receiver.arrived, "checksum": checksum(newest.weights)}, 0)
            receiver.wait(1 << 62)  # the stop message
        del weights, acks
    if rank == 0:
        results.put(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=0.5e9, help="model size in parameters (bf16 on the wire)")
    parser.add_argument("--buckets", default="16,64,256,1024", help="comma-separated rollout.weight_bucket_mb values")
    parser.add_argument("--versions", type=int, default=3, help="versions sent back to back per bucket size")
    parser.add_argument("--receivers", type=int, default=1, help="rollout worker processes")
    parser.add_argument("--train-s", type=float, default=3.0, help="background sends: seconds between sends")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    from megatron_dppo.distributed.launch import free_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    world = 1 + args.receivers
    mp.start_processes(worker, args=(world, free_port(), args, results), nprocs=world, start_method="spawn")
    rows = results.get()
    print(f"weight transfer, {rows[0]['gbytes']:.2f} GB of bf16 per version, 1 sender -> {args.receivers} "
          f"receiver(s) on this host (gloo, loopback), {args.versions} versions per bucket size, "
          f"{os.cpu_count()} CPUs")
    print(f"{'bucket MiB':>10} {'send':>10} {'s/version':>10} {'GB/s':>6} {'sender CPU s':>13} {'exact, in order':>16}")
    for r in rows:
        mode = "background" if r["background"] else "inline"
        rate = "-" if r["background"] else f"{r['gb_per_s']:.2f}"
        print(f"{r['bucket_mb']:>10} {mode:>10} {r['wall_s_median']:>10.2f} {rate:>6} "
              f"{r['sender_cpu_s_median']:>13.2f} {str(r['receivers_ok']):>16}")
    print(f"(background: s/version is the time send() blocked the trainer, with {args.train_s} s of stand-in "
          "training between sends)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["receivers_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
