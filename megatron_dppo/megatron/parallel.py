"""Process groups: torch.distributed + Megatron model-parallel state from the launcher's environment.

Layout (Megatron's default order ``tp-cp-ep-dp-pp``): ``world = tp * cp * dp * pp``; the data-parallel size
``dp`` is what is left. The ``cp`` ranks of a context-parallel group hold parts of the same micro-batches (every
packed sequence split over them) and their gradients are summed with the data-parallel ones (Megatron's DDP
reduces over ``dp * cp`` ranks). Mixture-of-Experts layers are laid out separately over the same ranks (Megatron's
expert grid ``etp-ep-edp-pp``): ``world = etp * ep * edp * pp``, each expert split over ``etp`` ranks, the experts
spread over ``ep`` ranks, and ``edp`` (expert data parallel) what is left; attention and dense layers keep
``tp/dp``. ``ep`` usually spans the TP and DP ranks of a pipeline stage (e.g. tp=2, dp=4, ep=8, etp=1).
``validate_parallel`` checks every divisibility Megatron needs *before* any process group exists, so a bad
configuration fails identically on every rank with a ``ValueError`` naming the numbers instead of hanging in a
collective.

``initialize_parallel`` reads rank/world/rendezvous from ``megatron_dppo.distributed.launch.discover_launch`` (torchrun,
Slurm ``srun``, ``mpirun``, or a single process), creates the default process group (NCCL on GPU, gloo on CPU,
with the CPU backend applied), Megatron's model-parallel groups, and seeds every generator:
``seed_rank = seed + 100 * pp_rank`` (as Megatron-LM) for Python/NumPy/torch, and Megatron's tracked RNG states via
``model_parallel_cuda_manual_seed(seed_rank)`` (tensor-parallel state: ``seed_rank + 2718 + tp_rank``).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_dppo.config.sections import ParallelConfig

from .cpu import ensure_device_backend

if TYPE_CHECKING:  # pragma: no cover
    from megatron_dppo.distributed.launch import LaunchInfo

    from .arch import ModelArch

logger = logging.getLogger(__name__)


# The parallel layout is the run configuration's ``parallel`` section (one class: config/sections.py, with the
# help of each field): tp, pp, vpp (virtual pipeline stages per rank, interleaved schedule), sp (sequence parallel),
# cp (context parallel: each packed sequence split over cp ranks in 2*cp load-balanced chunks,
# ``packing.context_parallel``; the engine splits every micro-batch, ``logprobs.forward_thd``), ep / etp (expert
# parallel / expert tensor parallel, MoE models), cp_comm_type (``config.sections.CP_COMM_TYPES``: how Transformer
# Engine's attention exchanges K/V under CP, Megatron's ``TransformerConfig.cp_comm_type``; p2p = ring of K/V
# blocks overlapped with compute, all_gather, a2a = all-to-all over heads; "a2a+p2p" needs hierarchical CP groups,
# which initialize_parallel does not create).


def validate_parallel(arch: "ModelArch", cfg: ParallelConfig, world_size: int) -> int:
    """Raise ``ValueError`` (naming the numbers) when Megatron cannot shard ``arch`` under ``cfg`` on
    ``world_size`` processes. Returns the data-parallel size. Touches no process group."""
    dp = cfg.dp(world_size)
    problems = []
    if arch.num_attention_heads % cfg.tp:
        problems.append(f"num_attention_heads={arch.num_attention_heads} is not divisible by tp={cfg.tp}")
    kv = arch.num_kv_heads
    if kv >= cfg.tp and kv % cfg.tp:
        problems.append(f"num_kv_heads={kv} (query groups) is not divisible by tp={cfg.tp}")
    if kv < cfg.tp:  # Megatron all-gathers the fused q/k/v rows over TP and takes its group's slice
        qkv_rows = (arch.num_attention_heads + 2 * kv) * arch.head_dim
        if cfg.tp % kv:
            problems.append(f"tp={cfg.tp} is not a multiple of num_kv_heads={kv} (with fewer KV heads than TP "
                            "ranks, each KV head serves tp / num_kv_heads ranks)")
        elif qkv_rows % cfg.tp:
            problems.append(f"the fused q/k/v projection has {qkv_rows} rows, not divisible by tp={cfg.tp}")
    if arch.ffn_hidden_size % cfg.tp:
        problems.append(f"ffn_hidden_size={arch.ffn_hidden_size} is not divisible by tp={cfg.tp}")
    # a vocabulary not divisible by tp is padded (model.padded_vocab_size) and its padding masked in the logits
    stages = cfg.pp * (cfg.vpp or 1)
    if arch.num_layers % stages:
        what = f"pp={cfg.pp}" if cfg.vpp is None else f"pp*vpp={cfg.pp}*{cfg.vpp}={stages}"
        problems.append(f"num_layers={arch.num_layers} is not divisible by {what}")
    problems += _expert_problems(arch, cfg, world_size)
    if problems:
        raise ValueError("cannot shard the model: " + "; ".join(problems))
    return dp


def _expert_problems(arch: "ModelArch", cfg: ParallelConfig, world_size: int) -> list[str]:
    moe = getattr(arch, "moe", None)
    if moe is None:
        return [f"ep={cfg.ep} / etp={cfg.etp}: expert parallelism needs a Mixture-of-Experts model, "
                f"{arch.family!r} is dense (use ep=1, etp=1)"] if (cfg.ep, cfg.etp) != (1, 1) else []
    problems = []
    if moe.num_experts % cfg.ep:
        problems.append(f"num_experts={moe.num_experts} is not divisible by ep={cfg.ep}")
    if moe.expert_ffn_hidden_size % cfg.etp:
        problems.append(f"the expert ffn size {moe.expert_ffn_hidden_size} is not divisible by etp={cfg.etp}")
    grid = cfg.etp * cfg.ep * cfg.pp
    if world_size % grid:
        problems.append(f"world size {world_size} is not divisible by etp*ep*pp = {cfg.etp}*{cfg.ep}*{cfg.pp} = "
                        f"{grid} (the expert layout must tile each pipeline stage)")
    if cfg.tp > 1 and not cfg.sp:  # Megatron's MoE layer refuses to train TP without SP at the first forward
        problems.append(f"tp={cfg.tp} in a Mixture-of-Experts model needs sequence parallelism (sp=true): each TP "
                        "rank routes its own share of the tokens")
    return problems


def initialize_parallel(cfg: ParallelConfig, seed: int, arch: "ModelArch | None" = None, *,
                        timeout_minutes: float = 30.0) -> "LaunchInfo":
    """Create the default process group and Megatron's model-parallel groups, then seed all generators.

    ``arch``, when given, is validated first (before any group exists). An existing default process group is
    reused (e.g. one created by a test harness); existing model-parallel state is destroyed and rebuilt.
    Returns the launch information of this process.
    """
    from megatron_dppo.distributed.launch import bind_to_launcher, discover_launch

    info = discover_launch()
    bind_to_launcher(info)  # a torchrun worker dies with its agent
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else info.world_size
    if arch is not None:
        validate_parallel(arch, cfg, world_size)
    else:
        cfg.dp(world_size)

    from megatron.core import parallel_state

    from . import compat

    device = ensure_device_backend()
    compat.log_gpu_extras_once()

    if not torch.distributed.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            # a task may see only its own GPU (Slurm --gpus-per-task, CUDA_VISIBLE_DEVICES): index modulo the count
            torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        torch.distributed.init_process_group(
            backend=backend, init_method="env://", rank=info.rank, world_size=info.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes))
        logger.info("process group: %s, rank %d of %d (launcher %s)", backend, info.rank, info.world_size,
                    info.launcher)

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    compat.call_with_supported_kwargs(
        parallel_state.initialize_model_parallel,
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.vpp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
        distributed_timeout_minutes=int(max(1, timeout_minutes)),
    )
    seed_everything(seed)
    return info


def seed_everything(seed: int) -> int:
    """Seed Python, torch and Megatron's tracked RNG states for this rank; returns the rank's seed
    ``seed + 100 * pp_rank`` (different pipeline stages initialize different layers)."""
    from megatron.core import parallel_state, tensor_parallel

    rank_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(rank_seed)
    return rank_seed


def destroy_parallel() -> None:
    """Tear down Megatron's model-parallel state and the default process group (no-op when absent)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def single_process_world(parallel: ParallelConfig | None = None, seed: int = 1234, arch: "ModelArch | None" = None):
    """A world of one process (gloo on CPU) with Megatron's model-parallel state, inside the current process: the
    launcher's variables set for rank 0 of 1 (a free rendezvous port) and restored on exit, the state torn down."""
    from megatron_dppo.distributed.launch import free_port

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    try:
        initialize_parallel(parallel or ParallelConfig(), seed, arch)
        yield
    finally:
        destroy_parallel()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
