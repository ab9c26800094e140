"""Report of the preregistered time-to-accuracy study (benchmarks/time_to_accuracy.py): the markdown tables, the
plots and the post-hoc checks, all rendered from the study's report dict (also from a saved results JSON, which
is how ``--from-results`` re-renders a study without its run folders)."""
from __future__ import annotations

import math
from pathlib import Path

from benchmarks import _tta_stats as S

EVAL_LABEL = "in-distribution pass@1 from fresh samples"


def _ci(r: dict, fmt: str = "{:+.3f}") -> str:
    if r is None or math.isnan(r.get("mean", math.nan)):
        return "-"
    if math.isnan(r["lo"]):
        return fmt.format(r["mean"])
    return f"{fmt.format(r['mean'])} [{fmt.format(r['lo'])}, {fmt.format(r['hi'])}]"


def _ratio(r: dict) -> str:
    if math.isnan(r["geo_mean"]):
        return "-"
    return f"{r['geo_mean']:.2f}x" + ("" if math.isnan(r["lo"]) else f" [{r['lo']:.2f}, {r['hi']:.2f}]")


def _p(p) -> str:
    return "-" if p is None or math.isnan(p) else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")


def endpoint_table(vs: dict, base: str, holm: bool) -> list[str]:
    adj = " (Holm)" if holm else ""
    lines = [f"| arm | n | E1 time to g*, ratio to {base} | p{adj} | E1 | E2 gain at T* - {base} | p{adj} | E2 | "
             f"E3 final acc - {base} | p NI{adj} | E3 | total RL time ratio | AUC[0,T*] - {base} |", "|---" * 13 + "|"]
    for a, r in vs.items():
        cens = f" (censored: arm {r['e1']['censored_arm'] or '-'}, {base} {r['e1']['censored_base'] or '-'})"
        ps = [r[e]["p_holm"] if holm and r[e].get("p_holm") is not None else r[e]["p"] for e in ("e1", "e2", "e3")]
        lines.append(f"| {a} | {len(r['seeds'])} | {_ratio(r['e1'])}{cens} | {_p(ps[0])} | {r['e1']['verdict']} | "
                     f"{_ci(r['e2'])} | {_p(ps[1])} | {r['e2']['verdict']} | {_ci(r['e3'])} | {_p(ps[2])} | "
                     f"{r['e3']['verdict']} | {_ratio(r['total_time_ratio'])} | {_ci(r['auc'])} |")
    return lines


def posthoc(analysis: dict) -> dict:
    """Post-hoc checks, labelled as such (not preregistered): endpoint 1 with censoring read as unknown
    (``_tta_stats.censoring_check``), for every arm against grpo and against the DAPO filter."""
    runs = {(r["seed"], r["arm"]): r for r in analysis["per_run"].values()}
    out = {}
    for base, vs in analysis["vs"].items():
        out[base] = {}
        for arm, res in vs.items():
            seeds = [s for s in res["seeds"] if (s, arm) in runs and (s, base) in runs]
            out[base][arm] = S.censoring_check([runs[(s, arm)] for s in seeds], [runs[(s, base)] for s in seeds])
    return out


def posthoc_table(ph: dict, base: str) -> list[str]:
    lines = [f"| arm | both reached g*: seeds | time ratio to {base} over them | {base} reached first | "
             f"arm reached first | indeterminate (the censored run stopped before the other reached g*) | "
             f"neither reached g* |", "|---" * 7 + "|"]
    for arm, c in ph.items():
        r = c["ratio_both"]
        lines.append(f"| {arm} | {c['both'] or '-'} | {_ratio(r) if r['n'] else '-'} | {c['base_wins']} | "
                     f"{c['arm_wins']} | {c['indeterminate'] or '-'} | {c['neither'] or '-'} |")
    return lines


