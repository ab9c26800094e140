"""The RL loop: one step reads exactly like the data flow of ARCHITECTURE.md.

    prompts ─► prompt pruning (DPPO: history, pi_q; pruned prompts are never generated)
            ─► generate G completions (rollout engine)  ─► rewards  ─► advantages on the FULL groups
            ─► completion pruning (none | cppo | dppo): keep mask + weight, full-batch denominator D
            ─► Dense Prompt Packing (THD micro-batches, equal count per DP rank)
            ─► old/ref log-probs (forward only)  ─► policy update with the fixed D
            ─► weight push (Megatron -> HF names -> rollout engine)  ─► eval  ─► metrics  ─► checkpoint

What this file decides (and the simplifications it makes, stated once):

* One optimizer update per rollout batch (on-policy). Old log-probs are recomputed by the Megatron engine
  (``train.recompute_old_logprobs``), so the PPO ratio is exactly 1 at the update and clipping only matters
  for train/inference mismatch; the rollout engine's own log-probs serve as a mismatch metric.
* Every process holds a rollout engine. Generation, reward scoring and evaluation are sharded over ranks
  (``distributed.map_sharded``) and gathered, so every rank sees the same full batch; advantages, the packing
  plan and the denominator are then computed identically everywhere, and every random pruning draw is made on
  rank 0 with a generator seeded from (seed, step, decision) and broadcast (ARCHITECTURE.md rules).
* Sampling seeds are derived from (seed, step, shard), so a resumed run regenerates exactly what a straight
  run would have generated (resume == straight run, bit for bit, at the same layout).
* The supervised warm start (``train.sft_steps``) goes through the same engine and loss: advantage 1 on gold
  completions at ratio 1 gives exactly the log-likelihood gradient (per-sequence token mean, mean over
  sequences); KL is off during it, and the reference model is re-synced to the warmed-up policy afterwards.
* The trainer owns the learning-rate schedule across phases (constant ``train.sft_lr`` for the warm start, then
  ``optim.*`` counted from the first RL step) and sets the engine's per-group peak LR before each update.
* CPPO reproduces its authors' "mean over kept completions" (the denominator counts kept units); DPPO and
  ``none`` use the full-batch denominator of ALGORITHMS.md section 3.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_dppo import distributed as D
from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.losses import LossConfig, loss_denominator, sequence_token_weights
from megatron_dppo.algo.pruning import (
    CPPOPruner,
    DPPOPruner,
    PromptHistory,
    PruneResult,
    combine,
    make_generator,
    pruning_stats,
    zero_variance_filter,
)
from megatron_dppo.build import (
    Prompt,
    build_hf_config,
    build_loss,
    build_rollout,
    build_scorer,
    build_tokenizer,
    eos_ids,
    full_hf_config,
    is_converted_checkpoint,
    load_eval_sets,
    load_train_prompts,
    quiet_logs,
    resolve_model_dir,
    torch_dtype,
)
from megatron_dppo.config import Config
from megatron_dppo.launch import stop_requested
from megatron_dppo.metrics import MetricsSink, PhaseTimer, pass_at_k, plot_reward_curve

logger = logging.getLogger("megatron_dppo.trainer")


# ==============================================================================================================
# Plain data passed between the stages of a step
# ==============================================================================================================
@dataclass
class Rollout:
    """The G completions of every kept prompt, identical on every rank after the gather."""

    prompts: list[Prompt]
    completions: list[list[list[int]]]  # [Bk][G] token ids (stop token included)
    texts: list[list[str]]  # [Bk][G] decoded completions
    policy_logprobs: list[list[list[float] | None]]  # [Bk][G] temperature-1 log-probs from the rollout engine
    truncated: list[list[bool]]  # [Bk][G] finish_reason == "length"
    rewards: torch.Tensor | None = None  # [Bk, G] float32

    @property
    def group_size(self) -> int:
        return len(self.completions[0]) if self.completions else 0


@dataclass
class TrainBatch:
    """The sequences that survive pruning, ready to pack, plus the fixed full-batch denominator D."""

    token_ids: list[list[int]]  # prompt + completion
    prompt_lengths: list[int]
    advantages: torch.Tensor  # [N] float32, the full-group advantage of each sequence
    token_weights: torch.Tensor  # [N] per-token loss factor (sequence_token_weights)
    seq_weights: torch.Tensor  # [N] pruning weight 1/P(keep)
    rewards: torch.Tensor  # [N]
    origin: list[tuple[int, int]]  # (kept-prompt row, completion index) of each sequence
    denominator: float

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class Run:
    """Everything one training run holds; built by :func:`setup`."""

    cfg: Config
    info: Any  # launch.LaunchInfo
    tokenizer: Any
    hf_config: dict
    arch: Any  # megatron.model.ModelArch
    engine: Any  # megatron.train_step.PolicyEngine
    rollout: Any  # rollout.RolloutEngine
    scorer: Any  # rewards.RewardScorer
    eval_scorers: dict[str, Any]
    train_prompts: list[Prompt]
    eval_sets: dict[str, list[Prompt]]
    sampler: Any  # data.PromptSampler
    pruner: DPPOPruner | CPPOPruner | None
    history: PromptHistory
    loss_cfg: LossConfig
    estimator: str
    sink: MetricsSink
    sft_pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (prompt ids, gold completion ids)
    rl_step: int = 0  # next RL step to run
    sft_step: int = 0  # warm-start steps done
    eos_ids: list[int] = field(default_factory=list)
    pad_id: int = 0
    audit: Any = None  # open file (rank 0, logging.audit_log)

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_world_size()


# ==============================================================================================================
# One RL step, top to bottom
# ==============================================================================================================
def rl_step(run: Run, step: int) -> dict[str, float]:
    """Run RL step ``step`` and return its metrics (identical on every rank)."""
    cfg, timer = run.cfg, PhaseTimer()
    G = cfg.train.group_size

    # 1. Prompts from the seeded, resumable sampler (CPPO allocation draws B/(1-P) to prune back to B*G).
    prompts = [run.train_prompts[i] for i in run.sampler.take(prompts_to_draw(run))]

    # 2. Prompt-level pruning (DPPO): low-signal prompts seen before are skipped with prob r_q, survivors 1/pi_q.
    with timer("prune"):
        prompt_cut = select_prompts(run, prompts, step)
    kept = [p for p, k in zip(prompts, prompt_cut.keep.tolist()) if k]

    # 3. Generate G completions for every kept prompt (sharded over ranks, gathered on all); then the rollout
    #    engine releases its accelerator memory for training (vLLM sleep mode; a no-op on CPU).
    with timer("generate"):
        rollout = generate(run, kept, G, step, temperature=cfg.rollout.temperature)
        if cfg.rollout.sleep_between_steps:
            run.rollout.sleep()

    # 4. Rewards (a failing reward function costs its sample a 0 and a warning).
    with timer("reward"):
        rollout.rewards = score(run, run.scorer, rollout)

    # 5. Advantages on the FULL groups (never recomputed from survivors); remember mean |A| per prompt.
    advantages = compute_advantages(rollout.rewards, run.estimator) if kept else torch.zeros(0, G)
    if kept:
        run.history.update([p.id for p in kept], advantages)

    # 6. Completion-level pruning -> per-completion keep mask and weight 1/(pi_q * pi_{i|q}).
    with timer("prune"):
        completion_cut, total_cut = select_completions(run, prompt_cut, rollout, advantages, step)

    # 7. The surviving sequences, their per-token weights and the fixed full-batch denominator D.
    batch = build_train_batch(run, prompts, prompt_cut, rollout, advantages, total_cut)

    metrics: dict[str, float] = {}
    if len(batch):
        # 8. Dense Prompt Packing: THD micro-batches, the same count on every DP rank.
        with timer("pack"):
            micro_batches, packing = pack(run, batch)
        # 9. Old-policy (and reference) log-probs, forward only.
        with timer("logprob"):
            if cfg.train.recompute_old_logprobs or run.loss_cfg.kl_coef > 0:
                run.engine.fill_logprobs(micro_batches, old=cfg.train.recompute_old_logprobs)
        # (every logging.audit_every steps: the pruned gradient against the full-batch one, at these weights)
        if cfg.logging.audit_every and step % cfg.logging.audit_every == 0:
            metrics.update(gradient_audit(run, prompts, prompt_cut, rollout, advantages, batch, micro_batches))
        # 10. Policy update with the fixed denominator D.
        with timer("train"):
            set_learning_rate(run.engine, rl_learning_rate(cfg, step))
            update = run.engine.train_step(micro_batches, batch.denominator)
        metrics.update({f"train/{k}": v for k, v in update.items()})
        # 11. Weight push: Megatron -> HF names -> rollout engine.
        with timer("weight_sync"):
            push_weights(run)
        metrics.update(packing)
        metrics.update(logprob_mismatch(rollout, batch, micro_batches))
    else:  # nothing survived (e.g. every group had equal rewards and was dropped): no update this step
        metrics["train/skipped"] = 1.0

    # 12. Metrics (ALGORITHMS.md section 5).
    metrics.update(step_metrics(run, prompt_cut, completion_cut, total_cut, rollout, batch))
    metrics.update(timer.as_metrics())
    metrics["throughput/tokens_per_s"] = metrics["tokens/trained_sequences"] / max(metrics["time/step"], 1e-9)
    write_audit(run, step, prompts, prompt_cut, rollout, advantages, total_cut)
    return metrics


# ==============================================================================================================
# The stages, in the order of the data flow
# ==============================================================================================================
def prompts_to_draw(run: Run) -> int:
    """B prompts; with CPPO dynamic completion allocation, enough to prune back to exactly B*G completions."""
    B = run.cfg.train.prompts_per_step
    if isinstance(run.pruner, CPPOPruner) and run.pruner.allocation:
        return run.pruner.prompts_to_draw(B, run.cfg.train.group_size)
    return B


def select_prompts(run: Run, prompts: list[Prompt], step: int) -> PruneResult:
    """DPPO prompt level on rank 0, broadcast; every other pruner keeps all prompts with probability 1."""
    n = len(prompts)
    if not isinstance(run.pruner, DPPOPruner):
        ones = torch.ones(n, dtype=torch.float64)
        return PruneResult(keep=torch.ones(n, dtype=torch.bool), weight=ones.float(), keep_prob=ones,
                           candidate=torch.zeros(n, dtype=torch.bool))
    result = None
    if D.is_main():
        history = run.history.scores([p.id for p in prompts])
        result = run.pruner.select_prompts(history, make_generator(run.cfg.train.seed, step, "prompts"))
    return D.broadcast_object(result)


def generate(run: Run, prompts: list[Prompt], n: int, step: int, temperature: float,
             tag: str = "generate") -> Rollout:
    """n completions per prompt; each rank generates a contiguous shard with a seed from (seed, step, shard)."""
    from megatron_dppo.rollout import SamplingParams

    cfg = run.cfg

    def generate_shard(shard: list[Prompt], shard_index: int) -> list[tuple]:
        sampling = SamplingParams(temperature=temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                  max_new_tokens=cfg.rollout.max_new_tokens,
                                  seed=D.derive_seed(cfg.train.seed, step, tag, shard_index) % (1 << 31))
        groups = run.rollout.generate([p.token_ids for p in shard], n, sampling)
        out = []
        for group in groups:
            comps = group.completions
            out.append(([c.token_ids for c in comps],
                        [run.tokenizer.decode(_strip_stop(c.token_ids, run.eos_ids), skip_special_tokens=True)
                         for c in comps],
                        [c.policy_logprobs for c in comps],
                        [c.finish_reason == "length" for c in comps]))
        return out

    run.rollout.wake_up()  # after a sleep (vLLM on GPU); a no-op when awake
    shard_index, num_shards = generation_shards(run)
    results = D.map_sharded(generate_shard, prompts, shard_index, num_shards)
    return Rollout(prompts=list(prompts), completions=[r[0] for r in results], texts=[r[1] for r in results],
                   policy_logprobs=[r[2] for r in results], truncated=[r[3] for r in results])


def score(run: Run, scorer: Any, rollout: Rollout) -> torch.Tensor:
    """Rewards [Bk, G]: each rank scores a shard of the completions, results gathered on all ranks."""
    items = [(text, p.gold, f"{p.id}#{i}") for p, texts in zip(rollout.prompts, rollout.texts)
             for i, text in enumerate(texts)]

    def score_shard(shard: list[tuple], _index: int) -> list[float]:
        result = scorer.score([t for t, _, _ in shard], [g for _, g, _ in shard], ids=[i for _, _, i in shard])
        return list(result.rewards)

    flat = D.map_sharded(score_shard, items)
    return torch.tensor(flat, dtype=torch.float32).view(len(rollout.prompts), rollout.group_size or 1) \
        if rollout.prompts else torch.zeros(0, run.cfg.train.group_size)


def select_completions(run: Run, prompt_cut: PruneResult, rollout: Rollout, advantages: torch.Tensor,
                       step: int) -> tuple[PruneResult | None, PruneResult]:
    """Completion-level decision on rank 0 (broadcast). Returns (decision over the kept prompts' completions
    [Bk, G], combined per-completion decision over all drawn prompts [B, G] with w = 1/(pi_q * pi_{i|q}))."""
    cfg, G = run.cfg, run.cfg.train.group_size
    decided = None
    if D.is_main() and len(rollout.prompts):
        gen = make_generator(cfg.train.seed, step, "completions")
        if isinstance(run.pruner, DPPOPruner):
            decided = run.pruner.select_completions(advantages, gen)
        elif isinstance(run.pruner, CPPOPruner):
            decided = (run.pruner.select_allocated(advantages, cfg.train.prompts_per_step, gen)
                       if run.pruner.allocation else run.pruner.select_completions(advantages, gen))
        else:
            ones = torch.ones(advantages.shape, dtype=torch.float64)
            decided = PruneResult(keep=torch.ones(advantages.shape, dtype=torch.bool), weight=ones.float(),
                                  keep_prob=ones, candidate=torch.zeros(advantages.shape, dtype=torch.bool))
        if cfg.algo.drop_zero_variance_groups:
            decided = _drop_zero_variance(decided, zero_variance_filter(rollout.rewards))
    decided = D.broadcast_object(decided)
    if decided is None:  # no prompt survived prompt pruning
        B = len(prompt_cut.keep)
        empty = torch.zeros(B, G, dtype=torch.bool)
        return None, PruneResult(keep=empty, weight=empty.float(), keep_prob=torch.ones(B, G, dtype=torch.float64))
    return decided, combine(prompt_cut, decided)


def _drop_zero_variance(decided: PruneResult, zero_var: PruneResult) -> PruneResult:
    """Also drop (deterministically, probability 1) every completion of a group whose rewards are all equal."""
    keep = decided.keep & zero_var.keep
    prob = decided.probabilities().double()
    return PruneResult(keep=keep, weight=torch.where(keep, decided.weight, torch.zeros_like(decided.weight)),
                       keep_prob=prob, candidate=decided.candidate)


def build_train_batch(run: Run, prompts: list[Prompt], prompt_cut: PruneResult, rollout: Rollout,
                      advantages: torch.Tensor, total_cut: PruneResult) -> TrainBatch:
    """Flatten the kept (prompt, completion) pairs; per-token weights and the full-batch denominator D."""
    G, agg = total_cut.keep.shape[1], run.loss_cfg.aggregation
    kept_rows = prompt_cut.keep.nonzero().flatten().tolist()  # drawn-prompt index of each generated row
    token_ids, prompt_lengths, adv, weight, rewards, origin, comp_lengths = [], [], [], [], [], [], []
    for row, q in enumerate(kept_rows):
        prompt = rollout.prompts[row]
        for i in range(G):
            if not bool(total_cut.keep[q, i]):
                continue
            completion = rollout.completions[row][i]
            token_ids.append(prompt.token_ids + completion)
            prompt_lengths.append(len(prompt.token_ids))
            adv.append(float(advantages[row, i]))
            weight.append(float(total_cut.weight[q, i]))
            rewards.append(float(rollout.rewards[row, i]))
            origin.append((row, i))
            comp_lengths.append(len(completion))
    seq_w = torch.tensor(weight, dtype=torch.float32)
    lengths = torch.tensor(comp_lengths, dtype=torch.float32)
    return TrainBatch(
        token_ids=token_ids, prompt_lengths=prompt_lengths, advantages=torch.tensor(adv, dtype=torch.float32),
        token_weights=sequence_token_weights(agg, seq_w, lengths), seq_weights=seq_w,
        rewards=torch.tensor(rewards, dtype=torch.float32), origin=origin,
        denominator=denominator(run, prompts, prompt_cut, rollout, total_cut, comp_lengths) if token_ids else 1.0)


def denominator(run: Run, prompts: list[Prompt], prompt_cut: PruneResult, rollout: Rollout,
                total_cut: PruneResult, kept_lengths: list[int]) -> float:
    """D of ALGORITHMS.md section 3: a constant of the full drawn batch (B prompts x G), independent of the draw.
    CPPO instead averages over the kept completions (its authors' choice; biased by design)."""
    agg, G, L_max = run.loss_cfg.aggregation, run.cfg.train.group_size, run.cfg.rollout.max_new_tokens
    if isinstance(run.pruner, CPPOPruner):
        kept = torch.tensor(kept_lengths, dtype=torch.float64).view(-1, 1)
        return loss_denominator(agg, len(kept_lengths), 1, kept, None, L_max)
    lengths = torch.tensor([[len(c) for c in comps] for comps in rollout.completions], dtype=torch.float64)
    pi_q = None
    if isinstance(run.pruner, DPPOPruner):
        pi_q = prompt_cut.probabilities()[prompt_cut.keep].double()
    return loss_denominator(agg, len(prompts), G, lengths.view(-1, G), pi_q, L_max)


def pack(run: Run, batch: TrainBatch) -> tuple[list, dict[str, float]]:
    """This DP rank's THD micro-batches (Dense Prompt Packing) and the packing metrics of the whole plan."""
    from megatron_dppo.packing import build_rank_micro_batches, pack_sequences, packing_stats, thd_pad_multiple

    cfg = run.cfg
    pad = thd_pad_multiple(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.sp)
    lengths = [len(t) for t in batch.token_ids]
    plan = pack_sequences(lengths, cfg.packing.capacity, run.dp_size, cfg.packing.window, pad_multiple=pad,
                          micro_batch_multiple=cfg.parallel.pp if cfg.parallel.vpp else 1)
    stats = packing_stats(plan, lengths, cfg.packing.capacity, pad_multiple=pad)
    micro_batches = build_rank_micro_batches(plan[run.dp_rank], batch.token_ids, batch.prompt_lengths,
                                             batch.advantages, batch.token_weights, pad_multiple=pad,
                                             pad_token_id=run.pad_id)
    return micro_batches, {"packing/density": stats.density, "packing/micro_batches": float(stats.num_micro_batches),
                           "packing/max_bin_fill": stats.max_bin_fill,
                           "packing/rank_cost_imbalance": stats.rank_cost_imbalance}


def gradient_audit(run: Run, prompts: list[Prompt], prompt_cut: PruneResult, rollout: Rollout,
                   advantages: torch.Tensor, batch: TrainBatch, micro_batches: list) -> dict[str, float]:
    """audit/*: cosine and relative error of this step's pruned gradient vs the gradient of every generated
    completion (weighted 1/pi_q), both at the current weights (megatron_dppo.audit)."""
    from megatron_dppo.audit import full_completion_cut, pruning_audit

    full = build_train_batch(run, prompts, prompt_cut, rollout, advantages,
                             full_completion_cut(prompt_cut, run.cfg.train.group_size))
    full_micro_batches, _ = pack(run, full)
    return pruning_audit(run.engine, full_micro_batches, micro_batches, full.denominator, batch.denominator,
                         weights=batch.seq_weights).as_metrics()


def push_weights(run: Run) -> int:
    """Stream the policy's weights (gathered over TP/PP, HF names) into this rank's rollout engine. vLLM wakes its
    weights first and its KV cache only after the push, which keeps the peak memory low."""
    from megatron_dppo.convert import export_hf_weights

    stream = export_hf_weights(run.engine.model_chunks, run.arch, run.cfg.rollout.weight_bucket_mb << 20)
    if run.cfg.rollout.engine == "vllm":
        run.rollout.wake_up(["weights"])
    count = run.rollout.load_weights(stream)
    run.rollout.wake_up()
    return count


# ==============================================================================================================
# Metrics of a step
# ==============================================================================================================
def step_metrics(run: Run, prompt_cut: PruneResult, completion_cut: PruneResult | None, total_cut: PruneResult,
                 rollout: Rollout, batch: TrainBatch) -> dict[str, float]:
    """Rewards before/after pruning, kept fractions per level, ESS, tokens (ALGORITHMS.md section 5)."""
    cfg, G = run.cfg, run.cfg.train.group_size
    m: dict[str, float] = {}
    r = rollout.rewards if rollout.rewards is not None else torch.zeros(0, G)
    flat = r.flatten()
    if flat.numel():
        m["reward/mean"] = float(flat.mean())
        m["reward/std"] = float(flat.std()) if flat.numel() > 1 else 0.0
        m["reward/pass_rate"] = float((flat > 0).float().mean())
        m["reward/prompt_solve_rate"] = float((r > 0).any(dim=1).float().mean())
        m["reward/zero_variance_groups"] = float((r == r[:, :1]).all(dim=1).float().mean())
    if len(batch):
        m["reward/mean_kept"] = float(batch.rewards.mean())
        m["reward/pass_rate_kept"] = float((batch.rewards > 0).float().mean())
        m["reward/mean_kept_weighted"] = float((batch.rewards * batch.seq_weights).sum() / batch.seq_weights.sum())
    # kept fraction and ESS per level: prompt (of drawn prompts), completion (of generated completions), total
    # (trained sequences of the B*G drawn units)
    m.update(pruning_stats(prompt_cut, completion_cut, total_cut))
    m.setdefault("prune/completion_kept_fraction", 0.0)
    comp_lengths = [len(c) for comps in rollout.completions for c in comps]
    m["tokens/generated"] = float(sum(comp_lengths))
    m["tokens/completion_mean"] = sum(comp_lengths) / len(comp_lengths) if comp_lengths else 0.0
    m["tokens/truncated_fraction"] = (sum(t for ts in rollout.truncated for t in ts) / len(comp_lengths)
                                      if comp_lengths else 0.0)
    m["tokens/trained_sequences"] = float(sum(len(t) for t in batch.token_ids))
    m["tokens/trained_completion"] = float(sum(len(t) - p for t, p in zip(batch.token_ids, batch.prompt_lengths)))
    m["loss/denominator"] = float(batch.denominator)
    m["history/prompts_seen"] = float(len(run.history))
    return m


def logprob_mismatch(rollout: Rollout, batch: TrainBatch, micro_batches: list) -> dict[str, float]:
    """Mean |rollout-engine log-prob - Megatron old log-prob| over completion tokens (weight-sync health check)."""
    diff, count = 0.0, 0
    for mb in micro_batches:
        if mb.old_logprobs is None or mb.is_dummy:
            continue
        for sid, values in zip(mb.sample_ids.tolist(), mb.completion_values(mb.old_logprobs)):
            row, i = batch.origin[sid]
            ref = rollout.policy_logprobs[row][i]
            if ref is None or len(ref) != values.numel():
                continue
            diff += float((values.double().cpu() - torch.tensor(ref, dtype=torch.float64)).abs().sum())
            count += values.numel()
    totals = D.all_gather_objects((diff, count))
    diff, count = sum(t[0] for t in totals), sum(t[1] for t in totals)
    return {"rollout/logprob_abs_diff": diff / count} if count else {}


def write_audit(run: Run, step: int, prompts: list[Prompt], prompt_cut: PruneResult, rollout: Rollout,
                advantages: torch.Tensor, total_cut: PruneResult) -> None:
    """logging.audit_log: one JSON line per drawn prompt with every completion's reward, advantage, keep, weight."""
    if run.audit is None:
        return
    row_of = {q: row for row, q in enumerate(prompt_cut.keep.nonzero().flatten().tolist())}
    for q, prompt in enumerate(prompts):
        rec: dict[str, Any] = {"step": step, "prompt_id": prompt.id, "prompt_kept": bool(prompt_cut.keep[q]),
                               "prompt_weight": float(prompt_cut.weight[q])}
        if q in row_of:
            row = row_of[q]
            rec.update(rewards=rollout.rewards[row].tolist(), advantages=advantages[row].tolist(),
                       keep=total_cut.keep[q].tolist(), weight=total_cut.weight[q].tolist(),
                       lengths=[len(c) for c in rollout.completions[row]], completions=rollout.texts[row])
        run.audit.write(json.dumps(rec) + "\n")
    run.audit.flush()


# ==============================================================================================================
# Evaluation: pass@1 and pass@k on held-out prompts
# ==============================================================================================================
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


# ==============================================================================================================
# Supervised warm start (same engine, same loss: advantage 1 at ratio 1 == log-likelihood gradient)
# ==============================================================================================================
def sft_step(run: Run, step: int) -> dict[str, float]:
    """One warm-start update on ``train.sft_batch_size`` gold (prompt, completion) pairs."""
    import random

    cfg, timer = run.cfg, PhaseTimer()
    rng = random.Random(D.derive_seed(cfg.train.seed, step, "sft"))
    pairs = [run.sft_pairs[i] for i in rng.sample(range(len(run.sft_pairs)),
                                                  min(cfg.train.sft_batch_size, len(run.sft_pairs)))]
    lengths = torch.tensor([len(c) for _, c in pairs], dtype=torch.float32)
    ones = torch.ones(len(pairs), dtype=torch.float32)
    batch = TrainBatch(token_ids=[p + c for p, c in pairs], prompt_lengths=[len(p) for p, _ in pairs],
                       advantages=ones, token_weights=sequence_token_weights("seq_mean_token_mean", ones, lengths),
                       seq_weights=ones, rewards=ones, origin=[], denominator=float(len(pairs)))
    with timer("pack"):
        micro_batches, packing = pack(run, batch)
    with timer("logprob"):  # old log-probs: ratio 1 exactly, and the NLL to report
        run.engine.fill_logprobs(micro_batches, old=True, reference=False)
    nll_sum = sum(float(-(mb.old_logprobs * mb.loss_mask).sum()) for mb in micro_batches if not mb.is_dummy)
    tokens = sum(float(mb.loss_mask.sum()) for mb in micro_batches if not mb.is_dummy)
    totals = D.all_gather_objects((nll_sum, tokens))  # TP/PP copies duplicate every DP rank equally: ratio exact
    with timer("train"), sft_loss(run.engine):
        set_learning_rate(run.engine, cfg.train.sft_lr)
        out = run.engine.train_step(micro_batches, batch.denominator)
    metrics = {"sft/nll": sum(t[0] for t in totals) / max(1.0, sum(t[1] for t in totals)),
               "sft/grad_norm": out["grad_norm"], "sft/lr": out["lr"]}
    metrics.update(packing)
    metrics.update(timer.as_metrics())
    return metrics


class sft_loss:  # noqa: N801 - used as a context manager
    """The engine's loss for the warm start: PPO clip with KL off, per-sequence token mean (then restored)."""

    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        self.saved = self.engine.loss_cfg
        self.engine.loss_cfg = LossConfig("ppo_clip", 0.2, 0.2, 0.0, "k1", "seq_mean_token_mean")

    def __exit__(self, *exc):
        self.engine.loss_cfg = self.saved


# ==============================================================================================================
# Learning rate (the trainer owns the schedule across the warm-start and RL phases)
# ==============================================================================================================
def rl_learning_rate(cfg: Config, rl_step_index: int) -> float:
    """optim.* schedule counted from the first RL step (warmup, then constant or cosine to optim.min_lr)."""
    from megatron_dppo.megatron.train_step import OptimConfig, lr_factor_schedule

    o = cfg.optim
    sched = OptimConfig(lr=o.lr, min_lr=o.min_lr, lr_schedule=o.scheduler, warmup_steps=o.warmup_steps,
                        total_steps=max(cfg.train.steps, o.warmup_steps + 1))
    return lr_factor_schedule(sched, rl_step_index, o.lr, o.min_lr)


def set_learning_rate(engine, lr: float) -> None:
    """Make the engine's next update use ``lr`` (its own schedule is configured constant; see setup)."""
    engine.optim_cfg = dataclasses.replace(engine.optim_cfg, lr=lr, min_lr=min(engine.optim_cfg.min_lr, lr))
    for group in engine.optimizer.param_groups:
        group["max_lr"] = lr
        group["min_lr"] = min(group.get("min_lr", 0.0), lr)


# ==============================================================================================================
# Checkpoints: model, optimizer, RNG (engine) + step, data cursor, prompt history (trainer "extra")
# ==============================================================================================================
def save(run: Run) -> Path:
    from megatron_dppo.megatron.checkpoint import save_checkpoint

    extra = {"rl_step": run.rl_step, "sft_step": run.sft_step, "sampler": run.sampler.state_dict(),
             "history": run.history.state_dict(), "config": run.cfg.to_dict()}
    return save_checkpoint(run.engine, run.cfg.checkpoint_dir, extra, keep_last=run.cfg.checkpoint.keep_last)


def find_resume_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint to resume from, per checkpoint.resume (auto | never | must)."""
    from megatron_dppo.megatron.checkpoint import latest_checkpoint

    found = latest_checkpoint(cfg.checkpoint_dir) if Path(cfg.checkpoint_dir).exists() else None
    if cfg.checkpoint.resume == "must" and found is None:
        raise ValueError(f"checkpoint.resume=must but there is no checkpoint under {cfg.checkpoint_dir}")
    if cfg.checkpoint.resume == "never" and found is not None:
        raise ValueError(f"checkpoint.resume=never but {found} exists; use another train.output_dir / "
                         "checkpoint.dir, delete it, or set checkpoint.resume=auto")
    return found


def restore(run: Run, path: Path) -> None:
    from megatron_dppo.megatron.checkpoint import load_checkpoint

    extra = load_checkpoint(run.engine, path)
    run.rl_step, run.sft_step = int(extra["rl_step"]), int(extra["sft_step"])
    run.sampler.load_state_dict(extra["sampler"])
    run.history.load_state_dict(extra["history"])
    if D.is_main():
        print(f"resumed from {path} (warm-start step {run.sft_step}, RL step {run.rl_step})", flush=True)


# ==============================================================================================================
# Clean stop on SIGINT / SIGTERM / SIGUSR1: finish the current step, save, exit
# ==============================================================================================================
class StopSignals:
    """First signal: stop after the current step with a checkpoint. A second SIGINT aborts immediately."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        import threading
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        if D.is_main():
            print(f"\n{signal.Signals(signum).name} received: stopping after this step and saving a checkpoint "
                  "(Ctrl-C again to abort without saving)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def poll(self) -> int | None:
        """Collective, at a step boundary: None to go on, else the stop code AGREED by every rank: the largest
        signal number any rank received, or ``STOP_REQUESTED`` (0) when the job script asked for a stop through
        ``$DPPO_STOP_FILE`` (``launch.stop_requested``; Slurm preemption). Ranks leave the loop on this shared
        answer, never on their local flag, so a signal that reached only some ranks cannot hang the others."""
        local = self.received if self.received is not None else (STOP_REQUESTED if stop_requested() else -1)
        code = D.max_over_ranks(local)
        return None if code < 0 else code


STOP_REQUESTED = 0  # stop code of a job-script request (no signal): the CLI exits 0 after the checkpoint


# ==============================================================================================================
# Entry points
# ==============================================================================================================
def train(cfg: Config, *, checkpoints: bool = True) -> dict[str, Any]:
    """Warm start (optional) + RL, resuming from the latest checkpoint. Returns {"metrics": the last RL step's
    metrics, "stopped_by": the signal number that stopped the run, STOP_REQUESTED (0) for a job-script stop request, or None, "rl_step", "sft_step", ...}."""
    from tqdm import tqdm

    run = setup(cfg, resume=checkpoints)
    start, last, stopped_by = (run.sft_step, run.rl_step), {}, None
    if start == (cfg.train.sft_steps, cfg.train.steps) and D.is_main():
        print(f"nothing to do: {cfg.train.output_dir} already finished RL step {cfg.train.steps} of "
              f"{cfg.train.steps}; raise train.steps to continue, or use a new train.output_dir (or delete this "
              "one) to start over", flush=True)
    try:
        with StopSignals() as stop:
            # -- supervised warm start
            bar = _bar(tqdm, cfg, run.sft_step, cfg.train.sft_steps, "warm start")
            while run.sft_step < cfg.train.sft_steps and stopped_by is None:
                m = sft_step(run, run.sft_step)
                run.sft_step += 1
                run.sink.log(run.sft_step - 1, m, phase="sft", global_step=run.sft_step - 1)
                _progress(bar, {"nll": m["sft/nll"]})
                if run.sft_step == cfg.train.sft_steps:
                    finish_warm_start(run)
                stopped_by = stop.poll()
            _close(bar)

            # -- RL (with an evaluation before the first step, logged at step -1, and every eval.every steps)
            if cfg.eval.every and run.rl_step == 0 and stopped_by is None:
                run.sink.log(-1, evaluate(run, -1), phase="eval", global_step=cfg.train.sft_steps)
            bar = _bar(tqdm, cfg, run.rl_step, cfg.train.steps, "RL") if stopped_by is None else None
            while run.rl_step < cfg.train.steps and stopped_by is None:
                step = run.rl_step
                m = rl_step(run, step)
                run.rl_step += 1
                run.sink.log(step, m, global_step=cfg.train.sft_steps + step)
                if cfg.eval.every and (run.rl_step % cfg.eval.every == 0 or run.rl_step == cfg.train.steps):
                    ev = evaluate(run, step)
                    run.sink.log(step, ev, phase="eval", global_step=cfg.train.sft_steps + step)
                    m.update(ev)
                last = m
                _progress(bar, {"reward": m.get("reward/mean", float("nan")),
                                "kept": m["prune/total_kept_fraction"], "tok/s": m["throughput/tokens_per_s"]})
                _print_step(run, step, m)
                if checkpoints and cfg.checkpoint.every and run.rl_step % cfg.checkpoint.every == 0 \
                        and run.rl_step < cfg.train.steps:
                    save(run)
                stopped_by = stop.poll()
            _close(bar)

            # -- final checkpoint (also the one a signal asked for)
            if checkpoints and (run.sft_step, run.rl_step) != start:
                path = save(run)
                if stopped_by is not None and D.is_main():
                    reason = "the job script's stop request" if stopped_by == STOP_REQUESTED \
                        else signal.Signals(stopped_by).name
                    print(f"stopped by {reason}; checkpoint {path}; run the same command again to resume", flush=True)
    finally:
        teardown(run)
    summary = {"metrics": last, "stopped_by": stopped_by, "rl_step": run.rl_step, "sft_step": run.sft_step,
               "output_dir": cfg.train.output_dir}
    if D.is_main() and cfg.logging.plot:
        png = plot_reward_curve(run.sink.jsonl_path, Path(cfg.train.output_dir) / "reward_curve.png")
        if png is not None:
            print(f"reward curve: {png}", flush=True)
            summary["plot"] = str(png)
    return summary


def finish_warm_start(run: Run) -> None:
    """After the warm start: the reference policy (KL) is the warmed-up policy; print where rewards start."""
    if run.engine.reference_chunks is not None:
        run.engine.sync_reference_from_policy()
    push_weights(run)


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


def bench(cfg: Config, steps: int = 5) -> dict[str, float]:
    """``megatron-dppo bench``: 1 warm-up + ``steps`` RL steps, no checkpoints, median time per phase."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, sft_steps=0, steps=steps + 1,
                                                             output_dir=str(Path(cfg.train.output_dir) / "bench")),
                              eval=dataclasses.replace(cfg.eval, every=0))
    summary = train(cfg, checkpoints=False)
    from megatron_dppo.metrics import read_jsonl

    records = [r for r in read_jsonl(Path(cfg.train.output_dir) / "metrics.jsonl") if r.get("phase") == "rl"][1:]
    keys = sorted({k for r in records for k in r if k.startswith(("time/", "throughput/", "packing/density"))})
    out = {k: _median([r[k] for r in records if k in r]) for k in keys}
    if D.is_main():
        print(f"median over {len(records)} RL steps (after 1 warm-up):")
        for k, v in out.items():
            print(f"  {k:32s} {v:10.4f}")
    summary["bench"] = out
    return out


def _median(values: Sequence[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


# ==============================================================================================================
# Set-up and tear-down
# ==============================================================================================================
def setup(cfg: Config, *, resume: bool = True, need_eval: bool = False) -> Run:
    """Process groups, tokenizer, data, Megatron engine, rollout engine, rewards, pruner; restore a checkpoint."""
    from megatron_dppo.data import PromptSampler
    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel, validate_parallel
    from megatron_dppo.megatron.train_step import OptimConfig, PolicyEngine

    quiet_logs()
    parallel = ParallelConfig(tp=cfg.parallel.tp, pp=cfg.parallel.pp, vpp=cfg.parallel.vpp, sp=cfg.parallel.sp,
                              cp=cfg.parallel.cp)
    D.pick_free_port_if_single_process()
    info = initialize_parallel(parallel, cfg.model.init_seed)
    D.set_cpu_threads(info.local_world_size, cfg.train.cpu_threads)
    out_dir = Path(cfg.train.output_dir)

    # 1. everything that can be wrong with the inputs fails here, before anything is written or overwritten
    tokenizer = build_tokenizer(cfg)
    model_dir = resolve_model_dir(cfg)
    hf_config = build_hf_config(cfg, tokenizer, model_dir)
    arch = ModelArch.from_hf_config(hf_config)
    validate_parallel(arch, parallel, D.world_size())
    if cfg.rollout.engine == "vllm" and cfg.parallel.pp > 1:
        raise ValueError("rollout.engine=vllm with parallel.pp > 1 is not supported (vLLM is colocated per TP "
                         "group); use parallel.pp=1 or rollout.engine=hf")

    loss_cfg, estimator = build_loss(cfg)
    train_prompts, sft_pairs = load_train_prompts(cfg, tokenizer, arch)
    if cfg.train.sft_steps and not sft_pairs:
        raise ValueError("train.sft_steps > 0 needs gold completions: only data.task=arithmetic provides them "
                         "(set train.sft_steps=0)")
    eval_sets = load_eval_sets(cfg, tokenizer, arch) if (cfg.eval.every or need_eval) else {}
    scorer = build_scorer(cfg, cfg.data.train_files)
    eval_scorers = {name: build_scorer(cfg, [name], cfg.eval.reward) for name in eval_sets}
    found = find_resume_checkpoint(cfg) if resume else None

    # 2. the engines
    engine = PolicyEngine(arch, parallel, OptimConfig(
        lr=cfg.optim.lr, min_lr=0.0, lr_schedule="constant", warmup_steps=0, weight_decay=cfg.optim.weight_decay,
        adam_beta1=cfg.optim.adam_beta1, adam_beta2=cfg.optim.adam_beta2, adam_eps=cfg.optim.adam_eps,
        clip_grad=cfg.optim.grad_clip, use_distributed_optimizer=cfg.optim.distributed_optimizer), loss_cfg,
        dtype=torch_dtype(cfg.model.dtype))
    rollout = build_rollout(cfg, hf_config, model_dir, tokenizer)

    pruner: DPPOPruner | CPPOPruner | None = None
    if cfg.algo.pruner == "dppo":
        pruner = DPPOPruner(cfg.algo.r_q, cfg.algo.r_o, cfg.algo.mode)
    elif cfg.algo.pruner == "cppo":
        pruner = CPPOPruner(cfg.algo.cppo_rate, cfg.algo.cppo_scope, cfg.algo.cppo_allocation)

    sink = MetricsSink(out_dir, enabled=D.is_main(), jsonl=cfg.logging.jsonl, tensorboard=cfg.logging.tensorboard,
                       wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project, run_config=cfg.to_dict())
    run = Run(cfg=cfg, info=info, tokenizer=tokenizer, hf_config=hf_config, arch=arch, engine=engine,
              rollout=rollout, scorer=scorer, eval_scorers=eval_scorers,
              train_prompts=train_prompts, eval_sets=eval_sets,
              sampler=PromptSampler(len(train_prompts), seed=cfg.train.seed, shuffle=cfg.data.shuffle),
              pruner=pruner, history=PromptHistory(cfg.algo.history_ema), loss_cfg=loss_cfg, estimator=estimator,
              sink=sink, sft_pairs=sft_pairs, eos_ids=eos_ids(tokenizer, hf_config),
              pad_id=int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0))

    # 3. state: a checkpoint, or pretrained weights, or the fresh initialization
    if found is not None:
        restore(run, found)
    elif model_dir is not None and cfg.model.path is not None:
        load_pretrained(run, model_dir)

    # 4. outputs (checkpoints/hf: config + tokenizer, so `megatron-dppo convert megatron-to-hf` exports a run)
    if D.is_main():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(cfg.to_yaml())
        hf_dir = Path(cfg.checkpoint_dir) / "hf"
        hf_dir.mkdir(parents=True, exist_ok=True)
        (hf_dir / "config.json").write_text(json.dumps(full_hf_config(hf_config), indent=1))
        tokenizer.save_pretrained(hf_dir)
    phase, position = run_phase_key(run)  # the global step of TensorBoard: warm-start steps, then RL steps
    sink.open(resume_key=(phase, position) if found is not None else None,
              tb_purge_step=(position if phase == 0 else cfg.train.sft_steps + position) if found is not None else None)
    push_weights(run)  # the rollout engine always starts from the policy's exact weights
    if D.is_main() and cfg.logging.audit_log:
        run.audit = open_audit(out_dir / "audit.jsonl", run.rl_step if found is not None else None)
    if D.is_main():
        _print_banner(run, found)
    return run


def open_audit(path: Path, resume_step: int | None):
    """The audit trail, keeping on resume only the lines of the steps before ``resume_step``."""
    kept = []
    if resume_step is not None and path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] < resume_step:
                    kept.append(line + "\n")
            except (json.JSONDecodeError, KeyError):
                continue
    path.write_text("".join(kept), encoding="utf-8")
    return open(path, "a", encoding="utf-8")


def run_phase_key(run: Run) -> tuple[int, int]:
    """Position in the metric stream: (0, sft step) during the warm start, (1, RL step) afterwards."""
    if run.sft_step < run.cfg.train.sft_steps:
        return (0, run.sft_step)
    return (1, run.rl_step)


def teardown(run: Run) -> None:
    run.sink.close()
    if run.audit is not None:
        run.audit.close()
    for scorer in [run.scorer, *run.eval_scorers.values()]:
        scorer.close()
    from megatron_dppo.megatron.parallel import destroy_parallel
    D.barrier()
    destroy_parallel()


def load_pretrained(run: Run, model_dir: Path) -> None:
    """Fill the Megatron policy (and reference) from the pretrained weights: a converted Megatron checkpoint
    (resharded to this layout) or HF safetensors (each rank reads only its own TP shard / PP layers, checked
    against the config)."""
    from megatron_dppo.convert.checkpoint import load_hf_folder, load_model_dist_checkpoint
    from megatron_dppo.convert.hf_io import HFCheckpoint
    from megatron_dppo.convert.weights import load_hf_weights

    if model_dir.name == "hf" and is_converted_checkpoint(model_dir.parent):
        load_model_dist_checkpoint(run.engine.model_chunks, model_dir.parent / "model")
    elif run.cfg.model.hf_config:  # config overrides (e.g. a longer context): the architecture differs on purpose
        load_hf_weights(run.engine.modules, run.arch, HFCheckpoint(model_dir).get)
    else:
        load_hf_folder(run.engine.model_chunks, model_dir, run.arch)
    run.engine.optimizer.reload_model_params()
    if run.engine.reference_chunks is not None:
        run.engine.sync_reference_from_policy()


def generation_shards(run: Run) -> tuple[int, int]:
    """Who generates what: the HF engine shards over every rank; vLLM over TP groups (same prompts per group)."""
    if run.cfg.rollout.engine == "vllm":
        return D.rank() // run.cfg.parallel.tp, D.world_size() // run.cfg.parallel.tp
    return D.rank(), D.world_size()


def _strip_stop(ids: list[int], stops: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stops else ids


# ==============================================================================================================
# Console output
# ==============================================================================================================
def _bar(tqdm, cfg: Config, start: int, total: int, desc: str):
    if not (D.is_main() and cfg.logging.progress_bar) or start >= total:
        return None
    return tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, leave=True)


def _progress(bar, postfix: dict) -> None:
    if bar is not None:
        bar.set_postfix({k: f"{v:.3g}" for k, v in postfix.items()}, refresh=False)
        bar.update(1)


def _close(bar) -> None:
    if bar is not None:
        bar.close()


def _print_step(run: Run, step: int, m: dict) -> None:
    every = run.cfg.logging.print_every
    if not (D.is_main() and every and (step + 1) % every == 0):
        return
    phases = " ".join(f"{k[5:]}={m[k]:.2f}s" for k in ("time/generate", "time/reward", "time/logprob",
                                                        "time/train", "time/weight_sync") if k in m)
    ev = " ".join(f"{k[5:]}={v:.3f}" for k, v in m.items() if k.startswith("eval/") and "pass@" in k)
    line = (f"step {step:4d} | reward {m.get('reward/mean', float('nan')):.3f} (kept {m.get('reward/mean_kept', float('nan')):.3f})"
            f" | kept prompts {m['prune/prompt_kept_fraction']:.2f} completions "
            f"{m['prune/completion_kept_fraction']:.2f} | ESS {m['prune/total_ess']:.1f} | density "
            f"{m.get('packing/density', 0):.2f} | {phases} | {m['throughput/tokens_per_s']:.0f} tok/s"
            + (f" | {ev}" if ev else ""))
    if run.cfg.logging.progress_bar:
        from tqdm import tqdm
        tqdm.write(line)  # above the progress bar
    else:
        print(line, flush=True)


def _print_banner(run: Run, found: Path | None) -> None:
    cfg, arch = run.cfg, run.arch
    print(f"megatron-dppo: {arch.family} {arch.num_parameters / 1e6:.2f}M params | world {D.world_size()} "
          f"(tp {cfg.parallel.tp}, pp {cfg.parallel.pp}, dp {run.dp_size}) | {len(run.train_prompts)} train prompts"
          f" | pruner {cfg.algo.pruner} | loss {cfg.loss.preset} ({run.loss_cfg.aggregation}, "
          f"estimator {run.estimator}) | output {cfg.train.output_dir}"
          + (f" | resuming {found.name}" if found else ""), flush=True)
