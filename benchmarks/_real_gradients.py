"""Per-sequence gradients of a REAL policy for ``benchmarks/gradient_fidelity.py --real``.

1. Checkpoints of the CPU quickstart (``examples/quickstart.yaml``: 1.6M-param Qwen2, single-digit arithmetic,
   100 supervised warm-start steps, then RL) trained once with GRPO (``algo.pruner=none``) by the CLI, in two
   segments into ``<work>/train``: ``train.steps=0`` (the warm start; its final checkpoint is RL step 0), then
   ``train.steps=max(steps)`` resumed from it with ``checkpoint.every=gcd(steps)`` and ``checkpoint.keep_last``
   large enough to keep them all. Evaluation is off (``eval.every=0``: it never touches the training stream).
   Existing checkpoints are reused.
2. One in-process ``Run`` (``run.setup``, the CLI's set-up; output ``<work>/analysis``, the training run's
   tokenizer), and per checkpoint ``lifecycle.restore`` + ``push_weights`` (the CLI's resume). Then the step the
   run would take next: B prompts from the restored sampler, G completions from the rollout engine at the
   configured temperature with the step's seeds (the very rollout the training run generated at that step),
   rewards, full-group advantages with the run's estimator, and the prompts' scores in the restored
   ``run.rollout_side.pruner.state`` (their last visit, under an older policy; NaN = never seen).
3. The gradient of each sequence's loss term alone (weight 1, the full batch's denominator D, on-policy: old
   log-probs = current, ratio 1; kl_coef 0 as the quickstart) through the Megatron engine (a batch holding that
   one sequence, ``audit.step_gradient``), and one gradient of the whole batch for the linearity check. Only the
   Gram matrix M = U U^T (float64 [N, N]) leaves this module; U (float32, the units with A != 0 only: a unit
   with A = 0 has an exactly zero term, checked) lives while M is formed.
4. ``fit_alpha`` / ``prompt_proxy``: how well |A| L^alpha ranks |g_i|, and the history h_q ranks |g_q|.
5. The pruning methods as weight vectors w [K, N] (K draws; ``w_*``), their error through M (``mc_stats``) and
   the rate that gives a target kept fraction (``solve_rate``: bisection with common random numbers).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import QUIET, REPO, RunFailed, cli, train

QUICKSTART = REPO / "examples" / "quickstart.yaml"


# ----------------------------------------------------------------------------------------------------------
# 1. Checkpoints
# ----------------------------------------------------------------------------------------------------------
def train_overrides(out_dir: Path, steps: int, every: int) -> list[str]:
    return ["algo.pruner=none", f"train.output_dir={out_dir}", f"train.steps={steps}", "eval.every=0",
            f"checkpoint.every={every}", "checkpoint.keep_last=1000", *QUIET, "logging.print_every=10",
            "logging.audit_log=true", "train.cpu_threads=1"]


def checkpoint_index(root: Path, sft_steps: int) -> dict[int, Path]:
    """RL step -> complete checkpoint (after the whole warm start) under ``root``."""
    out = {}
    for path in sorted(root.glob("step_*")):
        if (path / "manifest.json").is_file():
            extra = torch.load(path / "common.pt", weights_only=False, map_location="cpu").get("extra", {})
            if extra.get("sft_step") == sft_steps:
                out[int(extra["rl_step"])] = path
    return out


def ensure_checkpoints(work: Path, steps: list[int], config: Path = QUICKSTART) -> tuple[dict[int, Path], dict]:
    """The checkpoints at RL ``steps`` (trained now if missing) and what it took."""
    from megatron_dppo.config import load_config

    train_dir = work / "train"
    sft_steps = load_config(config).train.sft_steps
    root = train_dir / "checkpoints"
    index = checkpoint_index(root, sft_steps)
    every = math.gcd(*[s for s in steps if s > 0]) if any(steps) else 1
    info = {"train_dir": str(train_dir), "every": every, "segments": []}
    if any(s not in index for s in steps):
        if any(s > 0 and s % every for s in steps):
            raise ValueError(f"steps {steps}: each must be a multiple of {every}")
        segments = ([0] if 0 not in index and not index else []) + [max(steps)]
        for n in segments:
            overrides = train_overrides(train_dir, n, every)
            print("training:", " ".join(cli("train", "--config", str(config), *overrides)), file=sys.stderr, flush=True)
            try:
                seconds = train(config, overrides, work / f"train_steps{n}.log",
                                env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})["wall_s"]
            except RunFailed as err:
                sys.exit(f"training failed: {err}")
            info["segments"].append({"command": " ".join(cli("train", "--config", str(config), *overrides)),
                                     "seconds": seconds})
        index = checkpoint_index(root, sft_steps)
    missing = [s for s in steps if s not in index]
    if missing:
        sys.exit(f"no checkpoint at RL steps {missing} under {root} (a run trained with other checkpoint steps? "
                 f"delete {train_dir} to train again)")
    return {s: index[s] for s in steps}, info


# ----------------------------------------------------------------------------------------------------------
# 2. The run and one step's rollout
# ----------------------------------------------------------------------------------------------------------
def open_run(work: Path, config: Path = QUICKSTART):
    """The trainer's ``Run`` (``run.setup``) for analysis: the training run's config and tokenizer, its own
    output folder, nothing logged, no checkpoint resumed (each is restored by ``collect``)."""
    from megatron_dppo.config import load_config
    from megatron_dppo.run.setup import setup

    overrides = train_overrides(work / "analysis", 0, 0) + [
        f"model.tokenizer={work / 'train' / 'tokenizer'}", "logging.jsonl=false", "logging.audit_log=false"]
    return setup(load_config(config, overrides), resume=False)


@dataclasses.dataclass
class StepData:
    rl_step: int
    prompt_ids: list
    history: torch.Tensor  # [B] float64, NaN = never seen
    rewards: torch.Tensor  # [B, G]
    advantages: torch.Tensor  # [B, G]
    lengths: torch.Tensor  # [B, G] completion tokens
    logprob: torch.Tensor  # [B, G] sequence log-prob under the sampled distribution (rollout engine; the policy at T=1)
    gram: torch.Tensor | None = None  # [N, N] float64 (grpo preset)
    norms: torch.Tensor | None = None  # [N] |g_i|
    linearity: float = math.nan  # |sum_i g_i - g_full| / |g_full|
    full_norm: float = math.nan
    zero_adv_max_norm: float = math.nan  # largest |g_i| over units with A = 0 (0 when exact)
    seconds: dict = dataclasses.field(default_factory=dict)
    dapo: dict | None = None  # {"norms", "linearity", "full_norm"} of the dapo preset (token_mean)
    params: int = 0
    coords: torch.Tensor | None = None  # [N, S] float32: every g_i on a fixed random subset of S coordinates
    coord_index: torch.Tensor | None = None  # [S] which coordinates (for per-coordinate statistics: Adam)


def rollout_step(run, B: int, G: int) -> tuple[StepData, object]:
    """The next step's batch: prompts, rollout, rewards, advantages, history; and the full TrainBatch."""
    from megatron_dppo.algo.advantages import compute_advantages
    from megatron_dppo.algo.pruning import PruneResult
    from megatron_dppo.train.rollouts import generate, score
    from megatron_dppo.train.stages import build_train_batch

    step, side, trainer = run.rl_step, run.rollout_side, run.train_side
    prompts = [side.train_prompts[i] for i in side.sampler.take(B)]
    history = side.pruner.state.scores([p.id for p in prompts])
    rollout = generate(side, prompts, G, step, temperature=run.cfg.rollout.temperature)
    rollout.rewards = score(side, rollout, step)
    adv = compute_advantages(rollout.rewards, trainer.estimator, trainer.loss_cfg.advantage_eps)
    ones = torch.ones(B, dtype=torch.float64)
    prompt_cut = PruneResult(keep=torch.ones(B, dtype=torch.bool), weight=ones.float(), keep_prob=ones)
    ones2 = torch.ones(B, G, dtype=torch.float64)
    total_cut = PruneResult(keep=torch.ones(B, G, dtype=torch.bool), weight=ones2.float(), keep_prob=ones2)
    batch = build_train_batch(trainer, prompts, prompt_cut, rollout, adv, total_cut)
    lengths = torch.tensor([[len(c) for c in comps] for comps in rollout.completions], dtype=torch.float64)
    logprob = torch.tensor([[float(sum(lp)) for lp in row] for row in rollout.behaviour_logprobs], dtype=torch.float64)
    data = StepData(rl_step=step, prompt_ids=[p.id for p in prompts], history=history,
                    rewards=rollout.rewards.double(), advantages=adv.double(), lengths=lengths, logprob=logprob)
    return data, (prompts, prompt_cut, rollout, adv, total_cut, batch)


