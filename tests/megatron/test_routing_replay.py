"""MoE routing replay (megatron/routing_replay.py): the training forward uses exactly the experts the old-log-prob
pass recorded, even after the router changed; with the choices already agreeing replay changes nothing, bit for
bit; per-sequence routes survive any re-packing; the same under expert and pipeline parallelism."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dist import run_distributed, single_process_world
from _tiny import TINY_MOE_CONFIGS

SEED = 4321


@pytest.fixture(scope="module")
def world():
    with single_process_world(seed=SEED):
        yield


def _arch(family: str = "qwen3_moe", **hf_changes):
    from megatron_dppo.megatron.model import ModelArch

    return ModelArch.from_hf_config(dict(TINY_MOE_CONFIGS[family], **hf_changes))


def _engine(replay: bool, family: str = "qwen3_moe", parallel=None, lr: float = 1e-2, hf_changes=None, lora=None,
            loss=None):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig, seed_everything

    seed_everything(SEED)
    return PolicyEngine(_arch(family, **(hf_changes or {})), parallel or ParallelConfig(),
                        OptimConfig(lr=lr, grad_clip=0.0), loss or LossConfig(kl_coef=0.0).resolved(),
                        moe_routing_replay=replay, lora=lora)


def _batches(pad_multiple: int = 1, groups=((9, 5, 12), (7, 3, 8, 6)), seed: int = 0):
    """Packed micro-batches of random sequences (prompt length 2) with advantages of both signs."""
    from megatron_dppo.packing import build_thd_batch

    g = torch.Generator().manual_seed(seed)
    out, sid = [], 0
    for lengths in groups:
        seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
        ids = list(range(sid, sid + len(seqs)))
        adv = [(-1.0) ** i * (0.5 + 0.1 * i) for i in ids]
        out.append(build_thd_batch(seqs, [2] * len(seqs), ids, adv, [1.0 / len(seqs)] * len(seqs),
                                   pad_multiple=pad_multiple))
        sid += len(seqs)
    return out


class _ChosenExperts:
    """Forward hooks on the policy's routers: the expert set each router forward actually dispatched to
    (its routing_map, independent of the replay code), per router in call order."""

    def __init__(self, engine):
        from megatron_dppo.megatron.routing_replay import moe_routers

        self.calls: list[list[torch.Tensor]] = []
        routers = moe_routers(engine.modules)
        self.calls = [[] for _ in routers]
        self.handles = [r.register_forward_hook(self._hook(j)) for j, r in enumerate(routers)]

    def _hook(self, j):
        def hook(_module, _inputs, output):
            self.calls[j].append(output[1].detach().clone())  # routing_map [T, E] bool
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _recorded_maps(batches, layers: int, num_experts: int, topk: int) -> list[list[torch.Tensor]]:
    """Per router, per micro-batch: the recorded experts as a [T, E] bool map (real tokens only)."""
    from megatron_dppo.megatron.routing_replay import pack_routes

    out = [[] for _ in range(layers)]
    for b in batches:
        routes, valid = pack_routes(b.routed_experts, b, layers, topk)
        for j in range(layers):
            m = torch.zeros(routes.shape[0], num_experts, dtype=torch.bool)
            m.scatter_(1, routes[:, j], True)
            out[j].append((m, valid))
    return out


def _scramble_router(engine, generator_seed: int = 7):
    """A 'policy update' that certainly moves the router: its weight rows permuted + noise."""
    from megatron_dppo.megatron.routing_replay import moe_routers

    g = torch.Generator().manual_seed(generator_seed)
    with torch.no_grad():
        for r in moe_routers(engine.modules):
            w = r.weight
            w.copy_(w[torch.randperm(w.shape[0], generator=g)] + 0.5 * torch.randn(w.shape, generator=g))


def _scramble_adapters(engine, generator_seed: int = 7):
    """A LoRA 'policy update' (the router is frozen): large attention adapters move every router's input."""
    from megatron_dppo.megatron import lora as L

    g = torch.Generator().manual_seed(generator_seed)
    with torch.no_grad():
        for p in L.lora_parameters(engine.modules):
            p.copy_(2.0 * torch.randn(p.shape, generator=g))


