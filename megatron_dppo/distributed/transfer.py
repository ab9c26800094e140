"""Trainer <-> rollout-worker channels of ``rollout.placement=separate``: versioned weights one way, rollout batches
the other, each over its own process group of the job (gloo on CPU).

Weights (``WeightSender`` on the trainer's main rank, ``WeightReceiver`` on every rollout rank): one process group of
the trainer main rank (group rank 0) and the M rollout ranks (1..M). A version is a sequence of broadcasts from rank
0: a header (version number, the tensors' names / shapes / dtypes, the bucket's byte count, ``last``, and on the
first bucket a small ``extra`` object: the prompt history and the sampler position the rollout side needs) and one
flat byte buffer per bucket, the buckets cut from the streaming export at ``rollout.weight_bucket_mb``. Every
version is stamped; the receiver checks that versions arrive in increasing order and keeps only the newest complete
one (a version the rollout side never generated with is skipped, not loaded). The receiver runs in a thread whose
receive is always posted, so the trainer's send never waits for a generation to finish.

Batches (``BatchSender`` on the rollout main rank, ``BatchReceiver`` on the trainer main rank): a two-rank process
group; each batch is one pickled object (length, then bytes). The receiver thread puts batches in a bounded queue;
the staleness gate (``megatron_dppo.distributed.staleness``) already bounds how far the rollout side runs ahead.

Failures: a receive that fails (the peer process died: gloo reports the closed connection at once; or the process
group's timeout passed) is kept by the receiver thread and raised in the main thread as :class:`PeerFailed`, naming
the peer's job rank and role, the next time the main thread waits, within ``poll_s``."""

from __future__ import annotations

import datetime
import pickle
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

STOP = -1  # the version number of the message that ends the rollout side's loop
_END = "dppo/end-of-batches"  # the last message of the batch channel


class PeerFailed(RuntimeError):
    """The other side of a channel stopped: its process died, or nothing arrived within the timeout."""


def process_group(store: dist.Store, name: str, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo process group of ``size`` ranks under ``name`` in the job's store (not the default group: the
    trainer and rollout sides each have their own default group)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"dppo/{name}", store), rank, size,
                                 datetime.timedelta(seconds=timeout_s))


