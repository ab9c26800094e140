"""Console output of a run: progress bars, the per-step line, the start-up banner (rank 0 only)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from megatron_dppo.config import Config
from megatron_dppo.distributed import collectives as D

if TYPE_CHECKING:
    from megatron_dppo.run.state import Run


def progress_bar(tqdm, cfg: Config, start: int, total: int, desc: str):
    if not (D.is_main() and cfg.logging.progress_bar) or start >= total:
        return None
    return tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, leave=True)


def progress(bar, postfix: dict) -> None:
    if bar is not None:
        bar.set_postfix({k: f"{v:.3g}" for k, v in postfix.items()}, refresh=False)
        bar.update(1)


def close_bar(bar) -> None:
    if bar is not None:
        bar.close()


def print_step(cfg: Config, step: int, m: dict) -> None:
    every = cfg.logging.print_every
    if not (D.is_main() and every and (step + 1) % every == 0):
        return
    phases = " ".join(f"{k[5:]}={m[k]:.2f}s" for k in ("time/generate", "time/reward", "time/logprob",
                                                        "time/train", "time/weight_sync") if k in m)
    ev = " ".join(f"{k[5:]}={v:.3f}" for k, v in m.items() if k.startswith("eval/") and "pass@" in k)
    # what a pruning decision is predicted to cost (relative variance per level) next to what the audit measured
    cost = " ".join(f"{label} {m[k]:.3f}" for label, k in (("q", "prune/prompt_predicted_rel_var"),
                                                           ("o", "prune/completion_predicted_rel_var")) if k in m)
    cost = (f" | predicted rel. var {cost}" if cost else "") + \
        (f" | audit cos {m['audit/cosine']:.3f}" if "audit/cosine" in m else "")
    line_env = episode_summary(m)
    line = (f"step {step:4d} | reward {m.get('reward/mean', float('nan')):.3f} (generated "
            f"{m.get('reward/mean_generated', float('nan')):.3f}, trained "
            f"{m.get('reward/mean_kept', float('nan')):.3f})"
            f" | kept prompts {m['prune/prompt_kept_fraction']:.2f} completions "
            f"{m['prune/completion_kept_fraction']:.2f} | ESS {m['prune/total_ess']:.1f} | density "
            f"{m.get('packing/density', 0):.2f}{cost}{line_env} | {phases} | {m['throughput/tokens_per_s']:.0f} tok/s"
            + (f" | {ev}" if ev else ""))
    if cfg.logging.progress_bar:
        from tqdm import tqdm
        tqdm.write(line)  # above the progress bar
    else:
        print(line, flush=True)


def episode_summary(m: dict) -> str:
    """The multi-turn part of the step line (empty without episodes): turns and tool calls per episode, tool errors
    and timeouts, the finish reasons' shares, episode time p50/p99."""
    if "env/turns_mean" not in m:
        return ""
    from megatron_dppo.env import FINISH_REASONS

    finish = " ".join(f"{r} {m[f'env/finish_{r}']:.2f}" for r in FINISH_REASONS if m.get(f"env/finish_{r}", 0) > 0)
    return (f" | turns {m['env/turns_mean']:.2f} tools {m['env/tool_calls_mean']:.2f} (errors "
            f"{m['env/tool_errors']:.0f}, timeouts {m['env/tool_timeouts']:.0f}) | finish {finish} | episode p50 "
            f"{m['time/episode_p50']:.2f}s p99 {m['time/episode_p99']:.2f}s")


def attention_backend_name(cfg, arch=None) -> str:
    """The attention backend the engine was built with (model.attention_backend resolved for the model's dtype and
    head dim, as ``model.build_gpt_model`` resolves it: te | varlen | sdpa)."""
    import torch

    from megatron_dppo.megatron.model import resolve_backend

    return resolve_backend(cfg.model.attention_backend, dtype=getattr(torch, cfg.model.dtype),
                           head_dim=arch.head_dim if arch is not None else None)


def print_banner(run: Run, found: Path | None) -> None:
    cfg, arch = run.cfg, run.arch
    model, layout = f"{arch.num_parameters / 1e6:.2f}M params", ""
    precision = cfg.model.dtype if cfg.rollout.dtype in ("auto", cfg.model.dtype) else \
        f"{cfg.model.dtype}, rollout {cfg.rollout.dtype}"
    if arch.moe is not None:
        model += (f" ({arch.num_active_parameters / 1e6:.2f}M active: {arch.moe.num_experts} experts, top "
                  f"{arch.moe.topk}{', routing replay' if cfg.model.moe_routing_replay else ''})")
        layout = f", ep {cfg.parallel.ep}, etp {cfg.parallel.etp}"
    print(f"megatron-dppo: {arch.family} {model} ({precision}) | world {D.world_size()} "
          f"(tp {cfg.parallel.tp}, pp {cfg.parallel.pp}{f', cp {cfg.parallel.cp}' if cfg.parallel.cp > 1 else ''}, "
          f"dp {run.train_side.dp_size}{layout}) | {len(run.rollout_side.train_prompts)} "
          "train prompts"
          f" | pruner {cfg.algo.pruner} | loss {cfg.loss.preset} ({run.train_side.loss_cfg.aggregation}, "
          f"estimator {run.train_side.estimator}) | attention {attention_backend_name(cfg, arch)} | output "
          f"{cfg.train.output_dir}"
          + (f" | resuming {found.name}" if found else ""), flush=True)

