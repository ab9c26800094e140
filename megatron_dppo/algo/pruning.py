"""Pruning = a keep mask plus a weight per unit (docs/algorithms.md, "Pruning").

Every pruner returns a :class:`PruneResult`: ``keep`` (bool) and ``weight`` = 1/P(keep) for kept units, 0 for
pruned ones. The pruned objective is ``J_hat = 1/D * sum_{kept} weight * agg(s)`` with a denominator D fixed from
the full batch (see ``losses.loss_denominator``).

DPPO (unbiased; :class:`DPPOPruner`)
    Prompt level, before rollout. history h_q = mean |A| of the prompt's last group (``PromptHistory``), NaN if
    never seen. Unseen prompts are never candidates. A seen prompt is a candidate iff h_q == 0 or
    h_q < mean of h over the seen prompts of the batch. Candidates are kept with pi_q = 1 - r_q, others pi_q = 1.
    Completion level, after rewards and FULL-group advantages. A completion is a candidate iff A_qi == 0 or
    |A_qi| < mean_i |A_qi|. Candidates are kept with pi_{i|q} = 1 - r_o, others with 1.
    Weight w_qi = 1 / (pi_q * pi_{i|q}) (:func:`combine`), 0 if pruned.
    Because E[keep * w] = 1 for every unit and the loss is linear in the per-unit terms with a draw-independent
    denominator, E[J_hat] = J and E[grad J_hat] = grad J (conditional on the rollout).
    Variance (bernoulli mode, g_qi = per-unit term already divided by D, g_q = sum_i g_qi):
        Var(ghat_q) = sum_i (1/pi_{i|q} - 1) g_qi^2 ;  Var(J_hat) = sum_q [(1/pi_q - 1) g_q^2 + Var(ghat_q)/pi_q].

Variance-optimal keep probabilities (``keep="optimal"``; :mod:`megatron_dppo.algo.optimal_keep`)
    Instead of one rate for the candidates, each unit gets pi = clip(c * s, pi_min, 1), c solved per decision so
    that the EXPECTED kept count is (1 - r) times the units (the rates keep their meaning as budgets). Scores s:
    prompt level s_q = h_q (never-seen prompts pi_q = 1, every seen prompt at least pi_min, ``keep_floor``: a
    prompt whose last group was all-correct can be informative now, and only the floor keeps that unbiased);
    completion level s_qi = |A_qi| * L_qi^alpha / pi_q over all generated completions of the batch at once
    (``length_exponent`` alpha). A completion with A = 0 has an exactly zero policy-gradient term: it gets pi = 0
    (pruned for free) unless the loss has a term that does not vanish at A = 0 (``zero_advantage_gradient``, a KL
    term), when it gets the floor. A rate of 0 keeps everything (bit for bit the unpruned step).
    ``bernoulli``: independent draws with these pi; ``fixed_size``: systematic sampling in a random order, whose
    inclusion probabilities are exactly pi (floor or ceil of sum pi units kept); ``deterministic``: refused.

Posterior keep probabilities (``keep="posterior"``; :mod:`megatron_dppo.algo.prompt_posterior`)
    The prompt level water-fills the prompt posterior's forecast of each prompt's gradient norm, s_q > 0 for seen
    and unseen prompts alike, with pi_q >= 1/max_weight (a cap on the weight; s_q > 0 already keeps it unbiased).
    The caller keeps the posterior (updated from every generated group's raw rewards) and passes its scores as
    ``history``. The completion level is the optimal rule's.

Cost-aware keep probabilities (``keep="optimal", keep_cost="tokens"``; :func:`optimal_keep.cost_water_fill`)
    Units of unequal cost (multi-turn episodes: 1 turn or 8, short or long observations) get
    pi = clip(t * s / sqrt(c), pi_min, 1) with t solved so that the EXPECTED COST sum pi c is (1 - r) times the
    units' total cost (the rate is then the expected share of compute saved). The caller passes ``costs``: at
    completion level each episode's tokens (prompt + sampled + observation: what training it costs), at prompt
    level the expected cost of the prompt's G episodes (NaN = unknown: the mean of the known ones). The weights
    stay 1/pi, so the estimate stays unbiased (tests/unit/test_cost_aware_pruning.py).

Selection modes
    ``bernoulli``     independent draws, keep prob exactly 1 - r (the theory).
    ``fixed_size``    prune exactly n = floor(r * |C|) of the |C| candidates of a decision set (the batch at prompt
                      level, one group at completion level), uniformly without replacement; kept candidates are
                      weighted by the EXACT keep probability 1 - n/|C| (never 1/(1-r)), so it stays unbiased.
    ``deterministic`` prune the n lowest-score candidates (score h_q, resp. |A_qi|; ties: lower index first) and
                      weight the kept candidates by 1/(1 - n/|C|) as fixed_size does. The kept set is a function of
                      the scores, not a random draw, so E[keep * w] != 1: BIASED, for ablations only (a warning is
                      logged once per process).
    floor(r * |C|) is taken with a 1e-9 tolerance against binary representation error (0.3 * 10 -> 3, not 2).

Randomness (invariant 5)
    Draws use only the ``torch.Generator`` passed in (CPU), one generator per decision, seeded from (seed, step,
    decision) by the caller (``make_generator``). In distributed training the caller runs the pruner on ONE rank
    and broadcasts ``keep``/``weight`` (or the generator seed and identical inputs) to the others, so every rank
    makes the same decision. Nothing here touches the global RNG or torch.distributed.

Vectorisation
    Leading dimensions are independent decisions: ``select_prompts`` accepts history [..., B] (the candidate rule
    and the fixed_size count are per last-dim row) and ``select_completions`` accepts advantages [..., B, G]. A
    step uses [B] and [B, G]; Monte-Carlo tests stack many draws in a leading dimension.

CPPO (baseline, biased by design; :class:`CPPOPruner`)
    Keep the k completions with the largest |A| (``group``: k = floor(G*(1-P)) per prompt; ``batch``:
    floor(N*(1-P)) over the whole batch), weight 1. To reproduce the authors' "mean over kept units" the caller
    uses the kept count as the denominator (draw-dependent: part of why CPPO is biased). ``allocation=True``:
    draw ``prompts_to_draw(B)`` prompts and prune back to exactly B*G completions with ``select_allocated``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._checks import check_choice, check_finite, check_float_tensor, check_rate, floor_with_tolerance
from .optimal_keep import (
    completion_scores,
    cost_water_fill,
    predicted_relative_variance,
    systematic_sample,
    water_fill,
)
from .prompt_posterior import keep_probabilities

logger = logging.getLogger(__name__)

DPPO_MODES = ("bernoulli", "fixed_size", "deterministic")
DPPO_KEEPS = ("uniform", "optimal", "posterior")
DPPO_KEEP_COSTS = ("none", "tokens")
CPPO_SCOPES = ("group", "batch")

_warned_deterministic = False


# --------------------------------------------------------------------------------------------------------------
# Result type
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PruneResult:
    """Decision for a set of units (prompts [..., B] or completions [..., B, G]).

    keep:      bool tensor.
    weight:    float32 tensor, 1/keep_prob where kept, 0 where pruned.
    keep_prob: float64 probability with which each unit was kept (1 for non-candidates). For ``deterministic``
               mode it is the nominal 1 - n/|C| used for the weight; for CPPO it is 1 (no reweighting).
    candidate: bool tensor, units that were eligible for pruning (None when not applicable).
    score:     float64 proxy for each unit's gradient norm the decision saw (DPPO: h_q, resp. |A| L^alpha / pi_q;
               None otherwise); ``predicted_rel_variance`` is computed from it.
    """

    keep: Tensor
    weight: Tensor
    keep_prob: Tensor | None = None
    candidate: Tensor | None = None
    score: Tensor | None = None

    def __post_init__(self) -> None:
        if self.keep.dtype != torch.bool:
            raise ValueError(f"PruneResult.keep must be a bool tensor, got {self.keep.dtype}")
        for name in ("weight", "keep_prob", "candidate", "score"):
            value = getattr(self, name)
            if value is not None and value.shape != self.keep.shape:
                raise ValueError(
                    f"PruneResult.{name} has shape {tuple(value.shape)}, keep has {tuple(self.keep.shape)}"
                )

    @property
    def kept_fraction(self) -> float:
        """Fraction of units kept."""
        return float(self.keep.float().mean()) if self.keep.numel() else 0.0

    @property
    def ess(self) -> float:
        """Effective sample size (sum w)^2 / sum w^2 over the kept units (0 if nothing is kept)."""
        w = self.weight[self.keep].double()
        sq = float((w * w).sum())
        return float(w.sum()) ** 2 / sq if sq > 0 else 0.0

    @property
    def num_candidates(self) -> int:
        return int(self.candidate.sum()) if self.candidate is not None else 0

    @property
    def num_kept(self) -> int:
        return int(self.keep.sum())

    @property
    def predicted_rel_variance(self) -> float:
        """sum (1 - pi)/pi * s^2 / sum s^2 over the units with score s > 0: the relative variance the decision would
        add if unit gradients were orthogonal with norms s (NaN without scores or when every score is 0)."""
        if self.score is None:
            return float("nan")
        return predicted_relative_variance(self.probabilities(), self.score)

    def probabilities(self) -> Tensor:
        """keep_prob, or (for results built by hand) 1/weight on kept units and NaN on pruned ones."""
        if self.keep_prob is not None:
            return self.keep_prob
        w = self.weight.double()
        return torch.where(self.keep, 1.0 / w, torch.full_like(w, math.nan))


def keep_all(shape: int | tuple[int, ...]) -> PruneResult:
    """Every unit of ``shape`` kept with probability 1, weight 1, none a candidate (no pruning)."""
    ones = torch.ones(shape, dtype=torch.float64)
    return PruneResult(keep=torch.ones(shape, dtype=torch.bool), weight=ones.float(), keep_prob=ones,
                       candidate=torch.zeros(shape, dtype=torch.bool))


def _result(keep: Tensor, keep_prob: Tensor, candidate: Tensor | None, device: torch.device,
            score: Tensor | None = None) -> PruneResult:
    weight = torch.where(keep, 1.0 / keep_prob, torch.zeros_like(keep_prob)).to(torch.float32)
    return PruneResult(
        keep=keep.to(device),
        weight=weight.to(device),
        keep_prob=keep_prob.to(device),
        candidate=None if candidate is None else candidate.to(device),
        score=None if score is None else score.to(device),
    )


def make_generator(seed: int, step: int, decision: str | int = 0) -> torch.Generator:
    """A CPU generator for one pruning decision, seeded by a stable hash of (seed, step, decision).

    Stable across processes and Python versions (no ``hash()``), so the rank that draws and any rank that re-draws
    for checking agree; different decisions of one step ("prompts", "completions") get independent streams.
    """
    digest = hashlib.sha256(f"megatron-dppo/{int(seed)}/{int(step)}/{decision}".encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


# --------------------------------------------------------------------------------------------------------------
# Selection core: candidates along the last dimension, one independent decision per leading index
# --------------------------------------------------------------------------------------------------------------
def _ranks_along_last_dim(order: Tensor) -> Tensor:
    """ranks[..., order[..., j]] = j : the position of each element in the sorted order."""
    ranks = torch.empty_like(order)
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    ranks.scatter_(-1, order, positions.contiguous())
    return ranks


def _select(
    candidate: Tensor, score: Tensor, rate: float, mode: str, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Keep mask and keep probability (float64) for candidates along the last dim. Non-candidates are always kept."""
    ones = torch.ones(candidate.shape, dtype=torch.float64)
    if mode == "bernoulli":
        u = torch.rand(candidate.shape, generator=generator, dtype=torch.float64)
        keep_prob = torch.where(candidate, torch.full_like(ones, 1.0 - rate), ones)
        return u < keep_prob, keep_prob  # u in [0, 1): P(u < p) = p, and p = 1 always keeps

    n_cand = candidate.sum(dim=-1, keepdim=True)
    n_prune = torch.floor(rate * n_cand.double() + 1e-9).long()  # floor(r*|C|), see module docstring
    keep_prob_cand = 1.0 - n_prune.double() / n_cand.clamp(min=1).double()
    keep_prob = torch.where(candidate, keep_prob_cand.expand_as(ones), ones)
    if mode == "fixed_size":
        # a uniformly random order of the candidates: i.i.d. keys, non-candidates sorted last
        key = torch.rand(candidate.shape, generator=generator, dtype=torch.float64)
        key = torch.where(candidate, key, torch.full_like(key, 2.0))
        order = torch.sort(key, dim=-1, stable=True).indices
    elif mode == "deterministic":
        key = torch.where(candidate, score.double(), torch.full_like(ones, math.inf))
        order = torch.sort(key, dim=-1, stable=True).indices  # lowest score first, ties by index
    else:  # pragma: no cover - validated by the constructor
        raise ValueError(f"unknown mode {mode!r}")
    prune = candidate & (_ranks_along_last_dim(order) < n_prune)
    return ~prune, keep_prob


