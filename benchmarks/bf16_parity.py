"""bf16 mixed precision in the training engine on CPU: parity with fp32, the train phase's CPU seconds, peak RSS.

    .venv/bin/python -m benchmarks.bf16_parity --out docs/benchmarks/bf16_parity.json

One thread (``--threads``). Measured in one process, one after the other (the RSS workers in their own):

1. **Parity, tiny model** (a 2-layer Llama as in the tests, 12 random sequences in 3 packed micro-batches, PPO clip +
   k3 KL): an fp32 engine and a bf16 engine holding the same weights (the fp32 ones rounded to bf16, fp32 masters
   from them); the log-probs at the loss positions, then one step of each (``parity``: with each engine's own old
   log-probs as in a run, and with the fp32 engine's perturbed ones for both): loss, clipped fraction, grad norm
   and the relative L2 error and cosine of the whole gradient (fp32 ``main_grad`` in both), against the bound from
   bf16's rounding (tests/megatron/test_bf16.py's docstring: K = 12 L + 3 roundings in series, u = 2^-8; worst
   case first order |d log p| <= 2 K u Z with Z the largest |logit|, gradient and loss relative <= 2 K u; and the
   random-walk estimate with sqrt(K) for K, rounding errors of independent signs).
2. **Parity and the train phase on SmolLM2-135M-Instruct** (``examples/smollm2_list_max_cpu.yaml``: 8 prompts x 8
   completions of <= 32 tokens, GRPO, the trainer's own step): one RL step of the fp32 run gives the step's packed
   micro-batches; a bf16 engine gets the fp32 policy's weights; the same parity figures as (1); then the train phase
   (``PolicyEngine.train_step``) and the old-log-prob pass (``fill_logprobs``) of both engines on those micro-batches,
   interleaved fp32 / bf16, ``--reps`` times, in process CPU seconds; the train phase's FLOP (counted as
   ``benchmarks/real_step_profile.py`` does) per CPU second against ``torch.mm`` 512 x 1536 x 1536 in fp32 and bf16
   measured in this process.
3. **Peak RSS of a training process** (the train side: the engine, its optimizer and two train steps on the same
   micro-batches; no rollout engine), fp32 and bf16, each in a fresh process (``VmHWM``). ``--rss-only BATCHES``:
   this part alone, on the micro-batches a full run saved.

The box is shared with other users: CPU seconds, not wall clock, are the figures that count.
"""
from __future__ import annotations

import argparse
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/bf16_parity.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import QUIET, REPO, machine, write_json

U_BF16 = 2.0 ** -8


def rounding_chain(num_layers: int) -> int:
    return 12 * num_layers + 3


# ----------------------------------------------------------------------------------------------------------
# parity of two engines on the same micro-batches
# ----------------------------------------------------------------------------------------------------------
def copy_weights(dst, src) -> None:
    import torch

    with torch.no_grad():
        for pd, ps in zip((p for m in dst.modules for p in m.parameters()),
                          (p for m in src.modules for p in m.parameters())):
            pd.copy_(ps)
    dst.optimizer.reload_model_params()
    if dst.reference_chunks is not None:
        dst.sync_reference_from_policy()


def max_abs_logit(engine, batches) -> float:
    import torch

    from megatron_dppo.megatron.logprobs import forward_thd

    with torch.no_grad():
        return max(float(forward_thd(engine.modules[0], b, loss_positions_only=True).float().abs().max())
                   for b in batches)


