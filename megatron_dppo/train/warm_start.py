"""Supervised warm start (``train.sft_steps``): the same engine and loss as RL. Advantage 1 on gold completions
at ratio 1 gives exactly the log-likelihood gradient (per-sequence token mean, mean over sequences); KL is off
during it, and the reference model is re-synced to the warmed-up policy afterwards."""
from __future__ import annotations

import torch

from megatron_dppo.algo.losses import LossConfig, sequence_token_weights
from megatron_dppo.distributed import collectives as D
from megatron_dppo.run.metrics import PhaseTimer
from megatron_dppo.run.state import TrainSide
from megatron_dppo.train.stages import TrainBatch, pack


def sft_step(side: TrainSide, gold_pairs: list[tuple], step: int) -> dict[str, float]:
    """One warm-start update on ``train.sft_batch_size`` of the gold (prompt ids, completion ids) pairs, drawn
    from (seed, step). A gold completion may carry a loss mask as a third element (a tool-use trace: its
    observation tokens, mask 0, are context, not targets; the token mean is then over its mask-1 tokens)."""
    import random

    cfg, timer = side.cfg, PhaseTimer()
    rng = random.Random(D.derive_seed(cfg.train.seed, step, "sft"))
    pairs = [gold_pairs[i] for i in rng.sample(range(len(gold_pairs)), min(cfg.train.sft_batch_size, len(gold_pairs)))]
    masks = [pair[2] for pair in pairs] if pairs and len(pairs[0]) == 3 else None
    lengths = torch.tensor([len(pair[1]) if masks is None else sum(pair[2]) for pair in pairs], dtype=torch.float32)
    ones = torch.ones(len(pairs), dtype=torch.float32)
    batch = TrainBatch(token_ids=[pair[0] + pair[1] for pair in pairs], prompt_lengths=[len(pair[0]) for pair in pairs],
                       advantages=ones, token_weights=sequence_token_weights("seq_mean_token_mean", ones, lengths),
                       seq_weights=ones, rewards=ones, origin=[], denominator=float(len(pairs)), loss_masks=masks)
    with timer("pack"):
        micro_batches, packing = pack(side, batch)
    with timer("logprob"), sft_loss(side.engine):  # old log-probs at T = 1: ratio 1 exactly, and the NLL to report
        side.engine.fill_logprobs(micro_batches, old=True, reference=False)
    nll_sum = sum(float(-(mb.old_logprobs * mb.loss_mask).sum()) for mb in micro_batches if not mb.is_dummy)
    tokens = sum(float(mb.loss_mask.sum()) for mb in micro_batches if not mb.is_dummy)
    totals = D.all_gather_objects((nll_sum, tokens))  # TP/PP copies duplicate every DP rank equally: ratio exact
    with timer("train"), sft_loss(side.engine):
        side.engine.set_learning_rate(cfg.train.sft_lr)
        out = side.engine.train_step(micro_batches, batch.denominator)
    metrics = {"sft/nll": sum(t[0] for t in totals) / max(1.0, sum(t[1] for t in totals)),
               "sft/grad_norm": out["grad_norm"], "sft/lr": out["lr"]}
    metrics.update(packing)
    metrics.update(timer.as_metrics())
    metrics["time/step_cpu"] = D.sum_over_ranks(timer.step_cpu_seconds())  # the whole step's, all ranks (as RL steps)
    return metrics


class sft_loss:  # noqa: N801 - used as a context manager
    """The engine's loss for the warm start: PPO clip with KL off, per-sequence token mean, temperature 1 (the NLL
    of the gold answers, whatever rollout.temperature the RL loss uses), then restored."""

    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        self.saved = self.engine.loss_cfg
        self.engine.loss_cfg = LossConfig(kl_coef=0.0).resolved(temperature=1.0)

    def __exit__(self, *exc):
        self.engine.loss_cfg = self.saved


def finish_warm_start(side: TrainSide) -> None:
    """After the warm start: the reference policy (KL) is the warmed-up policy (the caller then pushes the weights
    to the rollout engine)."""
    if side.engine.reference_chunks is not None:
        side.engine.sync_reference_from_policy()