def _require_generator(mode: str, generator: torch.Generator | None) -> None:
    if mode != "deterministic" and not isinstance(generator, torch.Generator):
        raise ValueError(
            f"mode {mode!r} draws at random and needs a torch.Generator (one per decision, e.g. "
            f"make_generator(seed, step, 'prompts')), got {generator!r}"
        )


def _unit_costs(costs: Tensor | None, shape: torch.Size, name: str) -> Tensor:
    """Float64 costs of the units of a cost-aware decision: > 0, NaN (unknown, e.g. a prompt never seen) replaced
    by the mean of the known costs along the last dim (1 when none is known)."""
    if costs is None:
        raise ValueError(f"DPPO keep_cost='tokens' needs {name}, got None")
    c = costs.detach().cpu().double()
    if tuple(c.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(c.shape)}")
    known = ~torch.isnan(c)
    if bool((c[known] <= 0).any()) or not bool(torch.isfinite(c[known]).all()):
        raise ValueError(f"{name} must be finite and > 0 (NaN = unknown)")
    mean = torch.where(known, c, 0.0).sum(-1, keepdim=True) / known.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(known, c, torch.where(mean > 0, mean, 1.0).expand_as(c))


# --------------------------------------------------------------------------------------------------------------
# DPPO
# --------------------------------------------------------------------------------------------------------------
def prompt_candidates(history: Tensor) -> Tensor:
    """Prompt-level candidates along the last dim: seen (not NaN) and (h == 0 or h < mean of seen h)."""
    h = history.double()
    seen = ~torch.isnan(h)
    h0 = torch.where(seen, h, torch.zeros_like(h))
    n_seen = seen.sum(dim=-1, keepdim=True)
    mean_seen = h0.sum(dim=-1, keepdim=True) / n_seen.clamp(min=1)
    return seen & ((h0 == 0) | (h0 < mean_seen))


