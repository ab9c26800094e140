"""distributed/transfer.py over real gloo process groups (spawned processes, one TCPStore): weight versions arrive
bit for bit and in order at every rollout rank (bf16 and fp32 in one bucket, several buckets), the receiver keeps
the newest, a version that does not increase is refused, batches go the other way, and a rollout process that
dies ends the trainer's wait with an error naming it, within a bounded time."""

import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist

from megatron_dppo.distributed.launch import free_port
from megatron_dppo.distributed.transfer import (
    BatchReceiver,
    BatchSender,
    PeerFailed,
    WeightReceiver,
    WeightSender,
    _flat_bytes,
    _unflatten,
    buckets,
    process_group,
)

TIMEOUT_S = 60.0


def _store(port: int) -> dist.Store:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=60))


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("a.weight", torch.randn(3, 5, generator=g)), ("b.bias", torch.randn(7, generator=g).bfloat16()),
            ("c.weight", torch.randn(40, 4, generator=g))]


def _trainer(port: int, rollouts: int, out: mp.Queue) -> None:
    try:
        store = _store(port)
        sender = WeightSender(process_group(store, "weights", 0, rollouts + 1, TIMEOUT_S), bucket_bytes=256)
        batches = BatchReceiver(process_group(store, "batches", 0, 2, TIMEOUT_S), "rollout rank 1", capacity=2)
        for v in range(4):
            sender.send(v, _weights(v), extra={"history": v})
        got = [batches.get(TIMEOUT_S) for _ in range(2)]
        sender.stop()
        try:
            sender.send(2, _weights(2))
            refused = False
        except ValueError:
            refused = True
        out.put(("trainer", got, refused))
    except BaseException as err:  # noqa: BLE001
        out.put(("trainer-error", repr(err)))


def _rollout(port: int, index: int, rollouts: int, out: mp.Queue) -> None:
    try:
        store = _store(port)
        receiver = WeightReceiver(process_group(store, "weights", index + 1, rollouts + 1, TIMEOUT_S), "trainer")
        batch_pg = process_group(store, "batches", 1, 2, TIMEOUT_S) if index == 0 else None
        newest = receiver.wait(3, TIMEOUT_S)
        exact = all(n == m and torch.equal(t, u) and t.dtype == u.dtype
                    for (n, t), (m, u) in zip(newest.weights, _weights(3)))
        if batch_pg is not None:
            sender = BatchSender(batch_pg)
            sender.send({"step": 0, "version": newest.version})
            sender.send({"step": 1, "version": newest.version})
        stopped = receiver.wait(99, TIMEOUT_S) is None
        out.put(("rollout", index, newest.version, newest.extra, exact, receiver.arrived, stopped))
    except BaseException as err:  # noqa: BLE001
        out.put(("rollout-error", index, repr(err)))


def _run(targets, port):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(port, *args, out)) for fn, args in targets]
    for p in procs:
        p.start()
    return procs, out


def test_weight_versions_arrive_in_order_bit_for_bit_and_batches_come_back():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs, out = _run([(_trainer, (2,)), (_rollout, (0, 2)), (_rollout, (1, 2))], port)
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    del master
    by_kind = {r[0] if r[0] != "rollout" else f"rollout{r[1]}": r for r in results}
    assert not [r for r in results if r[0].endswith("error")], results
    _, got, refused = by_kind["trainer"]
    assert [b["step"] for b in got] == [0, 1] and refused
    for i in (0, 1):
        _, _, version, extra, exact, arrived, stopped = by_kind[f"rollout{i}"]
        assert version == 3 and extra == {"history": 3} and exact and stopped
        assert arrived == sorted(arrived) and arrived[-1] == 3 and len(set(arrived)) == len(arrived)


def _background_trainer(port: int, out: mp.Queue) -> None:
    """Sends in the background and overwrites what it sent right after each send() returns: the receivers must
    still get each version as it was when sent (the copy and the pickled history are made inside send())."""
    try:
        store = _store(port)
        sender = WeightSender(process_group(store, "weights", 0, 2, TIMEOUT_S), bucket_bytes=256, background=True)
        returned = []
        for v in range(4):
            weights, history = _weights(v), {"history": v}
            returned.append(sender.send(v, iter(weights), extra=history))
            for _, t in weights:
                t.fill_(-1.0)  # the trainer's next update
            history["history"] = -1
        sender.stop()
        out.put(("trainer", returned))
    except BaseException as err:  # noqa: BLE001
        out.put(("trainer-error", repr(err)))