def markdown(rep: dict) -> str:
    p, a, c = rep["prereg"], rep["analysis"], rep["config"]
    clock = p["clock"]
    cov = [v for k, v in p.get("eval_coverage", {}).items() if int(k) in c["seeds"] and "split_facts" in v]
    coverage = "" if not cov else (f" (covering {min(v['eval_distinct'] for v in cov)}-"
                                   f"{max(v['eval_distinct'] for v in cov)} of the split's "
                                   f"{cov[0]['split_facts']} facts)")
    lines = [f"# Time to accuracy (preregistered): {p['protocol']['config']}", "",
             f"Accuracy = **{EVAL_LABEL}** (not held-out): {p['eval']['prompts']} draws of the training split's facts "
             f"x {p['eval']['samples']} samples{coverage}, every {p['eval']['every']} of {p['steps']} RL steps; "
             f"smoothed by a 3-evaluation running mean, linear in time between evaluations. Time = cumulative RL "
             f"**{clock}** seconds (evaluation and start-up excluded). Seeds {c['seeds']}. Arms: "
             + "; ".join(f"{k} = {' '.join(v)}" for k, v in c["arms"].items()) + ".", "",
             f"Preregistered ({p['created']}, commit {p['git_commit']}{' + local changes' if p['git_dirty'] else ''}; "
             f"calibration seeds {p['calibration']['seeds']}, G_cal = {p['calibration']['G_cal']:.4f}): "
             f"g* = {p['g_star']:.4f} ({p['g_star_rule']}), T* = {p['T_star']:.1f} {clock}-s ({p['T_star_rule']}), "
             f"non-inferiority margin = {p['margin']:.4f} ({p['margin_rule']}). {p['multiple_comparisons']['rule']}.",
             "", f"Study commit {rep['git']['commit']}{' + local changes' if rep['git']['dirty'] else ''}."]
    if rep["deviations"]:
        lines += ["", "**Deviations from the preregistration:** " + "; ".join(rep["deviations"])]
    lines += ["", "## Endpoints vs GRPO (paired per seed, 95% t CI; E1 < 1x = faster; E3: non-inferior iff lower bound "
              f"> -{p['margin']:.3f})", ""] + endpoint_table(a["vs"].get("grpo", {}), "grpo", True)
    if a["vs"].get("dapo-filter"):
        lines += ["", "## Endpoint 4: vs the DAPO filter (secondary, unadjusted)", ""] + \
            endpoint_table(a["vs"]["dapo-filter"], "dapo-filter", False)
    ph = rep.get("posthoc") or posthoc(a)
    lines += ["", "## Post-hoc, not preregistered: endpoint 1 with censoring read as unknown", "",
              "Endpoint 1 counts a run that never reaches g* at its total time. Every arm runs the same number of "
              "steps, so a cheaper arm is censored earlier, and a pair of seeds in which neither run reached g* "
              "enters endpoint 1 as the ratio of total times: the cost of a step, not learning. Below, each seed's "
              "pair is classified as Gehan's test scores censored pairs (wins count the pairs whose order is "
              "known; `_tta_stats.censoring_check`).", ""] + posthoc_table(ph.get("grpo", {}), "grpo")
    if ph.get("dapo-filter"):
        lines += [""] + posthoc_table(ph["dapo-filter"], "dapo-filter")
    lines += ["", "## Per arm (mean [95% CI] over seeds)", "",
              f"| arm | runs | reached g* | pre-RL pass@1 | final pass@1 (smoothed) | final gain | "
              f"total RL {clock}-s | "
              f"time to g* ({clock}-s, censored counted) | gain at T* | prompt kept | total kept | zero-var groups |",
              "|---" * 12 + "|"]
    for arm, r in a["arms"].items():
        o = r["overall"]
        lines.append(f"| {arm} | {r['n']} | {r['reached']}/{r['n']} | {_ci(r['pre'], '{:.3f}')} | "
                     f"{_ci(r['final'], '{:.3f}')} | {_ci(r['final_gain'])} | {_ci(r['total'], '{:.0f}')} | "
                     f"{_ci(r['time_to_g'], '{:.0f}')} | {_ci(r['gain_at_T'])} | "
                     f"{_ci(o['prune/prompt_kept_fraction'], '{:.2f}')} | "
                     f"{_ci(o['prune/total_kept_fraction'], '{:.2f}')} | "
                     f"{_ci(o['reward/zero_variance_groups'], '{:.2f}')} |")
    first = next(iter(a["arms"].values()), None)
    if first:
        steps = first["eval_steps"]
        lines += ["", "## Over training, per evaluation interval (mean over seeds): total kept fraction / "
                  "zero-variance "
                  "group share", "", "| arm | " + " | ".join(f"steps {x}-{y}" for x, y in zip(steps, steps[1:])) + " |",
                  "|---" * len(steps) + "|"]
        for arm, r in a["arms"].items():
            bi = r["by_interval"]
            lines.append(f"| {arm} | " + " | ".join(
                f"{k:.2f} / {z:.2f}"
                for k, z in zip(bi["prune/total_kept_fraction"], bi["reward/zero_variance_groups"]))
                + " |")
    other = "wall" if clock == "cpu" else "cpu"
    lines += ["", "## Every run", "", f"| run | pre | final (smoothed) | gain | total {clock}-s | total {other}-s | "
              f"time to g* | reached | gain at T* | AUC[0,T*] |", "|---" * 10 + "|"]
    for name, r in sorted(a["per_run"].items(), key=lambda kv: (kv[1]["seed"], kv[1]["arm"])):
        lines.append(f"| {name} | {r['pre']:.3f} | {r['final']:.3f} | {r['final_gain']:+.3f} | {r['total']:.1f} | "
                     f"{r['total_' + other]:.1f} | {r['time_to_g']:.1f} | "
                     f"{'censored' if r['censored'] else 'yes'} | {r['gain_at_T']:+.3f}"
                     f"{' (ended before T*)' if r['ended_before_T'] else ''} | "
                     f"{r['auc_T']:+.3f} |")
    return "\n".join(lines)