def replay_case(replay: bool, family: str = "qwen3_moe", parallel=None, batches=None, hf_changes=None, lora=None):
    """Record (old pass), move the router (LoRA: its input, through the attention adapters), train one step (hooks
    on the routers). Returns the fraction of recorded (token, layer, k) choices the train forward did NOT dispatch
    to, the engine's flip metric, and the number of replayed choices compared."""
    from megatron_dppo.megatron.routing_replay import moe_routers

    engine = _engine(replay, family, parallel, hf_changes=hf_changes, lora=lora)
    batches = batches if batches is not None else _batches(pad_multiple=2 if parallel and parallel.sp else 1)
    engine.fill_logprobs(batches)
    assert all(b.routed_experts is not None for b in batches)
    (_scramble_adapters if lora is not None else _scramble_router)(engine)
    hooks = _ChosenExperts(engine)
    try:
        metrics = engine.train_step(batches, denominator=4.0)
    finally:
        hooks.remove()
    arch = engine.arch
    recorded = _recorded_maps(batches, len(moe_routers(engine.modules)), arch.moe.num_experts, arch.moe.topk)
    if parallel is not None and parallel.sp:
        from megatron_dppo.megatron.routing_replay import _sequence_shard

        recorded = [[(_sequence_shard(m), _sequence_shard(v)) for m, v in per] for per in recorded]
    missed, choices = 0, 0
    for j, per_batch in enumerate(recorded):
        assert len(hooks.calls[j]) == len(batches)  # one forward per micro-batch, no recompute
        for used, (want, valid) in zip(hooks.calls[j], per_batch):
            used = used[: want.shape[0]]  # the interleaved schedule pads micro-batches at the end (pad_thd_batch)
            missed += int((want & ~used)[valid].sum())
            choices += int(valid.sum()) * arch.moe.topk
    return {"missed": missed, "choices": choices, "flip_rate": metrics.get("moe/route_flip_rate"),
            "loss": metrics["loss"]}


# ----------------------------------------------------------------------------------------------------------
# (a) replay forces the recorded experts; without it they flip
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replay_uses_the_recorded_experts_after_the_router_moved(world, family):
    on = replay_case(True, family)
    off = replay_case(False, family)
    assert on["choices"] > 0
    assert on["missed"] == 0  # every recorded expert was dispatched to
    assert off["missed"] > 0  # the constructed case does flip without replay ...
    assert off["flip_rate"] == pytest.approx(off["missed"] / off["choices"], abs=0)  # ... and the metric says so
    assert on["flip_rate"] > 0  # with replay: how often the router's own top-k disagreed (and was overridden)


def test_replay_with_lora_adapters_on_attention(world):
    """LoRA on an MoE model (attention adapters, frozen routers and experts): the adapters' update moves the routers'
    inputs, replay still dispatches to the recorded experts, and the reference (adapters off) routes freely: its
    log-probs are the base model's."""
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.lora import LoraConfig

    lora = LoraConfig(rank=4, target_modules=("qkv", "proj"))
    on, off = replay_case(True, lora=lora), replay_case(False, lora=lora)
    assert on["choices"] > 0 and on["missed"] == 0 and off["missed"] > 0 and on["flip_rate"] > 0
    kl = LossConfig(kl_coef=0.1, kl_estimator="k1").resolved()
    engine, base = _engine(True, lora=lora, loss=kl), _engine(False, loss=kl)
    _scramble_adapters(engine)
    batches = _batches()
    engine.fill_logprobs(batches)  # old (recorded routes) and reference (adapters off) passes
    for b, ref in zip(batches, base.compute_logprobs(_batches(), "policy")):
        at = b.loss_mask > 0  # (fill_logprobs computes the loss positions only: PolicyEngine.logits_at_loss_positions)
        assert at.any() and torch.equal(b.ref_logprobs[at], ref[at])
        assert (b.old_logprobs - ref).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------------
