"""Partial rollouts (``rollout.max_interruptions``) on a CPU task with a long tail: 1 trainer + 1 HF rollout worker at
``train.max_staleness`` 1, whole batches against batches whose running samples take the next weight version
mid-generation (docs/benchmarks.md, "Partial rollouts"; docs/async.md, "Partial rollouts").

The task: the quickstart (``examples/quickstart.yaml``, single-digit arithmetic) after a SHORT warm start and with
completions allowed up to ``--max-new-tokens`` (48): most answers stop after 2-3 tokens, a few samples of every
batch run to the limit, and the HF engine's batch runs as long as its longest row. Each arm is one CLI run,
evaluation at the first and last version only (run by the worker), checkpoints off; the arms of a seed run one after
the other, never concurrently. Reported per run over the RL steps after the first (start-up):

* the trainer's idle seconds (``time/wait_rollout``) and the worker's (``async/rollout_idle_s``);
* generated tokens per worker-busy second and per worker CPU second (``async/rollout_cpu_s``);
* the per-token staleness (``async/token_staleness``) and the share of samples interrupted;
* learning per CPU second: held-out reward after the last step minus before the first, over the CPU seconds of
  both sides (trainer ``time/step_cpu`` + worker ``async/rollout_cpu_s``).

Run: ``.venv/bin/python benchmarks/partial_rollouts.py [--steps 30] [--seeds 1,2] [--out docs/benchmarks/
partial_rollouts.json]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

if not __package__:  # `python benchmarks/partial_rollouts.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, cli, machine, read_metrics, run, write_json

SEPARATE = ["rollout.placement=separate", "train.max_staleness=1"]
ARMS = {
    "whole": ("whole batches (max_interruptions 0)", []),
    "partial": ("partial rollouts (max_interruptions 2)", ["rollout.max_interruptions=2"]),
    "partial_mask": ("partial, off-policy segments masked", ["rollout.max_interruptions=2",
                                                             "rollout.mask_offpolicy=true"]),
    # over-provisioning (APRIL) needs k >= 2; "partial_k2" is its comparison at the same bound
    "partial_k2": ("partial rollouts, max_staleness 2", ["rollout.max_interruptions=2", "train.max_staleness=2"]),
    "april": ("partial + over-provisioning 0.5 (APRIL), k 2", ["rollout.max_interruptions=2", "train.max_staleness=2",
                                                               "rollout.overprovision=0.5"]),
}


def run_arm(name: str, seed: int, args, root: Path) -> dict:
    label, overrides = ARMS[name]
    out = root / f"{name}-{seed}"
    common = [f"train.steps={args.steps}", f"train.sft_steps={args.sft_steps}", f"train.seed={seed}",
              f"rollout.max_new_tokens={args.max_new_tokens}", f"eval.every={args.steps}",
              f"eval.max_prompts={args.eval_prompts}", f"eval.samples={args.eval_samples}", "eval.pass_k=1",
              "checkpoint.every=0", "logging.plot=false", "logging.tensorboard=false", f"train.output_dir={out}",
              *SEPARATE, *overrides, *args.overrides]
    cmd = cli("train", "--config", str(REPO / "examples" / "quickstart.yaml"), *common, nproc=2)
    wall = run(cmd, root / f"{name}-{seed}.log", env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    rl = read_metrics(out, "rl")[1:]  # the first RL step carries start-up costs
    evals = read_metrics(out, "eval")
    total = lambda key: sum(r.get(key, 0.0) for r in rl)  # noqa: E731
    reward_key = next(k for k in evals[0] if k.startswith("eval/") and k.endswith("/reward_mean"))
    tokens = total("tokens/generated")
    cpu = total("time/step_cpu") + total("async/rollout_cpu_s")
    gain = evals[-1][reward_key] - evals[0][reward_key]
    result = {
        "arm": name, "label": label, "seed": seed, "steps_measured": len(rl), "process_wall_s": wall["wall_s"],
        "trainer_idle_s": total("time/wait_rollout"), "worker_idle_s": total("async/rollout_idle_s"),
        "worker_busy_s": total("async/rollout_busy_s"), "worker_cpu_s": total("async/rollout_cpu_s"),
        "trainer_cpu_s": total("time/step_cpu"), "cpu_s_total": cpu,
        "completion_len_mean": statistics.mean(r["tokens/completion_mean"] for r in rl),
        "truncated_fraction_mean": statistics.mean(r["tokens/truncated_fraction"] for r in rl),
        "staleness_mean": total("async/staleness") / len(rl),
        "token_staleness_mean": total("async/token_staleness") / len(rl) if "async/token_staleness" in rl[0]
        else total("async/staleness") / len(rl),
        "interrupted_samples_mean": total("async/interrupted_samples") / len(rl),
        "versions_taken_mid_batch": total("async/versions_taken_mid_batch"),
        "carried_prompts_per_step": total("async/carried_prompts") / len(rl),
        "eval_reward_first": evals[0][reward_key], "eval_reward_last": evals[-1][reward_key],
        "eval_gain_per_cpu_s": gain / cpu, "train_reward_last10": statistics.mean(r["reward/mean"] for r in rl[-10:]),
    }
    result.update(tokens_generated=tokens, tokens_per_busy_s=tokens / result["worker_busy_s"],
                  tokens_per_worker_cpu_s=tokens / result["worker_cpu_s"])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sft-steps", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts per evaluation")
    p.add_argument("--eval-samples", type=int, default=4, help="fresh samples per evaluation prompt")
    p.add_argument("--arms", default="whole,partial")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every arm")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="partial_rollouts_") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            for name in args.arms.split(","):
                r = run_arm(name, seed, args, Path(tmp))
                results.append(r)
                print(f"seed {seed} {r['label']:40s} idle: trainer {r['trainer_idle_s']:.1f} s, worker "
                      f"{r['worker_idle_s']:.1f} s | worker busy {r['worker_busy_s']:.1f} s, "
                      f"CPU {r['worker_cpu_s']:.1f}"
                      f" s | tokens/busy s {r['tokens_per_busy_s']:.0f} | token staleness "
                      f"{r['token_staleness_mean']:.2f} (interrupted {r['interrupted_samples_mean']:.2f}) | eval "
                      f"{r['eval_reward_first']:.3f} -> {r['eval_reward_last']:.3f}, per CPU s "
                      f"{r['eval_gain_per_cpu_s']:.2e}", flush=True)
    write_json(args.out, {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "out"},
                          "runs": results})


if __name__ == "__main__":
    main()
