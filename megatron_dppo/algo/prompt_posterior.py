"""A discounted posterior per prompt: what its next group will teach, before it is generated (docs/algorithms.md,
"Prompt posterior").

Binary rewards (every reward seen is 0 or 1). Per prompt, discounted counts of successes a and failures b. A visit
at optimizer step t with k successes among n completions, Delta = t - t_last steps after the previous one:

    a <- lambda^Delta a + k,   b <- lambda^Delta b + (n - k),   t_last <- t

and the pass rate is read as p ~ Beta(alpha0 + lambda^Delta a, beta0 + lambda^Delta b) at the step of the
decision. The prior (alpha0, beta0) is a method-of-moments beta-binomial fit to the last ``prior_window`` groups
(their pass rates and sizes); an unseen prompt is the prior. The discount lambda is chosen from a grid
(``discounts``): the state is kept under every lambda of the grid at once, and each revisit scores the
one-step-ahead beta-binomial log-likelihood of its k under each lambda before it is added; the grid point with the
highest score (exponentially forgotten by ``selection_memory`` per step) is the one read. The proxy of the prompt's
gradient norm is

    s_q = sqrt( sum_k BetaBinomial(k; G, alpha, beta) m_G(k) ) * Lbar_q^length_exponent

with m_G(k) the estimator's energy curve (``gradient_energy.energy_curve``; gamma = the exponent of |A| in a
completion's gradient norm) and Lbar_q the discounted mean completion length (the prior's mean for unseen
prompts). s_q > 0 for every prompt, seen or not, so a keep probability water-filled on it is never 0.

Continuous rewards (a reward outside {0, 1} has been seen; ``rewards="auto"`` switches for good, ``"continuous"``
from the start). The state per prompt is the discounted sum of the energies m(r) of its groups, computed from the
RAW rewards through the estimator (``gradient_energy.group_energy``: scale-free under std-GRPO, as the gradient is,
proportional to the squared reward spread under Dr.GRPO and RLOO), and the discounted number of groups w:

    E_q = (w0 mbar + lambda^Delta e) / (w0 + lambda^Delta w),    s_q = sqrt(E_q) * Lbar_q^length_exponent

with mbar the mean energy of the last ``prior_window`` groups and w0 = ``continuous_prior_weight``. Here lambda is
chosen by the one-step-ahead squared error of the energy. Both states are updated on every visit; the rewards
decide which is read.

Determinism (every data-parallel rank agrees). The state is a function of the sequence of ``update`` calls only,
float64 throughout, and within one call the groups are processed in a canonical order of their prompt ids, so the
order in which a step's groups arrive does not matter. ``state_dict`` holds plain Python types, and
``load_state_dict`` restores the state bit for bit.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Hashable, Sequence

import torch
from torch import Tensor

from ._checks import check_choice, check_finite, check_float_tensor, check_rate
from .gradient_energy import beta_binomial_pmf, check_gamma, energy_curve, expected_energy, group_energy
from .optimal_keep import water_fill
from .prompt_history import _normalize_ids

PromptId = Hashable
REWARD_KINDS = ("auto", "binary", "continuous")
DEFAULT_DISCOUNTS = (1.0, 0.995, 0.98, 0.95, 0.9, 0.8, 0.6, 0.3)
INITIAL_PRIOR = (1.0, 1.0)  # before the window holds MIN_PRIOR_GROUPS groups
MIN_PRIOR_GROUPS = 8
CONCENTRATION = (0.2, 1000.0)  # bounds of alpha0 + beta0 in the prior fit
# state columns per discount of the grid: discounted successes, failures, energy sum, energy groups, length sum,
# length groups
A, B_, E, W, LSUM, LW = range(6)


def _key(prompt_id) -> tuple:
    """A total order over int and str ids (ints first)."""
    return (isinstance(prompt_id, str), prompt_id)


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0 (the optimizer step of the policy that generated the "
                         f"group), got {step!r}")
    return step


def beta_binomial_logpmf(k: Tensor, n: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """log P(K = k) for K ~ BetaBinomial(n, alpha, beta), elementwise (float64)."""
    k, n, a, b = (torch.as_tensor(x, dtype=torch.float64) for x in (k, n, alpha, beta))
    lbeta = lambda x, y: torch.lgamma(x) + torch.lgamma(y) - torch.lgamma(x + y)  # noqa: E731
    log_choose = torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    return log_choose + lbeta(k + a, n - k + b) - lbeta(a, b)


def fit_beta_prior(successes: Sequence[float], sizes: Sequence[float]) -> tuple[float, float]:
    """Method-of-moments Beta(alpha0, beta0) for pass rates from groups with ``successes`` out of ``sizes``.

    With mean m and beta-binomial overdispersion rho = 1/(alpha0 + beta0 + 1), a group's pass rate k/n has
    variance m(1 - m)(1/n + (1 - 1/n) rho) around m; rho is solved from the observed variance (groups of n >= 2),
    alpha0 + beta0 clipped to ``CONCENTRATION``. Fewer than ``MIN_PRIOR_GROUPS`` groups: Beta(1, 1)."""
    pairs = [(float(k), float(n)) for k, n in zip(successes, sizes) if n >= 2]
    if len(pairs) < MIN_PRIOR_GROUPS:
        return INITIAL_PRIOR
    total_k, total_n = math.fsum(k for k, _ in pairs), math.fsum(n for _, n in pairs)
    m = min(max(total_k / total_n, 0.5 / total_n), 1.0 - 0.5 / total_n)
    var = math.fsum((k / n - m) ** 2 for k, n in pairs) / len(pairs)
    inv_n = math.fsum(1.0 / n for _, n in pairs) / len(pairs)
    rho = (var / (m * (1.0 - m)) - inv_n) / (1.0 - inv_n)
    lo, hi = CONCENTRATION
    rho = min(max(rho, 1.0 / (hi + 1.0)), 1.0 / (lo + 1.0))
    concentration = 1.0 / rho - 1.0
    return m * concentration, (1.0 - m) * concentration


class PromptPosterior:
    """The per-prompt state of DPPO's prompt level (module docstring).

    group_size: G of the groups the proxy predicts. estimator, gamma: the energy curve (``gradient_energy``).
    length_exponent: alpha of the length factor Lbar^alpha (0: none). discounts: the grid of lambda in (0, 1].
    rewards: "auto" | "binary" | "continuous". prior_window: groups the prior is fitted to. selection_memory: the
    factor in (0, 1] by which each discount's score is forgotten per optimizer step. continuous_prior_weight: w0.
    """

    FORMAT = "megatron_dppo.PromptPosterior/1"

    def __init__(self, group_size: int, estimator: str = "grpo", gamma: float = 1.0, length_exponent: float = 0.0,
                 discounts: Sequence[float] = DEFAULT_DISCOUNTS, rewards: str = "auto", prior_window: int = 512,
                 selection_memory: float = 0.98, continuous_prior_weight: float = 1.0) -> None:
        self.curve = energy_curve(group_size, estimator, gamma)  # validates group_size, estimator, gamma
        self.group_size, self.estimator, self.gamma = group_size, estimator, check_gamma(gamma)
        if isinstance(length_exponent, bool) or not isinstance(length_exponent, (int, float)) \
                or not math.isfinite(length_exponent):
            raise ValueError(f"length_exponent must be a finite number, got {length_exponent!r}")
        self.length_exponent = float(length_exponent)
        discounts = tuple(float(x) for x in discounts)
        if not discounts or any(not (0.0 < x <= 1.0) for x in discounts) or len(set(discounts)) != len(discounts):
            raise ValueError(f"discounts must be distinct values in (0, 1], got {discounts!r}")
        self.discounts = discounts
        self.rewards = check_choice("reward kind", rewards, REWARD_KINDS)
        if isinstance(prior_window, bool) or not isinstance(prior_window, int) or prior_window < MIN_PRIOR_GROUPS:
            raise ValueError(f"prior_window must be an integer >= {MIN_PRIOR_GROUPS}, got {prior_window!r}")
        self.prior_window = prior_window
        if not isinstance(selection_memory, (int, float)) or not (0.0 < selection_memory <= 1.0):
            raise ValueError(f"selection_memory must be in (0, 1], got {selection_memory!r}")
        self.selection_memory = float(selection_memory)
        if not isinstance(continuous_prior_weight, (int, float)) or not (continuous_prior_weight > 0) \
                or not math.isfinite(continuous_prior_weight):
            raise ValueError(f"continuous_prior_weight must be a finite number > 0, got {continuous_prior_weight!r}")
        self.continuous_prior_weight = float(continuous_prior_weight)
        J = len(discounts)
        self._lam = torch.tensor(discounts, dtype=torch.float64)
        self._row: dict = {}  # prompt id -> row of _state / _t
        self._state = torch.zeros(0, 6, J, dtype=torch.float64)
        self._t = torch.zeros(0, dtype=torch.int64)
        self._window: deque = deque(maxlen=prior_window)  # (k, n, energy, mean length) per recent group; None:
        # not observed (k of continuous rewards, the energy of a screen, lengths not given)
        self._score_binary = [0.0] * J  # forgotten sum of one-step-ahead log-likelihoods of revisits
        self._score_continuous = [0.0] * J  # forgotten sum of minus squared one-step-ahead energy errors
        self._revisits = 0.0  # forgotten count of revisits (binary), the scores' denominator
        self._binary = rewards != "continuous"
        self._last_step: int | None = None

    # ------------------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._row

    @property
    def binary(self) -> bool:
        """True while every reward seen is 0 or 1 (and rewards != "continuous"): the Beta state is read."""
        return self._binary

    def discount(self) -> float:
        """The lambda read now: the grid point with the best forgotten one-step-ahead score (ties: first)."""
        scores = self._score_binary if self._binary else self._score_continuous
        return self.discounts[max(range(len(scores)), key=lambda j: (scores[j], -j))]

    def prior(self) -> tuple[float, float]:
        """(alpha0, beta0) fitted to the window (module docstring)."""
        groups = [g for g in self._window if g[0] is not None]
        return fit_beta_prior([g[0] for g in groups], [g[1] for g in groups])

    def _mean_energy(self) -> float:
        values = [g[2] for g in self._window if g[2] is not None]
        return math.fsum(values) / len(values) if values else 1.0

    def _mean_length(self) -> float:
        values = [g[3] for g in self._window if g[3] is not None]
        return math.fsum(values) / len(values) if values else 1.0

    # ------------------------------------------------------------------------------------------------------------
    def observe(self, groups, record_costs: bool = False) -> None:
        """``groups`` (``algo.pruner.Groups``: full groups or screens) added with ``update``: their raw rewards and
        completion lengths, dated by the version of the weights that generated them (no costs are kept)."""
        self.update(list(groups.ids), groups.rewards, groups.version, lengths=groups.lengths)

    def update(self, ids: Sequence[PromptId] | Tensor, rewards: Tensor, step: int,
               lengths: Tensor | None = None) -> None:
        """Add the groups ``rewards`` [len(ids), n] (n completions each; the G of the configured group size, or a
        screen's k) generated by the policy of optimizer step ``step``; ``lengths`` [len(ids), n] their completion
        tokens (for the length factor). A prompt id may repeat: its groups are added one after the other."""
        ids = _normalize_ids(ids)
        rewards = check_float_tensor("rewards", rewards, min_dim=2)
        if rewards.dim() != 2 or rewards.shape[0] != len(ids):
            raise ValueError(f"rewards must have shape [{len(ids)}, n] for {len(ids)} ids, got {tuple(rewards.shape)}")
        check_finite("rewards", rewards)
        step = _check_step(step)
        r = rewards.detach().double().cpu()
        L = None
        if lengths is not None:
            if tuple(lengths.shape) != tuple(r.shape):
                raise ValueError(f"lengths must have shape {tuple(r.shape)}, got {tuple(lengths.shape)}")
            L = lengths.detach().double().cpu()
        is_binary = bool(((r == 0) | (r == 1)).all())
        if not is_binary:
            if self.rewards == "binary":
                bad = r[(r != 0) & (r != 1)][0].item()
                raise ValueError(f"rewards='binary' needs rewards in {{0, 1}}, got {bad}; use 'auto' or 'continuous'")
            self._binary = False
        if self._last_step is not None and step > self._last_step:
            forget = self.selection_memory ** (step - self._last_step)
            self._score_binary = [s * forget for s in self._score_binary]
            self._score_continuous = [s * forget for s in self._score_continuous]
            self._revisits *= forget
        self._last_step = step if self._last_step is None else max(self._last_step, step)

        prior = self.prior()
        mbar, w0 = self._mean_energy(), self.continuous_prior_weight
        n = r.shape[1]
        k = r.sum(1) if is_binary else torch.full((len(ids),), math.nan, dtype=torch.float64)
        energy = group_energy(r, self.estimator, self.gamma) if n == self.group_size \
            else torch.full((len(ids),), math.nan, dtype=torch.float64)
        mean_len = L.mean(1) if L is not None else torch.full((len(ids),), math.nan, dtype=torch.float64)
        # canonical order: by id, a repeated id's groups by their rewards and lengths
        content = torch.cat([r, L if L is not None else torch.zeros_like(r)], dim=1).tolist()
        order = sorted(range(len(ids)), key=lambda i: (_key(ids[i]), content[i]))
        # passes of distinct ids (a repeated id's later groups in later passes), each processed as one batch
        passes: list[list[int]] = []
        seen: dict = {}
        for i in order:
            p = seen.get(ids[i], 0)
            seen[ids[i]] = p + 1
            if p == len(passes):
                passes.append([])
            passes[p].append(i)
        for rows_in_call in passes:
            self._update_pass([ids[i] for i in rows_in_call], torch.tensor(rows_in_call), k, n, energy, mean_len,
                              step, prior, mbar, w0, is_binary)
        for i in order:
            self._window.append(tuple(None if math.isnan(x) else x for x in
                                      (float(k[i]), float(n), float(energy[i]), float(mean_len[i]))))

    def _reserve(self, rows: int) -> None:
        """Room for ``rows`` prompts (capacity doubles: adding prompts costs amortised O(1) each)."""
        if rows > self._state.shape[0]:
            cap = max(rows, 2 * self._state.shape[0], 64)
            state = torch.zeros(cap, *self._state.shape[1:], dtype=torch.float64)
            t = torch.zeros(cap, dtype=torch.int64)
            state[:self._state.shape[0]], t[:self._t.shape[0]] = self._state, self._t
            self._state, self._t = state, t

    def _update_pass(self, ids, idx, k, n, energy, mean_len, step, prior, mbar, w0, is_binary) -> None:
        new = [i for i in ids if i not in self._row]
        if new:
            start = len(self._row)
            self._reserve(start + len(new))
            self._row.update({pid: start + j for j, pid in enumerate(new)})
            self._t[start:start + len(new)] = step
        rows = torch.tensor([self._row[i] for i in ids])
        delta = (step - self._t[rows]).clamp(min=0).double()  # a group older than the last visit: no decay
        decay = self._lam[None, :] ** delta[:, None]  # [b, J]
        s = self._state[rows] * decay[:, None, :]  # every column decayed to this step
        revisit = torch.tensor([i not in new for i in ids])
        kk, ee, ll = k[idx], energy[idx], mean_len[idx]
        if bool(revisit.any()):
            sr = s[revisit]
            if is_binary:
                logp = beta_binomial_logpmf(kk[revisit, None], torch.tensor(float(n)), prior[0] + sr[:, A],
                                            prior[1] + sr[:, B_])  # [b', J]
                total = logp.sum(0).tolist()
                self._score_binary = [x + y for x, y in zip(self._score_binary, total)]
                self._revisits += float(revisit.sum())
            full = revisit & ~torch.isnan(ee)
            if bool(full.any()):
                sf = s[full]
                predicted = (w0 * mbar + sf[:, E]) / (w0 + sf[:, W])
                err = ((ee[full, None] - predicted) ** 2).sum(0).tolist()
                self._score_continuous = [x - y for x, y in zip(self._score_continuous, err)]
        add = torch.zeros_like(s)
        if is_binary:
            add[:, A] = kk[:, None]
            add[:, B_] = (n - kk)[:, None]
        has_energy = ~torch.isnan(ee)
        add[:, E] = torch.where(has_energy, ee, 0.0)[:, None]
        add[:, W] = has_energy.double()[:, None]
        has_len = ~torch.isnan(ll)
        add[:, LSUM] = torch.where(has_len, ll, 0.0)[:, None]
        add[:, LW] = has_len.double()[:, None]
        self._state[rows] = s + add
        self._t[rows] = torch.maximum(self._t[rows], torch.full_like(self._t[rows], step))

    # ------------------------------------------------------------------------------------------------------------
    def _read(self, ids: list, step: int) -> tuple[Tensor, Tensor]:
        """(discounted state [b, 6] under the chosen lambda, seen [b])."""
        j = self.discounts.index(self.discount())
        out = torch.zeros(len(ids), 6, dtype=torch.float64)
        seen = torch.tensor([i in self._row for i in ids], dtype=torch.bool)
        if bool(seen.any()):
            rows = torch.tensor([self._row[i] for i, s in zip(ids, seen.tolist()) if s])
            delta = (step - self._t[rows]).clamp(min=0).double()
            out[seen] = self._state[rows, :, j] * (self.discounts[j] ** delta)[:, None]
        return out, seen

    def beta_parameters(self, ids: Sequence[PromptId] | Tensor, step: int) -> tuple[Tensor, Tensor]:
        """(alpha, beta) float64 [b] of each prompt's pass rate at optimizer step ``step`` (prior if unseen)."""
        s, _ = self._read(_normalize_ids(ids), _check_step(step))
        a0, b0 = self.prior()
        return a0 + s[:, A], b0 + s[:, B_]

    def mixed_probability(self, ids: Sequence[PromptId] | Tensor, step: int, n: int | None = None) -> Tensor:
        """P(the next group of n (default G) binary rewards is not all equal), float64 [b]."""
        alpha, beta = self.beta_parameters(ids, step)
        pmf = beta_binomial_pmf(n or self.group_size, alpha, beta)
        return 1.0 - pmf[:, 0] - pmf[:, -1]

    def expected_energy(self, ids: Sequence[PromptId] | Tensor, step: int) -> Tensor:
        """E[m] of each prompt's next full group at step ``step`` (binary: beta-binomial; continuous: discounted
        mean energy shrunk to the window's), float64 [b]."""
        ids, step = _normalize_ids(ids), _check_step(step)
        if self._binary:
            alpha, beta = self.beta_parameters(ids, step)
            return expected_energy(alpha, beta, self.curve)
        s, _ = self._read(ids, step)
        w0 = self.continuous_prior_weight
        return (w0 * self._mean_energy() + s[:, E]) / (w0 + s[:, W])

    def scores(self, ids: Sequence[PromptId] | Tensor, step: int) -> Tensor:
        """The prompt-level proxy s_q = sqrt(E[m]) * Lbar^length_exponent (float64 [b]; > 0 under binary
        rewards, for seen and unseen prompts alike)."""
        ids, step = _normalize_ids(ids), _check_step(step)
        s = self.expected_energy(ids, step).clamp(min=0.0).sqrt()
        if self.length_exponent != 0.0:
            state, _ = self._read(ids, step)
            mean_len = torch.where(state[:, LW] > 0, state[:, LSUM] / state[:, LW].clamp(min=1e-300),
                                   torch.full_like(s, self._mean_length()))
            s = s * mean_len.clamp(min=1.0) ** self.length_exponent
        return s

    def stats(self, prefix: str = "posterior/") -> dict[str, float]:
        """What to log each step: the chosen discount, the prior, the forgotten per-revisit log-likelihood of each
        grid point and of the chosen one (binary), the number of prompts, whether the Beta state is read."""
        a0, b0 = self.prior()
        out = {f"{prefix}discount": self.discount(), f"{prefix}prior_alpha": a0, f"{prefix}prior_beta": b0,
               f"{prefix}prompts": float(len(self)), f"{prefix}binary": float(self._binary),
               f"{prefix}revisits": self._revisits}
        if self._revisits > 0:
            for lam, score in zip(self.discounts, self._score_binary):
                out[f"{prefix}loglik_per_revisit/{lam:g}"] = score / self._revisits
            out[f"{prefix}loglik_per_revisit"] = self._score_binary[self.discounts.index(self.discount())] \
                / self._revisits if self._binary else math.nan
        return out

    # ------------------------------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"group_size": self.group_size, "estimator": self.estimator, "gamma": self.gamma,
                "discounts": list(self.discounts)}

    def state_dict(self) -> dict:
        ids = sorted(self._row, key=lambda i: self._row[i])
        n = len(ids)
        return {"format": self.FORMAT, **self._config(), "ids": ids, "t": self._t[:n].tolist(),
                "state": self._state[:n].tolist(), "window": [list(g) for g in self._window],
                "score_binary": list(self._score_binary), "score_continuous": list(self._score_continuous),
                "revisits": self._revisits, "binary": self._binary, "last_step": self._last_step}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != self.FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a PromptPosterior state (format {got!r}, expected {self.FORMAT!r})")
        mine = self._config()
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"PromptPosterior state was made with {theirs}; this posterior is configured with {mine} "
                             f"(the state depends on these)")
        ids = _normalize_ids(state["ids"])
        J = len(self.discounts)
        st = torch.tensor(state["state"], dtype=torch.float64).reshape(len(ids), 6, J)
        t = torch.tensor(state["t"], dtype=torch.int64).reshape(len(ids))
        self._row = {pid: j for j, pid in enumerate(ids)}
        self._state, self._t = st, t
        self._window = deque((tuple(None if x is None else float(x) for x in g) for g in state["window"]),
                             maxlen=self.prior_window)
        self._score_binary = [float(x) for x in state["score_binary"]]
        self._score_continuous = [float(x) for x in state["score_continuous"]]
        self._revisits = float(state["revisits"])
        self._binary = bool(state["binary"])
        self._last_step = None if state["last_step"] is None else int(state["last_step"])


def keep_probabilities(scores: Tensor, rate: float, max_weight: float) -> Tensor:
    """Prompt keep probabilities pi = clip(c * s, 1/max_weight, 1) with sum pi = (1 - rate) * B per leading
    index (``optimal_keep.water_fill``). The posterior's scores are positive, so no prompt gets 0 and the floor
    1/max_weight is only a cap on the weight 1/pi; a rate of 0 keeps every prompt with pi = 1."""
    rate = check_rate("prompt pruning rate", rate)
    if isinstance(max_weight, bool) or not isinstance(max_weight, (int, float)) or not max_weight >= 1.0 \
            or not math.isfinite(max_weight):
        raise ValueError(f"max_weight must be a finite number >= 1 (the largest weight 1/pi), got {max_weight!r}")
    s = check_float_tensor("scores", scores, min_dim=1).double()
    if rate == 0.0:
        return torch.ones_like(s)
    return water_fill(s, (1.0 - rate) * s.shape[-1], floor=1.0 / max_weight)
