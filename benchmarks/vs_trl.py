"""Step time against TRL's ``GRPOTrainer`` on the same work (the quickstart's, or a real model's): TRL GRPO vs our
GRPO vs our DPPO.

    make bench-trl                                   # = the line below
    .venv/bin/python benchmarks/vs_trl.py --seeds 3 --steps 16 [--out runs/vs_trl]
    .venv/bin/python benchmarks/vs_trl.py --work smollm2 --seeds 1 --steps 5     # a real pretrained model
    .venv/bin/python benchmarks/vs_trl.py --work smollm2 --dtype bfloat16 ...   # both sides in bf16 mixed precision

The work (identical for the three methods)
------------------------------------------
* Weights: the quickstart's warm start (``examples/quickstart.yaml``: the 1.6M-parameter Qwen2, 100 supervised
  steps on gold answers), trained ONCE by our trainer, exported to a Hugging Face folder (``convert
  megatron-to-hf``) with its tokenizer; every run of every method starts from that folder.
* Task: the quickstart's arithmetic prompts (512 per seed, ``arithmetic_task``), raw template, reward 1 when the
  stripped completion is exactly the integer answer (``rewards.math.arithmetic_reward``, re-stated in the TRL
  worker, which cannot import this package).
* Step: 64 prompts x G=8 completions, at most 6 new tokens, temperature 1, untruncated sampling; advantages
  (r - mean) / std per group; PPO-clip loss eps 0.2, no KL term, per-sequence token mean then mean over
  sequences (our ``grpo`` preset with ``loss.kl_coef=0``; TRL ``loss_type="grpo"``, ``beta=0``); Adam lr 5e-4,
  betas (0.9, 0.999), eps 1e-8, no weight decay, constant schedule, gradient clipping 1.0; ONE optimizer update
  per step (TRL: ``steps_per_generation=1``, ``gradient_accumulation_steps=1``, ``num_iterations=1``).
  Our DPPO adds prompt/completion pruning (``algo.r_q = algo.r_o = 0.5``, the quickstart's setting).
* One torch thread per process (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), one process at a time,
  the methods interleaved (for each seed the order rotates), so load from other processes hits all alike.

What is printed (and written to ``<out>/vs_trl.json``)
------------------------------------------------------
Per method, over all seeds, after one warm-up step per run: median seconds per step, wall clock (and per phase
for ours: generate / logprob / train / ...) and process CPU seconds (one thread: the work done, far less
sensitive than the wall clock to other processes on a shared machine), completion tokens generated per second
of step time, the rollout reward (accuracy: the reward is 0/1) averaged over the last 3 steps (equal steps),
and at equal wall time (the last 3 steps each run finished within the shortest run's total step time; nan: no
step finished in that time). Our rollout reward is the run's headline ``reward/mean``: for DPPO the unbiased
(1/pi) estimate over ALL drawn prompts, pruned ones included, so the same population as GRPO's and TRL's.

The real-model work (``--work smollm2``)
-----------------------------------------
The same three methods on ``examples/smollm2_list_max_cpu.yaml``: SmolLM2-135M-Instruct (the GGUF the venv carries,
converted once into the example's ``model.gguf_cache``; every method loads that HF folder), the list_max prompts
(512 training instances per seed) rendered ONCE by our prompt formatter (SmolLM2's chat template, the example's
system prompt) and given to TRL as that text, so both tokenize the same string; 8 prompts x G=8 per step, at most
32 new tokens, reward 1 when the last number of the completion is the list's maximum (``final_number_reward``,
re-stated in the TRL worker); Adam lr 1e-5, clip 1.0, everything else as above. Our DPPO is ``algo.pruner=dppo``
with its defaults. Our phases split the step into generation and training; the train phase's FLOP per CPU second
against ``torch.mm``'s is ``benchmarks/real_step_profile.py``.

Precision (``--dtype``)
-----------------------
``float32`` (default): everything in fp32. ``bfloat16``: both sides in bf16 mixed precision with fp32 master weights
and optimizer state: ours ``model.dtype=bfloat16`` (Megatron's mixed-precision optimizer; ``rollout.dtype=auto``
samples in bf16 too), TRL loads the fp32 model and trains with ``bf16=True`` (Accelerate's bf16 autocast around
the fp32 model, which TRL's generation runs under as well).

TRL is the one of the main environment (``requirements/cpu.txt``, the parity tests' peer), in its own process
that imports nothing from this package; ``--trl-python`` names another environment's Python.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:  # `python benchmarks/vs_trl.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, RunFailed, cli, run  # (the standard library only: the TRL worker imports it)

METHODS = ("trl-grpo", "ours-grpo", "ours-dppo")


@dataclass(frozen=True)
class Work:
    """One comparison's fixed work (module docstring)."""

    config: str
    prompts_per_step: int
    group: int
    max_new_tokens: int
    lr: float
    reward: str  # the TRL worker's re-stated reward: "arithmetic" or "final_number"