def one_step(f32, b16, batches, denominator: float, old: dict) -> dict:
    """One update of each engine from the same weights, each batch's old log-probs ``old[engine]`` (the reference
    log-probs: the fp32 policy's); the fp32 gradient buffers (``main_grad``) compared before the optimizer moved
    anything that matters here. The weights are put back afterwards (the masters reloaded from them)."""
    import torch

    saved = {e: [p.detach().clone() for m in e.modules for p in m.parameters()] for e in (f32, b16)}
    metrics, grads = {}, {}
    for name, engine in (("fp32", f32), ("bf16", b16)):
        for b, lp, ref in zip(batches, old[name], old["ref"]):
            b.old_logprobs = lp.clone()
            b.ref_logprobs = ref.clone() if engine.loss_cfg.kl_coef > 0 else None
        metrics[name] = engine.train_step(batches, denominator)
        grads[name] = torch.cat([p.main_grad.flatten() for m in engine.modules for p in m.parameters()])
    with torch.no_grad():
        for engine, params in saved.items():
            for p, v in zip((p for m in engine.modules for p in m.parameters()), params):
                p.copy_(v)
            engine.optimizer.reload_model_params()
    g32, g16 = grads["fp32"], grads["bf16"]
    loss32, loss16 = metrics["fp32"]["loss"], metrics["bf16"]["loss"]
    return {
        "loss": {"fp32": loss32, "bf16": loss16, "abs_diff": abs(loss16 - loss32)},
        "clip_fraction": {"fp32": metrics["fp32"]["clip_fraction"], "bf16": metrics["bf16"]["clip_fraction"]},
        "grad_norm": {"fp32": metrics["fp32"]["grad_norm"], "bf16": metrics["bf16"]["grad_norm"],
                      "rel_diff": abs(metrics["bf16"]["grad_norm"] - metrics["fp32"]["grad_norm"])
                      / metrics["fp32"]["grad_norm"]},
        "grad_rel_l2": float((g16 - g32).norm() / g32.norm()),
        "grad_cosine": float(torch.dot(g16.double(), g32.double()) / (g16.double().norm() * g32.double().norm())),
    }


def parity(f32, b16, batches, denominator: float, num_layers: int) -> dict:
    """Log-probs of both engines at the same weights, then one step of each two ways: ``own_old`` (each engine's
    old log-probs are its own, as in a run: ratio 1, the gradient of the same objective computed in two precisions)
    and ``fp32_old`` (both take the fp32 engine's log-probs, perturbed by 0.3 sin(position): the bf16 ratios then
    carry the bf16 / fp32 log-prob difference, as a bf16 trainer's do against an fp32 rollout)."""
    import torch

    K = rounding_chain(num_layers)
    Z = max_abs_logit(f32, batches)
    lp32, lp16 = f32.compute_logprobs(batches), b16.compute_logprobs(batches)
    diffs = torch.cat([(a - b)[bt.loss_mask > 0] for a, b, bt in zip(lp32, lp16, batches)]).abs()
    shifted = [lp + 0.3 * torch.sin(torch.arange(lp.numel(), dtype=torch.float32) + i) for i, lp in enumerate(lp32)]
    return {
        "num_layers": num_layers, "K": K, "max_abs_logit_Z": Z, "loss_positions": int(diffs.numel()),
        "logprob_abs_diff": {"max": float(diffs.max()), "mean": float(diffs.mean()),
                             "p99": float(diffs.quantile(0.99)) if diffs.numel() else 0.0},
        "logprob_bound_worst_case": 2 * K * U_BF16 * Z,
        "logprob_estimate_random_walk": 2 * math.sqrt(K) * U_BF16 * Z,
        "relative_bound_worst_case": 2 * K * U_BF16,
        "relative_estimate_random_walk": 2 * math.sqrt(K) * U_BF16,
        "own_old": one_step(f32, b16, batches, denominator, {"fp32": lp32, "bf16": lp16, "ref": lp32}),
        "fp32_old": one_step(f32, b16, batches, denominator, {"fp32": shifted, "bf16": shifted, "ref": lp32}),
    }


def tiny_micro_batches(seed: int = 0, sequences: int = 12, per_batch: int = 4) -> list:
    """Packed micro-batches of random sequences (prompt 2-5 tokens, completion 1-8) with advantages +-1 and
    weights 1 / completion length (a seq-mean-token-mean GRPO batch)."""
    import torch

    from megatron_dppo.packing import build_thd_batch

    g = torch.Generator().manual_seed(seed)
    batches = []
    for start in range(0, sequences, per_batch):
        seqs, prompts, adv, weights = [], [], [], []
        for _ in range(per_batch):
            p, c = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
            seqs.append(torch.randint(1, 256, (p + c,), generator=g).tolist())
            prompts.append(p)
            adv.append(float(torch.randint(0, 2, (1,), generator=g)) * 2 - 1)
            weights.append(1.0 / c)
        batches.append(build_thd_batch(seqs, prompts, list(range(start, start + per_batch)), adv, weights))
    return batches


