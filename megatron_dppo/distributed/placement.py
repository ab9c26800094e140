"""``rollout.placement=separate``: who is a trainer and who a rollout worker in the job, their process groups,
and the trainer side's end of the link (weights out with a version, batches in, the staleness check).

One job of N + M processes (``torchrun --nproc-per-node N+M``, or srun): job ranks 0..N-1 train, the last M
(``rollout.workers``) are rollout workers. All of them meet in the job's rendezvous store; each side then has a
default process group of its own (the trainers' holds Megatron's groups, the workers' shards generation), under
its own prefix of the store, and two groups cross the sides (``rollout/transfer.py``): the trainer main rank with
every worker for the weights, the trainer main rank with the worker main rank for the batches (and the workers'
evaluations). Only the main ranks talk across; the other trainer ranks get each batch by a broadcast inside the
trainers' group."""

from __future__ import annotations

import collections
import datetime
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_dppo.distributed import collectives as D
from megatron_dppo.distributed.staleness import StalenessGate
from megatron_dppo.distributed.transfer import (
    BatchReceiver,
    BatchSender,
    PeerFailed,
    WeightReceiver,
    WeightSender,
    process_group,
)

TIMEOUT_S = 1800.0
WEIGHTS_READY = "dppo/weights-ready"  # set in the job's store by the trainer main rank before its first weight send
TRAINER = "the trainer (job rank 0)"  # how a worker names its peer in errors


@dataclass
class _Failed:
    """What the trainer main rank hit while waiting for the workers, handed to every trainer rank (the others wait
    for it in a broadcast, and would otherwise block until the process group's own timeout)."""

    kind: type
    message: str


@dataclass
class WorkerEval:
    """The rollout workers' evaluation of one weight version, sent on the batch channel (``train.worker.serve``):
    ``metrics`` are ``evaluation.evaluate``'s, of the policy after ``version`` updates, at RL step ``version - 1``
    as the synchronous loop evaluates it."""

    version: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class Roles:
    """This process's place in a separate-placement job."""

    job_rank: int
    trainers: int
    workers: int

    @property
    def is_worker(self) -> bool:
        return self.job_rank >= self.trainers

    @property
    def side_rank(self) -> int:
        """Rank inside its own side (trainer rank, or worker rank)."""
        return self.job_rank - self.trainers if self.is_worker else self.job_rank

    def describe(self, worker: int) -> str:
        return f"rollout worker {worker} (job rank {self.trainers + worker})"

    def describe_workers(self) -> str:
        if self.workers == 1:
            return self.describe(0)
        last = self.trainers + self.workers - 1
        return f"rollout workers 0..{self.workers - 1} (job ranks {self.trainers}..{last})"


def roles(cfg, env=None) -> Roles:
    """The roles of this job from the launcher's world size and ``rollout.workers``; an error names a world too
    small to hold a trainer besides the workers."""
    from megatron_dppo.distributed.launch import discover_launch

    info = discover_launch(env)
    workers = cfg.rollout.workers
    if info.world_size <= workers:
        raise ValueError(f"rollout.workers={workers} with a job of {info.world_size} processes leaves no trainer: "
                         f"launch at least {workers + 1} processes (torchrun --nproc-per-node N+M) or lower "
                         "rollout.workers")
    return Roles(info.rank, info.world_size - workers, workers)


def job_store(r: Roles) -> dist.Store:
    """The job's rendezvous store (torchrun's agent store, or one hosted by job rank 0 as for env://)."""
    store, _, _ = next(dist.rendezvous("env://", rank=r.job_rank, world_size=r.trainers + r.workers,
                                       timeout=datetime.timedelta(seconds=TIMEOUT_S)))
    return store