def completion_candidates(advantages: Tensor) -> Tensor:
    """Completion-level candidates along the last dim: A == 0 or |A| < mean_i |A|.

    Compared in float64: the float64 mean of G equal float32 values is exactly that value, so a group whose |A|
    are all equal has no candidates instead of some decided by rounding.
    """
    a = advantages.double().abs()
    return (a == 0) | (a < a.mean(dim=-1, keepdim=True))


class DPPOPruner:
    """Hierarchical unbiased pruning: prompts before rollout (rate r_q), completions after advantages (rate r_o).

    keep="uniform": candidates kept with 1 - r (the paper's rule); keep="optimal": variance-optimal keep
    probabilities at the same expected budget (module docstring), with ``length_exponent`` alpha of the completion
    proxy |A| L^alpha, the floor ``keep_floor`` (pi_min) and ``zero_advantage_gradient`` (True when the loss has a
    term whose gradient does not vanish at A = 0, e.g. KL: zero-advantage completions then get the floor, not 0).
    ``keep_cost="tokens"`` (with keep="optimal"): cost-aware probabilities, pi proportional to s / sqrt(cost) at a
    fixed expected cost (module docstring); ``select_prompts`` / ``select_completions`` then need ``costs``.
    keep="posterior": the prompt level water-fills the prompt posterior's scores s_q > 0
    (``prompt_posterior.keep_probabilities``: pi_q >= 1/``max_weight``, a cap on the weight, not what keeps it
    unbiased); the completion level is the optimal rule's.
    """

    def __init__(self, r_q: float, r_o: float, mode: str = "bernoulli", keep: str = "uniform",
                 length_exponent: float = 0.0, keep_floor: float = 0.3,
                 zero_advantage_gradient: bool = False, keep_cost: str = "none", max_weight: float = 20.0) -> None:
        self.r_q = check_rate("r_q", r_q)
        self.r_o = check_rate("r_o", r_o)
        self.mode = check_choice("DPPO mode", mode, DPPO_MODES)
        self.keep = check_choice("DPPO keep rule", keep, DPPO_KEEPS)
        if keep != "uniform" and mode == "deterministic":
            raise ValueError(f"DPPO keep={keep!r} draws at random with per-unit probabilities; mode 'deterministic' "
                             f"has no probabilities to weight by (valid with {keep}: bernoulli, fixed_size)")
        if isinstance(max_weight, bool) or not isinstance(max_weight, (int, float)) or not max_weight >= 1.0 \
                or not math.isfinite(max_weight):
            raise ValueError(f"max_weight must be a finite number >= 1 (the largest prompt weight 1/pi_q), "
                             f"got {max_weight!r}")
        self.max_weight = float(max_weight)
        if isinstance(length_exponent, bool) or not isinstance(length_exponent, (int, float)) \
                or not math.isfinite(length_exponent):
            raise ValueError(f"length_exponent must be a finite number, got {length_exponent!r}")
        if isinstance(keep_floor, bool) or not isinstance(keep_floor, (int, float)) or not 0.0 <= keep_floor <= 1.0:
            raise ValueError(f"keep_floor must be in [0, 1], got {keep_floor!r}")
        self.length_exponent = float(length_exponent)
        self.keep_floor = float(keep_floor)
        self.zero_advantage_gradient = bool(zero_advantage_gradient)
        self.keep_cost = check_choice("DPPO keep cost", keep_cost, DPPO_KEEP_COSTS)
        if keep_cost != "none" and keep != "optimal":
            raise ValueError(f"DPPO keep_cost={keep_cost!r} shapes the optimal rule's probabilities; it needs "
                             f"keep='optimal', got keep={keep!r}")
        if mode == "deterministic":
            global _warned_deterministic
            if not _warned_deterministic:
                _warned_deterministic = True
                logger.warning(
                    "DPPOPruner mode='deterministic' prunes the lowest-score candidates: the estimate is BIASED "
                    "(E[keep * weight] != 1); use it for ablations only"
                )

    def __repr__(self) -> str:
        extra = (f", length_exponent={self.length_exponent}, keep_floor={self.keep_floor}, "
                 f"zero_advantage_gradient={self.zero_advantage_gradient}") if self.keep != "uniform" else ""
        extra += f", max_weight={self.max_weight}" if self.keep == "posterior" else ""
        extra += f", keep_cost={self.keep_cost!r}" if self.keep_cost != "none" else ""
        return f"DPPOPruner(r_q={self.r_q}, r_o={self.r_o}, mode={self.mode!r}, keep={self.keep!r}{extra})"

    def select_prompts(self, history: Tensor, generator: torch.Generator | None = None,
                       costs: Tensor | None = None) -> PruneResult:
        """Prompt-level decision for history [B] (NaN = never seen), or with keep="posterior" the posterior's
        scores s_q >= 0 [B] (no NaN: an unseen prompt has the prior's score); leading dims = independent
        decisions."""
        history = check_float_tensor("history", history, min_dim=1)
        finite_or_nan = torch.isfinite(history) | torch.isnan(history)
        if not bool(finite_or_nan.all()):
            check_finite("history (NaN allowed for unseen prompts)", torch.where(finite_or_nan, 0.0, history))
        if bool((history < 0).any()):
            bad = history[history < 0][0].item()
            raise ValueError(f"history scores are mean |A| and must be >= 0 (or NaN for unseen), got {bad}")
        _require_generator(self.mode, generator)
        h = history.detach().cpu().double()
        if self.keep == "posterior":
            if bool(torch.isnan(h).any()):
                raise ValueError("DPPO keep='posterior' needs a score for every prompt (PromptPosterior.scores: the "
                                 "prior's for an unseen one), got NaN")
            keep_prob = keep_probabilities(h, self.r_q, self.max_weight)
            keep = self._draw(keep_prob, generator)
            return _result(keep, keep_prob, keep_prob < 1.0, history.device, h)
        unseen = torch.isnan(h)
        score = torch.where(unseen, torch.zeros_like(h), h)
        if self.keep == "uniform":
            candidate = prompt_candidates(history).cpu()
            keep, keep_prob = _select(candidate, h, self.r_q, self.mode, generator)
            return _result(keep, keep_prob, candidate, history.device, score)
        if self.r_q == 0.0:
            keep_prob = torch.ones_like(h)
        else:
            budget = (1.0 - self.r_q) * h.shape[-1]
            if self.keep_cost == "tokens":  # cost-aware: expected cost sum pi c = (1 - r_q) * sum c
                c = _unit_costs(costs, h.shape, "costs (expected cost of each prompt's episodes)")
                keep_prob = cost_water_fill(score, c, (1.0 - self.r_q) * c.sum(-1), floor=self.keep_floor,
                                            forced=unseen)
            else:
                keep_prob = water_fill(score, budget, floor=self.keep_floor, forced=unseen)
        keep = self._draw(keep_prob, generator)
        return _result(keep, keep_prob, keep_prob < 1.0, history.device, score)

    def select_completions(self, advantages: Tensor, generator: torch.Generator | None = None,
                           lengths: Tensor | None = None, prompt_prob: Tensor | None = None,
                           generated: Tensor | None = None, costs: Tensor | None = None) -> PruneResult:
        """Completion-level decision for full-group advantages [B, G]; leading dims = independent decisions.

        For keep="optimal" (and for the reported proxy in either rule): ``lengths`` [B, G] completion tokens,
        ``prompt_prob`` [B] the prompts' keep probabilities pi_q, and ``generated`` [B] which rows exist (a prompt
        pruned at prompt level has no completions: its row takes no part in the decision; default all). The
        optimal rule water-fills over every generated completion of the batch at once."""
        advantages = check_float_tensor("advantages", advantages, min_dim=2)
        check_finite("advantages", advantages)
        _require_generator(self.mode, generator)
        a = advantages.detach().cpu()
        for name, t, dims in (("lengths", lengths, a.shape), ("prompt_prob", prompt_prob, a.shape[:-1]),
                              ("generated", generated, a.shape[:-1])):
            if t is not None and tuple(t.shape) != tuple(dims):
                raise ValueError(f"{name} must have shape {tuple(dims)} for advantages {tuple(a.shape)}, "
                                 f"got {tuple(t.shape)}")
        score = completion_scores(a, None if lengths is None else lengths.cpu(), self.length_exponent,
                                  None if prompt_prob is None else prompt_prob.cpu())
        if self.keep == "uniform":
            candidate = completion_candidates(a)
            keep, keep_prob = _select(candidate, a.abs(), self.r_o, self.mode, generator)
            return _result(keep, keep_prob, candidate, advantages.device, score)
        rows = torch.ones(a.shape[:-1], dtype=torch.bool) if generated is None else generated.cpu().bool()
        units = rows.unsqueeze(-1).expand(a.shape)
        if self.r_o == 0.0:
            keep_prob = torch.ones(a.shape, dtype=torch.float64)
        else:
            score = torch.where(units, score, torch.zeros_like(score))
            may_carry_gradient = (score > 0) | self.zero_advantage_gradient
            floor = torch.where(units & may_carry_gradient, self.keep_floor, 0.0).double()
            flat = lambda t: t.flatten(-2)  # noqa: E731 - one decision over every completion of the batch
            budget = (1.0 - self.r_o) * units.flatten(-2).sum(-1).double()
            if self.keep_cost == "tokens":  # cost-aware: expected cost sum pi c = (1 - r_o) * sum c
                c = torch.where(units, _unit_costs(costs, a.shape, "costs (tokens of each episode)"), 1.0)
                budget = (1.0 - self.r_o) * torch.where(units, c, 0.0).flatten(-2).sum(-1)
                keep_prob = cost_water_fill(flat(score), flat(c), budget, floor=flat(floor)).view(a.shape)
            else:
                keep_prob = water_fill(flat(score), budget, floor=flat(floor)).view(a.shape)
        keep = self._draw(keep_prob, generator, flatten=True) & units
        return _result(keep, keep_prob, units & (keep_prob < 1.0), advantages.device, score)

    def _draw(self, keep_prob: Tensor, generator: torch.Generator | None, flatten: bool = False) -> Tensor:
        """Keep mask for per-unit probabilities: independent coins (bernoulli) or a systematic sample (fixed_size)
        over the last dim (the last two with ``flatten``: one sample over the whole batch of completions)."""
        if self.mode == "bernoulli":
            u = torch.rand(keep_prob.shape, generator=generator, dtype=torch.float64)
            return u < keep_prob
        p = keep_prob.flatten(-2) if flatten else keep_prob
        return systematic_sample(p, generator).view(keep_prob.shape)