# (b) replay is a no-op when the choices agree
# ----------------------------------------------------------------------------------------------------------
def _step_outputs(replay: bool, hf_changes: dict):
    engine = _engine(replay, hf_changes=hf_changes)
    batches = _batches()
    engine.fill_logprobs(batches)
    metrics = engine.train_step(batches, denominator=4.0)
    grads = [p.main_grad.detach().clone() for c in engine.model_chunks for p in c.parameters()]
    params = [p.detach().clone() for c in engine.model_chunks for p in c.parameters()]
    return engine, batches, metrics, grads, params


@pytest.mark.parametrize("hf_changes", [{}, {"norm_topk_prob": False}],
                         ids=["topk_then_softmax", "softmax_then_topk"])
def test_replay_changes_nothing_when_the_choices_agree(world, hf_changes):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_dppo.megatron.routing_replay import moe_routers

    e_off, b_off, m_off, g_off, p_off = _step_outputs(False, hf_changes)
    e_on, b_on, m_on, g_on, p_on = _step_outputs(True, hf_changes)
    assert e_on.modules[0].config.moe_router_pre_softmax == ("norm_topk_prob" in hf_changes)
    assert m_on["moe/route_flip_rate"] == 0.0 and m_off["moe/route_flip_rate"] == 0.0
    assert m_on["loss"] == m_off["loss"] and m_on["grad_norm"] == m_off["grad_norm"]
    assert m_on["loss"] != 0.0 and m_on["grad_norm"] > 0.0
    for a, b in zip(e_on.last_logprobs, e_off.last_logprobs):
        assert torch.equal(a, b)
    for a, b in zip(b_on, b_off):
        assert torch.equal(a.old_logprobs, b.old_logprobs)
        assert all(torch.equal(x, y) and x.dtype == torch.int16 for x, y in zip(a.routed_experts, b.routed_experts))
    assert all(torch.equal(a, b) for a, b in zip(g_on, g_off))
    assert all(torch.equal(a, b) for a, b in zip(p_on, p_off))
    # Megatron's process-global RouterReplay list holds none of these engines' routers (no growth, no crosstalk)
    ours = {id(r.router_replay) for e in (e_on, e_off) for r in moe_routers(e.modules)}
    assert not ours & {id(i) for i in RouterReplay.global_router_replay_instances}
    # and every replay queue was drained / cleared after the step
    assert all(not s.targets and not s.recorded and s.mode is None for s in e_on.routing.slots)


def test_replay_needs_recorded_routes_and_refuses_recompute(world):
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.parallel import ParallelConfig

    engine = _engine(True)
    with pytest.raises(ValueError, match="no recorded routes"):
        engine.train_step(_batches(), denominator=1.0)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    with pytest.raises(ValueError, match="activation recompute"):
        PolicyEngine(_arch(), ParallelConfig(), OptimConfig(), LossConfig(kl_coef=0.0).resolved(),
                     moe_routing_replay=True, **recompute)
    # without replay the same recompute is fine: the routers are left alone (no flip metric)
    no_kl = LossConfig(kl_coef=0.0).resolved()
    assert PolicyEngine(_arch(), ParallelConfig(), OptimConfig(), no_kl, **recompute).routing is None


def test_replay_makes_the_old_logprob_pass_run():
    from megatron_dppo.config import load_config
    from megatron_dppo.run.build import build_loss
    from megatron_dppo.train.stages import old_logprobs_needed

    def needed(*overrides: str) -> bool:
        cfg = load_config(None, overrides, validate=False)
        return old_logprobs_needed(cfg, build_loss(cfg)[0])

    assert not needed()
    assert needed("model.moe_routing_replay=true")