def init_side(r: Roles, store: dist.Store) -> None:
    """This side's default process group: the trainers' (ranks 0..N-1; NCCL on GPU, as Megatron needs, else
    gloo) or the workers' (ranks 0..M-1; gloo: it only gathers generated samples as objects). On GPU each process
    takes the GPU of its local rank first (the rollout engine places itself on the current device)."""
    import torch

    from megatron_dppo.distributed.launch import discover_launch

    side, size = ("workers", r.workers) if r.is_worker else ("trainers", r.trainers)
    os.environ["DPPO_ROLE"] = "rollout" if r.is_worker else "trainer"
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(discover_launch().local_rank % torch.cuda.device_count())
    backend = "nccl" if cuda and not r.is_worker else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore(f"dppo/{side}", store), rank=r.side_rank,
                            world_size=size, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def weight_group_rank(r: Roles) -> int | None:
    """Rank in the weights group: the trainer main rank is 0, worker w is 1 + w; other trainers are not in it."""
    if r.is_worker:
        return 1 + r.side_rank
    return 0 if r.job_rank == 0 else None


# ------------------------------------------------------------------------------------------------------------
# The trainer's end
# ------------------------------------------------------------------------------------------------------------
class TrainerLink:
    """Trainer side of a separate-placement run. Every trainer rank holds one; only the main rank talks to the
    workers (the others take part in the broadcasts inside the trainers' group)."""

    def __init__(self, cfg, r: Roles, store: dist.Store):
        self.roles = r
        self.gate = StalenessGate(cfg.train.max_staleness, fixed=cfg.train.staleness_mode == "fixed")
        self.restored: list = []  # staleness_mode=fixed: the in-flight batches a resumed run took from its checkpoint
        self.timeout_s = cfg.rollout.worker_timeout_s
        self.sender = self.batches = None
        self.last_wait_s = 0.0
        self.early: collections.deque = collections.deque()  # batches that came before an awaited evaluation
        self.versions_sent = 0  # weight versions this process sent, on every trainer rank (LoRA: the first: base)
        if r.job_rank == 0:
            self._store, self._bucket_bytes = store, cfg.rollout.weight_bucket_mb << 20
            # k >= 1: the workers need version t + 1 only for a later batch, so the trainer's next step need not
            # wait for its transfer (one host copy of the model; transfer.WeightSender)
            self._background = cfg.train.max_staleness >= 1
            in_flight = cfg.train.max_staleness + 1 + (1 if cfg.eval.every else 0)  # batches, and one evaluation
            self.batches = BatchReceiver(process_group(store, "batches", 0, 2, TIMEOUT_S), r.describe(0),
                                         capacity=in_flight)

    def send_weights(self, stream, version: int, extra: dict[str, Any]) -> int:
        """Every trainer rank iterates the (collective) export; the main rank sends it, stamped ``version``. A
        worker that takes no bucket within ``rollout.worker_timeout_s`` (hung) or has died fails every trainer
        rank, naming the workers (background sends: at the next send)."""
        self.versions_sent += 1
        if self.roles.job_rank != 0:
            for _ in stream:
                pass
        return self._on_main_rank(lambda: self._weights_sender().send(version, stream, extra)) or 0

    def _weights_sender(self) -> WeightSender:
        """The weights group, made at the first send (main rank): the workers build their rollout engines only once
        the trainer's set-up is done (they read its tokenizer), and a vLLM worker can join only with its engine
        built (the receiver lives inside it). ``WEIGHTS_READY`` in the store tells them; the group's set-up waits
        for them all."""
        if self.sender is None:
            self._store.set(WEIGHTS_READY, "1")
            # (this rank's end of the group times out after rollout.worker_timeout_s: a broadcast a worker does not
            # take by then means a hung worker; the workers' ends keep TIMEOUT_S, as a step may take long)
            group = process_group(self._store, "weights", 0, self.roles.workers + 1, self.timeout_s)
            self.sender = WeightSender(group, self._bucket_bytes, self.roles.describe_workers(),
                                       background=self._background)
        return self.sender

    def _on_main_rank(self, wait) -> Any:
        """``wait()`` on the main rank (the one that talks to the workers), its result on every trainer rank; what it
        raised (a worker died or hung past ``rollout.worker_timeout_s``, an out-of-order message) is raised on every
        trainer rank, within that time, naming the worker."""
        result = None
        if self.batches is not None:
            try:
                result = wait()
            except (PeerFailed, RuntimeError) as err:
                result = _Failed(PeerFailed if isinstance(err, PeerFailed) else RuntimeError, str(err))
        result = D.broadcast_object(result)
        if isinstance(result, _Failed):
            raise result.kind(result.message)
        return result

    def receive(self, step: int) -> Any:
        """The batch of RL step ``step`` on every trainer rank, its staleness checked against the bound."""
        start = time.monotonic()
        batch = self._on_main_rank(self._next)
        self.last_wait_s = time.monotonic() - start
        if isinstance(batch, WorkerEval):
            raise RuntimeError(f"an evaluation of weight version {batch.version} arrived while the trainer waits for "
                               f"the batch of step {step}: only the evaluations the trainer waits for are sent")
        if batch.step != step:
            raise RuntimeError(f"rollout batch for step {batch.step} arrived while the trainer is at step {step}")
        self.gate.admit(step, batch.version, batch_token_versions(batch))
        return batch

    def receive_eval(self, version: int) -> dict[str, float]:
        """The workers' evaluation of weight ``version`` (marked due in its ``extra``) on every trainer rank. The
        batches that come before it on the channel (max_staleness >= 1: generated while the version was on its way)
        are kept for ``receive``, in order."""
        def wait() -> dict[str, float]:
            while True:
                message = self.batches.get(self.timeout_s)
                if not isinstance(message, WorkerEval):
                    self.early.append(message)
                elif message.version != version:
                    raise RuntimeError(f"the evaluation of weight version {message.version} arrived while the "
                                       f"trainer waits for that of version {version}")
                else:
                    return message.metrics

        return self._on_main_rank(wait)

    def _next(self) -> Any:
        return self.early.popleft() if self.early else self.batches.get(self.timeout_s)

    # -- train.staleness_mode=fixed: the batches in flight go into the checkpoint
    def in_flight(self, step: int, steps: int) -> bytes | None:
        """The batches of RL steps ``step`` .. ``step`` + k - 1 (not past ``steps``) on every trainer rank, pickled
        for a checkpoint at ``step`` (whose common state is loaded with ``weights_only``). They come from versions
        already sent (t - k < ``step``), so the main rank waits for them and keeps them for ``receive``. None in
        newest mode, or before the first version went out (no batch is in flight then).

        One evaluation may come first: that of version ``step`` when the run stops right after the version went out
        marked due, before the loop waited for it (a stop request in the last warm-start step: the loop skips its
        first evaluation). It is dropped: the resumed run marks that version due again and evaluates it then."""
        if not self.gate.fixed:
            return None
        count = max(0, min(self.gate.k, steps - step))

        def wait() -> list | None:
            if self.sender is None or self.sender.last_version is None:  # no version went out: nothing in flight
                return None
            while len(self.early) < count:
                message = self.batches.get(self.timeout_s)
                if isinstance(message, WorkerEval):
                    if message.version != step:
                        raise RuntimeError(f"an evaluation of weight version {message.version} arrived while the "
                                           f"trainer collects the batches in flight at step {step}")
                    continue  # the evaluation the stopping loop did not wait for (docstring)
                self.early.append(message)
            batches = list(self.early)[:count]
            if [b.step for b in batches] != list(range(step, step + count)):
                raise RuntimeError(f"the batches in flight at step {step} are those of steps "
                                   f"{[b.step for b in batches]}")
            return batches

        batches = self._on_main_rank(wait)
        return None if batches is None else pickle.dumps(batches)

    def resume_at(self, rl_step: int, in_flight: bytes | None) -> None:
        """A run resumed at ``rl_step``: its first version is ``rl_step`` (the staleness gate's floor), and the
        checkpoint's in-flight batches (fixed mode, ``in_flight``) that this run's bound admits are trained first,
        without being generated again (all of them when the bound and mode are the checkpoint's). Those it does not
        admit (the checkpoint was written with another ``train.max_staleness`` or ``staleness_mode``) are dropped,
        and the workers generate those steps again from version ``rl_step`` on (``StalenessGate.resumable``)."""
        self.gate.floor = rl_step
        saved = _unpickle_in_flight(in_flight)
        self.restored = self.gate.resumable(saved, rl_step)
        if len(self.restored) < len(saved) and D.is_main():
            print(f"the checkpoint holds {len(saved)} batch(es) in flight (steps {saved[0].step}.."
                  f"{saved[-1].step}, weight versions {saved[0].version}..{saved[-1].version}); train.max_staleness="
                  f"{self.gate.k} ({'fixed' if self.gate.fixed else 'newest'} mode) admits {len(self.restored)} of "
                  "them: the others are generated again", flush=True)
        if self.batches is not None:
            self.early.extend(self.restored)

    def worker_start(self, rl_step: int, sampler_state: dict) -> tuple[int, dict]:
        """Where the workers start: after the restored in-flight batches (their last sampler position), else at
        ``rl_step`` with the trainer's sampler position."""
        if self.restored:
            return self.restored[-1].step + 1, self.restored[-1].sampler_state
        return rl_step, sampler_state

    def close(self, clean: bool) -> None:
        """The stop message to the workers, then their end marker (only after a clean end: after a failure
        nobody waits for them). Nothing is left pending in the cross groups when the processes exit."""
        if clean and self.roles.job_rank == 0:
            self._weights_sender().stop()
            self.batches.join(self.timeout_s)


