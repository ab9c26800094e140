"""Evaluation: pass@1 and unbiased pass@k on held-out prompts, during training and for ``megatron-dppo eval``."""
from __future__ import annotations

import json
import time
from pathlib import Path

from megatron_dppo.config import Config
from megatron_dppo.distributed import collectives as D
from megatron_dppo.run.metrics import pass_at_k
from megatron_dppo.run.setup import setup, teardown
from megatron_dppo.run.state import RolloutSide
from megatron_dppo.train.rollouts import generate, score_rule


def evaluate(side: RolloutSide, step: int) -> dict[str, float]:
    """For every eval set: pass@1 (mean correctness over eval.samples samples) and unbiased pass@k (the rollout
    side's engine, here or on a rollout worker; sampling seeds from (seed, step, "eval/<set>", shard)). Correct =
    the rule reward (the eval set's reward.fn) > 0; an episode's environment step rewards and a reward model's
    scores never count (docs/reward_models.md)."""
    cfg, out = side.cfg, {}
    for name, prompts in side.eval_sets.items():
        start = time.perf_counter()
        rollout = generate(side, prompts, cfg.eval.samples, step, temperature=cfg.eval.temperature,
                           tag=f"eval/{name}")
        rewards = score_rule(side.eval_scorers[name], rollout, cfg.eval.samples)
        correct = (rewards > 0).sum(dim=1).tolist()
        n, k = cfg.eval.samples, cfg.eval.pass_k
        out[f"eval/{name}/pass@1"] = sum(c / n for c in correct) / len(correct)
        out[f"eval/{name}/pass@{k}"] = sum(pass_at_k(n, int(c), k) for c in correct) / len(correct)
        out[f"eval/{name}/reward_mean"] = float(rewards.mean())
        out[f"eval/{name}/seconds"] = time.perf_counter() - start
    if len(side.eval_sets) > 1:  # the papers' headline: the unweighted mean over benchmarks
        names = list(side.eval_sets)
        for key in ("pass@1", f"pass@{cfg.eval.pass_k}"):
            out[f"eval/average/{key}"] = sum(out[f"eval/{n}/{key}"] for n in names) / len(names)
    return out


def results_table(metrics: dict[str, float], sets: dict[str, list], samples: int, k: int) -> str:
    """One markdown table: a row per eval set (prompts, pass@1 averaged over ``samples`` samples, pass@k) and the
    average row (unweighted mean over the sets) when there are several."""
    lines = [f"| benchmark | prompts | pass@1 (mean of {samples} samples) | pass@{k} |", "|---|---|---|---|"]
    for name, prompts in sets.items():
        lines.append(f"| {name} | {len(prompts)} | {100 * metrics[f'eval/{name}/pass@1']:.1f} | "
                     f"{100 * metrics[f'eval/{name}/pass@{k}']:.1f} |")
    if "eval/average/pass@1" in metrics:
        lines.append(f"| **average** | {sum(len(p) for p in sets.values())} | "
                     f"**{100 * metrics['eval/average/pass@1']:.1f}** | "
                     f"{100 * metrics[f'eval/average/pass@{k}']:.1f} |")
    return "\n".join(lines)


def evaluate_checkpoint(cfg: Config) -> dict[str, float]:
    """``megatron-dppo eval``: pass@1 / pass@k of the latest checkpoint (or model.path) on the eval sets
    (eval.files, eval.suite), printed as one table with the average row and written to <output_dir>/eval.json."""
    if cfg.data.task not in ("arithmetic", "procedural") and not cfg.eval.files and not cfg.eval.suite:
        raise ValueError("megatron-dppo eval needs eval.files (held-out JSONL/parquet files) or eval.suite, e.g. "
                         "eval.files=[data/gsm8k_test.jsonl] or eval.suite=math6 (files written by `megatron-dppo data "
                         "prepare gsm8k|math6 --out data`)")
    run = setup(cfg, resume=True, need_eval=True)
    try:
        metrics = evaluate(run.rollout_side, run.rl_step)
        if D.is_main():
            for k, v in metrics.items():
                print(f"{k}: {v:.4f}")
            table = results_table(metrics, run.rollout_side.eval_sets, cfg.eval.samples, cfg.eval.pass_k)
            print(f"evaluation at RL step {run.rl_step}, temperature {cfg.eval.temperature} (percent):\n{table}")
            with open(Path(cfg.train.output_dir) / "eval.json", "w") as f:
                json.dump({"rl_step": run.rl_step, **metrics, "table": table}, f, indent=1)
        return metrics
    finally:
        teardown(run)

