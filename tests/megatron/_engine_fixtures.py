"""Shared tiny models, batches and multi-process workers for tests/megatron/test_train_step*.py and
test_checkpoint*.py (engine-train). Workers are module-level so ``_dist.run_distributed`` can import them."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEED = 1234


def tiny_arch(family: str = "qwen3", num_layers: int = 4, tie: bool = True):
    """hidden 64, 4 heads / 2 KV heads (GQA), vocab 256; qwen3 = QK-norm, tied embeddings by default."""
    from megatron_dppo.megatron.model import ModelArch

    return ModelArch(family=family, vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=num_layers,
                     num_attention_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, norm_eps=1e-6,
                     tie_embeddings=tie, qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
                     max_position_embeddings=256)


def make_sequences(num_prompts: int = 3, group: int = 4, seed: int = 0):
    """A GRPO-style global batch: B prompts x G completions with rewards -> advantages, keep/weight (a DPPO-like
    pruning draw with weights 1/pi), token ids. Returns a dict of python lists and tensors."""
    from megatron_dppo.algo.advantages import compute_advantages

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 256, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num_prompts)]
    tokens, prompt_lengths, completion_lengths = [], [], []
    for q in range(num_prompts):
        for _ in range(group):
            n = int(torch.randint(1, 9, (1,), generator=g))
            completion = torch.randint(1, 256, (n,), generator=g).tolist()
            tokens.append(prompts[q] + completion)
            prompt_lengths.append(len(prompts[q]))
            completion_lengths.append(n)
    rewards = torch.randint(0, 2, (num_prompts, group), generator=g).float()
    rewards[0, 0], rewards[0, 1] = 1.0, 0.0  # at least one group with signal
    advantages = compute_advantages(rewards, "grpo")
    keep = torch.rand(num_prompts, group, generator=g) > 0.25
    keep[0, 0] = True
    weight = torch.where(keep, 1.0 / 0.75, torch.zeros(()))  # inverse keep probability
    return {"tokens": tokens, "prompt_lengths": prompt_lengths,
            "completion_lengths": torch.tensor(completion_lengths).view(num_prompts, group),
            "advantages": advantages, "keep": keep, "weight": weight, "B": num_prompts, "G": group}


def perturbation(batch, scale: float, phase: float) -> torch.Tensor:
    """A deterministic, layout-independent offset per position (function of sample id and position id)."""
    sid = torch.where(batch.seq_index >= 0, batch.sample_ids[batch.seq_index.clamp(min=0)],
                      torch.zeros_like(batch.seq_index))
    return scale * torch.sin(1.7 * batch.position_ids.double() + 0.9 * sid.double() + phase).float()


def rank_micro_batches(data, loss_cfg, dp_rank: int, dp_size: int, pad_multiple: int, capacity: int = 24,
                       split: int | None = None):
    """This DP rank's packed THD micro-batches of the kept sequences (Dense Prompt Packing plan)."""
    from megatron_dppo.algo.losses import sequence_token_weights
    from megatron_dppo.packing import build_rank_micro_batches, pack_sequences

    keep = data["keep"].flatten()
    kept = [i for i in range(len(data["tokens"])) if bool(keep[i])]
    tw = sequence_token_weights(loss_cfg.aggregation, data["weight"].flatten(),
                                data["completion_lengths"].flatten())
    lengths = [len(data["tokens"][i]) for i in kept]
    if split is not None:  # `split` micro-batches on this rank, sequences dealt round-robin (micro-batching tests)
        mine = [j for j in range(len(kept)) if j % dp_size == dp_rank]
        plan = {dp_rank: [[j for n, j in enumerate(mine) if n % split == m] for m in range(split)]}
    else:
        plan = pack_sequences(lengths, capacity, dp_size, pad_multiple=pad_multiple)
    rank_plan = [[kept[j] for j in mb] for mb in plan[dp_rank]]
    return build_rank_micro_batches(rank_plan, data["tokens"], data["prompt_lengths"],
                                    data["advantages"].flatten(), tw, pad_multiple=pad_multiple)


def per_sample_completion_logp(batches, logps) -> dict[int, torch.Tensor]:
    out = {}
    for b, lp in zip(batches, logps):
        for sid, vals in zip(b.sample_ids.tolist(), b.completion_values(lp.cpu())):
            out[sid] = vals.detach().clone()
    return out


