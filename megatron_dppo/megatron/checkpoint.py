"""Checkpoints of a ``PolicyEngine``: Megatron distributed checkpointing (``torch_dist``), atomic, reshardable.

Layout of a checkpoint root::

    <root>/latest                 one line: the name of the newest complete checkpoint ("step_00000010")
    <root>/step_00000010/         a dist_checkpointing directory (metadata.json, common.pt, *.distcp) and
                                  manifest.json (size and SHA-256 of every file; written last)
    <root>/.tmp-step_00000010/    only while it is being written (or after a crash: never read, removed by
                                  the next save unless it is the only complete copy of its step)

Atomicity: every rank writes into ``.tmp-<name>`` (from threads of the trainer process: no helper process that
a signal to the process group could kill, see ``checkpoint_files``) and hashes the shards it wrote; after all
ranks succeeded (an all-reduced success flag), rank 0 writes the manifest, renames the directory to ``<name>``
(an existing ``<name>`` is first moved aside and deleted after the rename) and then replaces ``latest`` (write
``.latest.tmp``, fsync, ``os.replace``). A crash or an exception at any point leaves the previous complete
checkpoint and possibly the new one behind, never a partial one under a final name; a crash between the two
renames is repaired by the next start (``checkpoint_files.recover_interrupted_saves``). Resuming
(:func:`find_resume_checkpoint`) verifies the manifest and falls back to the newest checkpoint that verifies,
with a warning. A full disk is reported as such (``CheckpointDiskFullError``), naming the file system. (An
exception raised on ONE rank inside Megatron's collective save leaves the other ranks waiting in that
collective until the process-group timeout; the temporary directory is still never renamed.)

What is saved:

==================  =====================================================================================
``model``           the policy chunks' ``sharded_state_dict`` (global, layout-independent keys: a checkpoint
                    written at one TP/PP/VPP/DP/EP/ETP layout loads at any other; experts under their global
                    index)
``reference``       the frozen reference chunks (keys prefixed ``reference.``), when the engine has one
``lora``            instead of ``model``, for a LoRA engine (``megatron.lora``): the adapters only (their TP
                    shards as sharded tensors, reshardable); the frozen base is not saved, the metadata names
                    its folder and checksum (``lora_base``) and loading onto another base is refused
``optimizer``       Adam state + fp32 main params (MoE models: a dense and an expert optimizer, chained).
                    Regular optimizer: per-parameter sharded tensors (fully reshardable). DistributedOptimizer:
                    ``PolicyEngine``'s ``dist_ckpt_optim_format``; ``dp_reshardable`` (default; reshards over DP
                    only, same TP/PP/VPP/EP/ETP) or ``fully_reshardable`` (any
                    TP/PP/DP; gathers on DP rank 0 when saving). Both resume bit-exactly. Not written
                    before the first update (no state yet).
``rng``             per global rank: python ``random``, numpy, torch CPU (and CUDA) generators and
                    Megatron's tracked RNG states; restored only at the identical layout
``common``          step, the engine's configuration, and the trainer's opaque ``extra`` dict (data cursor,
                    prompt history, ...; rank 0's copy is saved and every rank gets it back)
==================  =====================================================================================

Resume (same layout) is bit-exact: weights, Adam moments, Adam's step counters, the LR-schedule position
(``engine.step``) and every RNG stream are restored, so the continued run equals the uninterrupted one
(``test_checkpoint.py``). Known Megatron-Core 0.16 pitfalls handled here: the DistributedOptimizer state is
initialized before building the sharded state dict for loading, the load runs under ``no_grad``, and Adam's
per-parameter ``step`` tensors are rebuilt: the DistributedOptimizer restores ONE tensor shared by all
parameters (torch's AdamW would increment it once per parameter) and its ``dp_reshardable`` parameter state
writes the pre-load step back into it; the step saved in the optimizer's param groups is put into a separate
tensor per parameter.

Checkpoints are written by the local (CPU) and the Transformer Engine (GPU) layer specs under different
parameter names (TE fuses the layer norms into the linear layers), so they load within one spec.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_dppo.distributed import collectives as D
from megatron_dppo.megatron.checkpoint_files import (
    ASIDE_PREFIX,
    LATEST_FILE,
    CheckpointDiskFullError,  # noqa: F401 - part of this module's interface
    CheckpointError,
    disk_full_error,
    find_checkpoint,
    in_process_save_strategy,
    out_of_space,
    recover_interrupted_saves,
    verify_checkpoint,
    write_latest,
    write_manifest,
)
from megatron_dppo.megatron.checkpoint_files import (
    NAME_RE as _NAME_RE,
)
from megatron_dppo.megatron.checkpoint_files import (
    TMP_PREFIX as _TMP_PREFIX,
)
from megatron_dppo.megatron.checkpoint_files import (
    fsync_dir as _fsync_dir,
)
from megatron_dppo.megatron.lora import is_lora_param

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def checkpoint_name(step: int) -> str:
    return f"step_{int(step):08d}"


# ----------------------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------------------
def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (read from ``latest``), or None."""
    root = Path(root)
    pointer = root / LATEST_FILE
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not _NAME_RE.match(name) or not (path / "metadata.json").is_file():
        raise ValueError(f"{pointer} names {name!r}, which is not a complete checkpoint under {root}")
    return path


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary directories excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME_RE.match(p.name) and (p / "metadata.json").is_file()]
    return sorted(found, key=lambda p: int(_NAME_RE.match(p.name).group(1)))


