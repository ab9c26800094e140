"""Command lines of the conversion tools (``tools/convert_*.py`` and ``megatron-dppo convert ...`` call these).

    python tools/convert_hf_to_megatron.py HF_DIR OUT_DIR [--tp 2 --pp 1]       (torchrun --nproc-per-node=TP*PP)
    python tools/convert_megatron_to_hf.py CKPT_DIR OUT_DIR [--tp 1 --pp 1] [--dtype bfloat16]
        (a LoRA run's checkpoint: the merged model on its base, [--base HF_DIR]; ``convert.lora_export``)
    megatron-dppo convert megatron-to-peft CKPT_DIR OUT_DIR [--tp 1 --pp 1]     (a LoRA run's adapters, PEFT format)
    (Mixture-of-Experts: also --ep / --etp; then --nproc-per-node=lcm(TP, EP*ETP)*PP)
    python -m megatron_dppo.convert.gguf [GGUF] OUT_DIR                         (default: SmolLM2-135M-Instruct)

A ValueError (bad config, unsupported model, missing/unexpected tensor, shape mismatch, TP/PP that does not
shard the model, an output folder that exists or cannot be created: under a file, on a read-only or pseudo file
system) prints ``error: ...`` and exits with status 2; no output folder is left. So does an OSError while reading
or writing (the line names the file; a full disk exits with status 1).
Set ``MEGATRON_DPPO_DEBUG=1`` for the traceback.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from typing import Callable, Sequence

import torch

OTHER_RANKS_EXIT_DELAY_S = 5.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parallel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size, MoE models (default 1)")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallel size, MoE models (default 1)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")


def run_tool(fn: Callable[[], object]) -> int:
    """Run one conversion (``fn`` returns the folder written): 0 and ``wrote FOLDER``, or one ``error:`` line and
    status 2 for a ValueError or an OSError (a file that cannot be read or written, named; a full disk: status 1)."""
    owned = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    try:
        out = fn()
    except (ValueError, OSError) as err:
        if os.environ.get("MEGATRON_DPPO_DEBUG"):
            raise
        if _is_rank0():  # the checks are the same on every rank, so is the error: rank 0 says it, once
            print(f"error: {_one_line(err)}", file=sys.stderr, flush=True)
        else:  # torchrun stops every worker as soon as one exits: let rank 0 exit (and report) first
            time.sleep(OTHER_RANKS_EXIT_DELAY_S)
        return 1 if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT) else 2
    finally:
        if owned:  # tear down only the process groups this call created
            _destroy()
    if _is_rank0():
        print(f"wrote {out}")
    return 0


def _one_line(err: BaseException) -> str:
    """The error's message; an OSError's as ``FILE: reason`` (``FILE -> FILE2: reason`` for a rename)."""
    if not isinstance(err, OSError) or not err.strerror:
        return str(err)
    where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f is not None)
    return f"{where}: {err.strerror}" if where else err.strerror


def _is_rank0() -> bool:
    """Rank 0 of the job, whatever the launcher (torchrun, srun, mpirun), also before any process group."""
    from megatron_dppo.distributed.launch import discover_launch

    try:
        return discover_launch(export=False, use_mpi4py=False).rank == 0
    except ValueError:  # an inconsistent launch environment: let every process speak
        return True


def _destroy() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from megatron_dppo.megatron.parallel import destroy_parallel

        destroy_parallel()


def hf_to_megatron_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_hf_to_megatron",
        description="HF folder (safetensors + config.json + tokenizer) -> Megatron dist checkpoint at TP/PP. "
                    "Run with torchrun --nproc-per-node=TP*PP (or a plain process for TP=PP=1).")
    parser.add_argument("hf_dir", help="Hugging Face model folder")
    parser.add_argument("out_dir", help="output checkpoint folder (created atomically)")
    _parallel_args(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="stored weight dtype (default float32: exact)")
    args = parser.parse_args(argv)
    from megatron_dppo.convert.checkpoint import convert_hf_to_megatron

    return run_tool(lambda: convert_hf_to_megatron(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp,
                                               dtype=DTYPES[args.dtype], overwrite=args.overwrite,
                                               ep=args.ep, etp=args.etp))


def megatron_to_hf_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_megatron_to_hf",
        description="Megatron checkpoint (saved at any TP/PP) -> HF folder that transformers and vLLM load. "
                    "Runs at --tp/--pp (default 1: one process reshards everything).")
    parser.add_argument("ckpt_dir", help="converted or trained checkpoint folder (holding model/ and hf/)")
    parser.add_argument("out_dir", help="output HF folder (created atomically)")
    _parallel_args(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="written dtype (default: the HF config's dtype, else float32)")
    parser.add_argument("--hf-config", default=None,
                        help="config.json (or its folder, with tokenizer files) when CKPT_DIR has no hf/ folder")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="size of each safetensors file")
    parser.add_argument("--base", default=None,
                        help="LoRA runs: the base HF folder the adapters are merged into (default: the folder the "
                             "checkpoint records; its checksum must match)")
    args = parser.parse_args(argv)
    from megatron_dppo.convert.checkpoint import convert_megatron_to_hf
    from megatron_dppo.convert.lora_export import convert_lora_to_merged_hf, lora_checkpoint

    if lora_checkpoint(args.ckpt_dir) is not None:  # adapters only: merged into their base
        return run_tool(lambda: convert_lora_to_merged_hf(
            args.ckpt_dir, args.out_dir, base=args.base, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
            dtype=DTYPES[args.dtype] if args.dtype else None, hf_config=args.hf_config, overwrite=args.overwrite,
            max_shard_bytes=int(args.max_shard_gb * 1024 ** 3)))
    if args.base is not None:
        parser.error("--base is for LoRA checkpoints; this checkpoint holds all weights")
    return run_tool(lambda: convert_megatron_to_hf(
        args.ckpt_dir, args.out_dir, tp=args.tp, pp=args.pp,
        dtype=DTYPES[args.dtype] if args.dtype else None, hf_config=args.hf_config, overwrite=args.overwrite,
        max_shard_bytes=int(args.max_shard_gb * 1024 ** 3), ep=args.ep, etp=args.etp))


def megatron_to_peft_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_megatron_to_peft",
        description="LoRA training checkpoint (a run with model.lora) -> PEFT adapter folder (adapter_config.json + "
                    "adapter_model.safetensors) that peft.PeftModel.from_pretrained(base, OUT_DIR) and vLLM's "
                    "LoRARequest load. Runs at --tp/--pp (default 1).")
    parser.add_argument("ckpt_dir", help="the run's checkpoint root (<output_dir>/checkpoints: the latest step) or "
                                         "a step folder")
    parser.add_argument("out_dir", help="output adapter folder (created atomically)")
    _parallel_args(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="written dtype (default: the adapters' own, float32 on CPU)")
    args = parser.parse_args(argv)
    from megatron_dppo.convert.lora_export import convert_lora_to_peft

    return run_tool(lambda: convert_lora_to_peft(args.ckpt_dir, args.out_dir, tp=args.tp, pp=args.pp, ep=args.ep,
                                             etp=args.etp, dtype=DTYPES[args.dtype] if args.dtype else None,
                                             overwrite=args.overwrite))
