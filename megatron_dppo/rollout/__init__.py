"""Rollout engines behind one protocol (see ``base.py``): ``hf`` (transformers, the CPU default) and ``vllm`` (GPU,
colocated under torchrun/srun). vLLM is imported only when a vLLM engine is created."""
from megatron_dppo.rollout.base import (
    Completion,
    CompletionGroup,
    RolloutEngine,
    SamplingParams,
    WeightStream,
)
from megatron_dppo.rollout.hf_engine import HFRolloutEngine

ENGINES = ("hf", "vllm")


def create_engine(kind: str, model_path, **kwargs) -> RolloutEngine:
    """An engine for the HF model directory ``model_path``: kind "hf" (HFRolloutEngine.from_pretrained kwargs) or
    "vllm" (VLLMRolloutEngine kwargs)."""
    if kind == "hf":
        return HFRolloutEngine.from_pretrained(model_path, **kwargs)
    if kind == "vllm":
        from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, **kwargs)
    raise ValueError(f"unknown rollout engine {kind!r}; choose one of {ENGINES}")


__all__ = ["Completion", "CompletionGroup", "ENGINES", "HFRolloutEngine", "RolloutEngine", "SamplingParams",
           "WeightStream", "create_engine"]