# ------------------------------------------------------------------------------------------------------------
# Objects and byte buffers over a process group
# ------------------------------------------------------------------------------------------------------------
def _bcast(pg: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    pg.broadcast([tensor], opts).wait()


def broadcast_object(pg: dist.ProcessGroup, obj: Any = None, pickled: bytes | None = None) -> Any:
    """Rank 0's ``obj`` on every rank of ``pg`` (pickled: a length, then the bytes; ``pickled``: rank 0's object
    already pickled)."""
    if pg.rank() == 0 and pickled is None:
        pickled = pickle.dumps(obj)
    payload = torch.frombuffer(bytearray(pickled), dtype=torch.uint8) if pg.rank() == 0 else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    _bcast(pg, length)
    if payload is None:
        payload = torch.empty(int(length), dtype=torch.uint8)
    _bcast(pg, payload)
    if pg.rank() == 0:
        return obj
    return pickle.loads(payload.numpy().tobytes())


def send_object(pg: dist.ProcessGroup, obj: Any, dst: int) -> None:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    pg.send([torch.tensor([payload.numel()], dtype=torch.int64)], dst, 0).wait()
    pg.send([payload], dst, 1).wait()


def recv_object(pg: dist.ProcessGroup, src: int) -> Any:
    length = torch.zeros(1, dtype=torch.int64)
    pg.recv([length], src, 0).wait()
    payload = torch.empty(int(length), dtype=torch.uint8)
    pg.recv([payload], src, 1).wait()
    return pickle.loads(payload.numpy().tobytes())


# ------------------------------------------------------------------------------------------------------------
# Weights: trainer main rank -> every rollout rank
# ------------------------------------------------------------------------------------------------------------
def buckets(stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream cut into lists of at most ``bucket_bytes`` (a larger tensor gets a list of its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in stream:
        n = tensor.numel() * tensor.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


ALIGN = 16  # every tensor starts at a multiple of this many bytes in a bucket (>= the widest element size)


def _layout(specs: list[tuple[str, tuple, torch.dtype]]) -> tuple[list[tuple[int, int]], int]:
    """(byte offset, byte count) of each tensor in a bucket, each offset a multiple of ``ALIGN`` (a bf16 tensor of
    odd length followed by an fp32 one would otherwise start the fp32 at an offset it cannot be viewed from), and
    the bucket's total size. The sender and the receiver compute it from the same specs."""
    out, offset = [], 0
    for _, shape, dtype in specs:
        offset = -(-offset // ALIGN) * ALIGN
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        out.append((offset, n))
        offset += n
    return out, offset


def _flat_bytes(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The bucket's tensors as one byte buffer, laid out by ``_layout`` (zero padding between them)."""
    places, total = _layout([(name, tuple(t.shape), t.dtype) for name, t in bucket])
    flat = torch.zeros(total, dtype=torch.uint8)
    for (_, t), (offset, n) in zip(bucket, places):
        flat[offset:offset + n] = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return flat


def _unflatten(flat: torch.Tensor, specs: list[tuple[str, tuple, torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
    places, total = _layout(specs)
    if flat.numel() != total:
        raise ValueError(f"a weight bucket of {flat.numel()} bytes does not hold its {len(specs)} tensors "
                         f"({total} bytes laid out)")
    return [(name, flat[offset:offset + n].view(dtype).reshape(shape))
            for (name, shape, dtype), (offset, n) in zip(specs, places)]


class WeightSender:
    """Trainer main rank: ``send(version, stream, extra)`` broadcasts one version to every rollout rank;
    ``stop()`` ends the rollout side's loop.

    ``background=True``: ``send`` first copies the whole version into host buffers (the export's collectives run
    in the caller's thread, as they must; the prompt history in ``extra`` is pickled then, so later changes do not
    leak into the version) and returns; a thread broadcasts the buffers while the trainer goes on with its next
    step. One version at most is in flight: the next ``send`` (or ``stop``) first waits for it, and a failure of
    the thread is raised there as :class:`PeerFailed`. The cost is one host copy of the model on this rank, against
    two buckets at a time when sending inline. The trainer's main rank then blocks only for the copy, not for the
    transfer (``benchmarks/weight_transfer.py``)."""

    def __init__(self, pg: dist.ProcessGroup, bucket_bytes: int, peers: str = "the rollout workers",
                 background: bool = False):
        self.pg, self.bucket_bytes, self.peers, self.background = pg, int(bucket_bytes), peers, background
        self.last_version: int | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def send(self, version: int, stream: Iterable[tuple[str, torch.Tensor]], extra: Any = None) -> int:
        """Returns the number of tensors sent (background: copied, to be sent). Versions must increase. A failed
        send (a receiver died) raises :class:`PeerFailed` naming ``peers`` (background: at the next send or stop)."""
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"weight version {version} after version {self.last_version}: versions must increase")
        self.wait()
        messages = self._messages(version, stream, extra)
        if self.background:
            messages = list(messages)  # every bucket copied to host memory before the trainer goes on
            self._thread = threading.Thread(target=self._send_all, args=(version, messages), name="weight-sender",
                                            daemon=True)
            self._thread.start()
            count = sum(n for _, _, n in messages)
        else:
            count = self._send_all(version, messages, raise_now=True)
        self.last_version = version
        return count

    def wait(self) -> None:
        """Until the version being sent in the background has gone out; raises what its thread hit."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise PeerFailed(f"sending weights to {self.peers} failed: {err}") from err

    def _messages(self, version: int, stream, extra: Any) -> Iterator[tuple[bytes, torch.Tensor, int]]:
        """(pickled header, flat bytes, tensor count) per bucket; ``last`` marks the final one (one bucket of
        lookahead: at most two in memory when consumed as they come)."""
        first, parts = True, buckets(stream, self.bucket_bytes)
        bucket = next(parts, [])
        while True:
            following = next(parts, None)
            flat = _flat_bytes(bucket) if bucket else torch.empty(0, dtype=torch.uint8)
            specs = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
            header = {"version": version, "specs": specs, "nbytes": flat.numel(), "last": following is None,
                      "extra": extra if first else None}
            yield pickle.dumps(header), flat, len(bucket)
            if following is None:
                return
            first, bucket = False, following

    def _send_all(self, version: int, messages, raise_now: bool = False) -> int:
        """Broadcast each message; inline (``raise_now``) the export runs as ``messages`` is iterated, outside the
        try, so that its own errors are not reported as the workers'."""
        count = 0
        for header, flat, n in messages:
            try:
                broadcast_object(self.pg, pickled=header)
                _bcast(self.pg, flat)
            except RuntimeError as err:  # gloo: the connection to a receiver closed, or the group's timeout passed
                if raise_now:
                    raise PeerFailed(f"sending weight version {version} to {self.peers} failed: {err}") from err
                self._error = err
                break
            count += n
        return count

    def stop(self) -> None:
        """The stop message (after the version in flight), then a barrier of the whole group: no side leaves
        before every rank has it."""
        self.wait()
        broadcast_object(self.pg, {"version": STOP, "specs": [], "nbytes": 0, "last": True, "extra": None})
        _bcast(self.pg, torch.empty(0, dtype=torch.uint8))
        self.pg.barrier().wait()


@dataclass
class WeightVersion:
    version: int
    weights: list[tuple[str, torch.Tensor]]
    extra: Any = None


@dataclass
class _Slot:
    newest: WeightVersion | None = None
    kept: dict[int, WeightVersion] = field(default_factory=dict)  # keep_all: every version not yet released
    arrived: list[int] = field(default_factory=list)  # every version number, in arrival order (instrumentation)
    stopped: bool = False
    error: BaseException | None = None


class WeightReceiver:
    """Rollout rank: a thread receives every version as it is broadcast and keeps the newest complete one.
    ``wait(min_version)`` blocks until a version >= ``min_version`` (or the stop message) arrived and returns the
    newest (None after stop); ``peer`` names the sender in errors. One version is kept, evaluation included: the
    trainer sends nothing newer before it has a due version's evaluation (``train.worker.DueEvaluations``).

    ``keep_all=True`` (``train.staleness_mode=fixed``): every version is kept until released, and
    ``wait(v, exact=True)`` returns exactly version v and releases the older ones. The sender runs at most k + 1
    versions ahead of the version a worker generates with (``staleness``), so at most k + 1 are held."""

    def __init__(self, pg: dist.ProcessGroup, peer: str, poll_s: float = 0.5, keep_all: bool = False):
        self.pg, self.peer, self.poll_s, self.keep_all = pg, peer, poll_s, keep_all
        self._slot = _Slot()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)
        self._thread.start()

    @property
    def arrived(self) -> list[int]:
        with self._cond:
            return list(self._slot.arrived)

    def _run(self) -> None:
        try:
            while True:
                weights, extra, version = [], None, None
                while True:
                    header = broadcast_object(self.pg)
                    flat = torch.empty(header["nbytes"], dtype=torch.uint8)
                    _bcast(self.pg, flat)
                    version = header["version"]
                    extra = header["extra"] if header["extra"] is not None else extra
                    weights += _unflatten(flat, header["specs"])
                    if header["last"]:
                        break
                if version == STOP:
                    self.pg.barrier().wait()
                with self._cond:
                    if version == STOP:
                        self._slot.stopped = True
                        self._cond.notify_all()
                        return
                    arrived = self._slot.arrived
                    if arrived and version <= arrived[-1]:
                        raise PeerFailed(f"weight version {version} arrived after version {arrived[-1]} from "
                                         f"{self.peer}: versions must increase")
                    arrived.append(version)
                    self._slot.newest = WeightVersion(version, weights, extra)
                    if self.keep_all:
                        self._slot.kept[version] = self._slot.newest
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread, which raises it
            with self._cond:
                self._slot.error = err
                self._cond.notify_all()

    def wait(self, min_version: int, timeout_s: float | None = None, exact: bool = False) -> WeightVersion | None:
        """The newest version >= ``min_version`` (``exact``: version ``min_version`` itself, the older ones
        released), or None after the stop message."""
        if exact and not self.keep_all:
            raise ValueError("wait(exact=True) needs a WeightReceiver made with keep_all=True")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                slot = self._slot
                if slot.newest is not None and slot.newest.version >= min_version:
                    if not exact:
                        return slot.newest
                    if min_version not in slot.kept:
                        raise PeerFailed(f"weight version {min_version} is no longer held (held: {sorted(slot.kept)}"
                                         f"): it was released by an earlier wait")
                    for version in [v for v in slot.kept if v < min_version]:
                        del slot.kept[version]
                    return slot.kept[min_version]
                if slot.stopped:
                    return None
                if slot.error is not None:
                    raise PeerFailed(f"no weights from {self.peer}: {slot.error}") from slot.error
                if deadline is not None and time.monotonic() > deadline:
                    raise PeerFailed(f"no weight version >= {min_version} from {self.peer} within {timeout_s} s")
                self._cond.wait(self.poll_s)


# ------------------------------------------------------------------------------------------------------------
# Batches: rollout main rank -> trainer main rank
# ------------------------------------------------------------------------------------------------------------
class BatchSender:
    """Rollout main rank: ``send(batch)`` to the trainer main rank; a send that fails (the trainer died: gloo
    reports the closed connection) raises :class:`PeerFailed` naming ``peer``."""

    def __init__(self, pg: dist.ProcessGroup, peer: str = "the trainer", dst: int = 0):
        self.pg, self.peer, self.dst = pg, peer, dst

    def send(self, batch: Any) -> None:
        try:
            send_object(self.pg, batch, self.dst)
        except RuntimeError as err:  # gloo: the connection to the trainer closed, or the group's timeout passed
            raise PeerFailed(f"sending a batch to {self.peer} failed: {err}") from err

    def close(self) -> None:
        """The end marker: the receiver's thread ends, so no receive is left pending when the processes exit."""
        self.send(_END)


class BatchReceiver:
    """Trainer main rank: a thread receives batches into a queue of at most ``capacity``; ``get(timeout_s)``
    returns the next one or raises :class:`PeerFailed` naming ``peer`` (its process died, or ``timeout_s``
    passed; the check runs every ``poll_s``)."""

    def __init__(self, pg: dist.ProcessGroup, peer: str, capacity: int, src: int = 1, poll_s: float = 0.5):
        self.pg, self.peer, self.src, self.poll_s = pg, peer, src, poll_s
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, capacity))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="batch-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                batch = recv_object(self.pg, self.src)
                if isinstance(batch, str) and batch == _END:
                    return
                self._queue.put(batch)
        except BaseException as err:  # noqa: BLE001 - raised in the main thread by get()
            self._error = err

    def join(self, timeout_s: float) -> None:
        """Wait for the sender's end marker (``BatchSender.close``)."""
        self._thread.join(timeout_s)

    def qsize(self) -> int:
        return self._queue.qsize()

    def get(self, timeout_s: float | None = None) -> Any:
        start = time.monotonic()
        while True:
            try:
                return self._queue.get(timeout=self.poll_s)
            except queue.Empty:
                pass
            if self._error is not None:
                raise PeerFailed(f"{self.peer} stopped sending batches: {self._error}") from self._error
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise PeerFailed(f"no batch from {self.peer} within {timeout_s:.0f} s (rollout.worker_timeout_s)")
