"""DPPO's prompt level stays unbiased when the keep decision is made from a history k steps old (asynchronous
RL: the rollout side draws batch t while the trainer is still on step t - k), provided the weight is the 1/pi
recorded with the batch at decision time.

A simulated training run, vectorised over DRAWS independent runs (the pruner treats leading dims as independent
decisions): a pool of prompts whose per-prompt gradients g_q(theta) depend on the parameters, theta updated with
each step's pruned estimate (so every later gradient, history and decision depends on the earlier draws), and the
history (mean |A|: here |g_q| of the prompts that were generated) updated only for the kept prompts. At every step
the error ghat_t - g_t of the pruned estimate against the full batch's gradient at the same theta must have mean 0
(z < Z_OK of test_pruning.py), for lags 0..3 and both keep rules. The negative control decides from the lagged
history but weights with the pi of the history current at training time: measurably biased (z > Z_BIASED).

Why it holds: the decision at step t is a fresh draw given everything that happened before it, with keep
probability pi_q(H_{t-k}); E[keep / pi | past] = 1 for any past, so E[ghat_t - g_t | past] = 0 and the errors
average to 0 over runs, whatever the lag. Using pi from another history breaks E[keep / pi] = 1."""

import pytest
import test_pruning as TP
import torch

from megatron_dppo.algo.pruning import DPPOPruner, make_generator

DT = torch.float64
P = 8  # prompts per step (the whole pool, every step)
DIM = 3  # gradient dimension
STEPS = 8
DRAWS = 6000
LR = 0.5


def _pool():
    g = torch.Generator().manual_seed(11)
    c = torch.randn(P, DIM, generator=g, dtype=DT)
    c[:3] *= 0.05  # low-signal prompts: the candidates of the paper's rule
    m = torch.randn(P, DIM, DIM, generator=g, dtype=DT) * 0.3
    return c, m


def gradients(theta: torch.Tensor, c: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """g_q(theta) [D, P, DIM] = tanh(c_q + M_q theta): depends on the run's parameters."""
    return torch.tanh(c[None] + torch.einsum("pij,dj->dpi", m, theta))


def observed_score(g: torch.Tensor) -> torch.Tensor:
    """The history value a generated prompt leaves (its 'mean |A|'), exactly 0 for small gradients (the groups
    with one reward for all)."""
    s = g.abs().mean(-1)
    return torch.where(s < 0.08, torch.zeros_like(s), s)


def simulate(lag: int, keep: str, weight_from_current: bool = False, stats: dict | None = None) -> torch.Tensor:
    """[DRAWS, STEPS * DIM]: ghat_t - g_t of every step of every run. ``stats`` (a dict) receives the kept
    fraction and the fraction of decisions whose lagged pi differs from the current history's, over steps >= 1."""
    c, m = _pool()
    pruner = DPPOPruner(0.5, 0.0, "bernoulli", keep=keep, keep_floor=0.2)
    theta = torch.zeros(DRAWS, DIM, dtype=DT)
    history = torch.full((DRAWS, P), float("nan"), dtype=DT)
    snapshots = [history.clone()]  # snapshots[j]: the history after j steps were trained
    errors = []
    for t in range(STEPS):
        lagged = snapshots[max(0, t - lag)]  # what the rollout side holds when it draws batch t
        cut = pruner.select_prompts(lagged, make_generator(0, t, "prompts"))
        pi = cut.probabilities().double()  # recorded with the batch
        current = pruner.select_prompts(snapshots[t], make_generator(0, t, "prompts")).probabilities().double()
        if weight_from_current:  # wrong: the trainer re-derives pi from ITS history at training time
            pi = current
        if stats is not None and t >= 1:
            stats.setdefault("kept", []).append(float(cut.keep.double().mean()))
            stats.setdefault("pi_differs", []).append(float((cut.probabilities().double() != current).double().mean()))
        g = gradients(theta, c, m)
        ghat = (cut.keep.to(DT) / pi)[..., None].mul(g).mean(1)
        errors.append(ghat - g.mean(1))
        theta = theta + LR * ghat
        history = torch.where(cut.keep, observed_score(g), history)
        snapshots.append(history.clone())
    return torch.cat(errors, dim=1)


@pytest.mark.parametrize("keep", ["uniform", "optimal"])
@pytest.mark.parametrize("lag", [0, 1, 2, 3])
def test_lagged_prompt_decisions_are_unbiased(lag, keep):
    err = simulate(lag, keep)
    z = TP.mc_z(err, torch.zeros(err.shape[1], dtype=DT))
    assert z.max() < TP.Z_OK, f"max z {z.max():.2f} at step {int(z.argmax()) // DIM}"


@pytest.mark.parametrize("keep", ["uniform", "optimal"])
def test_the_setting_is_not_trivial(keep):
    """Pruning acts after the first step, and at lag 2 the lagged pi differs from the current history's pi in a
    good share of the decisions (so recording pi with the batch matters)."""
    stats: dict = {}
    simulate(2, keep, stats=stats)
    kept = sum(stats["kept"]) / len(stats["kept"])
    differs = sum(stats["pi_differs"]) / len(stats["pi_differs"])
    assert 0.4 < kept < 0.95, kept
    assert differs > 0.1, differs


@pytest.mark.parametrize("keep", ["uniform", "optimal"])
def test_weight_from_the_training_time_history_is_biased(keep):
    err = simulate(2, keep, weight_from_current=True)
    z = TP.mc_z(err, torch.zeros(err.shape[1], dtype=DT))
    assert z.max() > TP.Z_BIASED, f"bias not detected: max z {z.max():.2f}"