def batch_token_versions(batch) -> list[int] | None:
    """Every sampled token's weight version of a batch with partial rollouts (``rollout.max_interruptions``), else
    None (the batch has one version)."""
    versions = getattr(getattr(batch, "rollout", None), "token_versions", None)
    if versions is None:
        return None
    return [v for group in versions for sample in group for v in sample]


def _unpickle_in_flight(in_flight: bytes | None) -> list:
    """A checkpoint's in-flight batches; none when it holds none, or when they were pickled by a megatron-dppo whose
    classes have moved or changed since (then they are generated again, as for another bound: ``resume_at``)."""
    if not in_flight:
        return []
    try:
        return pickle.loads(in_flight)
    except (ModuleNotFoundError, AttributeError, ImportError, TypeError) as err:
        if D.is_main():
            print(f"the checkpoint's batches in flight were written by another version of megatron-dppo and cannot "
                  f"be read here ({type(err).__name__}: {err}): they are generated again", flush=True)
        return []


def connect_trainer(cfg) -> TrainerLink:
    """Process groups of a trainer process (before Megatron's); returns its link to the workers."""
    r = roles(cfg)
    store = job_store(r)
    init_side(r, store)
    return TrainerLink(cfg, r, store)


# ------------------------------------------------------------------------------------------------------------
# The worker's end
# ------------------------------------------------------------------------------------------------------------
class WorkerWeights:
    """A rollout worker's end of the weights channel, the same for every engine: ``wait(min_version)`` returns a
    version >= ``min_version`` (``.version``, ``.extra``), the same one on every rank of the worker side, or None
    after the stop message; ``load(version)`` puts that version into the engine; ``arrived`` lists the versions
    received. Subclasses say where the versions land (``_newest``, ``load``, ``arrived``)."""

    def wait(self, min_version: int, exact: bool = False) -> Any:
        """``exact`` (staleness_mode=fixed): version ``min_version`` itself, the older ones released."""
        newest = self._newest(min_version, exact)
        while D.world_size() > 1 and not exact:  # one batch, one version stamp: the worker ranks agree on it
            versions = D.all_gather_objects(None if newest is None else newest.version)
            if None in versions:
                return None
            if min(versions) == max(versions):
                break
            newest = self._newest(max(versions), False)  # a newer one reached some ranks first: wait for it on all
        return newest

    def local_newest(self, min_version: int) -> Any:
        """The newest version >= ``min_version`` that reached THIS rank, without agreeing with the other worker
        ranks (partial rollouts: each worker takes versions mid-batch on its own)."""
        return self._newest(min_version, False)

    def _newest(self, min_version: int, exact: bool) -> Any:
        raise NotImplementedError

    def load(self, version: Any) -> None:
        raise NotImplementedError

    @property
    def arrived(self) -> list[int]:
        raise NotImplementedError


