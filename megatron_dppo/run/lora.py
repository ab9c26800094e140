"""LoRA in a run (``model.lora``; docs/lora.md): the engine's ``LoraConfig`` from the config section and the PEFT
adapter of ``model.lora.init``, the combinations a run refuses (by name, before anything is written), the start of
the adapters once the base is loaded, and the weight stream a push sends to the rollout engines.

What a LoRA run does differently, in order (``run.setup``):

1. ``lora_config``: rank, alpha, target modules and rsLoRA from the section, or from ``model.lora.init``'s
   adapter where the section leaves them null (values set in both must agree).
2. ``check_lora_run``: the refusals (the module list of ``refusals`` below says why each).
3. ``PolicyEngine(lora=...)``: adapters on the policy, every base weight frozen, no reference copy.
4. The base always loads from ``model.path``, also on resume (a LoRA checkpoint holds the adapters and their
   optimizer state only); ``start_adapters`` records the base folder and checksum (a checkpoint refuses another
   base) and loads ``model.lora.init``'s adapter, which is also kept, frozen, as the reference policy's adapter
   (a KL term measures the distance from the policy the run started from); a resume then loads the trained
   adapters from the checkpoint.
5. ``rollout_weights``: a push carries the base when the engine has none (the first push of the process, or after
   a level-2 vLLM sleep), then the adapters (``convert.peft.export_rollout_weights``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from megatron_dppo.config import Config
from megatron_dppo.megatron.lora import LoraConfig, check_lora_supported

DEFAULT_RANK = 16
DEFAULT_TARGETS = ("qkv", "proj", "fc1", "fc2")
MOE_DEFAULT_TARGETS = ("qkv", "proj")  # experts and routers are not adapted (megatron.lora)


def lora_config(cfg: Config, arch: Any) -> LoraConfig | None:
    """The engine's LoRA config of ``model.lora`` (None: full fine-tuning). Null fields take the adapter of
    ``model.lora.init`` where there is one, else the defaults (rank 16, alpha 2 * rank, every linear layer the
    model allows, no rsLoRA); a field set in both must agree (ValueError naming both values)."""
    section = cfg.model.lora
    if section is None:
        return None
    found = None
    if section.init is not None:
        from megatron_dppo.convert.peft import read_peft_adapter

        found, _ = read_peft_adapter(section.init, arch.num_layers)
    targets = tuple(section.target_modules) if section.target_modules is not None else None
    mine = {"rank": section.rank, "alpha": section.alpha, "target_modules": targets, "use_rslora": section.use_rslora}
    if found is not None:
        for key, value in mine.items():
            theirs = getattr(found, key)
            same = value is None or (LoraConfig(target_modules=value).projections == found.projections
                                     if key == "target_modules" else value == theirs)
            if not same:
                shown = list(found.projections) if key == "target_modules" else theirs
                raise ValueError(f"model.lora.{key}={value!r}, but the adapter of model.lora.init={section.init!r} "
                                 f"has {shown!r}; set model.lora.{key}={shown!r} or null")
        picked = {k: (v if v is not None else getattr(found, k)) for k, v in mine.items()}
    else:
        rank = section.rank if section.rank is not None else DEFAULT_RANK
        default_targets = MOE_DEFAULT_TARGETS if getattr(arch, "moe", None) is not None else DEFAULT_TARGETS
        picked = {"rank": rank, "alpha": section.alpha if section.alpha is not None else 2.0 * rank,
                  "target_modules": targets or default_targets, "use_rslora": bool(section.use_rslora)}
    return LoraConfig(rank=picked["rank"], alpha=float(picked["alpha"]), dropout=section.dropout,
                      target_modules=tuple(picked["target_modules"]), use_rslora=picked["use_rslora"],
                      seed=section.seed)


def check_lora_run(cfg: Config, arch: Any, parallel: Any, lora: LoraConfig | None, model_dir: Path | None,
                   kl_coef: float) -> None:
    """Refuse, naming the options, what a LoRA run cannot do (nothing for a full fine-tuning run):

    * adapters the model or layout cannot hold (``megatron.lora.check_lora_supported``: fc1 / fc2 on a
      Mixture-of-Experts model, q / k / v when tensor parallelism splits a query group);
    * a base without safetensors (a converted Megatron checkpoint, model.path = model/ + hf/): a LoRA checkpoint names
      its base by the SHA-256 of the HF folder's config.json and safetensors;
    * a warm start (train.sft_steps) with a KL term: the warm start trains the adapters, so the LoRA reference (the
      base, or the base with model.lora.init's adapter) is not the warmed-up policy that a full fine-tuning run's
      KL is measured against;
    * vLLM rollouts at a rank above the largest vLLM serves.

    Checked and supported (tests/megatron/test_lora.py, tests/e2e/test_lora_run.py): the gradient audit (it measures
    the adapters' gradient, the one the update uses), routing replay on MoE models (the routers are frozen; the
    reference forward routes freely), context parallelism, the DistributedOptimizer, TP / SP / PP, both placements
    and both rollout engines, DAPO sampling, mini-batches, rollout correction."""
    if lora is None:
        return
    try:
        check_lora_supported(arch, parallel, lora)
    except ValueError as err:
        raise ValueError(f"model.lora.target_modules={list(lora.target_modules)}: {err}") from None
    if model_dir is not None and not any(model_dir.glob("*.safetensors")):
        raise ValueError(f"model.lora with model.path={cfg.model.path!r}, whose weights are not Hugging Face "
                         "safetensors (a converted Megatron checkpoint?): LoRA needs the base as an HF folder with "
                         "safetensors (their checksum names the base in every LoRA checkpoint); point model.path at "
                         "the HF folder (or `megatron-dppo convert megatron-to-hf` it first)")
    if cfg.train.sft_steps > 0 and kl_coef > 0:
        raise ValueError(f"model.lora with train.sft_steps={cfg.train.sft_steps} and loss.kl_coef={kl_coef}: the "
                         "warm start trains the adapters, and the LoRA reference is the starting adapters (or the "
                         "base), not the warmed-up policy; set train.sft_steps=0 (start from a PEFT adapter with "
                         "model.lora.init instead: it is the reference then), or loss.kl_coef=0")
    if cfg.rollout.engine == "vllm":
        from megatron_dppo.rollout.vllm_engine import VLLM_LORA_RANKS

        if lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"model.lora.rank={lora.rank} with rollout.engine=vllm: vLLM serves adapters up to rank "
                             f"{VLLM_LORA_RANKS[-1]}")


def start_adapters(engine: Any, cfg: Config, model_dir: Path, *, fresh: bool) -> None:
    """After the base weights are loaded: record the base (its folder's checksum goes into every checkpoint, and
    a checkpoint of another base is refused) and load ``model.lora.init``'s adapter, kept frozen as the reference
    policy's adapter (``lora.keep_as_reference``: the KL is measured from the policy the run starts from). On a
    resume (``fresh`` False) the checkpoint's trained adapters replace it in the policy afterwards; the reference
    keeps it."""
    engine.set_lora_base(model_dir)
    init = cfg.model.lora.init
    if init is not None:
        from megatron_dppo.convert.peft import load_peft_adapter
        from megatron_dppo.megatron.lora import keep_as_reference

        load_peft_adapter(engine.modules, init, engine.lora, engine.arch.num_layers)
        keep_as_reference(engine.modules)
        if fresh:
            engine.optimizer.reload_model_params()  # the fp32 main copies of the adapters (bf16 training)


def rollout_adapter_config(lora: LoraConfig | None) -> dict | None:
    """The adapter_config.json dict the rollout engines serve the adapters with (None: full fine-tuning)."""
    if lora is None:
        return None
    from megatron_dppo.convert.peft import peft_config

    return peft_config(lora)


def rollout_weights(engine: Any, arch: Any, bucket_bytes: int, *, base: bool) -> Iterator:
    """The stream of one weight push: every weight (full fine-tuning), or for LoRA the base when the receiver has
    none (``base``) and then the adapters. Collective."""
    if engine.lora is None:
        from megatron_dppo.convert import export_hf_weights

        return export_hf_weights(engine.model_chunks, arch, bucket_bytes)
    from megatron_dppo.convert.peft import export_rollout_weights

    return export_rollout_weights(engine.model_chunks, arch, base=base, bucket_bytes=bucket_bytes)
