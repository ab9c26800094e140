"""Megatron-Core engine: model (GPTModel from HF configs), parallel state, vocab-parallel log-probs, train step,
checkpoints. ``cpu`` makes all of it run without CUDA; ``compat`` holds Megatron-Core version differences.

Megatron-Core warns at import time when Transformer Engine / Apex are missing; ``compat.log_gpu_extras_once``
reports the same once per process, so those warnings are silenced here.
"""
import warnings

warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex are|Apex is) not installed.*",
                        category=UserWarning)