def resolve_checkpoint(path: str | os.PathLike, verify: str = "hash") -> Path:
    """``path`` itself when it is a checkpoint directory, else the checkpoint of the root ``path`` that a resumed
    run would take: the newest one that verifies (``find_checkpoint``, nothing written; ``latest`` may lag behind
    after a crash)."""
    path = Path(path)
    if (path / "metadata.json").is_file():
        return path
    found = find_checkpoint(path, verify, repair=False) if path.is_dir() else None
    if found is None:
        raise ValueError(f"{path} is neither a checkpoint directory (no metadata.json) nor a checkpoint root "
                         f"holding one (step_<n>/ folders, '{LATEST_FILE}')")
    return found


# ----------------------------------------------------------------------------------------------------------
# State pieces
# ----------------------------------------------------------------------------------------------------------
def _layout(engine) -> dict:
    from megatron.core import parallel_state

    return {
        "world_size": D.world_size(),
        "tp": engine.parallel.tp,
        "pp": engine.parallel.pp,
        "vpp": engine.parallel.vpp,
        "cp": engine.parallel.cp,
        "dp": parallel_state.get_data_parallel_world_size(),
        "sp": engine.parallel.sp,
        "ep": engine.parallel.ep,
        "etp": engine.parallel.etp,
    }


# layout entries a dp_reshardable DistributedOptimizer state cannot change (ep / etp: the expert parameters' state
# is sharded over the expert-data-parallel group, which they define)
_MODEL_PARALLEL_KEYS = ("tp", "pp", "vpp", "cp", "ep", "etp")


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _optimizer_metadata(engine) -> dict:
    return {"distrib_optim_sharding_type": engine.dist_ckpt_optim_format}


def _optimizer_has_state(engine) -> bool:
    inner = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    return any(len(getattr(o, "optimizer", o).state) > 0 for o in inner)


def _inner_torch_optimizers(engine) -> list:
    return [getattr(o, "optimizer", o) for o in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])]


