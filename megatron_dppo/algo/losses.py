"""Policy losses of the GRPO family with per-sample weights and a FIXED full-batch denominator.

Notation (docs/algorithms.md, "Objective"): per-token ratio rho = exp(logp - old_logp), advantage A of the token's
sequence, KL estimate KL_t between the policy and the reference, coefficient beta = ``kl_coef``. Every log-prob is
of the TEMPERED policy softmax(logits / T), T = ``LossConfig.temperature`` (the rollout's sampling temperature; the
engine applies it), so the ratio and the KL are between the tempered policies the rollout samples from.
Per-token objective (to MAXIMIZE):  s_t = pg_t - beta * KL_t, with

    ppo_clip: pg_t = min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A)   (DAPO clip-higher: eps_high)
    gspo:     pg_t = min(S * A, clip(S, 1 - eps_low, 1 + eps_high) * A) with the SEQUENCE ratio
              S = exp(mean_{t in seq} (logp_t - old_logp_t)), the mean over the completion tokens of the token's
              sequence (grouped by ``seq_index``), broadcast to every token of that sequence with full autograd.
              Under ``seq_mean_token_mean`` the sequence's tokens carry weight w/|o| each, so the sum over its
              |o| tokens is exactly ONE term w * min(S A, clip(S) A) per sequence, with the exact gradient of that
              term (the GSPO paper's objective). Under ``token_mean`` / ``seq_mean_token_sum_norm`` the sequence
              term is counted |o| times (length-weighted, like those aggregations weight every token).
              ``gspo_gradient`` says how a per-token factor u_t (rollout correction) reaches the gradient:
                autograd (default; TRL's form): u_t multiplies the whole sequence term, so token j's gradient is
                  (sum_t c_t u_t) * d pg/d S * S / |o|: a token masked by ``mis`` (u = 0) still receives gradient
                  through the sequence mean, and a kept token's gradient carries the sequence's weights, not its own.
                stop_gradient (verl's compute_policy_loss_gspo): the per-token ratio s_t = sg[S] * pi_t / sg[pi_t]
                  has the value S and the gradient S * grad log pi_t, so token t's gradient is c_t u_t d pg/d S * S:
                  each token carries its own weight; a masked token gets none.
              With no rollout factor (u constant within a sequence) the two give the same value and gradient.
              ``gspo_log_ratio_cap`` = m (off when None; verl clamps at 10): the log of the ratio (log S, or log s_t
              in the stop_gradient form) is clamped at m before exp, so the ratio is at most e^m and its gradient
              is zero where the clamp binds (log S > m). Only the unclipped branch of a negative-advantage term
              reaches such a ratio, so the cap bounds that term at e^m |A| and drops its gradient.

Dual clip (``clip_ratio_c`` = c > 1, off when None; Ye et al. 2019, verl's ``clip_ratio_c``): for tokens with
A < 0 the clipped objective is bounded below, pg_t = max(pg_t, c * A), so a huge ratio on a negative-advantage
token cannot blow up the update.

KL estimators (registry ``KL_ESTIMATORS``), x = ref_logp - logp = log(pi_ref / pi_theta), tokens sampled from
the policy; no clamping is applied unless ``kl_clamp`` is set (k3 only, k1/k2 ignore it; as verl's ``low_var_kl``:
x clamped to [-20, 20], the estimate to [-kl_clamp, kl_clamp]):
    k1: -x = logp - ref_logp                     (unbiased, high variance)
    k2: x^2 / 2                                  (biased, low variance)
    k3: exp(x) - x - 1                           ("low_var_kl": unbiased, >= 0)
``kl_bias_correction`` (TRL's ``use_bias_correction_kl``, the DeepSeek-V3.2 form): KL_t is multiplied by the
policy loss's importance ratio with full autograd, rho_t for ppo_clip (and registered losses), S for gspo (TRL's
``coef_1``). The tokens come from pi_old, not pi_theta, so rho_t * KL_t is the importance-weighted estimate; the
ratio also changes the KL gradient where its value is 1 (d rho_t = rho_t d logp_t).

Rollout correction (``rollout_correction``: none | tis | mis): the rollout engine samples from its own numerics,
pi_rollout, not exactly from the trainer's old policy pi_old. Per token, with u_t = exp(old_logp_t -
rollout_logp_t) (``rollout_correction_weights``), the policy-gradient term becomes u'_t * pg_t where
    tis: u'_t = clamp(u_t, cap_low, cap)                    (truncated IS; verl token TIS, slime vanilla TIS)
    mis: u'_t = u_t if cap_low <= u_t <= cap else 0          (masked IS; slime "icepop", verl IcePop, i.e.
                                                              rollout_is=token with rollout_is_threshold "lo_hi")
The KL term is not reweighted (as in verl, slime and TRL). u' is a fixed per-token factor (no gradient): it
multiplies the per-token term and composes with the pruning weight w = 1/pi, which is per sequence and drawn
independently of it. verl's token REJECTION (rollout_rs=token_k1) is a different mode and is not offered: it
removes rejected tokens from the loss mask, hence from the KL term and from the denominators (|o| and T), and
weighs kept tokens 1. Those denominators depend on the old log-probs of every token of the drawn batch, which
pruned completions never get, so they break the fixed full-batch D that keeps DPPO unbiased (docs/algorithms.md,
"Rollout correction").

Aggregation (a per-token weight, ``sequence_token_weights``, times s_t, summed, divided by a constant D):
    seq_mean_token_mean:      token weight w/|o|,  D = B*G
    token_mean:               token weight w,      D = T (total completion tokens of the full batch)
    seq_mean_token_sum_norm:  token weight w,      D = B*G*L_max
    seq_mean_token_sum:       token weight w,      D = B*G   (verl's "seq-mean-token-sum": per-sequence token sums,
                                                              averaged over sequences)
With several updates per rollout (mini-batches) B is the mini-batch's number of drawn prompts and T its tokens.
w is the sequence's pruning weight (1 without pruning). Token counts (|o|, T) are TRAINED tokens, the mask-1
tokens of ``loss_mask``: in a multi-turn episode the observation tokens between assistant turns have mask 0 and
count nowhere (callers pass the mask-1 counts as ``completion_lengths``), and L_max is the bound on trained tokens
per sequence (``env.max_assistant_tokens``). KL, the rollout-correction factor and every metric likewise see
mask-1 tokens only (tests/unit/test_loss_masks.py). The loss of a step is
    sum over micro-batches and DP ranks of loss_numerator(...)  /  loss_denominator(...)
and ``loss_numerator`` returns -sum_t token_weight_t * mask_t * s_t (a quantity to MINIMIZE).

Registries: a new policy loss is one function ``fn(logp, old_logp, advantages, loss_mask, seq_index, cfg) ->
(pg[T], metrics)`` registered with ``@register_policy_loss(name)``; a new KL estimator is
``fn(logp, ref_logp) -> kl[T]`` registered with ``@register_kl_estimator(name)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Literal, Optional, Union, get_args, get_type_hints

import torch
from torch import Tensor

from ._checks import check_choice
from .advantages import ADVANTAGE_ESTIMATORS
from .registry import Registry

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm", "seq_mean_token_sum")
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")
GSPO_GRADIENTS = ("autograd", "stop_gradient")

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
KLFn = Callable[[Tensor, Tensor], Tensor]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


def register_policy_loss(name: str, overwrite: bool = False):
    """Decorator: ``fn(logp, old_logp, advantages, loss_mask, seq_index, cfg) -> (pg[T], metrics)``.

    pg is the per-token policy-gradient objective to maximize (before masking and weighting); metrics are
    detached SUMS over the masked tokens (so they add up across micro-batches).
    """
    return POLICY_LOSSES.register(name, overwrite=overwrite)


def register_kl_estimator(name: str, overwrite: bool = False):
    """Decorator: ``fn(logp[T], ref_logp[T]) -> kl[T]``."""
    return KL_ESTIMATORS.register(name, overwrite=overwrite)


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------
#: The options for which null is a value of their own (off), so their default is "preset" (the preset's value); every
#: other option's null is the preset's value.
LOSS_NULL_MEANS_OFF = ("clip_ratio_c", "kl_clamp", "gspo_log_ratio_cap")


def _opt(default: Any, help: str) -> Any:  # noqa: A002 - the config sections' spelling (config/fields.opt)
    return field(default=default, metadata={"help": help})


def _check(ok: bool, key: str, value: Any, valid: str) -> None:  # the config sections' message (config/fields._check)
    if not ok:
        raise ValueError(f"{key}={value!r} is invalid: expected {valid}")


@dataclass
class LossConfig:
    """Policy loss: a preset (docs/algorithms.md) plus optional per-field overrides (null = preset value, except for
    the overrides that can be off: ``LOSS_NULL_MEANS_OFF``, where "preset" is the preset's value and null is off).

    One class for the run's ``loss`` section and the loss code: as written (YAML, or in code) a field may still say
    "the preset's value"; ``resolved(temperature)`` returns the same class with every field final (the preset's
    values under the set ones), which is what the loss functions and the engine read (they refuse an unresolved
    one). ``temperature`` is not an option of the section: the run sets it from ``rollout.temperature``.
    """

    preset: Literal["grpo", "dapo", "gspo", "dr_grpo", "verl_grpo", "trl_grpo"] = _opt(
        "grpo", "Loss preset: grpo (PPO clip, seq-mean-token-mean, std-normalized A), dapo (clip-higher 0.28, "
                "token-mean), gspo (sequence ratio), dr_grpo (no std, sum-norm by L_max); the peers' defaults by "
                "name: verl_grpo (token-mean, dual clip 3, k3 KL 0.001 clamped to 10, advantage eps 1e-6; with "
                "policy_loss=gspo as verl's GSPO: no dual clip, gspo_gradient=stop_gradient, gspo_log_ratio_cap "
                "10), trl_grpo (token-mean, no KL, advantage eps 1e-4, kl_bias_correction on). Several updates per "
                "rollout are train."
                "mini_batches / train.epochs (verl ppo_mini_batch_size / ppo_epochs, TRL steps_per_generation / "
                "num_iterations).")
    policy_loss: Optional[Literal["ppo_clip", "gspo"]] = _opt(None, "Override: per-token PPO clip or GSPO.")
    eps_low: Optional[float] = _opt(None, "Override: lower clip range (ratio >= 1 - eps_low).")
    eps_high: Optional[float] = _opt(None, "Override: upper clip range (ratio <= 1 + eps_high).")
    kl_coef: Optional[float] = _opt(None, "Override: KL penalty beta against the initial (reference) policy.")
    kl_estimator: Optional[Literal["k1", "k2", "k3"]] = _opt(None, "Override: KL estimator (k3 = low-variance).")
    aggregation: Optional[Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm",
                                  "seq_mean_token_sum"]] = _opt(
        None, "Override: loss aggregation (fixes the full-batch denominator D). seq_mean_token_sum = verl's "
              "seq-mean-token-sum: per-sequence token sums over D = B*G.")
    advantage_estimator: Optional[Literal["grpo", "dr_grpo", "rloo"]] = _opt(
        None, "Override: advantage estimator on the full group.")
    advantage_eps: Optional[float] = _opt(None, "Override: eps of the grpo advantage (r - mean) / (std + eps); "
                                               "presets use 1e-6 (verl), trl_grpo 1e-4 (TRL).")
    clip_ratio_c: Union[float, Literal["preset"], None] = _opt(
        "preset", "Override: dual-clip bound c > 1 for tokens with A < 0 (objective bounded below by c*A; verl's "
                  "clip_ratio_c, 3 in verl_grpo, off in the other presets); preset = the preset's value, null = off.")
    kl_clamp: Union[float, Literal["preset"], None] = _opt(
        "preset", "Override: clamp the k3 KL estimate to [-kl_clamp, kl_clamp] (and its log-ratio to [-20, 20]) as "
                  "verl's low_var_kl does with 10 (verl_grpo; off in the other presets); k3 only, k1/k2 ignore it. "
                  "preset = the preset's value, null = off.")
    rollout_correction: Optional[Literal["none", "tis", "mis"]] = _opt(
        None, "Override: rollout/trainer mismatch correction of the policy-gradient term per token with u = "
              "exp(trainer old logp - rollout-engine logp): tis = truncated IS, clamp(u, cap_low, cap) (verl token "
              "TIS, slime TIS); mis = masked IS, u inside [cap_low, cap] else 0 (slime icepop, verl IcePop: "
              "rollout_is_threshold \"lo_hi\"); none (preset default). verl's token rejection (rollout_rs, kept "
              "tokens weigh 1, rejected ones leave the denominators) is not offered: docs/algorithms.md, \"Rollout "
              "correction\". Forces the trainer's old log-prob pass; composes with the pruning weights 1/pi. Logs "
              "rollout/is_ratio, rollout/is_corrected_fraction, rollout/kl_k1, rollout/kl_k3.")
    rollout_correction_cap: Optional[float] = _opt(None, "Override: upper bound of the rollout IS weight (preset 2.0, "
                                                        "the verl and slime default).")
    rollout_correction_cap_low: Optional[float] = _opt(None, "Override: lower bound of the rollout IS weight "
                                                            "(preset 0.0, slime's default).")
    gspo_gradient: Optional[Literal["autograd", "stop_gradient"]] = _opt(
        None, "Override: how GSPO's sequence ratio S passes a per-token rollout-correction factor u_t to the "
              "gradient. autograd (presets' default; TRL): u_t weighs the sequence term, every token gets gradient "
              "through S, so a token zeroed by mis still learns; stop_gradient (verl_grpo; verl): s_t = sg[S] "
              "pi_t/sg[pi_t], token t's gradient carries its own u_t. Identical without rollout_correction. "
              "Default autograd: it is the exact gradient of the GSPO objective the docs write, and leaves runs "
              "without rollout correction bit for bit as before; prefer stop_gradient with mis.")
    gspo_log_ratio_cap: Union[float, Literal["preset"], None] = _opt(
        "preset", "Override: GSPO only: clamp the log of the sequence ratio (log S; log s_t under stop_gradient) at "
                  "this value before exp, so the ratio is at most e^cap and gets no gradient where the clamp binds "
                  "(log S > cap; only negative-advantage terms reach it). 10 in verl_grpo (verl's "
                  "compute_policy_loss_gspo), no cap in the other presets; preset = the preset's value, null = no "
                  "cap.")
    kl_bias_correction: Optional[bool] = _opt(
        None, "Override: multiply the KL term by the importance ratio (rho_t; S for gspo) with full autograd, "
              "TRL's use_bias_correction_kl (on in trl_grpo, off elsewhere); acts only with kl_coef > 0.")
    # Every log-prob of the loss (current, old, reference) is of softmax(logits / temperature): the rollout's sampling
    # temperature (run/build wires rollout.temperature in), as verl and TRL do; 1 = the raw policy (warm start). Not
    # an option of the loss section (``set_by``: the loader neither reads nor lists it); None until resolved.
    temperature: Optional[float] = field(default=None, metadata={"set_by": "rollout.temperature"})

    def __post_init__(self) -> None:
        if self.is_resolved:  # a final config (``resolved()``, a preset, or every field given in code) is checked
            self._check_final()

    @property
    def unresolved(self) -> list[str]:
        """The fields that still say "the preset's value" (or, for temperature, "not set yet")."""
        return [f.name for f in fields(self)
                if getattr(self, f.name) == "preset" or (getattr(self, f.name) is None
                                                         and f.name not in LOSS_NULL_MEANS_OFF)]

    @property
    def is_resolved(self) -> bool:
        return not self.unresolved

    def resolved(self, temperature: float | None = None) -> LossConfig:
        """The preset ``preset`` with its policy-loss rules (``PRESET_POLICY_RULES``) and then the fields set here
        (the user's explicit choices, which win), every field final; ``temperature``: the rollout's sampling
        temperature (None: this config's, or 1 when unset)."""
        check_choice("loss preset", self.preset, tuple(LOSS_PRESETS))
        base = LOSS_PRESETS[self.preset]
        overrides = {f.name: getattr(self, f.name) for f in fields(self)
                     if f.name not in self.unresolved and f.name != "temperature"}
        rules = PRESET_POLICY_RULES.get((self.preset, overrides.get("policy_loss", base.policy_loss)), {})
        if temperature is None:
            temperature = 1.0 if self.temperature is None else self.temperature
        return replace(base, **{**rules, **overrides, "temperature": temperature})

    def _check_final(self) -> None:
        POLICY_LOSSES.check(self.policy_loss)
        KL_ESTIMATORS.check(self.kl_estimator)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        check_choice("gspo_gradient", self.gspo_gradient, GSPO_GRADIENTS)
        ADVANTAGE_ESTIMATORS.check(self.advantage_estimator)
        if not isinstance(self.kl_bias_correction, bool):
            raise ValueError(f"LossConfig.kl_bias_correction must be True or False, got {self.kl_bias_correction!r}")
        for name in ("eps_low", "eps_high", "kl_coef", "advantage_eps", "rollout_correction_cap",
                     "rollout_correction_cap_low"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LossConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.eps_low >= 1:
            raise ValueError(f"LossConfig.eps_low must be < 1 (lower clip bound 1 - eps_low), got {self.eps_low}")
        if self.clip_ratio_c is not None and not (math.isfinite(self.clip_ratio_c) and self.clip_ratio_c > 1):
            raise ValueError(f"LossConfig.clip_ratio_c must be None (off) or a finite number > 1, got "
                             f"{self.clip_ratio_c!r}")
        cap = self.gspo_log_ratio_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                or not (math.isfinite(cap) and cap > 0)):
            raise ValueError(f"LossConfig.gspo_log_ratio_cap must be None (off) or a finite number > 0, got {cap!r}")
        if self.kl_clamp is not None and not (math.isfinite(self.kl_clamp) and self.kl_clamp > 0):
            raise ValueError(f"LossConfig.kl_clamp must be None (off) or a finite number > 0, got {self.kl_clamp!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
                math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"LossConfig.temperature must be a finite number > 0 (the sampling temperature), got "
                             f"{self.temperature!r}")
        if self.rollout_correction_cap <= self.rollout_correction_cap_low:
            raise ValueError(f"LossConfig.rollout_correction_cap={self.rollout_correction_cap} must be > "
                             f"rollout_correction_cap_low={self.rollout_correction_cap_low}")

    def validate(self) -> None:
        for name in ("eps_low", "eps_high"):
            v = getattr(self, name)
            _check(v is None or v >= 0, f"loss.{name}", v, "null or >= 0")
        _check(self.kl_coef is None or self.kl_coef >= 0, "loss.kl_coef", self.kl_coef, "null or >= 0")
        _check(self.advantage_eps is None or self.advantage_eps >= 0, "loss.advantage_eps", self.advantage_eps,
               "null or >= 0")
        for name, bound in (("clip_ratio_c", 1), ("kl_clamp", 0), ("gspo_log_ratio_cap", 0)):
            v = getattr(self, name)
            _check(v in (None, "preset") or v > bound, f"loss.{name}", v, f"preset, null (off) or > {bound}")
        for name in ("rollout_correction_cap", "rollout_correction_cap_low"):
            v = getattr(self, name)
            _check(v is None or v >= 0, f"loss.{name}", v, "null or >= 0")


def _require_resolved(cfg: LossConfig) -> None:
    if not cfg.is_resolved:
        raise ValueError(f"LossConfig fields {cfg.unresolved} still say \"the preset's value\"; the loss reads a "
                         f"resolved config: LossConfig(...).resolved(temperature)")


# --------------------------------------------------------------------------------------------------------------
# KL estimators
# --------------------------------------------------------------------------------------------------------------
@register_kl_estimator("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


@register_kl_estimator("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@register_kl_estimator("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    x = ref_logp - logp
    return torch.exp(x) - x - 1.0


def kl_k3_clamped(logp: Tensor, ref_logp: Tensor, clamp: float) -> Tensor:
    """k3 with verl's ``low_var_kl`` clamps: x = ref_logp - logp clamped to [-20, 20], the estimate to
    [-clamp, clamp] (``LossConfig.kl_clamp``; verl uses 10). Biased where a clamp is active, bounded always."""
    x = torch.clamp(ref_logp - logp, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(x) - x - 1.0, min=-clamp, max=clamp)


# --------------------------------------------------------------------------------------------------------------
# Policy losses
# --------------------------------------------------------------------------------------------------------------
def _clipped_min(ratio: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    pg = torch.minimum(ratio * advantages, torch.clamp(ratio, lo, hi) * advantages)
    if cfg.clip_ratio_c is not None:  # dual clip: for A < 0 the objective is bounded below by c * A
        pg = torch.where(advantages < 0, torch.maximum(pg, cfg.clip_ratio_c * advantages), pg)
    with torch.no_grad():
        clip_high = mask & (advantages > 0) & (ratio > hi)  # the clipped branch is the active minimum
        clip_low = mask & (advantages < 0) & (ratio < lo)
        metrics = {
            "clip_high_tokens": clip_high.sum().to(ratio.dtype),
            "clip_low_tokens": clip_low.sum().to(ratio.dtype),
            "clipped_tokens": (clip_high | clip_low).sum().to(ratio.dtype),
            "ratio_sum": torch.where(mask, ratio, torch.zeros_like(ratio)).sum(),
        }
    return pg, metrics


@register_policy_loss("ppo_clip")
def ppo_clip(logp, old_logp, advantages, loss_mask, seq_index, cfg):
    """pg_t = min(rho_t A, clip(rho_t, 1-eps_low, 1+eps_high) A), rho_t = exp(logp_t - old_logp_t)."""
    mask = loss_mask > 0
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    return _clipped_min(torch.exp(log_ratio), advantages, mask, cfg)


def sequence_mean(values: Tensor, loss_mask: Tensor, seq_index: Tensor) -> Tensor:
    """Per token, the mean of ``values`` over the masked tokens of its sequence (autograd flows to every token).

    Tokens of one sequence share ``seq_index`` (>= 0); padding has -1. Tokens off the mask get the value of their
    sequence too (or 0 on padding); sequences without masked tokens get 0.
    """
    mask = loss_mask > 0
    if bool((mask & (seq_index < 0)).any()):
        raise ValueError("seq_index must be >= 0 on every masked (completion) token; -1 marks padding only")
    if seq_index.numel() == 0:
        return values
    idx = seq_index.clamp(min=0)
    n_seq = int(idx.max()) + 1
    contrib = torch.where(mask, values, torch.zeros_like(values))
    sums = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, idx, contrib)
    counts = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(0, idx, mask.to(values.dtype))
    means = sums / counts.clamp(min=1)
    return torch.where(seq_index >= 0, means[idx], torch.zeros_like(values))


@register_policy_loss("gspo")
def gspo(logp, old_logp, advantages, loss_mask, seq_index, cfg):
    """pg_t = min(S A, clip(S, 1-eps_low, 1+eps_high) A), S = exp(mean over the sequence of logp - old_logp).

    ``cfg.gspo_gradient == "stop_gradient"``: S is replaced by verl's s_t = exp(sg[log S] + logp_t - sg[logp_t]),
    the same value with the gradient S * d logp_t of token t alone (module docstring). ``cfg.gspo_log_ratio_cap``
    clamps that log-ratio from above before exp (verl's 10)."""
    if seq_index is None:
        raise ValueError("policy loss 'gspo' needs seq_index to group tokens into sequences, got None")
    mask = loss_mask > 0
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    log_seq = sequence_mean(log_ratio, loss_mask, seq_index)
    if cfg.gspo_gradient == "stop_gradient":
        log_seq = log_seq.detach() + (log_ratio - log_ratio.detach())
    if cfg.gspo_log_ratio_cap is not None:
        log_seq = torch.clamp(log_seq, max=cfg.gspo_log_ratio_cap)
    return _clipped_min(torch.exp(log_seq), advantages, mask, cfg)


def importance_ratio(logp: Tensor, old_logp: Tensor, loss_mask: Tensor, seq_index: Tensor | None,
                     cfg: LossConfig) -> Tensor:
    """The ratio ``kl_bias_correction`` multiplies KL_t by, with full autograd (TRL's ``coef_1``): the sequence
    ratio S for gspo, the token ratio rho_t otherwise; 1 off the mask."""
    mask = loss_mask > 0
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    if cfg.policy_loss == "gspo":
        log_ratio = torch.where(mask, sequence_mean(log_ratio, loss_mask, seq_index), log_ratio)
    return torch.exp(log_ratio)


# --------------------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------------------
#: name -> its LossConfig (every field final, the advantage estimator too). grpo follows DeepSeekMath (eps 0.2,
#: beta 0.04 with the k3 estimator, per-sequence mean); dapo: clip-higher 0.28, no KL, token_mean (the DAPO paper's
#: loss; its dynamic sampling is algo.drop_zero_variance_groups, its overlong shaping is not reproduced); gspo: the
#: GSPO paper's clip range (3e-4, 4e-4) on the sequence ratio; dr_grpo: no std scaling, constant B*G*L_max
#: normaliser, no KL.
#: The peers' shipped defaults, by name, so a user can switch and compare:
#: verl_grpo: verl's actor defaults with its GRPO example (verl/trainer/config/actor/actor.yaml: clip_ratio 0.2,
#:   clip_ratio_c 3.0, loss_agg_mode token-mean; examples/grpo_trainer: use_kl_loss, kl_loss_coef 0.001,
#:   kl_loss_type low_var_kl, which verl clamps to [-10, 10]; advantage epsilon 1e-6); with policy_loss gspo,
#:   verl's compute_policy_loss_gspo: the stop-gradient token ratio with its log clamped at 10
#:   (gspo_log_ratio_cap) and no dual clip (PRESET_POLICY_RULES);
#: trl_grpo: TRL GRPOConfig defaults (epsilon 0.2, beta 0.0, loss_type "dapo" = token sum over the batch's
#:   tokens, scale_rewards "group" with std + 1e-4, use_bias_correction_kl True: acts once kl_coef > 0).
# The values every preset shares unless it names its own:
_PRESET_COMMON = dict(eps_low=0.2, eps_high=0.2, clip_ratio_c=None, kl_clamp=None, advantage_eps=1e-6,
                      rollout_correction="none", rollout_correction_cap=2.0, rollout_correction_cap_low=0.0,
                      gspo_gradient="autograd", gspo_log_ratio_cap=None, kl_bias_correction=False, temperature=1.0)


def _preset(name: str, policy_loss: str, kl_coef: float, aggregation: str, advantage_estimator: str,
            **values: Any) -> LossConfig:
    return LossConfig(**{**_PRESET_COMMON, "preset": name, "policy_loss": policy_loss, "kl_coef": kl_coef,
                         "kl_estimator": "k3", "aggregation": aggregation,
                         "advantage_estimator": advantage_estimator, **values})


LOSS_PRESETS: dict[str, LossConfig] = {cfg.preset: cfg for cfg in (
    _preset("grpo", "ppo_clip", 0.04, "seq_mean_token_mean", "grpo"),
    _preset("dapo", "ppo_clip", 0.0, "token_mean", "grpo", eps_high=0.28),
    _preset("gspo", "gspo", 0.0, "seq_mean_token_mean", "grpo", eps_low=3e-4, eps_high=4e-4),
    _preset("dr_grpo", "ppo_clip", 0.0, "seq_mean_token_sum_norm", "dr_grpo"),
    _preset("verl_grpo", "ppo_clip", 0.001, "token_mean", "grpo", clip_ratio_c=3.0, kl_clamp=10.0,
            gspo_gradient="stop_gradient", gspo_log_ratio_cap=10.0),
    _preset("trl_grpo", "ppo_clip", 0.0, "token_mean", "grpo", advantage_eps=1e-4, kl_bias_correction=True),
)}
assert all(cfg.is_resolved for cfg in LOSS_PRESETS.values())
assert set(LOSS_PRESETS) == set(get_args(get_type_hints(LossConfig)["preset"]))  # the section's choices

#: (preset, policy loss) -> fields the peer sets differently for that policy loss, applied by
#: ``LossConfig.resolved`` under the user's overrides. verl's compute_policy_loss_gspo ignores clip_ratio_c.
PRESET_POLICY_RULES: dict[tuple[str, str], dict[str, object]] = {("verl_grpo", "gspo"): {"clip_ratio_c": None}}


# --------------------------------------------------------------------------------------------------------------
# Rollout correction (rollout engine vs trainer numerics)
# --------------------------------------------------------------------------------------------------------------
def rollout_correction_weights(old_logp: Tensor, rollout_logp: Tensor, loss_mask: Tensor,
                               cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token factor u'_t of the policy-gradient term (module docstring), 0 off the mask, no gradient.

    u_t = exp(old_logp_t - rollout_logp_t) (the log-ratio is clamped to [-20, 20] before exp, as verl's
    SAFETY_BOUND); ``tis`` truncates u_t to [cap_low, cap], ``mis`` zeroes tokens outside [cap_low, cap], ``none``
    returns ones. Metrics (detached SUMS over masked tokens, they add up across micro-batches): tokens, ratio_sum
    (u before truncation), corrected_tokens (tokens whose factor differs from u: truncated or masked),
    k1_sum = sum(rollout_logp - old_logp) and k3_sum = sum(u - log u - 1), the KL(rollout || old) estimates verl
    logs as ``kl`` / ``k3_kl``.
    """
    _check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp, loss_mask=loss_mask)
    _require_resolved(cfg)
    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    mask = loss_mask > 0
    zero = torch.zeros(old_logp.shape, dtype=dtype, device=old_logp.device)
    log_u = torch.where(mask, old_logp.to(dtype) - rollout_logp.to(dtype), zero).detach()
    u = torch.exp(log_u.clamp(-20.0, 20.0))
    lo, hi = cfg.rollout_correction_cap_low, cfg.rollout_correction_cap
    if cfg.rollout_correction == "tis":
        weight = u.clamp(min=lo, max=hi)
    elif cfg.rollout_correction == "mis":
        weight = torch.where((u >= lo) & (u <= hi), u, zero)
    else:
        weight = torch.ones_like(u)
    weight = torch.where(mask, weight, zero)
    metrics = {
        "tokens": mask.sum().to(dtype),
        "ratio_sum": torch.where(mask, u, zero).sum(),
        "corrected_tokens": (mask & (weight != u)).sum().to(dtype),
        "k1_sum": -log_u.sum(),
        "k3_sum": torch.where(mask, u - log_u - 1.0, zero).sum(),
    }
    return weight, metrics


# --------------------------------------------------------------------------------------------------------------
# Numerator / denominator / token weights
# --------------------------------------------------------------------------------------------------------------
def _check_same_shape(**tensors: Tensor | None) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"token tensors must share one flat shape [T], got {shapes}")


def per_token_objective(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    seq_index: Tensor | None,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    rollout_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """s_t = u_t * pg_t - beta * KL_t on masked tokens, exactly 0 elsewhere (u_t = ``rollout_weight``, the
    rollout-correction factor, 1 when None; KL_t times the importance ratio under ``kl_bias_correction``). Off-mask
    inputs are replaced by 0 with
    torch.where before any arithmetic, so NaN/inf in padding reach neither the loss nor the gradient.

    Computed in at least float32 (bf16/fp16 inputs are upcast). Returns (s[T], metrics of detached sums:
    tokens, clipped_tokens, clip_high_tokens, clip_low_tokens, ratio_sum, pg_sum, kl_sum).
    """
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=loss_mask,
                      seq_index=seq_index, ref_logp=ref_logp, rollout_weight=rollout_weight)
    _require_resolved(cfg)
    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask = loss_mask > 0

    def clean(t: Tensor) -> Tensor:  # off-mask values (padding, prompt) replaced by 0 before any arithmetic
        t = t.to(dtype)
        return torch.where(mask, t, torch.zeros_like(t))

    logp, old_logp, advantages = clean(logp), clean(old_logp), clean(advantages)
    pg, metrics = POLICY_LOSSES.get(cfg.policy_loss)(logp, old_logp, advantages, loss_mask, seq_index, cfg)
    zero = torch.zeros_like(pg)
    if rollout_weight is not None:
        pg = pg * clean(rollout_weight).detach()
    s = torch.where(mask, pg, zero)
    metrics = dict(metrics)
    metrics["tokens"] = mask.sum().to(dtype)
    metrics["pg_sum"] = s.detach().sum()
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"kl_coef = {cfg.kl_coef} > 0 needs ref_logp, got None")
        if cfg.kl_clamp is not None and cfg.kl_estimator == "k3":
            kl = kl_k3_clamped(logp, clean(ref_logp), cfg.kl_clamp)
        else:
            kl = KL_ESTIMATORS.get(cfg.kl_estimator)(logp, clean(ref_logp))
        if cfg.kl_bias_correction:
            kl = kl * importance_ratio(logp, old_logp, loss_mask, seq_index, cfg)
        kl = torch.where(mask, kl, zero)
        metrics["kl_sum"] = kl.detach().sum()
        s = s - cfg.kl_coef * kl
    return s, metrics


def loss_numerator(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    token_weight: Tensor,
    loss_mask: Tensor,
    seq_index: Tensor | None,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    rollout_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """numerator = -sum_t token_weight_t * s_t over masked tokens (to MINIMIZE), plus metrics (sums).

    Flat token layout [T]: a padded [N, L] batch flattened (seq_index = row) or a packed THD micro-batch. The
    step's loss is the sum of numerators over micro-batches and DP ranks divided ONCE by ``loss_denominator``.
    """
    _check_same_shape(logp=logp, token_weight=token_weight)
    s, metrics = per_token_objective(logp, old_logp, advantages, loss_mask, seq_index, cfg, ref_logp, rollout_weight)
    numerator = -(token_weight.to(s.dtype) * s).sum()
    return numerator, metrics


def sequence_token_weights(aggregation: str, seq_weight: Tensor, completion_lengths: Tensor) -> Tensor:
    """Per-token factor of each sequence [N]: w (token_mean, seq_mean_token_sum_norm, seq_mean_token_sum) or w/|o|
    (seq_mean_token_mean). Zero-length completions get 0 (they have no tokens)."""
    check_choice("aggregation", aggregation, AGGREGATIONS)
    if seq_weight.shape != completion_lengths.shape:
        raise ValueError(
            f"seq_weight {tuple(seq_weight.shape)} and completion_lengths {tuple(completion_lengths.shape)} differ"
        )
    if bool((completion_lengths < 0).any()):
        raise ValueError(f"completion lengths must be >= 0, got {completion_lengths.min().item()}")
    w = seq_weight if seq_weight.is_floating_point() else seq_weight.to(torch.float32)
    if aggregation != "seq_mean_token_mean":
        return w.clone()
    lengths = completion_lengths.to(w.dtype)
    return torch.where(lengths > 0, w / lengths.clamp(min=1), torch.zeros_like(w))


def loss_denominator(
    aggregation: str,
    num_prompts: int,
    group_size: int,
    completion_lengths: Tensor | None = None,
    prompt_keep_prob: Tensor | None = None,
    max_completion_len: int | None = None,
) -> float:
    """D of the step, a constant of the FULL (un-pruned) batch (docs/algorithms.md, "Denominators").

    seq_mean_token_mean:     D = B*G, B = num_prompts DRAWN (before prompt pruning).
    seq_mean_token_sum:      D = B*G (as seq_mean_token_mean; the tokens of a sequence are summed, not averaged).
    seq_mean_token_sum_norm: D = B*G*L_max (exactly unbiased under any pruning).
    token_mean:              D = T_full = sum of ``completion_lengths`` [B, G] when every prompt was rolled out
                             (``prompt_keep_prob`` None; completion pruning does not change T_full). With prompt
                             pruning the pruned prompts' lengths are unknown, so ``completion_lengths`` holds one
                             row per KEPT prompt, ``prompt_keep_prob`` their pi_q, and D is the Horvitz-Thompson
                             estimate T_hat = sum_{kept q} (1/pi_q) sum_i |o_qi| (float64). E[T_hat] = T_full, but
                             T_hat depends on the draw, so the ratio numerator/T_hat is consistent, not exactly
                             unbiased; use seq_mean_token_sum_norm where exactness matters. pi_q = 1 for every row
                             gives T_full bit for bit.
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    for name, value in (("num_prompts", num_prompts), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return float(num_prompts * group_size)
    if aggregation == "seq_mean_token_sum_norm":
        if isinstance(max_completion_len, bool) or not isinstance(max_completion_len, int) or max_completion_len < 1:
            raise ValueError(f"seq_mean_token_sum_norm needs max_completion_len >= 1, got {max_completion_len!r}")
        return float(num_prompts * group_size * max_completion_len)
    if completion_lengths is None:
        raise ValueError("token_mean needs completion_lengths [B, G], got None")
    lengths = torch.as_tensor(completion_lengths).double()
    if lengths.dim() != 2 or lengths.shape[1] != group_size:
        raise ValueError(f"completion_lengths must have shape [rows, G={group_size}], got {tuple(lengths.shape)}")
    if not bool(torch.isfinite(lengths).all()) or bool((lengths < 0).any()):
        raise ValueError("completion_lengths must be finite and >= 0")
    rows = lengths.shape[0]
    if prompt_keep_prob is None:
        if rows != num_prompts:
            raise ValueError(
                f"completion_lengths has {rows} rows but num_prompts = {num_prompts}; with prompt pruning pass "
                f"prompt_keep_prob for the kept rows (Horvitz-Thompson estimate)"
            )
        total = float(lengths.sum())
    else:
        pi = torch.as_tensor(prompt_keep_prob).double().flatten()
        if pi.shape[0] != rows or rows > num_prompts:
            raise ValueError(
                f"prompt_keep_prob has {pi.shape[0]} entries for {rows} rows of completion_lengths "
                f"(at most num_prompts = {num_prompts})"
            )
        if not bool(((pi > 0) & (pi <= 1)).all()):
            raise ValueError(f"prompt_keep_prob must be in (0, 1], got {pi[~((pi > 0) & (pi <= 1))][0].item()}")
        total = float((lengths.sum(dim=1) / pi).sum())
    if total <= 0:
        raise ValueError(f"token_mean denominator is {total}: the batch has no completion tokens")
    return total


# --------------------------------------------------------------------------------------------------------------
# Reference implementation (padded, straight from the formulas; for tests and engine equality checks)
# --------------------------------------------------------------------------------------------------------------
def reference_objective(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    weight: Tensor | None = None,
    denominator: float | None = None,
    rollout_weight: Tensor | None = None,
) -> Tensor:
    """J (to MAXIMIZE; the loss is -J) on padded tensors, written directly from docs/algorithms.md, "Objective".

    logp, old_logp, ref_logp, mask: [B, G, L] (mask 1 on completion tokens); advantages, weight: [B, G].
    Per sequence, with |o| = sum_t mask and beta = kl_coef:
        ppo_clip: P = sum_t min(rho_t A, clip(rho_t) A);   gspo: P = |o| * min(S A, clip(S) A), S = exp(mean_t log rho)
        K = sum_t KL_t
        seq_mean_token_mean:     J = 1/D sum_{q,i} w (P - beta K) / |o|     D = B*G
        token_mean:              J = 1/D sum_{q,i} w (P - beta K)           D = sum |o|
        seq_mean_token_sum_norm: J = 1/D sum_{q,i} w (P - beta K)           D = B*G*L
        seq_mean_token_sum:      J = 1/D sum_{q,i} w (P - beta K)           D = B*G
    Dual clip (A < 0): each term max(term, c A); ``kl_clamp``: k3 with x in [-20, 20], KL_t in [-c, c];
    ``rollout_weight`` [B, G, L]: u_t multiplies each ppo_clip token term (the whole gspo term per token);
    gspo ``stop_gradient``: the token terms min(s_t A, clip(s_t) A), s_t = exp(sg[log S] + log rho_t - sg[log rho_t]);
    ``gspo_log_ratio_cap`` m: the ratio's log (log S or log s_t) clamped at m;
    ``kl_bias_correction``: KL_t times rho_t (ppo_clip) or S (gspo).
    ``denominator`` overrides D (e.g. the Horvitz-Thompson T_hat). Only the built-in losses/estimators.
    """
    if cfg.policy_loss not in ("ppo_clip", "gspo") or cfg.kl_estimator not in ("k1", "k2", "k3"):
        raise ValueError(
            f"reference_objective knows ppo_clip/gspo and k1/k2/k3, got {cfg.policy_loss!r}/{cfg.kl_estimator!r}"
        )
    b, g, max_len = logp.shape
    m = mask.to(logp.dtype)
    length = m.sum(-1)  # [B, G]
    a = advantages.to(logp.dtype)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    log_rho = (logp - old_logp) * m
    if cfg.policy_loss == "ppo_clip":
        ratio = kl_ratio = torch.exp(log_rho)
    else:
        log_seq = log_rho.sum(-1) / length.clamp(min=1)
        kl_ratio = torch.exp(log_seq)[..., None].expand_as(logp)
        ratio = kl_ratio
        log_ratio = log_seq[..., None].expand_as(logp)
        if cfg.gspo_gradient == "stop_gradient":
            log_ratio = log_seq.detach()[..., None] + log_rho - log_rho.detach()
        if cfg.gspo_log_ratio_cap is not None:
            log_ratio = torch.clamp(log_ratio, max=cfg.gspo_log_ratio_cap)
        if cfg.gspo_gradient == "stop_gradient" or cfg.gspo_log_ratio_cap is not None:
            ratio = torch.exp(log_ratio)
    a_t = a[..., None]
    pg = torch.minimum(ratio * a_t, torch.clamp(ratio, lo, hi) * a_t)
    if cfg.clip_ratio_c is not None:
        pg = torch.where(a_t < 0, torch.maximum(pg, cfg.clip_ratio_c * a_t), pg)
    if rollout_weight is not None:
        pg = pg * rollout_weight.to(pg.dtype)
    p_seq = (pg * m).sum(-1)
    k_seq = torch.zeros_like(p_seq)
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"kl_coef = {cfg.kl_coef} > 0 needs ref_logp, got None")
        x = (ref_logp - logp) * m
        kl = {"k1": -x, "k2": 0.5 * x * x, "k3": torch.exp(x) - x - 1.0}[cfg.kl_estimator]
        if cfg.kl_clamp is not None and cfg.kl_estimator == "k3":
            xc = x.clamp(-20.0, 20.0)
            kl = (torch.exp(xc) - xc - 1.0).clamp(-cfg.kl_clamp, cfg.kl_clamp)
        if cfg.kl_bias_correction:
            kl = kl * kl_ratio
        k_seq = (kl * m).sum(-1)
    per_seq = p_seq - cfg.kl_coef * k_seq
    if cfg.aggregation == "seq_mean_token_mean":
        per_seq = torch.where(length > 0, per_seq / length.clamp(min=1), torch.zeros_like(per_seq))
        default_d = float(b * g)
    elif cfg.aggregation == "token_mean":
        default_d = float(length.sum())
    elif cfg.aggregation == "seq_mean_token_sum":
        default_d = float(b * g)
    else:
        default_d = float(b * g * max_len)
    w = torch.ones_like(per_seq) if weight is None else weight.to(per_seq.dtype)
    d = default_d if denominator is None else float(denominator)
    return (w * per_seq).sum() / d