# ----------------------------------------------------------------------------------------------------------
# (c) per-sequence routes <-> any packing
# ----------------------------------------------------------------------------------------------------------
def test_unpack_and_repack_are_inverse_across_packings():
    from megatron_dppo.megatron.routing_replay import pack_routes, routes_by_sample, unpack_routes
    from megatron_dppo.packing import build_thd_batch
    from megatron_dppo.packing.thd import pad_thd_batch

    L, k, E = 3, 2, 8
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 2, 7, 4, 11]
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    truth = {s: torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n * L)]).view(n, L, k)
             for s, n in enumerate(lengths)}

    def pack(groups, pad_multiple):
        return [build_thd_batch([seqs[s] for s in grp], [1] * len(grp), grp, [0.0] * len(grp), [1.0] * len(grp),
                                pad_multiple=pad_multiple) for grp in groups]

    layout_a = pack([[0, 1, 2], [3, 4, 5]], pad_multiple=1)
    layout_b = pack([[5, 2], [4], [0, 3, 1]], pad_multiple=4)  # other bins, order and padding
    layout_b.append(build_thd_batch([], [], [], [], [], pad_multiple=4))  # a dummy
    layout_b[0] = pad_thd_batch(layout_b[0], int(layout_b[0].tokens.numel()) + 6)  # interleaved-schedule padding
    # record in layout A: a packed tensor per micro-batch, unpacked per sequence
    for b in layout_a:
        routes, valid = pack_routes(truth, b, L, k)
        assert int(valid.sum()) == int(b.seq_lengths.sum())
        b.routed_experts = unpack_routes(routes, b)
        assert all(torch.equal(r, truth[s]) for s, r in zip(b.sample_ids.tolist(), b.routed_experts))
    # re-pack into layout B and back: exactly the recorded routes; padding gets valid ids, flagged invalid
    recorded = routes_by_sample(layout_a)
    assert recorded.keys() == truth.keys()
    for b in layout_b:
        routes, valid = pack_routes(recorded if b.num_sequences else None, b, L, k)
        assert routes.shape == (b.tokens.numel(), L, k) and routes.dtype == torch.long
        assert torch.equal(routes[~valid], torch.arange(k).expand(int((~valid).sum()), L, k))
        for s, r in zip(b.sample_ids.tolist(), unpack_routes(routes, b)):
            assert torch.equal(r, truth[s])
    with pytest.raises(ValueError, match="no recorded routes for sample ids"):
        pack_routes({0: truth[0]}, layout_b[0], L, k)


# ----------------------------------------------------------------------------------------------------------
# (d) expert and pipeline parallelism
# ----------------------------------------------------------------------------------------------------------
def _parallel_worker(ep: int, pp: int, tp: int = 1, vpp: int | None = None, dense_layers: tuple = (1,)):
    """(replay on, replay off) on one layout: two engines in one process, as a run with a reference copy would."""
    from megatron_dppo.megatron.parallel import ParallelConfig, initialize_parallel

    parallel = ParallelConfig(ep=ep, pp=pp, tp=tp, sp=tp > 1, vpp=vpp)
    changes = dict(mlp_only_layers=list(dense_layers))
    initialize_parallel(parallel, SEED, _arch(**changes))
    return (replay_case(True, parallel=parallel, hf_changes=changes),
            replay_case(False, parallel=parallel, hf_changes=changes))


def _check_parallel(results, every_rank_routes: bool = True):
    on, off = [r[0] for r in results], [r[1] for r in results]
    assert all(r["choices"] > 0 for r in on) or not every_rank_routes  # every rank routes through its own layers
    assert sum(r["choices"] for r in on) > 0
    assert all(r["missed"] == 0 for r in on)
    assert sum(r["missed"] for r in off) > 0
    assert on[0]["flip_rate"] > 0 and all(r["flip_rate"] == on[0]["flip_rate"] for r in on)  # one global number
    assert off[0]["flip_rate"] == pytest.approx(sum(r["missed"] for r in off) / sum(r["choices"] for r in off))


@pytest.mark.multiproc
def test_replay_under_expert_parallelism():
    _check_parallel(run_distributed(_parallel_worker, world_size=2, kwargs=dict(ep=2, pp=1), timeout=300))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("world,layout", [
    (2, dict(ep=1, pp=2)),
    (2, dict(ep=1, pp=2, dense_layers=(0, 1))),  # the first stage has no MoE layer at all
    (2, dict(ep=1, pp=2, vpp=2)),
    (4, dict(ep=2, pp=1, tp=2)),  # sequence parallel: each TP rank routes its shard
], ids=["pp2", "pp2_dense_stage", "pp2_vpp2", "tp2sp_ep2_dp2"])
def test_replay_under_pipeline_and_sequence_parallelism(world, layout):
    results = run_distributed(_parallel_worker, world_size=world, kwargs=layout, timeout=300)
    _check_parallel(results, every_rank_routes="dense_layers" not in layout)
