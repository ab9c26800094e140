"""A small real distributed program that exercises a launch end to end (stand-in for the trainer in CI).

    python -m megatron_dppo.distributed.launch_check --out DIR [--steps N --ckpt DIR --step-seconds S]
        [--fail-rank R] [--mpi]

1. :func:`~megatron_dppo.distributed.launch.discover_launch` +
   :func:`~megatron_dppo.distributed.launch.check_single_world`;
2. ``torch.distributed`` (gloo, ``env://``) and an all-reduce of ``rank + 1`` whose sum must be ``W (W + 1) / 2``;
3. optionally ``--steps`` "training" steps: each sleeps, all-reduces, adds ``step + 1`` to a running total and
   checkpoints (rank 0 writes ``CKPT/step-<k>/state.json`` then ``CKPT/latest``, both atomically by rename). A
   restarted run resumes from ``CKPT/latest``, so an interrupted-and-resumed run ends with the same total as an
   uninterrupted one: ``N (N + 1) / 2``;
4. a stop request -- the file ``$DPPO_STOP_FILE`` (what slurm/train.sbatch creates before the time limit, see
   :func:`~megatron_dppo.distributed.launch.stop_requested`), SIGUSR1 or SIGTERM -- means checkpoint-and-exit at the
   next step boundary. The ranks agree on it by an all-reduce (MAX) so that all of them stop after the same step, as
   the trainer must (``--ignore-stop-file`` plays a program that only understands signals);
5. ``--fail-rank R`` makes rank R exit with status 3 right after the first all-reduce (the others then block in
   the next collective until Slurm's ``--kill-on-bad-exit`` or torchrun ends them);
6. writes ``DIR/rank-<r>.json``: rank, world, local rank, host, Slurm node, launcher, the all-reduce, the
   checkpoint step it resumed from, the last step, the running total, whether it stopped for a preemption, and
   (``earlier_runs``) the same summary of every earlier run that wrote this file, e.g. before a requeue.

Exit status: 0 when done or checkpointed on request, 3 for ``--fail-rank``, 1 on a wrong all-reduce.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from megatron_dppo.distributed.launch import LaunchInfo, check_single_world, discover_launch, stop_requested

_STOP_REQUESTED = False


def _request_stop(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _STOP_REQUESTED
    _STOP_REQUESTED = True
    print(f"[launch_check] rank {os.environ.get('RANK')} got signal {signal.Signals(signum).name}: "
          f"checkpoint at the next step boundary", file=sys.stderr, flush=True)


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
    os.replace(tmp, path)


def load_latest(ckpt: Path) -> dict | None:
    """The state of the newest complete checkpoint under ``ckpt`` (``None`` when there is none): the newest
    ``step-<k>/state.json``, as the trainer resumes from its newest complete checkpoint, whatever ``latest`` says
    (a kill between renaming a step into place and updating ``latest`` leaves the pointer behind)."""
    states = sorted(ckpt.glob("step-*/state.json"))  # zero-padded step numbers: name order is step order
    return json.loads(states[-1].read_text()) if states else None


def save_checkpoint(ckpt: Path, state: dict) -> None:
    """``ckpt/step-<k>/state.json`` then ``ckpt/latest`` (each written to a temporary name, then renamed)."""
    name = f"step-{state['step']:06d}"
    final = ckpt / name
    tmp = ckpt / f".{name}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(tmp / "state.json", state)
    if final.exists():
        for child in final.iterdir():
            child.unlink()
        final.rmdir()
    os.replace(tmp, final)
    latest_tmp = ckpt / f".latest.tmp{os.getpid()}"
    latest_tmp.write_text(name)
    os.replace(latest_tmp, ckpt / "latest")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_dppo.distributed.launch_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for rank-<r>.json")
    parser.add_argument("--steps", type=int, default=0, help="number of checkpointed steps (0: none)")
    parser.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory (required with --steps)")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="sleep per step (simulated work)")
    parser.add_argument("--fail-rank", type=int, default=None, help="this rank exits with status 3")
    parser.add_argument("--mpi", action="store_true", help="also initialize MPI (mpi4py) and cross-check it")
    parser.add_argument("--ignore-stop-file", action="store_true", help="react to signals only, not $DPPO_STOP_FILE")
    parser.add_argument("--timeout", type=float, default=120.0, help="torch.distributed timeout in seconds")
    args, ignored = parser.parse_known_args(argv)  # trainer arguments (--config, key=value) are ignored here
    if ignored:
        print(f"[launch_check] ignoring arguments meant for the trainer: {' '.join(ignored)}", file=sys.stderr)
    if args.steps and args.ckpt is None:
        parser.error("--steps needs --ckpt")

    signal.signal(signal.SIGUSR1, _request_stop)
    signal.signal(signal.SIGTERM, _request_stop)

    mpi_world = None
    if args.mpi:
        from mpi4py import MPI

        mpi_world = [MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()]
    info: LaunchInfo = discover_launch()
    check_single_world(info)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", rank=info.rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout))
    value = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(value)
    expected = info.world_size * (info.world_size + 1) / 2
    nodes = [None] * info.world_size
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME", socket.gethostname()))

    record = {
        "rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
        "local_world_size": info.local_world_size, "launcher": info.launcher, "hostname": socket.gethostname(),
        "slurm_node": os.environ.get("SLURMD_NODENAME"), "nodes": nodes,
        "master": f"{info.master_addr}:{info.master_port}", "allreduce": value.item(), "allreduce_ok":
        value.item() == expected, "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "mpi_world": mpi_world, "pid": os.getpid(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / f"rank-{info.rank}.json"
    if out_file.exists():  # an earlier run of this rank (e.g. before a requeue): keep its summary
        earlier = json.loads(out_file.read_text())
        record["earlier_runs"] = earlier.pop("earlier_runs", []) + [
            {key: earlier.get(key) for key in ("restart_count", "resumed_from", "last_step", "preempted", "pid")}]
    _write_json_atomic(out_file, record)
    if value.item() != expected:
        print(f"[launch_check] all-reduce gave {value.item()}, expected {expected}", file=sys.stderr)
        return 1
    if args.fail_rank == info.rank:
        print(f"[launch_check] rank {info.rank}: failing on purpose (--fail-rank)", file=sys.stderr, flush=True)
        os._exit(3)

    resumed_from, total, step, preempted = 0, 0.0, 0, False
    if args.steps:
        state = load_latest(args.ckpt)
        if state is not None:
            resumed_from, total = state["step"], state["total"]
        for step in range(resumed_from + 1, args.steps + 1):
            time.sleep(args.step_seconds)
            contribution = torch.tensor([float(step) if info.rank == 0 else 0.0])
            dist.all_reduce(contribution)  # the step's "gradient": the same on every rank
            total += contribution.item()
            if info.rank == 0:
                save_checkpoint(args.ckpt, {"step": step, "total": total, "world_size": info.world_size})
            asked = _STOP_REQUESTED or (not args.ignore_stop_file and stop_requested())
            stop = torch.tensor([1.0 if asked else 0.0])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # checkpoint written; all ranks agree to stop or go on
            if stop.item() > 0:
                preempted = True
                break
        else:
            step = max(resumed_from, args.steps)
    # The decision is taken. Copies of the signal still on their way (srun delivers to each node separately) must
    # not kill us now: during interpreter shutdown Python restores the default action (terminate) for signals
    # with Python handlers, so a late SIGUSR1 would turn a clean exit into "killed by signal" and srun's
    # --kill-on-bad-exit would cancel the other ranks. SIG_IGN survives shutdown.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    record.update({"resumed_from": resumed_from, "last_step": step, "total": total, "preempted": preempted,
                   "finished": bool(args.steps) and step >= args.steps and not preempted})
    _write_json_atomic(out_file, record)
    dist.barrier()
    dist.destroy_process_group()
    print(f"[launch_check] rank {info.rank}/{info.world_size} on {record['slurm_node'] or record['hostname']} "
          f"({info.launcher}): ok, step {step}{' (preempted)' if preempted else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
