"""Observation tokens of multi-turn episodes receive exactly zero gradient in the Megatron engine: the log-probs
the loss sees have zero gradient at every position predicting an observation token, the engine's gradient equals
autograd of (sum of numerators) / D on the masked micro-batches, it is bit for bit unchanged when the old,
reference and rollout data of observation tokens are garbage (NaN, +-1e6), the engine counts trained tokens
only; and the same batch packed WITHOUT the mask gives another gradient (negative control)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _engine_fixtures as F
from _dist import single_process_world


@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=F.SEED):
        yield


def _engine(loss_cfg):
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    seed_everything(F.SEED)
    return PolicyEngine(F.tiny_arch("llama", num_layers=2, tie=False), ParallelConfig(),
                        OptimConfig(lr=0.0, grad_clip=0.0), loss_cfg)


def episodes(seed: int = 5, n: int = 6):
    """Token ids and 0/1 masks of n episodes: prompt, then assistant / observation / assistant segments."""
    g = torch.Generator().manual_seed(seed)
    tokens, prompt_lengths, masks = [], [], []
    for _ in range(n):
        prompt = torch.randint(1, 256, (3,), generator=g).tolist()
        mask = [1] * int(torch.randint(2, 5, (1,), generator=g)) + [0] * int(torch.randint(3, 6, (1,), generator=g)) \
            + [1] * int(torch.randint(1, 4, (1,), generator=g))
        tokens.append(prompt + torch.randint(1, 256, (len(mask),), generator=g).tolist())
        prompt_lengths.append(3)
        masks.append(mask)
    adv = torch.randn(n, generator=g)
    return tokens, prompt_lengths, masks, adv


def micro_batches(cfg, with_masks: bool = True, seed: int = 5):
    from megatron_dppo.algo.losses import sequence_token_weights
    from megatron_dppo.packing import build_rank_micro_batches, pack_sequences

    tokens, prompt_lengths, masks, adv = episodes(seed)
    trained = torch.tensor([sum(m) for m in masks], dtype=torch.float32)
    tw = sequence_token_weights(cfg.aggregation, torch.ones(len(tokens)), trained)
    plan = pack_sequences([len(t) for t in tokens], 16, 1)
    return build_rank_micro_batches(plan[0], tokens, prompt_lengths, adv, tw,
                                    loss_masks=masks if with_masks else None), masks


def fill(engine, batches, garbage: bool = False):
    logp = engine.compute_logprobs(batches, "policy")
    for b, lp in zip(batches, logp):
        b.old_logprobs = lp + F.perturbation(b, 0.3, 0.0)
        b.ref_logprobs = lp + F.perturbation(b, 0.2, 1.0)
        b.rollout_weight = torch.ones_like(lp) + 0.1 * torch.sin(b.position_ids.float())
        if garbage:
            off = b.loss_mask == 0
            b.old_logprobs[off], b.ref_logprobs[off], b.rollout_weight[off] = float("nan"), 1e6, -1e6




def _step(cfg, with_masks=True, garbage=False):
    engine = _engine(cfg)
    batches, masks = micro_batches(cfg, with_masks)
    fill(engine, batches, garbage)
    metrics = engine.train_step(batches, 6.0)
    params = [p for chunk in engine.modules for p in chunk.parameters() if p.requires_grad]
    return engine, batches, masks, metrics, [p.main_grad.detach().clone() for p in params]


def test_observation_tokens_get_exactly_zero_gradient(world):
    from megatron_dppo.algo.losses import LossConfig, loss_numerator
    from megatron_dppo.megatron.logprobs import forward_thd, vocab_parallel_logprobs

    cfg = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=0.05, kl_estimator="k3",
                     aggregation="seq_mean_token_mean", rollout_correction="tis", rollout_correction_cap=1.5).resolved()
    engine, batches, masks, metrics, grads = _step(cfg)
    assert metrics["tokens"] == sum(sum(m) for m in masks) < sum(len(m) for m in masks)

    # the gradient the engine applied == autograd of sum(numerators) / D on the plain module; d loss / d logp is
    # exactly 0 wherever the label is an observation token
    module = engine.modules[0]
    params = [p for p in module.parameters() if p.requires_grad]
    total, logps = 0.0, []
    for b in batches:
        logp, _ = vocab_parallel_logprobs(forward_thd(module, b), b.labels, with_entropy=False)
        num, _ = loss_numerator(logp, b.old_logprobs, b.advantages, b.token_weight, b.loss_mask, b.seq_index, cfg,
                                b.ref_logprobs, b.rollout_weight)
        total, logps = total + num, logps + [logp]
    grad = torch.autograd.grad(total / 6.0, params + logps)
    reference, logp_grads = grad[: len(params)], grad[len(params):]
    for got, ref in zip(grads, reference):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    observation_positions = 0
    for b, g in zip(batches, logp_grads):
        observation_positions += int(((b.seq_index >= 0) & (b.loss_mask == 0)).sum())
        assert bool((g[b.loss_mask == 0] == 0).all())
        assert bool((g[b.loss_mask > 0] != 0).any())
    assert observation_positions > sum(len(m) for m in masks) - sum(sum(m) for m in masks)  # + prompt positions

    # garbage on observation tokens: the same gradient, bit for bit
    _, _, _, dirty_metrics, dirty = _step(cfg, garbage=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, dirty))
    assert dirty_metrics["loss"] == metrics["loss"]

    # negative control: the same episodes packed without their masks train the observation tokens
    _, _, _, unmasked_metrics, unmasked = _step(cfg, with_masks=False)
    assert unmasked_metrics["tokens"] == sum(len(m) for m in masks)
    assert not all(torch.allclose(a, b) for a, b in zip(grads, unmasked))
