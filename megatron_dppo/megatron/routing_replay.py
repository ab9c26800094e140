"""Routing replay for Mixture-of-Experts policies: a later forward uses the experts an earlier forward chose.

Why: an MoE layer sends each token to the top-k experts of its router. Two forwards of the same tokens can pick
different experts (the weights moved between them, or a different numerical path), and a flipped expert is a
different function: the log-prob of the token jumps, the PPO ratio with it. Replaying the recorded choices in
the training forward keeps the routing fixed between the pass that scored a token (the old-log-prob pass) and
the update, so the ratio measures the change of the experts' and attention weights only (docs/algorithms.md,
"Routing replay"). The router's weights still get gradients: the replayed experts' probabilities are the
router's current softmax scores gathered at the recorded indices.

The three steps
---------------
1. Record (forward-only old-log-prob pass, ``PolicyEngine.fill_logprobs``): every MoE router of this rank
   appends its top-k expert ids ``[T_local, k]`` per forward call. After the pass the ``L`` routers' lists are
   stacked per micro-batch (``[T, L, k]``; under sequence parallelism all-gathered over the TP group first) and
   unpacked PER SEQUENCE with the micro-batch's ``cu_seqlens`` (``unpack_routes``): ``batch.routed_experts[i]``
   is ``[n_i, L, k]`` for its ``i``-th sequence (``n_i`` its true length, ``L`` the MoE layers of THIS rank:
   of its pipeline stage, of all its virtual stages in chunk order), int16 from the start (``2 L k`` bytes per
   token: 768 B for Qwen3-30B-A3B's 48 layers x top-8), kept on the micro-batch's device.
2. Re-pack (``pack_routes``): the training pass may pack differently (mini-batches, DP dummies, the interleaved
   schedule's padding); each of its micro-batches gets ``[T, L, k]`` rebuilt from its sequences' routes, with
   the valid ids ``0..k-1`` on padding positions (they carry no loss) and a mask of the real positions.
3. Replay (``PolicyEngine.train_step``): each router gets a queue of targets, one per micro-batch (its TP
   shard under sequence parallelism), and takes the next one at each forward call. The queue relies on what
   every Megatron pipeline schedule guarantees: a model chunk runs its micro-batches' forwards in order, once
   each. Activation recompute would run some routers' forwards twice (the full-layer or the ``moe`` selective
   recompute): replay refuses it, and without replay the routers are then left alone (no flip metric);
   ``moe_act`` recompute (experts only) is fine. At the end of the pass every queue must be empty, and all
   replay state is dropped (also after an exception). The load-balancing auxiliary loss, when on, keeps
   computing its statistics from the router's own top-k (Megatron computes them apart from the routing).

Parallelism: expert parallelism needs nothing (each rank's router sees this rank's tokens; expert ids are
global); pipeline parallelism: each stage records and replays its own layers; sequence parallelism: the router
sees the rank's contiguous ``T / tp`` shard (gathered for the per-sequence routes, sliced for the replay). TP > 1
without sequence parallelism would have every TP rank route all ``T`` tokens identically (routes used as they are,
the flips counted on TP rank 0 only), but Megatron-Core 0.16's ``MoELayer`` refuses to train MoE that way. Context
parallelism is not supported by the engine.

The flip rate: in the training forward each router also computes its own top-k (one ``topk`` on scores it has
anyway) and counts the (token, layer, k) choices where a recorded expert is not among its own (padding excluded):
``moe/route_flip_rate`` = flips / choices. With replay on it says how often replay overrode the router; with
replay off (routes still recorded when the old-log-prob pass runs) it is the real flip rate, the routing
mismatch replay would remove.

Megatron's own ``RouterReplay`` (``moe_enable_routing_replay``) keeps every instance ever built in a
process-global list, positional, shared by every model in the process (a reference copy, tests building several
engines), and its backward list grows with each target set. We therefore take our routers from the policy's own
modules (``moe_routers``), remove Megatron's instances of these models from the global list
(``release_megatron_router_replay``, also for the frozen reference model, which routes freely) and give each
policy router a ``_RouterSlot`` whose only entry point is the ``get_replay_topk`` call Megatron's
``topk_routing_with_score_function`` makes.

``pack_routes`` / ``unpack_routes`` are plain torch (no Megatron import).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Sequence

import torch
from torch import Tensor


# ----------------------------------------------------------------------------------------------------------
# Per-sequence routes <-> packed micro-batch layout (pure)
# ----------------------------------------------------------------------------------------------------------
def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed int dtype holding expert ids ``0..num_experts-1`` (stored routes)."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def unpack_routes(routes: Tensor, batch) -> list[Tensor]:
    """Per-sequence routes ``[n_i, L, k]`` from a micro-batch's ``routes[T, L, k]`` (``batch``: a
    ``ThdBatch``; sequence ``i`` occupies ``cu_seqlens_padded[i] : + n_i``, ``n_i`` its true length)."""
    if routes.dim() != 3 or routes.shape[0] < int(batch.tokens.numel()):
        raise ValueError(f"routes of shape {tuple(routes.shape)} do not cover the micro-batch's "
                         f"{int(batch.tokens.numel())} positions as [T, layers, topk]")
    starts = batch.cu_seqlens_padded[:-1].tolist()
    return [routes[a:a + n] for a, n in zip(starts, batch.seq_lengths.tolist())]


def pack_routes(per_sequence: Sequence[Tensor] | Mapping[int, Tensor] | None, batch, layers: int, topk: int
                ) -> tuple[Tensor, Tensor]:
    """``(routes[T, L, k] int64, valid[T] bool)`` for a micro-batch from its sequences' routes: a list in the
    order of ``batch.sample_ids``, or a mapping sample id -> routes (routes recorded under another packing).
    Positions outside the sequences' true lengths get the valid ids ``0..k-1`` and ``valid = False`` (every
    position when ``per_sequence`` is None: nothing recorded)."""
    total = int(batch.tokens.numel())
    routes = torch.arange(topk, dtype=torch.long).expand(total, layers, topk).clone()
    valid = torch.zeros(total, dtype=torch.bool)
    if per_sequence is None:
        return routes, valid
    sample_ids = batch.sample_ids.tolist()
    if isinstance(per_sequence, Mapping):
        missing = [s for s in sample_ids if s not in per_sequence]
        if missing:
            raise ValueError(f"no recorded routes for sample ids {missing[:8]} of this micro-batch")
        per_sequence = [per_sequence[s] for s in sample_ids]
    if len(per_sequence) != len(sample_ids):
        raise ValueError(f"{len(per_sequence)} sequences of routes for a micro-batch of {len(sample_ids)}")
    for a, n, r in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.seq_lengths.tolist(), per_sequence):
        if tuple(r.shape) != (n, layers, topk):
            raise ValueError(f"recorded routes of shape {tuple(r.shape)} for a sequence of {n} tokens; expected "
                             f"({n}, {layers}, {topk}) (tokens, MoE layers of this rank, top-k)")
        routes[a:a + n] = r.to(torch.long)
        valid[a:a + n] = True
    return routes, valid


def routes_by_sample(micro_batches: Sequence) -> dict[int, Tensor]:
    """Sample id -> recorded routes over ``micro_batches`` (e.g. to re-pack them under another packing)."""
    out: dict[int, Tensor] = {}
    for b in micro_batches:
        if getattr(b, "routed_experts", None) is not None:
            out.update(zip(b.sample_ids.tolist(), b.routed_experts))
    return out


# ----------------------------------------------------------------------------------------------------------
# The policy's routers
# ----------------------------------------------------------------------------------------------------------
def moe_routers(model_chunks: Sequence) -> list:
    """This rank's MoE routers (``TopKRouter``) of ``model_chunks``, in chunk order then layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


