"""The root ``Config``: one typed section per stage of a step (``sections.py``, ``data.py``, ``dapo.py``), and the
rules that span sections. Loading from YAML and the command line is ``loading.py``; every option is documented
once, in its field's ``help`` where its section is defined."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_dppo.config.dapo import DynamicSamplingConfig, OverlongConfig
from megatron_dppo.config.fields import _check
from megatron_dppo.config.data import DataConfig
from megatron_dppo.config.sections import (
    AlgoConfig, CheckpointConfig, EvalConfig, LoggingConfig, LossConfig, ModelConfig, OptimConfig, PackingConfig,
    ParallelConfig, RewardConfig, RolloutConfig, TrainConfig)


@dataclass
class Config:
    """The whole run. Sections mirror the data flow of one step (docs/architecture.md)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> "Config":
        """Check every section, then the rules that span sections. Returns self."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        _check(self.packing.capacity > self.rollout.max_new_tokens, "packing.capacity", self.packing.capacity,
               f"> rollout.max_new_tokens={self.rollout.max_new_tokens} (a whole prompt + completion must fit; "
               "checked against the real prompt lengths at start-up)")
        ctx = self.model.hf_config.get("max_position_embeddings")
        _check(ctx is None or self.rollout.max_new_tokens < ctx, "rollout.max_new_tokens",
               self.rollout.max_new_tokens, f"< the model context max_position_embeddings={ctx}")
        if self.algo.pruner == "cppo" and self.algo.cppo_allocation and self.algo.drop_zero_variance_groups:
            raise ValueError("algo.cppo_allocation=true and algo.drop_zero_variance_groups=true cannot be combined "
                             "(allocation prunes back to exactly B*G completions); set one of them to false")
        _check(self.overlong.buffer <= self.rollout.max_new_tokens, "overlong.buffer", self.overlong.buffer,
               f"<= rollout.max_new_tokens={self.rollout.max_new_tokens} (the penalty zone ends at the limit)")
        if self.dynamic_sampling.enable and self.algo.pruner != "none":
            raise ValueError(f"dynamic_sampling.enable=true needs algo.pruner=none, got algo.pruner="
                             f"{self.algo.pruner!r}: refill trains on a batch conditioned on non-zero reward "
                             "variance (a filter), which the pruners' keep probabilities do not describe "
                             "(docs/algorithms.md, \"Dynamic sampling with refill\"); set algo.pruner=none, or "
                             "dynamic_sampling.enable=false (algo.drop_zero_variance_groups=true drops the same "
                             "groups without refill and composes with algo.pruner=dppo)")
        if self.parallel.cp > 1 and (self.model.moe_routing_replay or self.model.moe_aux_loss_coeff):
            model = self.model
            raise ValueError(f"parallel.cp={self.parallel.cp} with model.moe_routing_replay={model.moe_routing_replay}"
                             f" / model.moe_aux_loss_coeff={model.moe_aux_loss_coeff}: a context-parallel rank routes "
                             "only its part of each sequence; use parallel.cp=1 or turn both off")
        self._validate_placement()
        if self.eval.every and self.data.task == "files" and not self.eval.files:
            raise ValueError("eval.every > 0 needs eval.files (held-out JSONL/parquet files)")
        return self

    def _validate_placement(self) -> None:
        """rollout.placement / train.max_staleness across sections (their help says why)."""
        r, k = self.rollout, self.train.max_staleness
        if self.reward.model.path is not None and self.reward.model.engine == "megatron":
            _check(r.placement == "colocated", "reward.model.engine", "megatron",
                   "hf or vllm with rollout.placement=separate (the rollout workers score and hold no Megatron "
                   "engine); the Megatron reward model runs in the trainer's processes under parallel.tp/pp")
        if r.placement == "colocated":
            _check(k == 0, "train.max_staleness", k, "0 with rollout.placement=colocated (one process generates "
                   "and trains in turn: nothing to overlap); use rollout.placement=separate for k >= 1")

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.train.output_dir) / "checkpoints")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