WORKS = {"quickstart": Work("examples/quickstart.yaml", 64, 8, 6, 5e-4, "arithmetic"),
         "smollm2": Work("examples/smollm2_list_max_cpu.yaml", 8, 8, 32, 1e-5, "final_number")}


# ==============================================================================================================
# Driver (main environment)
# ==============================================================================================================
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error"}


def _run(cmd: list[str], log: Path) -> float:
    try:
        return run(cmd, log, env=ENV)["wall_s"]
    except RunFailed as err:
        sys.exit(str(err))


def prepare(out: Path, python: str, work: str) -> Path:
    """The HF folder every method starts from: for the quickstart, our warm start trained once and exported
    (weights + tokenizer, ``<out>/hf``); for SmolLM2, the example's GGUF converted once into its cache."""
    if work == "smollm2":
        from megatron_dppo.config import load_config
        from megatron_dppo.run.build import resolve_model_dir

        return resolve_model_dir(load_config(str(REPO / WORKS[work].config), [])).resolve()
    hf = out / "hf"
    if (hf / "config.json").is_file():
        return hf
    warm = out / "warm"
    print("warm start (examples/quickstart.yaml, train.steps=0) ...", flush=True)
    _run(cli("train", "--config", "examples/quickstart.yaml", "train.steps=0", "eval.every=0", "logging.plot=false",
             f"train.output_dir={warm}", python=python), out / "warm.log")
    _run(cli("convert", "megatron-to-hf", str(warm / "checkpoints"), str(hf), python=python), out / "export.log")
    return hf