# ----------------------------------------------------------------------------------------------------------
# Multi-process worker: the same global batch and weights at any layout
# ----------------------------------------------------------------------------------------------------------
def layout_worker(ckpt_root: str, tp: int = 1, pp: int = 1, sp: bool = False, vpp=None,
                  distributed_optimizer: bool = False, save: bool = False, steps: int = 1,
                  uneven: bool = False, arch_changes: dict | None = None, cp: int = 1, temperature: float = 1.0,
                  dtype: str = "float32"):
    """Load (or, with ``save``, create) the TP1 reference weights, fill old/ref log-probs (perturbed so ratios
    clip and the KL is non-zero), run ``steps`` train steps, then recompute log-probs. Returns per-sample
    completion log-probs before/after (at the loss's ``temperature``) and the step metrics (rank 0's view; all ranks
    agree); with tp = pp = 1 (and
    no distributed optimizer) also the updated weights and the last step's gradient (``params``, ``grads``: name ->
    tensor). ``dtype``: the engine's parameter dtype (a torch dtype name; the checkpoint's weights are cast to it)."""
    from megatron.core import parallel_state

    from megatron_dppo.algo.losses import LossConfig, loss_denominator
    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel
    from megatron_dppo.packing import thd_pad_multiple

    arch = dataclasses.replace(tiny_arch(), **(arch_changes or {}))
    parallel = ParallelConfig(tp=tp, pp=pp, sp=sp, vpp=vpp, cp=cp)
    initialize_parallel(parallel, SEED, arch)
    loss_cfg = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=0.05, kl_estimator="k3",
                          aggregation="seq_mean_token_mean", temperature=temperature).resolved()
    optim = OptimConfig(lr=1e-2, grad_clip=1.0, weight_decay=0.01, distributed_optimizer=distributed_optimizer)
    engine = PolicyEngine(arch, parallel, optim, loss_cfg, dtype=getattr(torch, dtype))
    if save:
        save_checkpoint(engine, ckpt_root)
    else:
        load_checkpoint(engine, ckpt_root, load_optimizer=False, load_rng=False)
        engine.sync_reference_from_policy()

    data = make_sequences()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    # uneven: rank r gets r+2 micro-batches round-robin (the engine pads the others with dummies)
    split = dp_rank + 2 if uneven else None
    batches = rank_micro_batches(data, loss_cfg, dp_rank, dp_size, thd_pad_multiple(tp, cp, sp), split=split)
    D = loss_denominator(loss_cfg.aggregation, data["B"], data["G"])

    logp = engine.compute_logprobs(batches, "policy")
    before = per_sample_completion_logp(batches, logp)
    for b, lp in zip(batches, logp):
        b.old_logprobs = lp + perturbation(b, 0.3, 0.0)
        b.ref_logprobs = lp + perturbation(b, 0.2, 1.0)
    metrics = [engine.train_step(batches, D) for _ in range(steps)]
    after = per_sample_completion_logp(batches, engine.compute_logprobs(batches, "policy"))
    # gather per-sample dicts over DP so rank 0 reports the whole batch
    gathered_before, gathered_after = [None] * dp_size, [None] * dp_size
    group = parallel_state.get_data_parallel_group()
    torch.distributed.all_gather_object(gathered_before, before, group=group)
    torch.distributed.all_gather_object(gathered_after, after, group=group)
    merge = lambda parts: {k: v for p in parts for k, v in p.items()}  # noqa: E731
    full = tp == 1 and pp == 1 and not distributed_optimizer
    params = {name: p.detach().clone() for name, p in engine.modules[0].named_parameters()} if full else None
    # the last step's gradient (DDP's reduced main_grad, kept until the next step zeroes it)
    grads = {name: p.main_grad.detach().clone() for name, p in engine.modules[0].named_parameters()} if full else None
    return {"before": merge(gathered_before), "after": merge(gathered_after), "metrics": metrics,
            "rank": torch.distributed.get_rank(), "params": params, "grads": grads}


# ----------------------------------------------------------------------------------------------------------
# Checkpoint workers
# ----------------------------------------------------------------------------------------------------------
def noisy_step(engine, step: int, loss_cfg, data_seed: int = 10):
    """One trainer-like step that also consumes every RNG stream a trainer may use (python, numpy, torch,
    Megatron's tracker), so an incomplete RNG restore changes the result."""
    import random

    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_dppo.algo.losses import loss_denominator

    data = make_sequences(num_prompts=2, group=4, seed=data_seed + step)
    batches = rank_micro_batches(data, loss_cfg, parallel_state.get_data_parallel_rank(),
                                 parallel_state.get_data_parallel_world_size(), 1)
    engine.fill_logprobs(batches)
    with get_cuda_rng_tracker().fork():
        tracker_noise = float(torch.rand(()))
    for b in batches:
        noise = 0.05 * torch.randn(b.old_logprobs.shape) + 0.01 * random.random() + 0.01 * float(np.random.rand())
        b.old_logprobs = b.old_logprobs + noise + 0.01 * tracker_noise
    metrics = engine.train_step(batches, loss_denominator(loss_cfg.aggregation, data["B"], data["G"]))
    return metrics["loss"], metrics["grad_norm"]


def resume_engine(parallel, distributed_optimizer: bool, kl: bool = True, optim_format: str = "dp_reshardable",
                  dtype: str = "float32"):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine

    loss_cfg = LossConfig(kl_coef=0.05 if kl else 0.0, kl_estimator="k3").resolved()
    optim = OptimConfig(lr=3e-3, warmup_steps=2, scheduler="cosine", weight_decay=0.1,
                        distributed_optimizer=distributed_optimizer)
    return PolicyEngine(tiny_arch(num_layers=2), parallel, optim, loss_cfg, total_steps=8,
                        dist_ckpt_optim_format=optim_format, dtype=getattr(torch, dtype)), loss_cfg


