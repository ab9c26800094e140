"""Gradient fidelity of pruning on the Megatron engine: mean pruned gradient over K draws vs the full batch.

A real decoder (tiny Qwen2, random init, ``--model``) and real rollouts (``benchmarks/_common.py``: GSM8K token
ids and lengths scaled by ``--scale``, seeded rewards, B prompts x G completions). Old and reference log-probs
are the current log-probs plus a smooth per-(sequence, position) offset (0.3 and 0.2 nats), so PPO/GSPO
clipping is active and the KL term (k3, beta = ``--kl``) is non-zero: the hardest case for unbiasedness.

For each loss preset (``LOSS_PRESETS``: grpo = seq_mean_token_mean, dapo = token_mean, dr_grpo =
seq_mean_token_sum_norm, gspo = sequence ratio) and each pruner:

* ``full``: every sequence, weight 1, D of the full batch -> g (one engine gradient, ``audit.step_gradient``).
* ``dppo <mode>``: ``DPPOPruner(r_q, r_o, mode)``, prompt AND completion level, weights 1/(pi_q pi_{i|q}),
  the full-batch D (token_mean with prompt pruning: the Horvitz-Thompson D, consistent, not exactly unbiased).
* ``cppo <scope>``: ``CPPOPruner(P, scope)``, weight 1, D over the kept units (the authors' mean).

Each pruner is drawn K times (seeded generators); every draw's gradient g_k is a full engine forward+backward on
the packed kept sequences. Reported: cosine(mean_k g_k, g); rel. error |mean_k g_k - g| / |g|; its Monte-Carlo
standard error ``se = sqrt(tr S / K) / |g|`` (S = sample covariance of the g_k); ``z = rel / se`` (about 1
when unbiased: E|mean - g|^2 = tr Var / K; >> 1 = bias); the mean single-draw cosine; the empirical total
variance tr S vs the docs/algorithms.md "Pruning / DPPO / Variance" formula (bernoulli mode, draw-independent D):

    tr Var = sum_q [ (1/pi_q - 1) |g_q|^2 + sum_i (1/pi_{i|q} - 1) |g_qi|^2 / pi_q ],  g_q = sum_i g_qi,

with the per-unit gradients g_qi computed one sequence at a time on the engine (weight 1, full D).
``ratio`` = empirical / formula; its own sampling error is about sqrt(2/(K-1)).

Run: ``.venv/bin/python benchmarks/gradient_fidelity.py [--quick] [--out results.json]``
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import torch  # noqa: E402


def perturb(batch, scale: float, phase: float) -> torch.Tensor:
    """Layout-independent offset per (sample id, position) (same function as the engine tests)."""
    sid = torch.where(batch.seq_index >= 0, batch.sample_ids[batch.seq_index.clamp(min=0)],
                      torch.zeros_like(batch.seq_index))
    return scale * torch.sin(1.7 * batch.position_ids.double() + 0.9 * sid.double() + phase).float()


def prepare(engine, mbs, kl: bool) -> list:
    lps = engine.compute_logprobs(mbs, "policy")
    for b, lp in zip(mbs, lps):
        b.old_logprobs = lp + perturb(b, 0.3, 0.0)
        b.ref_logprobs = (lp + perturb(b, 0.2, 1.0)) if kl else None
    return mbs


def denominator(kind: str, agg: str, r: C.Rollouts, keep, prompt_prob, L_max: int) -> float:
    from megatron_dppo.algo.losses import loss_denominator

    lengths = r.completion_lengths.double()
    if kind == "cppo":
        kept = lengths[keep].view(-1, 1)
        return loss_denominator(agg, int(keep.sum()), 1, kept, None, L_max)
    if kind == "dppo" and agg == "token_mean" and prompt_prob is not None:
        rows = keep.any(dim=1)
        # HT estimate over the kept prompts (their completions are all known here; pruned prompts' are not)
        return loss_denominator(agg, r.B, r.G, lengths[rows], prompt_prob[rows], L_max)
    return loss_denominator(agg, r.B, r.G, lengths, None, L_max)


def draw(kind: str, mode: str, args, r: C.Rollouts, k: int):
    """(keep [B,G], weight [B,G], prompt keep prob [B] or None, completion keep prob [B,G] or None)."""
    from megatron_dppo.algo.pruning import CPPOPruner, DPPOPruner, combine, make_generator

    if kind == "full":
        return torch.ones(r.B, r.G, dtype=torch.bool), torch.ones(r.B, r.G), None, None
    if kind == "cppo":
        res = CPPOPruner(args.cppo_rate, mode).select_completions(r.advantages, make_generator(args.seed, k, "c"))
        return res.keep, res.weight, None, None
    pruner = DPPOPruner(args.r_q, args.r_o, mode)
    p = pruner.select_prompts(r.history, make_generator(args.seed, k, "prompts"))
    c = pruner.select_completions(r.advantages, make_generator(args.seed, k, "completions"))
    total = combine(p, c)
    return total.keep, total.weight, p.probabilities().double(), c.probabilities().double()


def gradient(engine, r, keep, weight, agg, D, capacity, kl):
    from megatron_dppo.audit import step_gradient

    mbs, _ = C.micro_batches(r, keep, weight, agg, capacity)
    return step_gradient(engine, prepare(engine, mbs, kl), D)


def run(args) -> dict:
    from megatron_dppo.algo.advantages import compute_advantages
    from megatron_dppo.algo.losses import LOSS_PRESETS, LossConfig

    C.quiet()
    torch.set_num_threads(args.threads)
    questions = C.load_gsm8k(limit=args.questions, seed=args.seed)
    arch = C.bench_arch(args.model)
    base = C.make_rollouts(questions, args.prompts, args.group, arch.vocab_size, seed=args.seed, scale=args.scale,
                           max_completion=args.max_completion)
    L_max = args.max_completion
    kl = args.kl > 0
    results, per_unit_cache = [], {}
    with C.engine_world(arch, LossConfig(kl_coef=args.kl, kl_estimator="k3"), seed=args.seed) as engine:
        for loss_name in args.losses:
            preset, estimator = LOSS_PRESETS[loss_name]
            cfg = dataclasses.replace(preset, kl_coef=args.kl, kl_estimator="k3")
            engine.loss_cfg = cfg
            agg = cfg.aggregation
            r = dataclasses.replace(base, advantages=compute_advantages(base.rewards, estimator))
            D_full = denominator("full", agg, r, None, None, L_max)
            g = gradient(engine, r, *draw("full", "", args, r, 0)[:2], agg, D_full, args.capacity, kl)
            g_norm = float(g.norm())
            # per-unit gradients (weight 1, full D) for the variance formula
            units = torch.zeros(r.B, r.G, g.numel(), dtype=torch.float64)
            if args.formula:
                for q in range(r.B):
                    for i in range(r.G):
                        keep = torch.zeros(r.B, r.G, dtype=torch.bool)
                        keep[q, i] = True
                        units[q, i] = gradient(engine, r, keep, torch.ones(r.B, r.G), agg, D_full, args.capacity,
                                               kl).double()
                lin_err = float((units.sum(dim=(0, 1)) - g.double()).norm()) / g_norm
            else:
                lin_err = float("nan")
            pruners = [("dppo", m) for m in args.modes] + [("cppo", s) for s in args.cppo_scopes]
            for kind, mode in pruners:
                grads, kept, probs = [], [], None
                for k in range(args.draws):
                    keep, weight, pq, pc = draw(kind, mode, args, r, k)
                    D = denominator(kind, agg, r, keep, pq, L_max)
                    grads.append(gradient(engine, r, keep, weight, agg, D, args.capacity, kl).double())
                    kept.append(float(keep.float().mean()))
                    probs = (pq, pc)
                G_ = torch.stack(grads)
                mean = G_.mean(0)
                diff = mean - g.double()
                trS = float(((G_ - mean) ** 2).sum(1).sum() / (args.draws - 1))
                rel = float(diff.norm()) / g_norm
                se = math.sqrt(trS / args.draws) / g_norm
                cos = float(mean @ g.double()) / (float(mean.norm()) * g_norm)
                single = float(torch.stack([(x @ g.double()) / (x.norm() * g_norm) for x in G_]).mean())
                formula = float("nan")
                if args.formula and kind == "dppo" and mode == "bernoulli" and agg != "token_mean":
                    pq, pc = probs
                    gq = units.sum(1)  # [B, P]
                    var_c = ((1 / pc - 1).unsqueeze(-1) * units ** 2).sum(dim=(1, 2))  # [B]
                    formula = float(((1 / pq - 1) * (gq ** 2).sum(1) + var_c / pq).sum())
                results.append({"loss": loss_name, "aggregation": agg, "pruner": f"{kind} {mode}", "kind": kind,
                                "mode": mode, "kept_fraction": sum(kept) / len(kept), "cosine_mean": cos,
                                "rel_error": rel, "se": se, "z": rel / se if se > 0 else float("nan"),
                                "single_draw_cosine": single, "trace_var": trS, "trace_var_formula": formula,
                                "var_ratio": trS / formula if formula == formula and formula > 0 else float("nan"),
                                "full_grad_norm": g_norm, "per_unit_linearity_error": lin_err})
                print(f"{loss_name} {kind} {mode}: rel {rel:.4f} se {se:.4f}", file=sys.stderr, flush=True)
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": C.machine(), "arch": arch.__dict__,
            "workload": {"sequences": base.B * base.G, "tokens": sum(base.lengths),
                         "zero_variance_groups": base.meta["zero_variance_groups"]},
            "results": results}


def markdown(rep: dict) -> str:
    c, a, w = rep["config"], rep["arch"], rep["workload"]
    lines = [f"qwen2 hidden {a['hidden_size']} x {a['num_layers']} layers (random init); B={c['prompts']} x "
             f"G={c['group']} GSM8K rollouts ({w['tokens']} tokens, {100 * w['zero_variance_groups']:.0f}% "
             f"zero-variance groups); K={c['draws']} draws; DPPO r_q={c['r_q']} r_o={c['r_o']}; CPPO P="
             f"{c['cppo_rate']}; clipping on (old log-probs offset 0.3), KL k3 beta={c['kl']}.", "",
             "| loss | pruner | kept | cos(mean, full) | rel. error | MC s.e. | z = rel/se | single-draw cos | "
             "tr Var (empirical) | tr Var (formula) | emp/formula |", "|---" * 11 + "|"]
    for r in rep["results"]:
        f = lambda x, spec=".3g": "n/a" if x != x else format(x, spec)  # noqa: E731
        lines.append(f"| {r['loss']} | {r['pruner']} | {r['kept_fraction']:.2f} | {r['cosine_mean']:.4f} | "
                     f"{r['rel_error']:.4f} | {r['se']:.4f} | {r['z']:.2f} | {r['single_draw_cosine']:.3f} | "
                     f"{f(r['trace_var'])} | {f(r['trace_var_formula'])} | {f(r['var_ratio'], '.2f')} |")
    lin = {r["loss"]: r["per_unit_linearity_error"] for r in rep["results"]}
    lines += ["", "Sum of per-unit gradients vs full gradient (linearity of the packed engine, rel.): "
              + ", ".join(f"{k} {v:.1e}" for k, v in lin.items())]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes for a shared 2-core CPU")
    ap.add_argument("--model", default="tiny", choices=["tiny", "small", "medium"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--draws", type=int, default=32)
    ap.add_argument("--losses", nargs="+", default=["grpo", "dapo", "dr_grpo", "gspo"])
    ap.add_argument("--modes", nargs="+", default=["bernoulli", "fixed_size", "deterministic"])
    ap.add_argument("--cppo-scopes", nargs="+", default=["group", "batch"])
    ap.add_argument("--r-q", type=float, default=0.5)
    ap.add_argument("--r-o", type=float, default=0.5)
    ap.add_argument("--cppo-rate", type=float, default=0.5)
    ap.add_argument("--kl", type=float, default=0.05)
    ap.add_argument("--no-formula", dest="formula", action="store_false",
                    help="skip the per-unit gradients (variance formula)")
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--max-completion", type=int, default=64)
    ap.add_argument("--questions", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.group, args.draws, args.losses = 6, 6, 16, ["grpo", "dr_grpo", "gspo"]
    rep = run(args)
    print(markdown(rep))
    C.write_json(args.out, rep)


if __name__ == "__main__":
    main()