def _init_optimizer_state(engine) -> None:
    """Allocate Adam state (zeros, step 0) so a sharded state dict for loading can be built."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner = getattr(opt, "optimizer", opt)
        if len(inner.state) > 0:
            continue
        if isinstance(opt, DistributedOptimizer):
            opt._init_optimizer_states_with_dummy_values()
        else:
            opt.init_state_fn(inner, opt.config) if getattr(opt, "init_state_fn", None) else None


def _saved_distopt_step(opt_state) -> float | None:
    """Adam's step as the DistributedOptimizer saved it (``optimizer.param_groups[*].step``), or None. A chained
    optimizer (MoE models: one for the dense and one for the expert parameters) saves one such state per
    sub-optimizer under keys 0, 1, ...; their steps agree (Megatron synchronizes them before saving)."""
    if not isinstance(opt_state, dict):
        return None
    parts = [opt_state[k] for k in sorted(opt_state) if isinstance(k, int)] or [opt_state]
    steps = set()
    for part in parts:
        inner = part.get("optimizer") if isinstance(part, dict) else None
        if isinstance(inner, dict) and isinstance(inner.get("param_groups"), list):
            steps |= {float(g["step"]) for g in inner["param_groups"] if g.get("step") is not None}
    if len(steps) > 1:
        raise ValueError(f"checkpoint has different Adam steps per parameter group: {sorted(steps)}")
    return steps.pop() if steps else None


def _fix_adam_steps(engine, step: float | None) -> None:
    """Give every parameter its own, correct ``step`` tensor.

    Megatron-Core 0.16's DistributedOptimizer restores ONE step tensor shared by all parameters (torch's AdamW
    then increments it once per parameter and update), and its ``dp_reshardable`` parameter state copies the
    PRE-LOAD step back into it (the per-parameter step is not restored from the file). ``step`` is the value
    saved in the optimizer's param groups; None keeps the loaded values (regular optimizer: already correct).
    """
    for inner in _inner_torch_optimizers(engine):
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                value = state["step"].detach().clone()
                if step is not None:
                    value.fill_(step)
                state["step"] = value


@contextlib.contextmanager
def _distopt_state_without_step(engine):
    """During a DistributedOptimizer load, copy parameter states while Adam's ``step`` is set aside.

    With torch's AdamW (no Transformer Engine / Apex fused Adam) every parameter state holds a ``step``;
    Megatron-Core 0.16's ``_set_main_param_and_optimizer_states`` copies EVERY state key from the checkpoint,
    and the ``fully_reshardable`` format has no per-parameter ``step`` (KeyError 'step'). The step is restored
    separately (``_fix_adam_steps``), so it is hidden from that copy.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = []
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        original = opt._set_main_param_and_optimizer_states

        def without_step(model_param, tensors, _opt=opt, _original=original):
            if "step" in tensors or _opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                return _original(model_param, tensors)
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            state = _opt.optimizer.state[main_param]
            step = state.pop("step", None)
            try:
                return _original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = without_step
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class method


def _model_sharded_state_dict(engine) -> dict:
    if getattr(engine, "lora", None) is not None:  # the adapters only: the frozen base is the base folder's
        return {"lora": {str(i): {k: v for k, v in m.sharded_state_dict().items() if is_lora_param(k)}
                         for i, m in enumerate(engine.modules)}}
    sd = {"model": {str(i): m.sharded_state_dict() for i, m in enumerate(engine.modules)}}
    if engine.reference_chunks is not None:
        sd["reference"] = {str(i): m.sharded_state_dict(prefix="reference.")
                           for i, m in enumerate(engine.reference_chunks)}
    return sd


def _flat_model_sd(sd: dict) -> dict:
    flat = {}
    for chunk_sd in sd["model" if "model" in sd else "lora"].values():
        flat.update(chunk_sd)
    return flat


def layer_spec_of(modules) -> str:
    """"te" when the model was built with the Transformer Engine layer spec (fused norm+linear names, TE
    ``_extra_state`` entries), "local" for the local spec (SDPA twin or varlen attention: identical state dicts)."""
    for module in modules:
        for name in module.state_dict(keep_vars=True):
            if name.endswith("_extra_state") or name.endswith("linear_qkv.layer_norm_weight"):
                return "te"
    return "local"


def check_layer_spec(meta: dict, engine, path) -> None:
    """A checkpoint written with one layer spec cannot be loaded into the other: parameter names differ (TE fuses
    the norms into ``linear_qkv``/``linear_fc1`` and adds ``_extra_state``). Raise naming both and the way out."""
    saved = meta.get("layer_spec", "local")  # checkpoints before this field: CPU runs, local spec
    here = layer_spec_of(engine.modules)
    if saved != here:
        name = {"te": "the Transformer Engine layer spec (model.attention_backend=te)",
                "local": "the local layer spec (model.attention_backend=varlen or sdpa)"}
        raise ValueError(f"{path}: the checkpoint was written with {name[saved]}, but this run builds "
                         f"{name[here]}; their parameter names differ. Resume with the same attention backend, "
                         "or export the weights (megatron-dppo convert megatron-to-hf) and start from them "
                         "(model.path)")


def _engine_meta(engine) -> dict:
    return {
        "layer_spec": layer_spec_of(engine.modules),
        "format_version": FORMAT_VERSION,
        "step": int(engine.step),
        "arch": asdict(engine.arch),
        "layout": _layout(engine),
        "optim": {**asdict(engine.optim_cfg), "dist_ckpt_optim_format": engine.dist_ckpt_optim_format},
        "loss": asdict(engine.loss_cfg),
        "dtype": str(engine.dtype),
        "distributed_optimizer": bool(engine.optim_cfg.distributed_optimizer),
        "has_optimizer_state": _optimizer_has_state(engine),
        "has_reference": engine.reference_chunks is not None,
        "lora": asdict(engine.lora) if getattr(engine, "lora", None) is not None else None,
        "lora_base": asdict(engine.lora_base) if getattr(engine, "lora", None) is not None else None,
    }