def _one(batch, k: int):
    """The TrainBatch holding sequence k of ``batch`` alone, with the full batch's denominator."""
    from megatron_dppo.train.stages import TrainBatch

    t = torch.tensor([k])
    return TrainBatch(token_ids=[batch.token_ids[k]], prompt_lengths=[batch.prompt_lengths[k]],
                      advantages=batch.advantages[t], token_weights=batch.token_weights[t],
                      seq_weights=batch.seq_weights[t], rewards=batch.rewards[t], origin=[batch.origin[k]],
                      denominator=batch.denominator)


def per_sequence(run, batch, keep_units: bool, coord_count: int = 0) -> dict:
    """Per-sequence gradients of ``batch`` (row-major (q, i) order) at the current weights: norms, the
    linearity check, (``keep_units``) the Gram matrix and (``coord_count``) every g_i on that many random
    coordinates (seeded, sorted)."""
    from megatron_dppo.train.audit import step_gradient
    from megatron_dppo.train.stages import pack

    D = float(batch.denominator)
    t0 = time.perf_counter()
    trainer = run.train_side
    g_full = step_gradient(trainer.engine, pack(trainer, batch)[0], D).double()
    t_full = time.perf_counter() - t0
    N, P = len(batch), g_full.numel()
    nonzero = [k for k in range(N) if float(batch.advantages[k]) != 0.0]
    slot = {k: j for j, k in enumerate(nonzero)}
    U = torch.empty(len(nonzero), P, dtype=torch.float32) if keep_units else None
    norms = torch.zeros(N, dtype=torch.float64)
    total = torch.zeros(P, dtype=torch.float64)
    zero_max = 0.0
    coord_index = torch.randperm(P, generator=torch.Generator().manual_seed(0))[:coord_count].sort().values
    Uc = torch.zeros(N, len(coord_index), dtype=torch.float32)
    t0 = time.perf_counter()
    for k in range(N):
        g = step_gradient(trainer.engine, pack(trainer, _one(batch, k))[0], D)
        norms[k] = float(g.double().norm())
        total += g.double()
        Uc[k] = g[coord_index]
        if k in slot:
            if U is not None:
                U[slot[k]] = g
        else:
            zero_max = max(zero_max, float(norms[k]))
        if (k + 1) % 128 == 0:
            print(f"  per-sequence gradients {k + 1}/{N} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
    t_seq = time.perf_counter() - t0
    out = {"norms": norms, "linearity": float((total - g_full).norm() / g_full.norm()),
           "full_norm": float(g_full.norm()), "zero_adv_max_norm": zero_max, "params": P,
           "seconds": {"full_gradient": t_full, "per_sequence": t_seq, "per_sequence_each": t_seq / N}}
    if coord_count:
        out["coords"], out["coord_index"] = Uc, coord_index
    if U is not None:
        t0 = time.perf_counter()
        Mnz = torch.zeros(len(nonzero), len(nonzero), dtype=torch.float64)
        for c in range(0, P, 1 << 16):
            X = U[:, c:c + (1 << 16)].double()
            Mnz += X @ X.T
        del U
        idx = torch.tensor(nonzero, dtype=torch.long)
        M = torch.zeros(N, N, dtype=torch.float64)
        M[idx.unsqueeze(1), idx.unsqueeze(0)] = Mnz
        out["gram"] = M
        out["seconds"]["gram"] = time.perf_counter() - t0
    return out


def collect(run, path: Path, B: int, G: int, dapo: bool = False, coord_count: int = 0) -> StepData:
    """Restore ``path``, roll out its next step, and the per-sequence gradients (grpo preset; dapo's norms too)."""
    from megatron_dppo.algo.losses import LOSS_PRESETS, sequence_token_weights
    from megatron_dppo.run.lifecycle import restore
    from megatron_dppo.run.setup import push_weights
    from megatron_dppo.train.stages import build_train_batch

    t0 = time.perf_counter()
    restore(run, path)
    push_weights(run)
    data, (prompts, prompt_cut, rollout, adv, total_cut, batch) = rollout_step(run, B, G)
    rollout_s = time.perf_counter() - t0
    res = per_sequence(run, batch, keep_units=True, coord_count=coord_count)
    data.gram, data.norms, data.linearity = res["gram"], res["norms"], res["linearity"]
    data.coords, data.coord_index = res.get("coords"), res.get("coord_index")
    data.full_norm, data.zero_adv_max_norm, data.params = res["full_norm"], res["zero_adv_max_norm"], res["params"]
    data.seconds = {"restore_and_rollout": rollout_s, **res["seconds"]}
    if dapo:
        trainer = run.train_side
        saved = trainer.loss_cfg, trainer.engine.loss_cfg
        preset = dataclasses.replace(LOSS_PRESETS["dapo"], kl_coef=trainer.loss_cfg.kl_coef)
        trainer.loss_cfg = trainer.engine.loss_cfg = preset
        try:
            b = build_train_batch(trainer, prompts, prompt_cut, rollout, adv, total_cut)
            assert torch.equal(b.token_weights, sequence_token_weights(
                "token_mean", b.seq_weights, torch.tensor([len(t) - p for t, p in zip(b.token_ids, b.prompt_lengths)],
                                                          dtype=torch.float32)))
            r = per_sequence(run, b, keep_units=False)
        finally:
            trainer.loss_cfg, trainer.engine.loss_cfg = saved
        data.dapo = {k: r[k] for k in ("norms", "linearity", "full_norm", "zero_adv_max_norm", "seconds")}
    return data


# ----------------------------------------------------------------------------------------------------------
# 4. Does |A| L^alpha rank the gradient norms?
# ----------------------------------------------------------------------------------------------------------
def ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties: |A| takes few values with 0/1 rewards)."""
    values, inverse = torch.unique(x, return_inverse=True)
    counts = torch.bincount(inverse, minlength=len(values)).double()
    return (torch.cumsum(counts, 0) - (counts - 1) / 2)[inverse]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([ranks(a), ranks(b)]))[0, 1])


def prompt_proxy(gram: torch.Tensor, history: torch.Tensor, G: int) -> dict:
    """How well the prompt-level score h_q (last visit's mean |A|) ranks this step's |g_q| = |sum_i g_qi|."""
    B = history.numel()
    gq = gram.view(B, G, B, G).diagonal(dim1=0, dim2=2).sum((0, 1)).clamp(min=0).sqrt()
    seen = ~torch.isnan(history)
    out = {"seen": int(seen.sum())}
    if int(seen.sum()) > 2:
        h, g = history[seen], gq[seen]
        out.update(spearman_h_gq=spearman(g, h), h_zero=int((h == 0).sum()),
                   h_zero_now_informative=int(((h == 0) & (g > 0)).sum()), gq_zero=int((g == 0).sum()),
                   share_of_sum_gq2_with_h_zero=float((g[h == 0] ** 2).sum() / (g ** 2).sum()))
    return out


def fit_alpha(norms: torch.Tensor, A: torch.Tensor, L: torch.Tensor, logprob: torch.Tensor | None = None) -> dict:
    """OLS of log|g_i| on [1, log|A_i|, log L_i] over units with A != 0 (+ variants: |A| only, + log pi(o),
    + per-prompt intercepts), and Spearman rank correlations of |g| with the proxy |A| L^alpha."""
    G = A.shape[1]
    A, L = A.flatten().double(), L.flatten().double()
    m = (A != 0) & (norms > 0)
    y = norms[m].log()
    cols = {"one": torch.ones_like(y), "log|A|": A[m].abs().log(), "log L": L[m].log()}

    def ols(names, extra=None):
        X = torch.stack([cols[n] for n in names], 1)
        if extra is not None:
            X = torch.cat([X, extra], 1)
        beta = torch.linalg.lstsq(X, y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
        res = y - X @ beta
        r2 = 1 - float(res.pow(2).sum() / (y - y.mean()).pow(2).sum())
        s2 = float(res.pow(2).sum()) / max(1, len(y) - X.shape[1])
        cov = s2 * torch.linalg.pinv(X.T @ X)
        return beta, cov.diagonal().sqrt(), r2

    beta, se, r2 = ols(["one", "log|A|", "log L"])
    out = {"units": int(m.sum()), "alpha": float(beta[2]), "alpha_se": float(se[2]), "coef_log_abs_A": float(beta[1]),
           "coef_log_abs_A_se": float(se[1]), "r2": r2, "r2_abs_A_only": ols(["one", "log|A|"])[2],
           "log_L_std": float(cols["log L"].std())}
    prompt = torch.unique((torch.arange(A.numel()) // G)[m], return_inverse=True)[1]
    dummies = torch.nn.functional.one_hot(prompt).double()[:, 1:]  # per-prompt intercepts (the first: "one")
    out["r2_with_prompt_intercepts"] = ols(["one", "log|A|", "log L"], dummies)[2]
    if logprob is not None and bool(torch.isfinite(logprob.flatten()[m]).all()):
        cols["log pi(o)"] = logprob.flatten().double()[m]
        b, s, r = ols(["one", "log|A|", "log L", "log pi(o)"])
        out.update(coef_log_pi=float(b[3]), coef_log_pi_se=float(s[3]), r2_with_log_pi=r)

    out["spearman_abs_A"] = spearman(norms[m], A[m].abs())
    out["spearman_proxy_fit"] = spearman(norms[m], A[m].abs() * L[m] ** out["alpha"])
    return out


# ----------------------------------------------------------------------------------------------------------
# 5. Pruning methods as weight vectors w [K, N] over one checkpoint's units, and their error
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Ctx:
    """One checkpoint's fixed rollout and Gram matrix; K draws per evaluation."""

    M: torch.Tensor  # [N, N] float64
    A: torch.Tensor  # [B, G]
    L: torch.Tensor  # [B, G]
    h: torch.Tensor  # [B] NaN = never seen
    rewards: torch.Tensor  # [B, G]
    norms: torch.Tensor  # [N]
    K: int
    seed: int
    step: int
    ids: list | None = None  # the batch's prompt ids (the prompt-level study reads the run's record by them)

    @property
    def B(self) -> int:
        return self.A.shape[0]

    @property
    def G(self) -> int:
        return self.A.shape[1]

    @property
    def N(self) -> int:
        return self.B * self.G

    def gen(self, name: str):
        from megatron_dppo.algo.pruning import make_generator
        return make_generator(self.seed, self.step, name)  # the same stream at every rate: common random numbers


def w_subsample(ctx: Ctx, r: float) -> torch.Tensor:
    """grpo-subsample: each prompt (all G completions) kept with 1 - r, weight 1/(1 - r)."""
    keep = torch.rand(ctx.K, ctx.B, generator=ctx.gen("subsample"), dtype=torch.float64) < 1.0 - r
    return (keep.double() / (1.0 - r)).repeat_interleave(ctx.G, dim=1)


def w_dppo(ctx: Ctx, r: float, keep: str = "uniform", mode: str = "bernoulli", completion_only: bool = False,
           alpha: float = 0.0, floor: float = 0.1, zvf: bool = False, floor_q: float | None = None) -> torch.Tensor:
    """DPPO with r_q = r_o = r (r_q = 0: completion_only); zvf also drops the zero-variance groups; floor_q: the
    prompt level's keep_floor when it differs from the completion level's (two pruners, one per level)."""
    from megatron_dppo.algo.pruning import DPPOPruner, combine, zero_variance_filter

    K, B, G = ctx.K, ctx.B, ctx.G
    pruner = DPPOPruner(0.0 if completion_only else r, r, mode, keep=keep, length_exponent=alpha, keep_floor=floor)
    prompt_pruner = pruner if floor_q is None else DPPOPruner(r, r, mode, keep=keep, keep_floor=floor_q)
    p = prompt_pruner.select_prompts(ctx.h.expand(K, B).clone(), ctx.gen("prompts"))
    c = pruner.select_completions(ctx.A.expand(K, B, G).clone(), ctx.gen("completions"),
                                  lengths=ctx.L.expand(K, B, G), prompt_prob=p.keep_prob, generated=p.keep)
    t = combine(p, c)
    kept = t.keep & zero_variance_filter(ctx.rewards.float()).keep if zvf else t.keep
    return torch.where(kept, 1.0 / t.keep_prob, torch.zeros_like(t.keep_prob)).reshape(K, -1)


def w_cppo(ctx: Ctx, r: float) -> torch.Tensor:
    """CPPO group scope: the top floor(G(1-P)) |A| per group (random ties), weight 1, kept-count denominator."""
    from megatron_dppo.algo.pruning import CPPOPruner

    res = CPPOPruner(r, "group").select_completions(ctx.A.expand(ctx.K, ctx.B, ctx.G).clone(), ctx.gen("cppo"))
    keep = res.keep.reshape(ctx.K, -1).double()
    return keep * (ctx.N / keep.sum(1, keepdim=True))


def w_oracle(ctx: Ctx, r: float) -> torch.Tensor:
    """Not implementable (needs every |g_i|): completion-level water-filling on the TRUE norms, floor 0."""
    from megatron_dppo.algo.optimal_keep import water_fill

    pi = torch.ones(1, ctx.N, dtype=torch.float64) if r == 0 else water_fill(ctx.norms.unsqueeze(0),
                                                                                (1.0 - r) * ctx.N, floor=0.0)
    keep = torch.rand(ctx.K, ctx.N, generator=ctx.gen("oracle"), dtype=torch.float64) < pi
    return torch.where(keep, 1.0 / pi, torch.zeros_like(pi))


def w_proxy(ctx: Ctx, r: float, gamma: float = 2.0, floor: float = 0.1) -> torch.Tensor:
    """Exploratory, not in the library: completion-level water-filling (r_q = 0) on the proxy |A|^gamma."""
    from megatron_dppo.algo.optimal_keep import water_fill

    s = ctx.A.abs().flatten().double().unsqueeze(0) ** gamma
    pi = torch.ones_like(s) if r == 0 else water_fill(s, (1.0 - r) * ctx.N, floor=torch.where(s > 0, floor, 0.0))
    keep = torch.rand(ctx.K, ctx.N, generator=ctx.gen("proxy"), dtype=torch.float64) < pi
    return torch.where(keep, 1.0 / pi, torch.zeros_like(pi))


def w_zvf(ctx: Ctx, _r: float = 0.0) -> torch.Tensor:
    """dapo-filter: every zero-variance group dropped, weight 1, the full batch's D (deterministic)."""
    from megatron_dppo.algo.pruning import zero_variance_filter
    return zero_variance_filter(ctx.rewards.float()).keep.reshape(1, -1).double()


def mc_stats(ctx: Ctx, W: torch.Tensor) -> dict:
    """Relative MSE (+ MC s.e.), squared bias, mean single-draw cosine and kept fraction of draws W [K, N]."""
    M, g2 = ctx.M, float(ctx.M.sum())
    E = W - 1.0
    q = ((E @ M) * E).sum(1) / g2
    ebar = E.mean(0)
    wMw = ((W @ M) * W).sum(1)
    cos = (W @ M.sum(1)) / torch.sqrt(wMw * g2)
    cos = cos[torch.isfinite(cos)]
    K = W.shape[0]
    return {"rel_mse": float(q.mean()), "se": float(q.std()) / math.sqrt(K) if K > 1 else 0.0,
            "bias2": float(ebar @ M @ ebar) / g2, "cosine": float(cos.mean()) if cos.numel() else float("nan"),
            "kept": float((W > 0).double().mean()), "draws": K}


def solve_rate(ctx: Ctx, fn, f: float, r_hi: float, iters: int, tol: float = 0.01):
    """Rate whose MC mean kept fraction (common random numbers) is f; kept(r) falls with r. Returns (rate, W,
    info); when f is not reached (a step or a gap in kept(r), or out of range) the nearest rate keeping <= f."""
    cache: dict[float, tuple[float, torch.Tensor]] = {}

    def kept(r: float) -> float:
        if r not in cache:
            W = fn(ctx, r)
            cache[r] = (float((W > 0).double().mean()), W)
        return cache[r][0]

    lo, hi = 0.0, r_hi
    if kept(hi) > f + tol:
        return None, None, {"reached": False, "range": [kept(hi), kept(lo)]}
    if kept(lo) < f:
        return 0.0, cache[0.0][1], {"reached": abs(kept(lo) - f) <= tol, "range": [kept(hi), kept(lo)]}
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if kept(mid) >= f else (lo, mid)
    best = min((lo, hi), key=lambda x: abs(kept(x) - f))
    if abs(kept(best) - f) > tol:
        best = hi  # a gap in kept(r): the side that keeps <= f
    return best, cache[best][1], {"reached": abs(kept(best) - f) <= tol, "bracket": [kept(hi), kept(lo)]}


def uniform_exact(ctx: Ctx, r: float) -> float:
    """docs/algorithms.md variance of dppo-uniform bernoulli (rates independent of the draw) / |g|^2."""
    from megatron_dppo.algo.pruning import DPPOPruner, make_generator

    p = DPPOPruner(r, r).select_prompts(ctx.h, make_generator(0, 0, "p")).keep_prob
    c = DPPOPruner(r, r).select_completions(ctx.A, make_generator(0, 0, "c")).keep_prob
    Mq = ctx.M.view(ctx.B, ctx.G, ctx.B, ctx.G).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [B, G, G]
    var = ((1 / p - 1) * Mq.sum((1, 2))).sum() + ((1 / p) * ((1 / c - 1) * Mq.diagonal(dim1=1, dim2=2)).sum(1)).sum()
    return float(var) / float(ctx.M.sum())
