"""Reward for the Slurm tests of the real trainer, imported by path ("tests.slurm._rewards:parity_or_fail"; the
jobs run with PYTHONPATH=<repo>)."""
import os
import sys


def parity_or_fail(completion: str, gold) -> float:
    """``tests.e2e._rewards.parity`` (varies within every group, so every step trains), except on the rank named by
    ``$DPPO_TEST_FAIL_RANK``: that rank dies (exit status 3) while scoring its first shard of the first RL step,
    the way a crashing rank would, leaving the others waiting in the next collective."""
    rank = os.environ.get("RANK")
    if rank is not None and rank == os.environ.get("DPPO_TEST_FAIL_RANK"):
        print(f"[tests.slurm._rewards] rank {rank} failing on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    return float(len(completion) % 2 == 0)