def check_lora(meta: dict, engine, path) -> None:
    """A LoRA checkpoint holds adapters for one base: the engine must have the same LoRA config and, where both
    record one, the same base folder checksum (``PolicyEngine.set_lora_base``); a full checkpoint loads only
    into an engine without LoRA, and the other way round."""
    saved = meta.get("lora")
    here = asdict(engine.lora) if getattr(engine, "lora", None) is not None else None
    if (saved is None) != (here is None):
        what = "LoRA adapters (model.lora set)" if saved is not None else "all weights (no model.lora)"
        raise ValueError(f"{path}: the checkpoint holds {what}, this engine was built "
                         f"{'with' if here is not None else 'without'} LoRA; build it as the checkpoint was")
    if saved is None:
        return
    if saved != here:
        diff = {k: (saved.get(k), v) for k, v in here.items() if saved.get(k) != v}
        raise ValueError(f"{path}: LoRA config differs (checkpoint, engine): {diff}")
    base, mine = meta.get("lora_base") or {}, asdict(engine.lora_base)
    if base.get("sha256") != mine["sha256"]:
        raise ValueError(f"{path}: the adapters were trained on the base {base.get('path')!r} (sha256 "
                         f"{base.get('sha256')}), this engine's base is {mine['path']!r} (sha256 {mine['sha256']}); "
                         "load that base (engine.set_lora_base after loading its weights)")


# ----------------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------------
def save_checkpoint(engine, root: str | os.PathLike, extra: dict[str, Any] | None = None, *,
                    keep_last: int | None = None) -> Path:
    """Write the engine's full training state to ``root/step_<engine.step>`` atomically; every rank calls it.

    ``extra``: the trainer's picklable state (data cursor, prompt history, ...), returned by
    ``load_checkpoint``. ``keep_last``: delete all but the newest ``keep_last`` complete checkpoints
    afterwards. Returns the checkpoint directory. Raises ``CheckpointDiskFullError`` (an ``OSError``, errno
    ENOSPC) when the file system is full; nothing is committed then and the previous checkpoint stays.
    """
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be None or an integer >= 1")
    root = Path(root)
    name = checkpoint_name(engine.step)
    final, tmp = root / name, root / f"{_TMP_PREFIX}{name}"
    if D.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for line in recover_interrupted_saves(root):  # before removing leftovers: one may be a step's only copy
            logger.warning("checkpoint recovery: %s", line)
        for stale in root.glob(f"{_TMP_PREFIX}*"):  # leftovers of crashed saves
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    D.barrier()
    previous = _latest_or_none(root)

    ok, error, written = False, None, {}
    try:
        written, meta = _write_state(engine, tmp, extra)
        ok = True
    except BaseException as err:  # torch.distributed's CheckpointException is a BaseException
        error = err
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
    finally:
        all_ok = D.all_ranks(ok)  # also runs when this rank raised, so the others do not hang here
        disk_full = not all_ok and D.max_over_ranks(int(out_of_space(error, tmp))) > 0
        if not all_ok and D.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    if not all_ok:
        if disk_full:
            raise disk_full_error(final, root, previous) from error
        if error is not None:
            raise error
        raise RuntimeError(f"saving checkpoint {final} failed on another rank; nothing was written")

    entries = {k: v for rank_entries in D.all_gather_objects(written) for k, v in rank_entries.items()}
    committed, error = True, None
    if D.rank() == 0:
        try:
            _commit(root, name, tmp, meta, entries, keep_last)
        except OSError as err:  # e.g. no space left for the manifest or the pointer
            committed, error = False, err
            shutil.rmtree(tmp, ignore_errors=True)  # (already gone when the rename happened)
    if not D.all_ranks(committed):
        if D.max_over_ranks(int(out_of_space(error, root))) > 0:
            raise disk_full_error(final, root, previous) from error
        if error is not None:
            raise error
        raise RuntimeError(f"committing checkpoint {final} failed on rank 0")
    logger.info("saved checkpoint %s", final)
    return final


def _latest_or_none(root: Path) -> Path | None:
    try:
        return latest_checkpoint(root)
    except ValueError:
        return None