def tiny_parity() -> dict:
    """(1): a 2-layer Llama (hidden 64, 4 heads, vocab 256), PPO clip + k3 KL, in a world of one process."""
    import torch

    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything, single_process_world

    arch = ModelArch(family="llama", vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=2,
                     num_attention_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, norm_eps=1e-6,
                     tie_embeddings=False, qkv_bias=False, qk_norm=False, max_position_embeddings=256)
    with single_process_world(seed=1234):
        loss_cfg = LossConfig(policy_loss="ppo_clip", kl_coef=0.05, kl_estimator="k3").resolved()
        engines = {}
        for dtype in (torch.float32, torch.bfloat16):
            seed_everything(1234)
            engines[dtype] = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=1e-2), loss_cfg, dtype=dtype)
        copy_weights(engines[torch.bfloat16], engines[torch.float32])
        batches = tiny_micro_batches()
        return parity(engines[torch.float32], engines[torch.bfloat16], batches, 12.0, arch.num_layers)


# ----------------------------------------------------------------------------------------------------------
# matmul rate, train-phase timing
# ----------------------------------------------------------------------------------------------------------
def mm_rate(dtype, m: int = 512, k: int = 1536, n: int = 1536, reps: int = 5) -> float:
    """Best GFLOP per CPU second of ``torch.mm`` [m, k] x [k, n] over ``reps`` repetitions of ~2 GFLOP."""
    import torch

    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(a, b)
    flop = 2.0 * m * k * n
    count = max(1, int(2e9 // flop))
    best = 0.0
    for _ in range(reps):
        c0 = time.process_time()
        for _ in range(count):
            torch.mm(a, b)
        best = max(best, flop * count / (time.process_time() - c0) / 1e9)
    return best


def timed_phases(engines: dict, batches, denominator: float, reps: int) -> dict:
    """CPU seconds of the old-log-prob pass and of ``train_step``, interleaved over the engines."""
    times = {name: {"logprob": [], "train": []} for name in engines}
    for _ in range(reps):
        for name, engine in engines.items():
            for b in batches:
                b.old_logprobs = b.ref_logprobs = None
            c0 = time.process_time()
            engine.fill_logprobs(batches)
            c1 = time.process_time()
            engine.train_step(batches, denominator)
            c2 = time.process_time()
            times[name]["logprob"].append(c1 - c0)
            times[name]["train"].append(c2 - c1)
    return times


def smollm2(args) -> tuple[dict, Path]:
    import torch

    from benchmarks.real_step_profile import sequence_lengths, train_flop
    from megatron_dppo.config import load_config
    from megatron_dppo.megatron.engine import PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.run.setup import setup, teardown
    from megatron_dppo.train.loop import rl_step

    work = Path(tempfile.mkdtemp(prefix="bf16_parity-"))
    cfg = load_config(args.config, [f"train.output_dir={work}", "eval.every=0", "checkpoint.every=0", *QUIET,
                                    "logging.print_every=0", f"train.cpu_threads={args.threads}",
                                    f"model.gguf_cache={args.gguf_cache}", "model.dtype=float32", *args.overrides])
    run = setup(cfg, resume=False)
    torch.set_num_threads(args.threads)
    batches: list = []
    engine = run.train_side.engine
    original = engine.train_step

    def recording(micro_batches, denominator):
        batches.extend(micro_batches)
        recording.denominator = denominator
        return original(micro_batches, denominator)

    engine.train_step = recording
    try:
        rl_step(run, 0)
    finally:
        engine.train_step = original
    denominator = recording.denominator
    b16 = PolicyEngine(run.arch, ParallelConfig(), engine.optim_cfg, engine.loss_cfg, dtype=torch.bfloat16)
    copy_weights(b16, engine)
    out = {"parity": parity(engine, b16, batches, denominator, run.arch.num_layers)}
    print(f"SmolLM2 parity: {out['parity']}", flush=True)
    if args.parity_only:
        teardown(run)
        return out, None
    lengths, loss_positions = sequence_lengths(batches)
    flop = train_flop(run.arch, lengths, loss_positions if engine.logits_at_loss_positions else sum(lengths))
    mm = {"fp32": mm_rate(torch.float32), "bf16": mm_rate(torch.bfloat16)}
    times = timed_phases({"fp32": engine, "bf16": b16}, batches, denominator, args.reps)
    mm_after = {"fp32": mm_rate(torch.float32), "bf16": mm_rate(torch.bfloat16)}
    med = {name: {phase: statistics.median(v) for phase, v in t.items()} for name, t in times.items()}
    out["train_phase"] = {
        "micro_batches": len(batches), "sequences": len(lengths), "positions": sum(lengths),
        "loss_positions": loss_positions, "train_flop": flop, "cpu_s": times, "cpu_s_median": med,
        "bf16_over_fp32": {phase: med["bf16"][phase] / med["fp32"][phase] for phase in ("logprob", "train")},
        "mm_512x1536x1536_gflop_per_cpu_s": {"before": mm, "after": mm_after},
        "train_gflop_per_cpu_s": {name: flop / med[name]["train"] / 1e9 for name in med},
    }
    best_mm = {k: max(mm[k], mm_after[k]) for k in mm}
    out["train_phase"]["fraction_of_mm_rate"] = {
        name: out["train_phase"]["train_gflop_per_cpu_s"][name] / best_mm[name] for name in med}
    out["train_phase"]["bf16_fraction_of_bf16_mm"] = out["train_phase"]["fraction_of_mm_rate"]["bf16"]
    batch_file = work / "micro_batches.pt"
    for b in batches:
        b.old_logprobs = b.ref_logprobs = None
    torch.save({"batches": batches, "denominator": denominator}, batch_file)
    teardown(run)
    return out, batch_file


# ----------------------------------------------------------------------------------------------------------
# peak RSS of the train side, one fresh process per dtype
# ----------------------------------------------------------------------------------------------------------
def peak_rss_mib() -> float:
    """This process's peak resident set (``VmHWM``): unlike ``ru_maxrss``, which a process spawned by a big parent
    inherits through fork and exec, it starts afresh with the new program."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_worker(args) -> None:
    import torch

    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.convert.checkpoint import load_hf_folder
    from megatron_dppo.convert.gguf import smollm2_hf_dir
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig, single_process_world

    torch.set_num_threads(args.threads)
    hf_dir = smollm2_hf_dir(args.gguf_cache)
    import json

    arch = ModelArch.from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    saved = torch.load(args.batches, weights_only=False)
    rss = {"start_mib": peak_rss_mib()}
    with single_process_world():
        engine = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=1e-6), LossConfig(kl_coef=0.0).resolved(),
                              dtype=getattr(torch, args.rss_worker))
        load_hf_folder(engine.model_chunks, hf_dir, arch)
        engine.optimizer.reload_model_params()
        rss["engine_built_mib"] = peak_rss_mib()
        for _ in range(2):
            engine.fill_logprobs(saved["batches"])
            engine.train_step(saved["batches"], saved["denominator"])
        rss["peak_after_2_steps_mib"] = peak_rss_mib()
    print("RSS " + json.dumps(rss), flush=True)


def peak_rss(args, batch_file: Path) -> dict:
    import json

    out = {}
    for dtype in ("float32", "bfloat16"):
        cmd = [sys.executable, "-m", "benchmarks.bf16_parity", "--rss-worker", dtype, "--batches", str(batch_file),
               "--threads", str(args.threads), "--gguf-cache", args.gguf_cache]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RSS ")][-1]
        out[dtype] = json.loads(line[4:])
        print(f"peak RSS {dtype}: {out[dtype]}", flush=True)
    out["bf16_over_fp32"] = out["bfloat16"]["peak_after_2_steps_mib"] / out["float32"]["peak_after_2_steps_mib"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "smollm2_list_max_cpu.yaml"))
    ap.add_argument("--gguf-cache", default="/work/cache/smollm2",
                    help="model.gguf_cache: where the converted SmolLM2 folder is (or is converted to)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-smollm2", action="store_true", help="the tiny model's parity only")
    ap.add_argument("--parity-only", action="store_true", help="no timing, no peak RSS")
    ap.add_argument("--rss-only", default=None, help="the peak RSS part alone, on a full run's saved micro-batches")
    ap.add_argument("--rss-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batches", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.rss_worker:
        return rss_worker(args)
    if args.rss_only:
        return write_json(args.out, {"machine": machine(), "peak_rss": peak_rss(args, Path(args.rss_only))})
    load_before = machine()["load_avg_1m"]
    c0 = time.process_time()
    report = {"machine": machine(), "load_avg_1m_before": load_before, "threads": args.threads,
              "shared_machine": True, "tiny": tiny_parity()}
    print(f"tiny parity: {report['tiny']}", flush=True)
    if not args.skip_smollm2:
        report["smollm2"], batch_file = smollm2(args)
        if not args.parity_only:
            print(f"train phase: {report['smollm2']['train_phase']['cpu_s_median']}", flush=True)
            report["peak_rss"] = peak_rss(args, batch_file)
    report["cpu_s_total"] = time.process_time() - c0
    write_json(args.out, report)


if __name__ == "__main__":
    main()