def release_megatron_router_replay(model_chunks: Sequence) -> None:
    """Remove the ``RouterReplay`` instances of these chunks' routers from Megatron's process-global list and
    detach them (the routers route freely until a ``RoutingReplay`` attaches its own slots)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mine = [r.router_replay for r in moe_routers(model_chunks) if r.router_replay is not None]
    registry = RouterReplay.global_router_replay_instances
    registry[:] = [inst for inst in registry if not any(inst is m for m in mine)]
    for router in moe_routers(model_chunks):
        if not isinstance(router.router_replay, _RouterSlot):
            router.router_replay = None


class _RouterSlot:
    """One router's replay state; Megatron's top-k routing calls ``get_replay_topk`` (the router_replay hook).

    mode None: the router's own top-k. "record": own top-k, appended to ``recorded``. "replay" / "observe": own
    top-k compared with the next target of ``targets`` (flips counted over valid tokens); "replay" then returns
    the target (its probabilities gathered from the current scores), "observe" the router's own choice."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype  # of the recorded ids (route_dtype: 2 bytes per choice for up to 32767 experts)
        self.mode: str | None = None
        self.recorded: list[Tensor] = []
        self.targets: list[tuple[Tensor, Tensor]] = []
        self.flips: Tensor | None = None
        self.choices: Tensor | None = None

    def reset(self) -> None:
        self.mode, self.recorded, self.targets, self.flips, self.choices = None, [], [], None, None

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[Tensor, Tensor]:
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode is None:
            return probs, own
        if self.mode == "record":
            self.recorded.append(own.detach().to(self.dtype))
            return probs, own
        if not self.targets:
            raise RuntimeError("routing replay: a router ran more forwards than there are micro-batches (activation "
                               "recompute of the router, or a forward outside the pipeline schedule)")
        target, valid = self.targets.pop(0)
        target, valid = target.to(scores.device), valid.to(scores.device)
        if target.shape != own.shape:
            raise RuntimeError(f"routing replay: target of shape {tuple(target.shape)} for router input "
                               f"{tuple(own.shape)} (micro-batch order or sequence-parallel shard mismatch)")
        with torch.no_grad():
            missing = (target.unsqueeze(-1) != own.unsqueeze(-2)).all(dim=-1) & valid.unsqueeze(-1)
            flips, choices = missing.sum(), valid.sum() * topk
            self.flips = flips if self.flips is None else self.flips + flips
            self.choices = choices if self.choices is None else self.choices + choices
        if self.mode == "observe":
            return probs, own
        return scores.gather(1, target), target