def _write_state(engine, tmp: Path, extra: dict[str, Any] | None) -> tuple[dict, dict]:
    """Every rank: write its shards into ``tmp``; returns (manifest entries of the files it wrote, metadata)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = _model_sharded_state_dict(engine)
    meta = _engine_meta(engine)
    if meta["has_optimizer_state"]:
        sd["optimizer"] = engine.optimizer.sharded_state_dict(_flat_model_sd(sd), is_loading=False,
                                                              metadata=_optimizer_metadata(engine))
    sd["rng"] = ShardedObject("megatron_dppo.rng_state", _rng_state(), (D.world_size(),), (D.rank(),), replica_id=0)
    sd["meta"] = meta
    sd["extra"] = extra if extra is not None else {}
    strategy = in_process_save_strategy()
    dist_checkpointing.save(sd, str(tmp), sharded_strategy=strategy)
    return strategy.written, meta


def _commit(root: Path, name: str, tmp: Path, meta: dict, entries: dict, keep_last: int | None) -> None:
    """Rank 0: manifest, rename into place, ``latest``, clean-up (module docstring, "Atomicity")."""
    final, aside = root / name, root / f"{ASIDE_PREFIX}{name}"
    (tmp / "megatron_dppo.json").write_text(json.dumps(
        {k: v for k, v in meta.items() if k != "optim" and k != "loss"}, indent=1, default=str))
    write_manifest(tmp, entries)  # last: its presence marks the directory complete
    _fsync_dir(tmp)
    if final.exists():
        final.rename(aside)
    tmp.rename(final)
    _fsync_dir(root)
    write_latest(root, name)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
    if keep_last is not None:
        for old in list_checkpoints(root)[:-keep_last]:
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)


def _load_adapters(module, state: dict, path) -> None:
    """Load a chunk's adapter tensors; every adapter parameter must be there, and nothing else."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if is_lora_param(k)]
    if missing or unexpected:
        raise ValueError(f"{path}: adapter tensors missing {missing[:4]} / unexpected {unexpected[:4]}")


@torch.no_grad()
def load_adapters(chunks, path: str | os.PathLike) -> dict:
    """Collective: the adapters of a LoRA training checkpoint (a step folder, or the latest under a root) into bare
    model chunks built with the checkpoint's LoRA config (``megatron.lora.add_lora_adapters``), at any TP/PP
    layout; no optimizer, no RNG (the export tools: ``convert.lora_export``). Returns the checkpoint's metadata."""
    from megatron.core import dist_checkpointing

    path = Path(D.broadcast_object(str(resolve_checkpoint(path))))
    meta = read_checkpoint_meta(path)
    if meta.get("lora") is None:
        raise ValueError(f"{path}: not a LoRA checkpoint (it holds all weights)")
    sd = {"lora": {str(i): {k: v for k, v in m.sharded_state_dict().items() if is_lora_param(k)}
                   for i, m in enumerate(chunks)}}
    state = dist_checkpointing.load(sd, str(path))
    for i, module in enumerate(chunks):
        _load_adapters(module, state["lora"][str(i)], path)
    return meta


def find_resume_checkpoint(root: str | os.PathLike, verify: str = "hash") -> Path | None:
    """Collective: the checkpoint to resume from under ``root`` (``checkpoint_files.find_checkpoint``: repairs
    an interrupted save, verifies the manifest, falls back to the newest usable one with a warning)."""
    return find_checkpoint(root, verify)