class HostWeights(WorkerWeights):
    """The versions land in this process's memory (``transfer.WeightReceiver``'s thread, joined here) and are
    pushed into the engine with its ``load_weights`` (the HF engine)."""

    def __init__(self, receiver: WeightReceiver, engine):
        self.receiver, self.engine = receiver, engine

    def _newest(self, min_version: int, exact: bool) -> Any:
        return self.receiver.wait(min_version, exact=exact)

    def load(self, version: Any) -> None:
        self.engine.load_weights(iter(version.weights))

    @property
    def arrived(self) -> list[int]:
        return self.receiver.arrived


class EngineWeights(WorkerWeights):
    """The versions land inside the engine's workers (vLLM: ``rollout/vllm_weight_sync.py``, a receiver thread in
    each worker); only the version number and ``extra`` come out, and the engine loads the version it returned."""

    def __init__(self, engine):
        self.engine = engine

    def _newest(self, min_version: int, exact: bool) -> Any:
        return self.engine.wait_weights(min_version, exact=exact)

    def load(self, version: Any) -> None:
        self.engine.wake_up(["weights"])  # (marked asleep after each generation: rollout.handover; no sleep mode)
        self.engine.load_received(version.version)

    @property
    def arrived(self) -> list[int]:
        return self.engine.weights_arrived()


