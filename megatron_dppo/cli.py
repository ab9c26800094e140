"""``megatron-dppo``: the command line.

    megatron-dppo train --config examples/quickstart.yaml [key.sub=value ...]
    megatron-dppo eval  --config FILE [key.sub=value ...]        # pass@1 / pass@k of the latest checkpoint
    megatron-dppo bench --config FILE [--steps N] [key=value ...] # time per phase and tokens/s, no checkpoints
    megatron-dppo convert {hf-to-megatron,megatron-to-hf,megatron-to-peft,gguf-to-hf} ...  # the convert tools
    megatron-dppo data prepare NAME|SUITE ... --out DIR [--source NAME=SRC]  # Hub datasets -> files + manifest
    megatron-dppo data list                                       # the named datasets and suites
    megatron-dppo rm train --config FILE --out DIR [--pairs F.jsonl] # a small Bradley-Terry reward model
    megatron-dppo train --help-config                             # every option, its type, default and meaning

Multi-process runs use any launcher (``torchrun --nproc-per-node 2 -m megatron_dppo.cli train ...``, ``srun``,
``mpirun``); ranks and rendezvous are discovered by ``megatron_dppo.distributed.launch``.

Configuration and input errors (``ValueError``) print one clear line, ``error: ...``, and exit with status 2;
set ``MEGATRON_DPPO_DEBUG=1`` for the traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="YAML config file (see examples/)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="override any option, e.g. algo.r_q=0.5 train.steps=20 eval.files=[a.jsonl,b.jsonl]")
    p.add_argument("--help-config", action="store_true", help="print every config option with its documentation")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dppo", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _config_args(sub.add_parser("train", help="run SFT warm start (optional) + RL training"))
    _config_args(sub.add_parser("eval", help="evaluate pass@1/pass@k on eval.files with the latest checkpoint"))
    bench = sub.add_parser("bench", help="a few RL steps without checkpoints: time per phase and tokens/s")
    _config_args(bench)
    bench.add_argument("--steps", type=int, default=5, help="RL steps to time (after one warm-up step)")
    conv = sub.add_parser("convert", help="checkpoint conversion (HF <-> Megatron, GGUF -> HF)", add_help=False)
    conv.add_argument("args", nargs=argparse.REMAINDER)
    data = sub.add_parser("data", help="datasets: prepare named Hub datasets as files, list them")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="download (where the Hub is reachable) and write the files training "
                                               "and eval.suite read, with manifest.json (sources, rows, SHA-256)")
    prep.add_argument("names", nargs="+", metavar="NAME|SUITE",
                      help="named datasets (gsm8k, math_lighteval, math500, ...; `megatron-dppo data list`) or "
                           "suites (math6, math8: the test files of their benchmarks)")
    prep.add_argument("--out", required=True, help="output folder, e.g. data (then data.train_files=[data/gsm8k_"
                                                   "train.jsonl]) or data/math (eval.data_dir's default)")
    prep.add_argument("--source", action="append", default=[], metavar="NAME[:ROLE]=SRC",
                      help="read NAME (its ROLE only: train or test) from SRC instead of its Hub id: another Hub "
                           "id, a Hub-format folder, or a file; repeatable")
    prep.add_argument("--roles", default=None, help="comma-separated roles to prepare (train,test); default: all")
    prep.add_argument("--revision", default=None, help="Hub revision (branch, tag, commit) of the Hub sources")
    prep.add_argument("--limit", type=int, default=None, help="write at most this many rows per file")
    data_sub.add_parser("list", help="the named datasets (Hub id, roles, reward) and the evaluation suites")
    rm = sub.add_parser("rm", help="reward models: train a small Bradley-Terry one on preference pairs")
    rm_sub = rm.add_subparsers(dest="rm_command", required=True)
    rmt = rm_sub.add_parser("train", help="a small sequence-classifier reward model (seconds on a CPU) for the run "
                                          "the config describes: its tokenizer and prompt template; use the folder "
                                          "as reward.model.path")
    _config_args(rmt)
    rmt.add_argument("--out", required=True, help="the reward model's folder (HF format + reward_model.json)")
    rmt.add_argument("--pairs", default=None, help="JSONL preference pairs {prompt, chosen, rejected} (texts); the "
                                                   "last 10%% are held out. Default: generated from the arithmetic "
                                                   "task (data.task=arithmetic)")
    rmt.add_argument("--prefer", default="closer", choices=["closer", "correct", "longer"],
                     help="generated pairs: closer = the correct answer over a wrong one, and the nearer of two "
                          "wrong numbers (graded; what RL on the model needs, docs/reward_models.md); correct = "
                          "only the correct answer over a wrong one; longer = the longer answer whatever its "
                          "correctness (a deliberately length-biased model)")
    rmt.add_argument("--num-pairs", type=int, default=4000, help="generated training pairs")
    rmt.add_argument("--heldout", type=int, default=500, help="generated held-out pairs (test split)")
    rmt.add_argument("--template", default="tokens", choices=["tokens", "chat", "text"],
                     help="the input rendering the run will score with (reward.model.template; tokens = the "
                          "policy's ids, what template=auto picks for a model trained here)")
    rmt.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    rmt.add_argument("--batch-size", type=int, default=64, help="pairs per step")
    rmt.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    rmt.add_argument("--hidden", type=int, default=64, help="hidden size of the Qwen2 classifier")
    rmt.add_argument("--layers", type=int, default=2, help="its layers")
    rmt.add_argument("--seed", type=int, default=0, help="initialization and batch order")
    return parser


def _rm(args) -> int:
    from megatron_dppo.rewards.bradley_terry import BTConfig  # noqa: PLC0415
    from megatron_dppo.run.reward_model import train_reward_model  # noqa: PLC0415

    cfg = _load(args)
    bt = BTConfig(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=2 * args.hidden,
                  steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    record = train_reward_model(cfg, args.out, pairs_file=args.pairs, prefer=args.prefer, num_pairs=args.num_pairs,
                                heldout=args.heldout, template=args.template, bt=bt, log_every=max(1, args.steps // 5))
    print(f"reward model: {args.out} ({record['pairs']} pairs, {record['seconds']:.1f} s, {record['cpu_seconds']:.1f} "
          f"CPU s); pairwise accuracy: "
          f"train {record['train_accuracy']:.3f}, held-out {record['heldout_accuracy']:.3f} "
          f"({record['heldout_pairs']} pairs)", flush=True)
    return 0


def _data(args) -> int:
    from megatron_dppo.data.hub import HUB_DATASETS  # noqa: PLC0415
    from megatron_dppo.data.suites import SUITES  # noqa: PLC0415

    if args.data_command == "list":
        for name, d in HUB_DATASETS.items():
            roles = ", ".join(f"{r} ({s})" if r != s else r for r, s in d.splits.items())
            subset = f" [{d.subset}]" if d.subset else ""
            print(f"{name:15s} {d.repo}{subset}  roles: {roles}  reward: {d.reward}  {d.about}")
        for name, benches in SUITES.items():
            print(f"{name:15s} suite: {', '.join(b for b, _ in benches)} (test files)")
        return 0
    from megatron_dppo.data.prepare import parse_sources, prepare  # noqa: PLC0415

    roles = [r.strip() for r in args.roles.split(",") if r.strip()] if args.roles else None
    prepare(args.names, args.out, parse_sources(args.source), roles=roles, revision=args.revision, limit=args.limit)
    return 0


def _load(args):
    from megatron_dppo.config import describe, load_config  # noqa: PLC0415 - keep `--help` fast
    if args.help_config:
        print(describe())
        sys.exit(0)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(cfg.to_yaml())
        sys.exit(0)
    return cfg


CONVERT_TOOLS = {  # name -> (module, function); each tool owns its arguments: `megatron-dppo convert NAME --help`
    "hf-to-megatron": ("megatron_dppo.convert.tools", "hf_to_megatron_main"),
    "megatron-to-hf": ("megatron_dppo.convert.tools", "megatron_to_hf_main"),
    "megatron-to-peft": ("megatron_dppo.convert.tools", "megatron_to_peft_main"),
    "gguf-to-hf": ("megatron_dppo.convert.gguf", "main"),
}


def _convert(argv: list[str]) -> int:
    """Delegate to the conversion tools. ``megatron-to-hf`` also reads a training run's checkpoint root
    (``<output_dir>/checkpoints``: the latest step, with the HF config and tokenizer the trainer stores in
    ``checkpoints/hf``)."""
    names = ", ".join(CONVERT_TOOLS)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: megatron-dppo convert {{{names}}} [tool arguments]   (NAME --help for each tool)")
        return 0
    if argv[0] not in CONVERT_TOOLS:
        raise ValueError(f"unknown conversion {argv[0]!r}; valid: {names}")
    import importlib  # noqa: PLC0415

    module, function = CONVERT_TOOLS[argv[0]]
    try:
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "convert":  # the tools own their arguments: a leading option (--help) escapes REMAINDER
        args.args = unknown + list(args.args)
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from megatron_dppo.rewards.model import RewardModelError  # noqa: PLC0415 - (after --help: imports torch)

    try:
        if args.command == "convert":
            return _convert(list(args.args))
        if args.command == "data":
            return _data(args)
        if args.command == "rm":
            return _rm(args)
        cfg = _load(args)
        from megatron_dppo.train import loop  # noqa: PLC0415 - imports torch/Megatron
        from megatron_dppo.train.evaluation import evaluate_checkpoint  # noqa: PLC0415
        if args.command == "train":
            summary = loop.train(cfg)
            if summary["stopped_by"]:  # stopped by a signal, checkpoint written: 128 + signal number
                return 128 + int(summary["stopped_by"])  # (a job-script stop request, code 0, exits 0)
        elif args.command == "eval":
            evaluate_checkpoint(cfg)
        elif args.command == "bench":
            loop.bench(cfg, steps=args.steps)
        return 0
    except ValueError as err:
        if os.environ.get("MEGATRON_DPPO_DEBUG"):
            raise
        rank = os.environ.get("RANK", "0")
        if rank == "0" or os.environ.get("WORLD_SIZE", "1") == "1":
            print(f"error: {err}", file=sys.stderr)
        return 2
    except RewardModelError as err:  # a failing reward model (reward.model.on_error=stop): one line, every rank
        if os.environ.get("MEGATRON_DPPO_DEBUG"):
            raise
        if os.environ.get("RANK", "0") == "0" or os.environ.get("WORLD_SIZE", "1") == "1":
            print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk (checkpoint.CheckpointDiskFullError names the file system): one line
        import errno  # noqa: PLC0415

        if err.errno not in (errno.ENOSPC, errno.EDQUOT) or os.environ.get("MEGATRON_DPPO_DEBUG"):
            raise
        if os.environ.get("RANK", "0") == "0" or os.environ.get("WORLD_SIZE", "1") == "1":
            print(f"error: {err.strerror or err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