# ----------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------
def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    """The engine metadata of a checkpoint (rank-independent; reads only common.pt)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(resolve_checkpoint(path)))
    return common["meta"]


def load_checkpoint(engine, path: str | os.PathLike, *, load_optimizer: bool | None = None,
                    load_rng: bool | None = None, verify: str | None = "hash") -> dict[str, Any]:
    """Restore ``engine`` from a checkpoint directory, or from the ``latest`` one under a checkpoint root.

    The model loads at any TP/PP/VPP/DP layout. ``load_optimizer`` / ``load_rng`` default to "when
    possible": the optimizer state when the checkpoint has one of the same kind (regular: any layout;
    DistributedOptimizer ``dp_reshardable``: same TP/PP/VPP/EP/ETP), the RNG states at the identical layout.
    Passing True where it is impossible raises ``ValueError``. ``verify``: check the files against the manifest
    first (``hash`` | ``size``; None when the caller has just done so); a damaged checkpoint raises
    ``CheckpointError`` naming the files. Returns the ``extra`` dict saved with it.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    path = resolve_checkpoint(path)
    # every rank must load the same directory even if `latest` moves meanwhile
    path = Path(D.broadcast_object(str(path)))
    if verify is not None:
        problems = verify_checkpoint(path, verify)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    meta = read_checkpoint_meta(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format_version={meta.get('format_version')}, this code reads "
                         f"{FORMAT_VERSION}")
    if meta["arch"] != asdict(engine.arch):
        diff = {k: (meta["arch"].get(k), v) for k, v in asdict(engine.arch).items() if meta["arch"].get(k) != v}
        raise ValueError(f"{path}: model architecture differs from the engine's (checkpoint, engine): {diff}")
    check_layer_spec(meta, engine, path)
    check_lora(meta, engine, path)
    saved, here = meta["layout"], _layout(engine)

    # -- what can be restored
    opt_possible, opt_reason = meta["has_optimizer_state"], "the checkpoint has no optimizer state"
    if opt_possible and meta["distributed_optimizer"] != engine.optim_cfg.distributed_optimizer:
        opt_possible, opt_reason = False, (f"use_distributed_optimizer differs (checkpoint "
                                           f"{meta['distributed_optimizer']}, engine "
                                           f"{engine.optim_cfg.distributed_optimizer})")
    if opt_possible and meta["distributed_optimizer"]:
        fmt = meta["optim"]["dist_ckpt_optim_format"]
        if fmt != engine.dist_ckpt_optim_format:
            opt_possible, opt_reason = False, (f"DistributedOptimizer format differs (checkpoint {fmt}, engine "
                                               f"{engine.dist_ckpt_optim_format})")
        elif fmt == "dp_reshardable" and any(saved.get(k, 1) != here[k] for k in _MODEL_PARALLEL_KEYS):
            opt_possible, opt_reason = False, (
                f"the dp_reshardable DistributedOptimizer state reshards over DP only; saved "
                f"{'/'.join(_MODEL_PARALLEL_KEYS)}={[saved.get(k, 1) for k in _MODEL_PARALLEL_KEYS]}, now "
                f"{[here[k] for k in _MODEL_PARALLEL_KEYS]} (use dist_ckpt_optim_format=fully_reshardable to "
                "change them)")
    if load_optimizer and not opt_possible:
        raise ValueError(f"{path}: cannot load the optimizer state: {opt_reason}; pass load_optimizer=False "
                         "to load the weights only")
    do_opt = opt_possible if load_optimizer is None else bool(load_optimizer)
    same_layout = {"ep": 1, "etp": 1, **saved} == here  # checkpoints before ep/etp were recorded: dense, 1
    if load_rng and not same_layout:
        raise ValueError(f"{path}: RNG states were saved at layout {saved}, the engine runs at {here}; pass "
                         "load_rng=False")
    do_rng = same_layout if load_rng is None else bool(load_rng)

    # -- build the sharded state dict to load into
    sd = _model_sharded_state_dict(engine)
    load_reference = "reference" in sd and meta["has_reference"]
    if "reference" in sd and not load_reference:
        del sd["reference"]
    if do_opt:
        _init_optimizer_state(engine)
        sd["optimizer"] = engine.optimizer.sharded_state_dict(_flat_model_sd(sd), is_loading=True,
                                                              metadata=_optimizer_metadata(engine))
    if do_rng:
        sd["rng"] = ShardedObject("megatron_dppo.rng_state", None, (D.world_size(),), (D.rank(),), replica_id=0)

    with torch.no_grad():
        state = dist_checkpointing.load(sd, str(path))
        for i, module in enumerate(engine.modules):
            if "lora" in state:
                _load_adapters(module, state["lora"][str(i)], path)
            else:
                module.load_state_dict(state["model"][str(i)], strict=True)
        if load_reference:
            for i, ref in enumerate(engine.reference_chunks):
                ref_sd = {k[len("reference."):] if k.startswith("reference.") else k: v
                          for k, v in state["reference"][str(i)].items()}
                ref.load_state_dict(ref_sd, strict=True)
        elif engine.reference_chunks is not None:
            engine.sync_reference_from_policy()
        if do_opt:
            saved_step = _saved_distopt_step(state["optimizer"])
            with _distopt_state_without_step(engine):
                engine.optimizer.load_state_dict(state["optimizer"])
            _fix_adam_steps(engine, saved_step)
        else:
            engine.optimizer.reload_model_params()  # main (fp32) params from the loaded weights
    if do_rng:
        _set_rng_state(state["rng"])
    engine.step = int(meta["step"])
    D.barrier()
    logger.info("loaded checkpoint %s (step %d, optimizer %s, rng %s)", path, engine.step, do_opt, do_rng)
    return state.get("extra", {})