def write_prompts(out: Path, seed: int, work: str, hf: Path) -> Path:
    """512 training prompts of ``seed``, as the text the model reads (our trainer draws from the same generator):
    the quickstart's raw arithmetic prompts; list_max questions rendered by our formatter (chat template and system
    prompt of the example), so that TRL is given exactly the string our engine tokenizes."""
    from megatron_dppo.config import load_config
    from megatron_dppo.run.build import _formatter, arithmetic_task, procedural_task

    path = out / f"prompts-{seed}.jsonl"
    cfg = load_config(str(REPO / WORKS[work].config), [f"train.seed={seed}"])
    if work == "quickstart":
        rows = [{"prompt": r.prompt, "gold": str(r.gold)}
                for r in arithmetic_task(cfg).records(cfg.data.arithmetic_train_size, "train")]
    else:
        from transformers import AutoTokenizer

        formatter = _formatter(cfg, AutoTokenizer.from_pretrained(hf))
        rows = [{"prompt": formatter.render(r.prompt), "gold": str(r.gold)}
                for r in procedural_task(cfg).records(512, "train", start=512 * (seed - 1))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_ours(method: str, out: Path, hf: Path, seed: int, steps: int, python: str, work: str,
             dtype: str = "float32") -> list[dict]:
    result = out / "runs" / f"{method}-s{seed}.json"
    pruner = "dppo" if method == "ours-dppo" else "none"
    model = [f"model.path={hf}", f"model.tokenizer={hf}"] if work == "quickstart" else []  # (smollm2: its GGUF)
    _run([python, str(Path(__file__).resolve()), "_ours", "--config", WORKS[work].config, "--result", str(result),
          "--steps", str(steps + 1), *model, "train.sft_steps=0", f"train.seed={seed}", "train.cpu_threads=1",
          f"algo.pruner={pruner}", f"model.dtype={dtype}", "loss.kl_coef=0.0", "eval.every=0", "logging.plot=false",
          f"train.output_dir={out / 'runs' / f'{method}-s{seed}'}"], out / f"{method}-s{seed}.log")
    return json.loads(result.read_text())


def ours_worker(argv: list[str]) -> None:
    """Our trainer's RL steps (no checkpoints, no eval), each timed in wall and process-CPU seconds."""
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    import torch

    from megatron_dppo.config import load_config
    from megatron_dppo.run.setup import setup, teardown
    from megatron_dppo.train.loop import rl_step

    cfg = load_config(str(REPO / a.config), a.overrides)
    run = setup(cfg, resume=False)
    torch.set_num_threads(1)
    steps = []
    try:
        for step in range(a.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            m = rl_step(run, step)
            steps.append({"time": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                          "reward": m.get("reward/mean", 0.0), "generated_tokens": m.get("tokens/generated", 0.0),
                          "phases": {k[5:]: v for k, v in m.items() if k.startswith("time/") and k != "time/step"}})
    finally:
        teardown(run)
    Path(a.result).write_text(json.dumps(steps))


def run_trl(out: Path, hf: Path, prompts: Path, seed: int, steps: int, trl_python: str, work: str,
            dtype: str = "float32") -> list[dict]:
    result = out / "runs" / f"trl-grpo-s{seed}.json"
    _run([trl_python, str(Path(__file__).resolve()), "_trl", "--hf", str(hf), "--prompts", str(prompts),
          "--work", json.dumps(asdict(WORKS[work])), "--dtype", dtype,
          "--seed", str(seed), "--steps", str(steps + 1), "--result", str(result),
          "--workdir", str(out / "runs" / f"trl-grpo-s{seed}")], out / f"trl-grpo-s{seed}.log")
    return json.loads(result.read_text())


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _last_mean(xs, k=3):
    xs = xs[-k:]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(runs: dict[str, list[list[dict]]]) -> dict:
    """Per method: medians over every measured step of every seed (warm-up step dropped)."""
    measured = {m: [r[1:] for r in rs] for m, rs in runs.items()}
    equal_time = min(sum(s["time"] for s in r) for rs in measured.values() for r in rs)
    summary = {}
    for m, rs in measured.items():
        steps = [s for r in rs for s in r]
        phases = sorted({k for s in steps for k in s.get("phases", {})})
        within = []
        for r in rs:
            t, done = 0.0, []
            for s in r:
                t += s["time"]
                if t > equal_time:
                    break
                done.append(s["reward"])
            within.append(_last_mean(done))
        summary[m] = {
            "step_s_median": _median([s["time"] for s in steps]),
            "step_cpu_s_median": _median([s["cpu"] for s in steps]),
            "phase_s_median": {k: _median([s["phases"][k] for s in steps if k in s["phases"]]) for k in phases},
            "generated_tokens_per_s": sum(s["generated_tokens"] for s in steps) / sum(s["time"] for s in steps),
            "reward_last3_equal_steps": statistics.mean(_last_mean([s["reward"] for s in r]) for r in rs),
            "reward_last3_equal_time": statistics.mean(within),
            "steps_measured": len(steps),
        }
    summary["_equal_time_s"] = equal_time
    trl = summary["trl-grpo"]["step_s_median"]
    trl_cpu = summary["trl-grpo"]["step_cpu_s_median"]
    for m in ("ours-grpo", "ours-dppo"):
        summary[m]["step_vs_trl"] = summary[m]["step_s_median"] / trl
        summary[m]["cpu_vs_trl"] = summary[m]["step_cpu_s_median"] / trl_cpu
    return summary


def print_summary(summary: dict, meta: dict) -> None:
    print(f"\n{meta.get('dtype', 'float32')}: {meta['seeds']} seeds x {meta['steps']} measured steps per run (+1 "
          "warm-up), one torch thread, "
          f"interleaved; load average before/after: {meta['load_before']:.1f} / {meta['load_after']:.1f}")
    print(f"{'method':10s} {'s/step':>7s} {'x TRL':>6s} {'CPU s':>6s} {'x TRL':>6s} {'gen tok/s':>9s} "
          f"{'reward@steps':>12s} {'reward@time':>11s}  phases (median wall s)")
    for m in METHODS:
        s = summary[m]
        ratio, cpu_ratio = s.get("step_vs_trl", 1.0), s.get("cpu_vs_trl", 1.0)
        phases = " ".join(f"{k}={v:.3f}" for k, v in s["phase_s_median"].items() if v >= 0.0005)
        print(f"{m:10s} {s['step_s_median']:7.3f} {ratio:6.2f} {s['step_cpu_s_median']:6.3f} {cpu_ratio:6.2f} "
              f"{s['generated_tokens_per_s']:9.0f} "
              f"{s['reward_last3_equal_steps']:12.3f} {s['reward_last3_equal_time']:11.3f}  {phases}")
    print(f"equal wall time = {summary['_equal_time_s']:.1f} s of step time (the shortest run)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="measured steps per run (after one warm-up step; DPPO's "
                   "prompt pruning acts from step 9 on, once prompts have a history)")
    p.add_argument("--work", choices=sorted(WORKS), default="quickstart", help="the quickstart's 1.6M-parameter "
                   "model on arithmetic, or SmolLM2-135M-Instruct on list_max (module docstring)")
    p.add_argument("--out", default=None, help="default runs/vs_trl (quickstart), runs/vs_trl_smollm2; with "
                   "--dtype bfloat16 the folder name ends in _bf16")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both sides' precision (module docstring, 'Precision')")
    p.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    p.add_argument("--trl-python", default=str(REPO / ".venv" / "bin" / "python"),
                   help="a Python with TRL (the main venv has the TRL of requirements/cpu.txt, the parity tests' peer)")
    args = p.parse_args()
    default_out = "runs/vs_trl" if args.work == "quickstart" else f"runs/vs_trl_{args.work}"
    default_out += "_bf16" if args.dtype == "bfloat16" else ""
    out = (REPO / (args.out or default_out)).resolve()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    hf = prepare(out, args.python, args.work)
    runs: dict[str, list] = {m: [] for m in METHODS}
    for i, seed in enumerate(range(1, args.seeds + 1)):
        prompts = write_prompts(out, seed, args.work, hf)
        order = METHODS[i % 3:] + METHODS[: i % 3]
        for m in order:
            print(f"seed {seed}: {m} ...", flush=True)
            if m == "trl-grpo":
                runs[m].append(run_trl(out, hf, prompts, seed, args.steps, args.trl_python, args.work, args.dtype))
            else:
                runs[m].append(run_ours(m, out, hf, seed, args.steps, args.python, args.work, args.dtype))
            print(f"  median s/step {_median([s['time'] for s in runs[m][-1][1:]]):.3f}", flush=True)
    meta = {"work": args.work, **asdict(WORKS[args.work]), "dtype": args.dtype, "seeds": args.seeds,
            "steps": args.steps, "load_before": load_before, "load_after": os.getloadavg()[0],
            "cpu_count": os.cpu_count()}
    summary = summarize(runs)
    print_summary(summary, meta)
    (out / "vs_trl.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {out / 'vs_trl.json'}")


# ==============================================================================================================
# TRL worker (TRL's environment; imports nothing from this package)
# ==============================================================================================================
_INTEGER_RE = re.compile(r"-?\d+")


_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def arithmetic_reward(completion: str, gold: str) -> float:
    """== megatron_dppo.rewards.math.arithmetic_reward."""
    text = completion.strip()
    return float(bool(_INTEGER_RE.fullmatch(text)) and int(text) == int(str(gold).strip()))


def final_number_reward(completion: str, gold: str) -> float:
    """== megatron_dppo.rewards.math.final_number_reward (the last number written equals the gold number)."""
    from fractions import Fraction

    numbers = _NUMBER_RE.findall(completion.replace("\\$", "").replace("$", ""))
    return float(bool(numbers) and Fraction(numbers[-1].replace(",", "")) == Fraction(str(gold).strip()))


TRL_REWARDS = {"arithmetic": arithmetic_reward, "final_number": final_number_reward}


def trl_worker(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    for name in ("--hf", "--prompts", "--result", "--workdir"):
        p.add_argument(name, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--work", required=True, help="the Work's fields, as JSON")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = p.parse_args(argv)
    work = Work(**json.loads(a.work))
    score = TRL_REWARDS[work.reward]

    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in open(a.prompts)]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(a.hf)
    model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32)

    def reward(completions, gold, **_):
        return [score(c, g) for c, g in zip(completions, gold)]

    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            steps.append({"time": time.perf_counter() - self.t0, "cpu": time.process_time() - self.c0})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = float(logs["reward"])
                steps[-1]["generated_tokens"] = float(logs.get("completions/mean_length", 0.0)) * \
                    work.prompts_per_step * work.group

    config = GRPOConfig(
        output_dir=a.workdir, seed=a.seed, max_steps=a.steps, use_cpu=True, bf16=a.dtype == "bfloat16",
        per_device_train_batch_size=work.prompts_per_step * work.group, num_generations=work.group,
        steps_per_generation=1, gradient_accumulation_steps=1, num_iterations=1,
        max_completion_length=work.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, learning_rate=work.lr,
        lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, beta=0.0,
        epsilon=0.2, loss_type="grpo", scale_rewards="group", logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    Path(a.result).write_text(json.dumps(steps))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_trl":
        trl_worker(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_ours":
        ours_worker(sys.argv[2:])
    else:
        main()
