"""Megatron-Core engine: model (GPTModel from HF configs), parallel state, vocab-parallel log-probs, train step,
checkpoints. ``cpu`` makes all of it run without CUDA; ``compat`` holds Megatron-Core version differences.

Megatron-Core warns at import time when Transformer Engine / Apex are missing; ``compat.log_gpu_extras_once``
reports the same once per process, so those warnings are silenced here. Every module of this package is imported
after this file, so ``compat.check_transformer_engine`` here runs before the first ``import megatron.core``: a
broken Transformer Engine install is named with its fix instead of crashing inside Megatron-Core.
"""
import warnings

from . import compat as _compat

warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex are|Apex is) not installed.*",
                        category=UserWarning)
_compat.check_transformer_engine()