@dataclass
class WorkerLink:
    roles: Roles
    batches: BatchSender | None  # worker main rank only
    store: dist.Store
    weights: WorkerWeights | None = None  # after join_weights

    def join_weights(self, cfg, engine) -> WorkerWeights:
        """Join the weights group (every worker at once with the trainer main rank, whose set-up waits for all):
        the vLLM engine's workers join it themselves, given the store's address; the HF engine's versions are
        received here."""
        rank, size, peer = weight_group_rank(self.roles), self.roles.workers + 1, TRAINER
        keep_all = cfg.train.staleness_mode == "fixed"  # (every version kept until the worker is past it)
        if cfg.rollout.engine == "vllm":
            engine.join_weight_group(self.store.host, self.store.port, rank, size, TIMEOUT_S, peer, keep_all=keep_all)
            self.weights = EngineWeights(engine)
        else:
            self.weights = HostWeights(WeightReceiver(process_group(self.store, "weights", rank, size, TIMEOUT_S),
                                                      peer, keep_all=keep_all), engine)
        return self.weights

    def close(self) -> None:
        """After the trainer's stop message: the end marker of the batch channel, then this side's group."""
        if self.batches is not None:
            self.batches.close()
        dist.destroy_process_group()


def connect_worker(cfg) -> WorkerLink:
    """Process groups of a rollout worker (the weights group comes with its engine: ``WorkerLink.join_weights``);
    returns once the trainer's set-up is done (``WEIGHTS_READY``)."""
    r = roles(cfg)
    store = job_store(r)
    init_side(r, store)
    sender = BatchSender(process_group(store, "batches", 1, 2, TIMEOUT_S), TRAINER) if r.side_rank == 0 else None
    store.wait([WEIGHTS_READY], datetime.timedelta(seconds=TIMEOUT_S))
    return WorkerLink(r, sender, store)
