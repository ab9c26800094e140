"""The run's configuration: typed dataclasses <- YAML <- ``key.sub=value`` overrides.

    cfg = load_config("examples/quickstart.yaml", ["algo.r_q=0.5"])   # validated Config
    print(describe())                                               # every option, its type, default and help

``root.py``: the root ``Config`` and the rules that span sections; ``sections.py``: model ... logging;
``data.py``: data; ``algo.py``: algo (pruning); the loss section is the loss code's own (``algo/losses.py``), the env
section the episode loop's (``env/config.py``); ``dapo.py``: dynamic_sampling, overlong; ``speculative.py``:
rollout.speculative; ``fields.py``: the field helpers (``opt``, ``_check``); ``loading.py``: YAML, overrides,
coercion, the option catalogue.
"""
from megatron_dppo.algo.losses import LossConfig
from megatron_dppo.config.algo import AlgoConfig
from megatron_dppo.config.dapo import DynamicSamplingConfig, OverlongConfig
from megatron_dppo.config.data import DataConfig
from megatron_dppo.config.loading import all_keys, coerce, describe, load_config, parse_override, set_option
from megatron_dppo.config.rollout import RolloutConfig
from megatron_dppo.config.root import Config
from megatron_dppo.config.sections import (
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    PackingConfig,
    ParallelConfig,
    RewardConfig,
    RewardModelConfig,
    TrainConfig,
)
from megatron_dppo.config.speculative import SpeculativeConfig

__all__ = [
    "AlgoConfig", "CheckpointConfig", "Config", "DataConfig", "DynamicSamplingConfig",
    "EvalConfig", "LoggingConfig", "LossConfig", "ModelConfig", "OptimConfig", "OverlongConfig", "PackingConfig",
    "ParallelConfig", "RewardConfig", "RewardModelConfig", "RolloutConfig", "SpeculativeConfig", "TrainConfig",
    "all_keys", "coerce", "describe", "load_config", "parse_override", "set_option",
]