# ----------------------------------------------------------------------------------------------------------
# The engine side
# ----------------------------------------------------------------------------------------------------------
def router_recomputed(config) -> bool:
    """Whether activation recompute runs the routers' forward again in the backward (full-layer recompute, or
    the selective ``moe`` module; ``moe_act`` recomputes the experts' activation only)."""
    granularity = getattr(config, "recompute_granularity", None)
    return granularity == "full" or (granularity == "selective"
                                     and "moe" in (getattr(config, "recompute_modules", None) or []))


class RoutingReplay:
    """Records and replays the expert choices of the policy's MoE routers on this rank (module docstring).

    ``replay``: the training forward uses the recorded experts (``model.moe_routing_replay``); False only
    observes them (the real flip rate). ``topk`` / ``num_experts``: of the MoE layers."""

    def __init__(self, model_chunks: Sequence, *, replay: bool, topk: int, num_experts: int):
        configs = [getattr(c, "config", None) for c in model_chunks]
        if any(router_recomputed(cfg) for cfg in configs):
            raise ValueError(f"routing replay with activation recompute (recompute_granularity="
                             f"{configs[0].recompute_granularity!r}, recompute_modules={configs[0].recompute_modules})"
                             " is not supported: the recompute runs the router's forward again inside the backward; "
                             "use no recompute, or selective recompute without 'moe' (e.g. 'moe_act')")
        release_megatron_router_replay(model_chunks)
        self.routers = moe_routers(model_chunks)
        self.replay, self.topk, self.dtype = bool(replay), int(topk), route_dtype(num_experts)
        self.slots = [_RouterSlot(self.dtype) for _ in self.routers]
        for router, slot in zip(self.routers, self.slots):
            router.router_replay = slot
        self.sequence_parallel = bool(getattr(configs[0], "sequence_parallel", False)) if configs else False

    @classmethod
    def for_policy(cls, model_chunks: Sequence, arch, replay: bool) -> "RoutingReplay | None":
        """The policy's ``RoutingReplay``: None for a dense model, and when only observing (``replay`` False)
        under a recompute that re-runs the routers (no flip metric then); replay with such a recompute raises."""
        if arch.moe is None:
            return None
        if not replay and any(router_recomputed(getattr(c, "config", None)) for c in model_chunks):
            release_megatron_router_replay(model_chunks)
            return None
        return cls(model_chunks, replay=replay, topk=arch.moe.topk, num_experts=arch.moe.num_experts)

    @property
    def layers(self) -> int:
        """MoE layers (routers) on this rank."""
        return len(self.slots)

    def reset(self) -> None:
        for slot in self.slots:
            slot.reset()

    # -- record -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, micro_batches: Sequence) -> Iterator[None]:
        """Record every router during the block (one forward-only schedule over ``micro_batches``, possibly
        followed by dummies), then store ``batch.routed_experts`` (per sequence) on each of ``micro_batches``."""
        self.reset()
        for slot in self.slots:
            slot.mode = "record"
        try:
            yield
            per_batch = self._stacked_records(micro_batches)
        finally:
            self.reset()
        for batch, routes in zip(micro_batches, per_batch):
            device = batch.tokens.device
            batch.routed_experts = [r.to(device) for r in unpack_routes(routes, batch)]

    def _stacked_records(self, micro_batches: Sequence) -> list[Tensor]:
        """``[T, L, k]`` per micro-batch (the first ``len(micro_batches)`` recorded forwards), all-gathered over
        TP under sequence parallelism. A stage without MoE layers gives ``[T, 0, k]``."""
        count = len(micro_batches)
        for slot in self.slots:
            if len(slot.recorded) < count:
                raise RuntimeError(f"routing replay: a router recorded {len(slot.recorded)} forwards for {count} "
                                   "micro-batches")
        if not self.slots:
            return [torch.zeros(int(b.tokens.numel()), 0, self.topk, dtype=self.dtype) for b in micro_batches]
        out = []
        for m in range(count):
            local = torch.stack([slot.recorded[m] for slot in self.slots], dim=1)  # [T_local, L, k]
            out.append(_gather_sequence_shards(local) if self.sequence_parallel else local)
        return out

    # -- replay -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def replaying(self, micro_batches: Sequence) -> Iterator[dict]:
        """During the block (one training schedule over ``micro_batches``, in order), each router takes the
        recorded experts of the next micro-batch (``replay``) or only compares with them. Yields a dict that
        holds, after the block, ``flips`` and ``choices`` (this rank's counts, float64). Batches without
        sequences (dummies) need no routes; any other batch without ``routed_experts`` is an error."""
        counts: dict = {}
        missing = [i for i, b in enumerate(micro_batches)
                   if not b.is_dummy and getattr(b, "routed_experts", None) is None]
        if missing and self.replay:
            raise ValueError(f"routing replay: micro-batches {missing} have no recorded routes "
                             "(batch.routed_experts); run PolicyEngine.fill_logprobs(..., old=True) first")
        if len(missing) == len(micro_batches) or not self.slots:  # observing, nothing recorded: route freely
            yield counts
            return
        self.reset()
        for batch in micro_batches:
            # a dummy, or (observing only) a batch without routes: filler targets, no position compared
            routes, valid = pack_routes(getattr(batch, "routed_experts", None), batch, self.layers, self.topk)
            routes, valid = routes.to(batch.tokens.device), valid.to(batch.tokens.device)
            if self.sequence_parallel:
                routes, valid = _sequence_shard(routes), _sequence_shard(valid)
            for j, slot in enumerate(self.slots):
                slot.targets.append((routes[:, j], valid))
        for slot in self.slots:
            slot.mode = "replay" if self.replay else "observe"
        try:
            yield counts
            left = [len(slot.targets) for slot in self.slots]
            if any(left):
                raise RuntimeError(f"routing replay: routers left {left} micro-batch targets unused")
            flips = sum(float(s.flips) for s in self.slots if s.flips is not None)
            choices = sum(float(s.choices) for s in self.slots if s.choices is not None)
            counts.update(flips=flips, choices=choices)
        finally:
            self.reset()


    # -- the metric -------------------------------------------------------------------------------------
    def flip_metrics(self, counts: Mapping[str, float], device: torch.device) -> dict[str, float]:
        """``{"moe/route_flip_rate": flips / choices}`` from ``replaying``'s counts summed over the world (each
        rank's own routers: every pipeline stage, DP/EP rank, and TP shard under sequence parallelism; without
        it the TP ranks route the same tokens, so TP rank 0 counts alone). Empty when nothing was compared.
        Collective: every rank calls it."""
        from megatron.core import parallel_state

        counts_rank = self.sequence_parallel or parallel_state.get_tensor_model_parallel_rank() == 0
        local = [counts.get("flips", 0.0), counts.get("choices", 0.0)] if counts_rank else [0.0, 0.0]
        totals = torch.tensor(local, dtype=torch.float64, device=device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(totals)
        flips, choices = totals.tolist()
        return {"moe/route_flip_rate": flips / choices} if choices else {}


def _sequence_shard(x: Tensor) -> Tensor:
    """This TP rank's contiguous ``T / tp`` rows of ``x`` (sequence parallelism's split of the sequence dim)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return x
    rank = parallel_state.get_tensor_model_parallel_rank()
    rows = x.shape[0] // tp
    return x[rank * rows:(rank + 1) * rows]


def _gather_sequence_shards(local: Tensor) -> Tensor:
    """The full ``[T, ...]`` from every TP rank's ``[T / tp, ...]`` shard (rank order); exchanged as int32
    (gloo and NCCL have no int16 collectives), returned in ``local``'s dtype."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    wide = local.to(torch.int32).contiguous()
    parts = [torch.empty_like(wide) for _ in range(tp)]
    torch.distributed.all_gather(parts, wide, group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts).to(local.dtype)