def combine(prompt: PruneResult, completion: PruneResult) -> PruneResult:
    """Per-completion result of a prompt-level and a completion-level decision: w = 1 / (pi_q * pi_{i|q}).

    ``prompt`` has shape [..., B]. ``completion`` has shape [..., B, G] (rows of pruned prompts are ignored) or,
    for a 1-D prompt decision, [B_kept, G] with one row per KEPT prompt in order (pruned prompts are not
    generated); the result is always [..., B, G] with pruned prompts' rows not kept. The product of the two
    probabilities is formed in float64, so r_q = r_o = 0 gives weights exactly 1.
    """
    pq, pc = prompt.probabilities(), completion.probabilities()
    keep_c, cand_c = completion.keep, completion.candidate
    b = prompt.keep.shape[-1]
    if completion.keep.dim() != prompt.keep.dim() + 1:
        raise ValueError(
            f"completion decision must have one more dim than the prompt decision, got shapes "
            f"{tuple(completion.keep.shape)} and {tuple(prompt.keep.shape)}"
        )
    if completion.keep.shape[:-1] != prompt.keep.shape:
        n_kept = prompt.num_kept
        if prompt.keep.dim() != 1 or completion.keep.shape[0] != n_kept:
            raise ValueError(
                f"completion decision has {tuple(completion.keep.shape)} rows; expected one row per prompt "
                f"({b}) or one per kept prompt ({n_kept}) of prompt decision shape {tuple(prompt.keep.shape)}"
            )
        rows = prompt.keep.nonzero().squeeze(-1)
        g = completion.keep.shape[-1]
        full_keep = torch.zeros(b, g, dtype=torch.bool, device=keep_c.device)
        full_prob = torch.ones(b, g, dtype=torch.float64, device=keep_c.device)
        full_keep[rows], full_prob[rows] = keep_c, pc
        keep_c, pc = full_keep, full_prob
        if cand_c is not None:
            full_cand = torch.zeros(b, g, dtype=torch.bool, device=keep_c.device)
            full_cand[rows] = cand_c
            cand_c = full_cand
    keep = prompt.keep.unsqueeze(-1) & keep_c
    prob = pq.unsqueeze(-1).double() * pc.double()
    prob = torch.where(keep, prob, torch.ones_like(prob))  # pruned units: any finite value, weight is 0
    weight = torch.where(keep, 1.0 / prob, torch.zeros_like(prob)).to(torch.float32)
    candidate = None
    if prompt.candidate is not None and cand_c is not None:
        candidate = prompt.candidate.unsqueeze(-1) | cand_c
    keep_prob = pq.unsqueeze(-1).double() * pc.double()
    return PruneResult(keep=keep, weight=weight, keep_prob=keep_prob, candidate=candidate)