def _receiver_of_all(port: int, out: mp.Queue) -> None:
    try:
        store = _store(port)
        receiver = WeightReceiver(process_group(store, "weights", 1, 2, TIMEOUT_S), "trainer")
        newest = receiver.wait(3, TIMEOUT_S)
        exact = all(n == m and torch.equal(t, u) for (n, t), (m, u) in zip(newest.weights, _weights(3)))
        out.put(("rollout", newest.extra, exact, receiver.arrived, receiver.wait(99, TIMEOUT_S) is None))
    except BaseException as err:  # noqa: BLE001
        out.put(("rollout-error", repr(err)))


def test_background_send_sends_each_version_as_it_was_when_sent():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs, out = _run([(_background_trainer, ()), (_receiver_of_all, ())], port)
    results = {r[0]: r for r in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(30)
    del master
    assert set(results) == {"trainer", "rollout"}, results
    assert results["trainer"][1] == [3, 3, 3, 3]  # tensors per version
    _, extra, exact, arrived, stopped = results["rollout"]
    assert extra == {"history": 3} and exact and stopped
    assert arrived == sorted(set(arrived)) and arrived[-1] == 3


def _background_trainer_of_a_dead_worker(port: int, out: mp.Queue) -> None:
    store = _store(port)
    sender = WeightSender(process_group(store, "weights", 0, 2, TIMEOUT_S), bucket_bytes=256,
                          peers="rollout worker 0 (job rank 1)", background=True)
    sender.send(0, iter(_weights(0)))
    sender.wait()
    out.put(("sent", 0))
    time.sleep(2.0)  # the worker dies meanwhile
    start = time.monotonic()
    try:
        for v in range(1, 50):  # gloo may buffer a send or two before it notices the closed connection
            sender.send(v, iter(_weights(v)))
        sender.stop()
        out.put(("no-error", time.monotonic() - start))
    except PeerFailed as err:
        out.put(("failed", str(err), time.monotonic() - start))


def _worker_dies_after_version_0(port: int, out: mp.Queue) -> None:
    store = _store(port)
    receiver = WeightReceiver(process_group(store, "weights", 1, 2, TIMEOUT_S), "trainer")
    receiver.wait(0, TIMEOUT_S)
    os._exit(9)


def test_a_failed_background_send_is_raised_at_the_next_send_naming_the_workers():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs, out = _run([(_background_trainer_of_a_dead_worker, ()), (_worker_dies_after_version_0, ())], port)
    first, result = out.get(timeout=120), out.get(timeout=120)
    for p in procs:
        p.join(30)
    del master
    assert first == ("sent", 0)
    assert result[0] == "failed", result
    assert "rollout worker 0 (job rank 1)" in result[1] and result[2] < 20.0, result


def _trainer_waits(port: int, out: mp.Queue) -> None:
    store = _store(port)
    batches = BatchReceiver(process_group(store, "batches", 0, 2, TIMEOUT_S), "rollout worker (job rank 1)",
                            capacity=1, poll_s=0.2)
    out.put(("first", batches.get(TIMEOUT_S)))
    start = time.monotonic()
    try:
        batches.get(TIMEOUT_S)
        out.put(("no-error", time.monotonic() - start))
    except PeerFailed as err:
        out.put(("failed", str(err), time.monotonic() - start))


def _rollout_dies(port: int, out: mp.Queue) -> None:
    store = _store(port)
    BatchSender(process_group(store, "batches", 1, 2, TIMEOUT_S)).send({"step": 0})
    time.sleep(0.5)
    os._exit(9)  # as if killed: no clean shutdown


def test_a_dead_rollout_worker_ends_the_wait_with_its_name():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs, out = _run([(_trainer_waits, ()), (_rollout_dies, ())], port)
    first = out.get(timeout=120)
    result = out.get(timeout=120)
    for p in procs:
        p.join(30)
    del master
    assert first == ("first", {"step": 0})
    assert result[0] == "failed", result
    assert "rollout worker (job rank 1)" in result[1]
    assert result[2] < 20.0, f"took {result[2]:.1f} s to notice"


def _trainer_takes_one_then_dies(port: int, out: mp.Queue) -> None:
    store = _store(port)
    batches = BatchReceiver(process_group(store, "batches", 0, 2, TIMEOUT_S), "rollout worker", capacity=1)
    out.put(("first", batches.get(TIMEOUT_S)))
    time.sleep(0.5)  # (the queue's feeder thread hands the message over)
    os._exit(9)  # as if killed


def _rollout_sends_after_the_trainer_died(port: int, out: mp.Queue) -> None:
    store = _store(port)
    sender = BatchSender(process_group(store, "batches", 1, 2, TIMEOUT_S))  # (placement names the job rank too)
    sender.send({"step": 0})
    time.sleep(2.0)  # the trainer is gone by now
    try:
        for step in range(1, 50):  # (a send can land in the socket buffer; a later one sees the closed connection)
            sender.send({"step": step, "payload": torch.zeros(1 << 16)})
        out.put(("no-error",))
    except PeerFailed as err:
        out.put(("peer-failed", str(err)))
    except BaseException as err:  # noqa: BLE001
        out.put(("other", type(err).__name__, str(err)))


def test_a_dead_trainer_ends_the_workers_batch_send_naming_it():
    """A worker whose trainer died ends in PeerFailed naming the trainer, not a raw gloo error."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs, out = _run([(_trainer_takes_one_then_dies, ()), (_rollout_sends_after_the_trainer_died, ())], port)
    results = [out.get(timeout=120) for _ in range(2)]
    for p in procs:
        p.join(30)
    del master
    worker = next(r for r in results if r[0] != "first")
    assert worker[0] == "peer-failed", worker  # (before: a raw gloo RuntimeError)
    assert "sending a batch to the trainer failed" in worker[1]


def test_buckets_respect_the_bound():
    stream = [(f"t{i}", torch.zeros(10)) for i in range(5)] + [("big", torch.zeros(100))]
    parts = list(buckets(stream, 80))
    assert [len(p) for p in parts] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="versions must increase"):
        s = WeightSender.__new__(WeightSender)
        s.last_version, s.bucket_bytes = 3, 80
        s.send(3, [])


def test_an_export_error_is_not_reported_as_the_workers():
    """Inline, the export runs while the buckets are sent: its own error (a collective of the trainers' group,
    here raised by hand) propagates as it is, not as PeerFailed blaming the rollout workers."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=__import__("datetime").timedelta(seconds=30))
    sender = WeightSender(process_group(store, "weights", 0, 1, TIMEOUT_S), bucket_bytes=16)

    def export():
        yield "a.weight", torch.zeros(4)
        yield "b.weight", torch.zeros(4)
        raise RuntimeError("the export's gather failed")

    with pytest.raises(RuntimeError, match="the export's gather failed") as info:
        sender.send(0, export())
    assert not isinstance(info.value, PeerFailed)


def test_a_bucket_of_mixed_dtypes_round_trips_whatever_the_lengths():
    """An odd-length bf16 tensor followed by fp32 and int64 ones in one bucket: each tensor starts at an aligned
    offset, so the receiver views every one in its own dtype (unaligned, viewing the fp32 bytes at offset 6 failed
    and the worker blamed the trainer), bit for bit."""
    g = torch.Generator().manual_seed(0)
    bucket = [("odd.bf16", torch.randn(3, generator=g).bfloat16()), ("f32", torch.randn(2, 3, generator=g)),
              ("one.bf16", torch.randn(1, generator=g).bfloat16()), ("i64", torch.arange(5)),
              ("f16", torch.randn(7, generator=g).half()), ("f64", torch.randn(2, generator=g).double())]
    flat = _flat_bytes(bucket)
    back = _unflatten(flat, [(n, tuple(x.shape), x.dtype) for n, x in bucket])
    assert [n for n, _ in back] == [n for n, _ in bucket]
    for (_, sent), (_, got) in zip(bucket, back):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    with pytest.raises(ValueError, match="does not hold"):
        _unflatten(flat[:-1], [(n, tuple(x.shape), x.dtype) for n, x in bucket])
