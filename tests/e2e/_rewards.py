"""Reward functions for the end-to-end tests, imported by path ("tests.e2e._rewards:parity")."""
import math


def parity(completion: str, gold) -> float:
    """1 for an even number of characters: varies within every group of a random policy, so advantages are non-zero
    from the first step (an untrained model almost never solves the arithmetic)."""
    return float(len(completion) % 2 == 0)


def flaky(completion: str, gold) -> float:
    """Raises, returns NaN or a non-number for some completions: each such sample must cost a 0, never the run."""
    if len(completion) % 3 == 0:
        raise RuntimeError(f"flaky reward refuses {completion!r}")
    if len(completion) % 3 == 1:
        return math.nan
    return 1.0


def hangs(completion: str, gold) -> float:
    """Hangs (for a minute) on completions of even length: each such sample must cost at most its timeout, and
    all of them together at most the step's scoring budget."""
    if len(completion) % 2 == 0:
        import time

        time.sleep(60)
    return 1.0


def solved_or_parity(completion: str, gold) -> float:
    """1 for every completion of a prompt whose gold is a multiple of 3 (a group with one reward for all: zero
    advantage, so DPPO's prompt history marks it prunable on its next visit), ``parity`` otherwise."""
    return 1.0 if int(str(gold)) % 3 == 0 else parity(completion, gold)


def constant(completion: str, gold) -> float:
    """1 for everything: every group has one reward for all (dynamic sampling can never fill a batch)."""
    return 1.0


def never(completion: str, gold) -> float:
    """0 for everything: nothing is ever correct (what evaluation must report, whatever an environment rewards)."""
    return 0.0


def burns_cpu(completion: str, gold) -> float:
    """``parity`` after spinning 50 ms of CPU: the CPU a process-isolated reward's workers spend, which a step's
    CPU clock (train.cpu_budget_s) must count."""
    import time

    start = time.process_time()
    while time.process_time() - start < 0.05:
        pass
    return parity(completion, gold)