def zero_variance_filter(rewards: Tensor) -> PruneResult:
    """Drop every group whose G rewards are all exactly equal (its advantages are 0): shape [B, G], rows constant.

    Deterministic, weight 1 for kept units: exact for the policy-gradient term (A = 0 contributes nothing) and
    biased for a KL term (the DAPO "dynamic sampling" filter; docs/algorithms.md, "Pruning").
    """
    rewards = check_float_tensor("rewards", rewards, min_dim=2)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [B, G], got {tuple(rewards.shape)}")
    check_finite("rewards", rewards)
    if rewards.shape[1] < 2:
        raise ValueError(f"zero_variance_filter needs group size G >= 2, got G = {rewards.shape[1]}")
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True).expand_as(rewards)
    keep = ~constant
    return PruneResult(
        keep=keep,
        weight=keep.to(torch.float32),
        keep_prob=torch.ones(rewards.shape, dtype=torch.float64, device=rewards.device),
        candidate=constant.clone(),
    )


# --------------------------------------------------------------------------------------------------------------
# CPPO
# --------------------------------------------------------------------------------------------------------------
def _top_abs(abs_adv: Tensor, k: Tensor | int, generator: torch.Generator | None) -> Tensor:
    """Keep mask of the k largest values along the last dim. Ties: random if a generator is given, else lower
    index first."""
    key = abs_adv.double()
    if generator is not None:
        perm = torch.argsort(torch.rand(key.shape, generator=generator, dtype=torch.float64), dim=-1)
        order_in_perm = torch.sort(-key.gather(-1, perm), dim=-1, stable=True).indices
        order = perm.gather(-1, order_in_perm)
    else:
        order = torch.sort(-key, dim=-1, stable=True).indices
    return _ranks_along_last_dim(order) < k