def plot(rep: dict, prefix: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, a = rep["prereg"], rep["analysis"]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = []

    def band(ax, xs, cis, **kw):
        ys = [r["mean"] for r in cis]
        lo = [r["lo"] if not math.isnan(r["lo"]) else r["mean"] for r in cis]
        hi = [r["hi"] if not math.isnan(r["hi"]) else r["mean"] for r in cis]
        (line,) = ax.plot(xs, ys, **kw)
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12)
        return line

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for arm, r in a["arms"].items():
        band(axes[0], r["eval_steps"], r["gain_by_step"], marker="o", ms=3, label=arm)
        band(axes[1], r["gain_by_time"]["t"], r["gain_by_time"]["gain"], label=arm)
    for ax in axes:
        ax.axhline(p["g_star"], color="k", ls="--", lw=1, label=f"g* = {p['g_star']:.3f}")
        ax.set_ylabel(f"gain in {EVAL_LABEL}\n(smoothed; mean, 95% CI over seeds)")
        ax.grid(alpha=0.3)
    axes[1].axvline(p["T_star"], color="k", ls=":", lw=1, label=f"T* = {p['T_star']:.0f} s")
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel(f"cumulative RL {p['clock']} seconds (evaluation excluded)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle("Accuracy gain over the warm start vs steps and vs time")
    fig.tight_layout()
    paths.append(str(prefix) + "_curves.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    keys = [("prune/prompt_kept_fraction", "kept prompt fraction"),
            ("prune/total_kept_fraction", "total kept fraction"),
            ("reward/zero_variance_groups", "zero-variance group share")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for arm, r in a["arms"].items():
        mids = [(x + y) / 2 for x, y in zip(r["eval_steps"], r["eval_steps"][1:])]
        for ax, (k, _) in zip(axes, keys):
            ax.plot(mids, r["by_interval"][k], marker="o", ms=3, label=arm)
    for ax, (_, title) in zip(axes, keys):
        ax.set_title(title + " (per eval interval, mean over seeds)", fontsize=9)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(str(prefix) + "_pruning.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    vs = a["vs"].get("grpo", {})
    if vs:
        names = list(vs)
        fig, axes = plt.subplots(1, 2, figsize=(12, 0.6 * len(names) + 1.8))
        for i, n in enumerate(names):
            e1, e3 = vs[n]["e1"], vs[n]["e3"]
            if not math.isnan(e1["geo_mean"]):
                lo, hi = (e1["lo"], e1["hi"]) if not math.isnan(e1["lo"]) else (e1["geo_mean"],) * 2
                axes[0].errorbar(e1["geo_mean"], i, xerr=[[e1["geo_mean"] - lo], [hi - e1["geo_mean"]]], fmt="o",
                                 capsize=3, color="C3" if e1["censored_arm"] else "C0")
            if not math.isnan(e3["mean"]):
                lo, hi = (e3["lo"], e3["hi"]) if not math.isnan(e3["lo"]) else (e3["mean"],) * 2
                axes[1].errorbar(e3["mean"], i, xerr=[[e3["mean"] - lo], [hi - e3["mean"]]], fmt="o", capsize=3)
        axes[0].axvline(1.0, color="k", lw=1)
        axes[0].set_xscale("log")
        axes[0].set_xlabel("time to g*, ratio arm / grpo (geo mean, 95% CI; red: some censored)")
        axes[1].axvline(0.0, color="k", lw=1)
        axes[1].axvline(-p["margin"], color="r", ls="--", lw=1, label=f"-margin = {-p['margin']:.3f}")
        axes[1].set_xlabel("final smoothed accuracy, arm - grpo (95% CI)")
        axes[1].legend(fontsize=7)
        for ax in axes:
            ax.set_yticks(range(len(names)), [n if n in a["family"] else f"{n} (secondary)" for n in names])
            ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(str(prefix) + "_forest.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
