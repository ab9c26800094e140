"""Does bf16 mixed precision learn as fp32 does? The real-model GRPO run in both precisions at the same CPU budget.

    python benchmarks/bf16_learning.py --write-prereg   # once, then commit docs/benchmarks/bf16_learning_prereg.json
    python benchmarks/bf16_learning.py --extra model.gguf_cache=<folder>   # the runs (resumable)
    python benchmarks/bf16_learning.py --report         # the table and the figure
    python benchmarks/bf16_learning.py --weight-change  # how much of each run's weights its updates changed

The protocol of ``benchmarks/real_model_study.py`` (SmolLM2-135M-Instruct on list_max, held-out test lists, GRPO,
one torch thread per run, two runs side by side, every run stopped after the RL step that crosses ``budget_s``
process CPU seconds, evaluated on 200 held-out lists x 2 fresh samples at 0, half the budget and the budget) with
two arms that differ in precision only:

- ``fp32``: ``model.dtype=float32`` (the rollout engine in fp32 too);
- ``bf16``: ``model.dtype=bfloat16``: bf16 parameters and compute, fp32 master weights and Adam state (Megatron's
  mixed-precision optimizer), the rollout engine in bf16 (``rollout.dtype=auto``), the log-prob / loss math in fp32.

Both arms run in the same session, seeds outermost, so the box's load hits both alike. Endpoints (fixed here,
before the runs): held-out pass@1 at the budget (bf16 - fp32, paired by seed, t interval; with 2 seeds the t
quantile is 12.7, so only a large difference would show: the report states the half-width), the RL steps each arm
fits in the budget, and pass@1 against RL steps (learning per step, which precision should not change).

``--weight-change`` (added after the runs, to explain them): each run's last checkpoint exported to HF
(``convert megatron-to-hf``: the weights the forward computes with, bf16 for the bf16 arm) against the pretrained
weights in the run's precision: the fraction of the elements that changed and the L2 norm of the change.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/bf16_learning.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import real_model_study as R
from benchmarks import study_runner as SR
from benchmarks.common import REPO

PROTOCOL = dict(
    R.PROTOCOL,
    arms={"fp32": ["algo.pruner=none", "model.dtype=float32"],
          "bf16": ["algo.pruner=none", "model.dtype=bfloat16"]},
    seeds=[1, 2],
    primary="held-out pass@1 (200 test prompts x 2 fresh samples) after the RL step that crosses budget_s",
    secondary="RL steps in the budget; held-out pass@1 at half the budget; pass@1 against RL steps",
    comparisons=[["bf16", "fp32"]],
    test="paired by seed, Student t (df = seeds - 1), two-sided; the half-width is the smallest difference the "
         "two seeds could have detected",
)


def weight_change(work: Path, protocol: dict, pretrained: Path) -> dict:
    """Per run: the fraction of weight elements that differ from the pretrained ones (in the run's precision) and
    the L2 norm of the difference, from the run's last checkpoint exported to HF."""
    import subprocess
    import tempfile

    import torch
    from safetensors.torch import load_file

    def weights(folder: Path) -> dict:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    base = weights(pretrained)
    result = {}
    for arm in protocol["arms"]:
        dtype = torch.bfloat16 if "model.dtype=bfloat16" in protocol["arms"][arm] else torch.float32
        for seed in protocol["seeds"]:
            run = work / f"{arm}_s{seed}"
            with tempfile.TemporaryDirectory() as tmp:
                subprocess.run([sys.executable, "-m", "megatron_dppo.cli", "convert", "megatron-to-hf",
                                str(run / "checkpoints"), str(Path(tmp) / "hf")], check=True, capture_output=True)
                trained = weights(Path(tmp) / "hf")
            changed = total = 0
            square = 0.0
            for name, w0 in base.items():
                if name not in trained:
                    continue
                w0 = w0.to(dtype).float()
                dw = trained[name].float() - w0
                changed += int((dw != 0).sum())
                total += dw.numel()
                square += float((dw.double() ** 2).sum())
            steps = SR.rl_steps(R.read_metrics(run))
            result[f"{arm}_s{seed}"] = {"steps": steps, "changed_fraction": changed / total,
                                        "change_l2": square ** 0.5}
            print(f"{arm}_s{seed}: {steps} RL steps, {changed / total:.4f} of {total} weights changed, "
                  f"|dW| = {square ** 0.5:.4f}", flush=True)
    return result


def main(argv=None) -> int:
    ap = SR.study_arguments(__doc__, REPO / "runs" / "bf16_learning",
                            REPO / "docs" / "benchmarks" / "bf16_learning_prereg.json")
    ap.add_argument("--weight-change", action="store_true", help="how much of its weights each finished run "
                    "changed (module docstring); writes <work>/weight_change.json")
    args = ap.parse_args(argv)
    if args.weight_change:
        from megatron_dppo.config import load_config
        from megatron_dppo.run.build import resolve_model_dir

        protocol = SR.read_prereg(args.prereg)
        pretrained = resolve_model_dir(load_config(str(REPO / protocol["config"]), args.extra))
        result = weight_change(args.work, protocol, pretrained)
        (args.work / "weight_change.json").write_text(json.dumps(result, indent=1))
        return 0

    def report(protocol: dict, out: Path) -> None:
        rep = R.analyse(args.work, protocol)
        for arm, runs in rep["runs"].items():  # learning per step: pass@1 at each evaluation with its RL step
            rep["arms"][arm]["points_by_step"] = {s: [(p[2], p[1]) for p in r["points"]] for s, r in runs.items()}
        out.write_text(json.dumps(rep, indent=1))
        print(R.markdown(rep))
        for arm, a in rep["arms"].items():
            print(f"{arm}: (RL step, pass@1) per seed: {a['points_by_step']}")
        figure = R.plot(rep, args.work / "bf16_learning.png",
                        title="SmolLM2-135M list_max GRPO: fp32 vs bf16, equal CPU budget")
        print(f"figure: {figure}")

    return SR.run_study(args, PROTOCOL, R.jobs, report)


if __name__ == "__main__":
    sys.exit(main())