def optimizer_tensors(engine) -> list[torch.Tensor]:
    """Copies of what the inner torch optimizers step (the fp32 main params under bf16/fp16; this rank's shards
    with the DistributedOptimizer) followed by their Adam moments."""
    from megatron_dppo.megatron.checkpoint import _inner_torch_optimizers

    out = []
    for opt in _inner_torch_optimizers(engine):
        params = [p for g in opt.param_groups for p in g["params"]]
        out += [p.detach().clone() for p in params]
        out += [opt.state[p][k].detach().clone() for p in params for k in ("exp_avg", "exp_avg_sq")
                if p in opt.state]
    return out


def resume_worker(root: str, tp: int = 1, pp: int = 1, distributed_optimizer: bool = False, n_before: int = 2,
                  n_after: int = 2, optim_format: str = "dp_reshardable", dtype: str = "float32"):
    """Uninterrupted run of n_before + n_after steps (checkpoint after n_before) vs a fresh engine resumed from
    that checkpoint: returns both loss/grad-norm traces, whether final parameters are equal and whether the
    optimizer's main params and Adam moments right after loading equal those saved (``optimizer_restored``;
    ``saved_optimizer``: those tensors at the save)."""
    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel

    parallel = ParallelConfig(tp=tp, pp=pp)
    initialize_parallel(parallel, SEED, tiny_arch(num_layers=2))
    engine, loss_cfg = resume_engine(parallel, distributed_optimizer, optim_format=optim_format, dtype=dtype)
    for s in range(n_before):
        noisy_step(engine, s, loss_cfg)
    save_checkpoint(engine, root, extra={"cursor": n_before, "history": {"q1": 0.5}})
    saved_optimizer = optimizer_tensors(engine)
    straight = [noisy_step(engine, s, loss_cfg) for s in range(n_before, n_before + n_after)]
    params_a = [p.detach().clone() for m in engine.modules for p in m.parameters()]

    resumed_engine, _ = resume_engine(parallel, distributed_optimizer, optim_format=optim_format, dtype=dtype)
    noisy_step(resumed_engine, 99, loss_cfg)  # move weights, optimizer and RNG away first
    extra = load_checkpoint(resumed_engine, root)
    assert resumed_engine.step == n_before, resumed_engine.step
    loaded_optimizer = optimizer_tensors(resumed_engine)
    resumed = [noisy_step(resumed_engine, s, loss_cfg) for s in range(n_before, n_before + n_after)]
    params_b = [p.detach().clone() for m in resumed_engine.modules for p in m.parameters()]
    return {"straight": straight, "resumed": resumed, "extra": extra,
            "params_equal": all(torch.equal(a, b) for a, b in zip(params_a, params_b)),
            "param_dtypes": sorted({str(p.dtype) for p in params_b}),
            "saved_optimizer": saved_optimizer,
            "optimizer_restored": len(saved_optimizer) == len(loaded_optimizer) and all(
                torch.equal(a, b) for a, b in zip(saved_optimizer, loaded_optimizer))}


def reshard_worker(root: str, tp: int = 1, pp: int = 1, save: bool = False, distributed_optimizer: bool = False):
    """TP1 (``save``): one step, checkpoint (weights + Adam state), one more step. Other layouts: load that
    checkpoint WITH its optimizer state, then the same second step. Returns per-sample log-probs right after
    loading / saving and after the second step."""
    from megatron.core import parallel_state

    from megatron_dppo.algo.losses import LossConfig, loss_denominator
    from megatron_dppo.megatron.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel

    arch = tiny_arch()
    parallel = ParallelConfig(tp=tp, pp=pp)
    initialize_parallel(parallel, SEED, arch)
    loss_cfg = LossConfig(kl_coef=0.0).resolved()
    optim = OptimConfig(lr=1e-2, weight_decay=0.01, distributed_optimizer=distributed_optimizer)
    engine = PolicyEngine(arch, parallel, optim, loss_cfg, dist_ckpt_optim_format="fully_reshardable")
    data = make_sequences(seed=5)
    batches = rank_micro_batches(data, loss_cfg, parallel_state.get_data_parallel_rank(),
                                 parallel_state.get_data_parallel_world_size(), 1)
    D = loss_denominator(loss_cfg.aggregation, data["B"], data["G"])

    def step():
        engine.fill_logprobs(batches)
        for b in batches:
            b.old_logprobs = b.old_logprobs + perturbation(b, 0.3, 0.0)
        return engine.train_step(batches, D)

    if save:
        step()
        save_checkpoint(engine, root)
    else:
        load_checkpoint(engine, root, load_optimizer=True, load_rng=False)
    at_ckpt = per_sample_completion_logp(batches, engine.compute_logprobs(batches))
    metrics = step()
    after = per_sample_completion_logp(batches, engine.compute_logprobs(batches))
    return {"at_ckpt": at_ckpt, "after": after, "metrics": metrics, "step": engine.step}
