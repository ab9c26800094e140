"""Evaluation: pass@1 and unbiased pass@k on held-out prompts, during training and for ``megatron-dppo eval``."""
from __future__ import annotations

import json
import time
from pathlib import Path

from megatron_dppo import distributed as D
from megatron_dppo.config import Config
from megatron_dppo.metrics import pass_at_k
from megatron_dppo.run import Run, setup, teardown
from megatron_dppo.stages import generate, score


def evaluate(run: Run, step: int) -> dict[str, float]:
    """For every eval set: pass@1 (mean correctness over eval.samples samples) and unbiased pass@k."""
    cfg, out = run.cfg, {}
    for name, prompts in run.eval_sets.items():
        start = time.perf_counter()
        rollout = generate(run, prompts, cfg.eval.samples, step, temperature=cfg.eval.temperature,
                           tag=f"eval/{name}")
        rewards = score(run, run.eval_scorers[name], rollout)
        correct = (rewards > 0).sum(dim=1).tolist()
        n, k = cfg.eval.samples, cfg.eval.pass_k
        out[f"eval/{name}/pass@1"] = sum(c / n for c in correct) / len(correct)
        out[f"eval/{name}/pass@{k}"] = sum(pass_at_k(n, int(c), k) for c in correct) / len(correct)
        out[f"eval/{name}/reward_mean"] = float(rewards.mean())
        out[f"eval/{name}/seconds"] = time.perf_counter() - start
    return out


def evaluate_checkpoint(cfg: Config) -> dict[str, float]:
    """``megatron-dppo eval``: pass@1 / pass@k of the latest checkpoint (or model.path) on the eval sets."""
    if cfg.data.task != "arithmetic" and not cfg.eval.files:
        raise ValueError("megatron-dppo eval needs eval.files (held-out JSONL/parquet files), e.g. "
                         "eval.files=[../shared/data/math/gsm8k_test.jsonl]")
    run = setup(cfg, resume=True, need_eval=True)
    try:
        metrics = evaluate(run, run.rl_step)
        if D.is_main():
            for k, v in metrics.items():
                print(f"{k}: {v:.4f}")
            with open(Path(cfg.train.output_dir) / "eval.json", "w") as f:
                json.dump({"rl_step": run.rl_step, **metrics}, f, indent=1)
        return metrics
    finally:
        teardown(run)

