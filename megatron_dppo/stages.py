"""The stages of one RL step, in the order of the data flow, and the plain data passed between them: prompt
pruning, generation, rewards, completion pruning, the surviving batch with its fixed denominator, packing, the
gradient audit, and the step's metrics."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dppo import distributed as D
from megatron_dppo.algo.losses import loss_denominator, sequence_token_weights
from megatron_dppo.algo.pruning import (
    CPPOPruner,
    DPPOPruner,
    PruneResult,
    combine,
    make_generator,
    pruning_stats,
    zero_variance_filter,
)
from megatron_dppo.build import Prompt
from megatron_dppo.run import Run, generation_shards


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


def old_logprobs_needed(cfg: Any, loss_cfg: Any) -> bool:
    """Whether the step runs the forward-only old-policy log-prob pass before the update.

    With exactly one optimizer update per rollout batch the weights being trained ARE the weights the old
    log-probs would be computed with, so the PPO/GSPO ratio exp(logp - old) is identically 1. The pass is then
    skipped and the loss uses old = logp.detach() from the train forward itself (as TRL's GRPOTrainer does):
    the same value (bit for bit on CPU, tests/megatron/test_train_step.py) and the same gradient, one forward
    pass less. It is needed when the ratio can differ from 1: several updates per rollout, or when forced with
    ``train.recompute_old_logprobs``. A KL term needs the REFERENCE pass, not this one (``fill_logprobs``
    decides that from ``loss_cfg.kl_coef``)."""
    several_updates_per_rollout = False  # one optimizer update per rollout batch (trainer.rl_step)
    return bool(cfg.train.recompute_old_logprobs) or several_updates_per_rollout


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



# ==============================================================================================================
# Metrics of a step
# ==============================================================================================================
def step_metrics(run: Run, prompt_cut: PruneResult, completion_cut: PruneResult | None, total_cut: PruneResult,
                 rollout: Rollout, batch: TrainBatch) -> dict[str, float]:
    """Rewards before/after pruning, kept fractions per level, ESS, tokens (ALGORITHMS.md section 5)."""
    G = run.cfg.train.group_size
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


def logprob_mismatch(rollout: Rollout, batch: TrainBatch, micro_batches: list,
                     train_logprobs: list | None = None) -> dict[str, float]:
    """Mean |rollout-engine log-prob - Megatron log-prob| over completion tokens (weight-sync health check).
    The Megatron side is the old-policy pass (``mb.old_logprobs``) when it ran, else the train forward's own
    log-probs at the same weights (``train_logprobs``, one per micro-batch: ``PolicyEngine.last_logprobs``,
    None on ranks that hold no output layer); the two are the same numbers."""
    diff, count = 0.0, 0
    for m, mb in enumerate(micro_batches):
        values_all = mb.old_logprobs
        if values_all is None and train_logprobs is not None and m < len(train_logprobs):
            values_all = train_logprobs[m]
        if values_all is None or mb.is_dummy:
            continue
        for sid, values in zip(mb.sample_ids.tolist(), mb.completion_values(values_all)):
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



def _strip_stop(ids: list[int], stops: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stops else ids

