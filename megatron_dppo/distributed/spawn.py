"""Run a function in N fresh Python processes on this host forming one gloo world (the engine tests' and the
benchmarks' multi-process harness).

    from megatron_dppo.distributed.spawn import run_distributed
    results = run_distributed(my_worker, world_size=2, args=(tmp_path, 3), timeout=180)

``my_worker(*args, **kwargs)`` must be a module-level function of an importable file (a test module is fine: the
worker imports it again from its file path). Each process gets torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` = a free port,
``OMP_NUM_THREADS=1``), so ``megatron_dppo.megatron.parallel.initialize_parallel`` works unchanged. The return
value of each rank (anything ``torch.save`` can write) comes back in rank order.

A rank that raises fails the call with its traceback; a hang is killed after ``timeout`` seconds (every process
of the run, by pid) and reported with the tail of each rank's output. Run this module (``python -m``) only through
``run_distributed`` (it is the worker bootstrap).
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from .launch import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder megatron_dppo imports from (joins the ranks' PYTHONPATH)


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "<no output>"
    return text[-chars:]


def run_distributed(fn: Callable, world_size: int, args: tuple = (), kwargs: dict | None = None,
                    timeout: float = 180.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes; return the per-rank results (rank order)."""
    source = inspect.getsourcefile(fn)
    if source is None or "<locals>" in fn.__qualname__:
        raise ValueError(f"{fn!r} must be a module-level function defined in a file")
    with tempfile.TemporaryDirectory(prefix="mdppo_dist_") as tmp:
        tmpdir = Path(tmp)
        payload = tmpdir / "payload.pt"
        torch.save({"file": source, "name": fn.__qualname__, "args": args, "kwargs": kwargs or {}}, payload)
        port = free_port()
        procs: list[subprocess.Popen] = []
        logs: list[Path] = []
        base_env = dict(os.environ)
        base_env.update({
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT)] + [p for p in sys.path if p]),
            "PYTHONWARNINGS": "ignore",
        })
        base_env.pop("TORCHELASTIC_RUN_ID")
        base_env.update(env or {})
        try:
            for rank in range(world_size):
                log = tmpdir / f"rank{rank}.log"
                logs.append(log)
                rank_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
                with open(log, "wb") as out:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "megatron_dppo.distributed.spawn", str(payload),
                         str(tmpdir / f"result{rank}.pt")],
                        env=rank_env, stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT)))
            deadline = time.monotonic() + timeout
            failed: list[int] = []
            while True:
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    tails = "\n".join(f"--- rank {r} ---\n{_tail(logs[r])}" for r in range(world_size))
                    raise TimeoutError(f"{fn.__qualname__} on {world_size} processes did not finish in "
                                       f"{timeout:.0f} s\n{tails}")
                time.sleep(0.05)
            if failed:
                time.sleep(0.5)  # let the other ranks print their side before they are killed
                tails = "\n".join(f"--- rank {r} (exit {procs[r].poll()}) ---\n{_tail(logs[r])}" for r in failed)
                raise RuntimeError(f"{fn.__qualname__}: rank(s) {failed} failed\n{tails}")
            return [torch.load(tmpdir / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


def _worker_main(payload_path: str, result_path: str) -> int:
    payload = torch.load(payload_path, weights_only=False)
    spec = importlib.util.spec_from_file_location(f"_dist_target_{Path(payload['file']).stem}", payload["file"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn = module
    for part in payload["name"].split("."):
        fn = getattr(fn, part)
    try:
        result = fn(*payload["args"], **payload["kwargs"])
    except BaseException:  # noqa: BLE001 - any failure of the rank is its exit status and traceback
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    torch.save(result, result_path)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1], sys.argv[2]))