class CPPOPruner:
    """CPPO baseline: keep the completions with the largest |A|, weight 1 (no reweighting: biased by design).

    scope="group": k = floor(G*(1-P)) per prompt (the paper); scope="batch": floor(N*(1-P)) of the N = B*G
    completions of the batch (the authors' verl code). floor uses a 1e-9 tolerance (0.1 * 10 -> 1).
    """

    def __init__(self, rate: float, scope: str = "group", allocation: bool = False) -> None:
        self.rate = check_rate("CPPO rate", rate)
        self.scope = check_choice("CPPO scope", scope, CPPO_SCOPES)
        self.allocation = bool(allocation)

    def __repr__(self) -> str:
        return f"CPPOPruner(rate={self.rate}, scope={self.scope!r}, allocation={self.allocation})"

    def kept_count(self, units: int) -> int:
        """floor(units * (1 - P)); ValueError if that is 0 (nothing would be trained)."""
        k = floor_with_tolerance(units * (1.0 - self.rate))
        if k < 1:
            raise ValueError(f"CPPO rate {self.rate} keeps floor({units} * (1 - {self.rate})) = 0 of {units} units")
        return k

    def select_completions(self, advantages: Tensor, generator: torch.Generator | None = None) -> PruneResult:
        """Keep the top-|A| completions of advantages [B, G] (leading dims = independent batches)."""
        advantages = check_float_tensor("advantages", advantages, min_dim=2)
        check_finite("advantages", advantages)
        a = advantages.detach().abs().cpu()
        if self.scope == "group":
            keep = _top_abs(a, self.kept_count(a.shape[-1]), generator)
        else:
            flat = a.flatten(-2)
            keep = _top_abs(flat, self.kept_count(flat.shape[-1]), generator).view(a.shape)
        return _result(keep, torch.ones(a.shape, dtype=torch.float64), None, advantages.device)

    def prompts_to_draw(self, update_batch_prompts: int, group_size: int | None = None) -> int:
        """Prompts to roll out so that pruning leaves B*G completions ("dynamic completion allocation").

        batch scope (or group_size None): ceil(B / (1 - P)) (1e-9 tolerance against representation error).
        group scope with group_size G: ceil(B*G / k), k = floor(G*(1-P)) kept per prompt; equal to B/(1-P) when
        G*(1-P) is an integer and otherwise the smallest count whose per-prompt top-k still yields B*G.
        """
        b = update_batch_prompts
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"update_batch_prompts must be an integer >= 1, got {update_batch_prompts!r}")
        if self.scope == "group" and group_size is not None:
            k = self.kept_count(group_size)
            return -(-(b * group_size) // k)
        return int(math.ceil(b / (1.0 - self.rate) - 1e-9))

    def select_allocated(
        self, advantages: Tensor, update_batch_prompts: int, generator: torch.Generator | None = None
    ) -> PruneResult:
        """Prune an allocated batch advantages [B', G] back to exactly B*G completions (B = update_batch_prompts).

        batch scope: the B*G largest |A| of the batch. group scope: the per-prompt top-k first, then the surplus
        over B*G is dropped by smallest |A| across the batch (ties as in select_completions).
        """
        advantages = check_float_tensor("advantages", advantages, min_dim=2)
        if advantages.dim() != 2:
            raise ValueError(f"advantages must have shape [B', G], got {tuple(advantages.shape)}")
        check_finite("advantages", advantages)
        n_prompts, g = advantages.shape
        target = update_batch_prompts * g
        needed = self.prompts_to_draw(update_batch_prompts, g)
        if n_prompts < needed:
            raise ValueError(
                f"allocated batch has {n_prompts} prompts; rate {self.rate} with scope {self.scope!r} needs "
                f"{needed} to keep {update_batch_prompts} x {g} = {target} completions"
            )
        a = advantages.detach().abs().cpu()
        if self.scope == "group":
            per_group = _top_abs(a, self.kept_count(g), generator)
            masked = torch.where(per_group, a.double(), torch.full(a.shape, -1.0, dtype=torch.float64))
            keep = _top_abs(masked.flatten(), target, generator).view(a.shape) & per_group
        else:
            keep = _top_abs(a.flatten(), target, generator).view(a.shape)
        return _result(keep, torch.ones(a.shape, dtype=torch.float64), None, advantages.device)


# --------------------------------------------------------------------------------------------------------------
# Per-step statistics
# --------------------------------------------------------------------------------------------------------------
def pruning_stats(
    prompt: PruneResult | None = None,
    completion: PruneResult | None = None,
    combined: PruneResult | None = None,
    prefix: str = "prune/",
) -> dict[str, float]:
    """Kept fraction, number of units/candidates/kept and ESS per level (keys ``{prefix}{level}_{stat}``)."""
    stats: dict[str, float] = {}
    for level, result in (("prompt", prompt), ("completion", completion), ("total", combined)):
        if result is None:
            continue
        stats[f"{prefix}{level}_units"] = float(result.keep.numel())
        stats[f"{prefix}{level}_kept"] = float(result.num_kept)
        stats[f"{prefix}{level}_kept_fraction"] = result.kept_fraction
        stats[f"{prefix}{level}_ess"] = result.ess
        if result.candidate is not None:
            stats[f"{prefix}{level}_candidates"] = float(result.num_candidates)
        if result.score is not None:
            predicted = result.predicted_rel_variance
            if math.isfinite(predicted):
                stats[f"{prefix}{level}_predicted_rel_var"] = predicted
    return stats
