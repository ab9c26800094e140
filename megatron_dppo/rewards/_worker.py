"""Reward worker process: ``python -m megatron_dppo.rewards._worker FD``.

Talks to the parent over the inherited socket FD with ``multiprocessing.connection`` framing (stdout stays free for
the reward function's own prints). Protocol, one message at a time:

    parent -> ("init", sys_path, pickled_reward_fn)      child -> ("ready", None) | ("init_error", message)
    parent -> [(index, completion, gold), ...]           child -> (index, "ok", float) | (index, "error", message)
                                                                   one reply per item, in order
    parent -> None                                       child exits

The worker runs in its own session (process group), so a timeout kills it together with anything it started.
"""
from __future__ import annotations

import math
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection


def _serve(conn: Connection) -> None:
    kind, sys_path, payload = conn.recv()
    assert kind == "init", kind
    for entry in reversed(sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        fn = pickle.loads(payload)
    except BaseException as err:  # noqa: BLE001 - report anything, the parent decides
        conn.send(("init_error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            tasks = conn.recv()
        except EOFError:  # parent went away
            return
        if tasks is None:
            return
        for index, completion, gold in tasks:
            try:
                value = float(fn(completion, gold))
                reply = (index, "ok", value) if math.isfinite(value) else (index, "error", f"non-finite reward {value}")
            except BaseException as err:  # noqa: BLE001 - a reward must never take the worker down
                reply = (index, "error", f"{type(err).__name__}: {err}")
            conn.send(reply)


def main() -> None:
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and shuts workers down itself
    from megatron_dppo.distributed.launch import die_with_parent

    die_with_parent(parent)  # a SIGKILLed trainer must not leave a worker behind (it runs in a session of its own)
    conn = Connection(int(sys.argv[1]))
    try:
        _serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
