"""The root ``Config``: one typed section per stage of a step (``sections.py``, ``data.py``, ``dapo.py``), and the
rules that span sections. Loading from YAML and the command line is ``loading.py``; every option is documented
once, in its field's ``help`` where its section is defined."""
from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from megatron_dppo.algo.losses import LossConfig  # the loss section is the loss code's own (algo/losses.py)
from megatron_dppo.config.algo import AlgoConfig
from megatron_dppo.config.dapo import DynamicSamplingConfig, OverlongConfig
from megatron_dppo.config.data import DataConfig
from megatron_dppo.config.fields import _check
from megatron_dppo.config.rollout import RolloutConfig
from megatron_dppo.config.sections import (
    CheckpointConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    PackingConfig,
    ParallelConfig,
    RewardConfig,
    TrainConfig,
)
from megatron_dppo.env.config import EnvConfig  # the env section is the episode loop's own (env/config.py)


@dataclass
class Config:
    """The whole run. Sections mirror the data flow of one step (docs/architecture.md)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: Optional[EnvConfig] = None  # multi-turn episodes (docs/environments.md); None = single-turn completions
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

    def validate(self, overridden: Collection[str] = ()) -> "Config":
        """Check every section, then the rules that span sections. Returns self. ``overridden``: the keys set on
        the command line, over a YAML file (``_refuse_unused_options`` says what they change)."""
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:  # (an optional section left out: env)
                getattr(self, f.name).validate()
        budget = self.completion_budget_key
        _check(self.packing.capacity > self.completion_budget, "packing.capacity", self.packing.capacity,
               f"> {budget}={self.completion_budget} (a whole prompt + completion must fit; checked against the "
               "real prompt lengths at start-up)")
        ctx = self.model.hf_config.get("max_position_embeddings")
        _check(ctx is None or self.completion_budget < ctx, budget, self.completion_budget,
               f"< the model context max_position_embeddings={ctx}")
        if self.algo.pruner == "cppo" and self.algo.cppo_allocation and self.algo.drop_zero_variance_groups:
            raise ValueError("algo.cppo_allocation=true and algo.drop_zero_variance_groups=true cannot be combined "
                             "(allocation prunes back to exactly B*G completions); set one of them to false")
        _check(self.overlong.buffer <= self.trained_token_limit, "overlong.buffer", self.overlong.buffer,
               f"<= {self.trained_token_limit_key}={self.trained_token_limit} (the penalty zone ends at the limit)")
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
        if self.data.arithmetic_warm_start == "calculator" and (self.data.task != "arithmetic" or self.env is None):
            raise ValueError("data.arithmetic_warm_start=calculator warm-starts a calculator-using policy on the "
                             f"arithmetic task: it needs data.task=arithmetic (got {self.data.task!r}) and an env "
                             "section (env.name=calculator)")
        if self.algo.screens:
            _check(self.algo.screen_k < self.train.group_size, "algo.screen_k", self.algo.screen_k,
                   f"in [1, train.group_size - 1 = {self.train.group_size - 1}] (a screen of k, then G - k more)")
            _check(self.overlong.buffer == 0, "algo.screen_k", self.algo.screen_k,
                   "0 with overlong.buffer > 0 (the penalty makes the training rewards continuous; the "
                   "continuation rule needs binary rewards)")
            _check(not self.overlong.filter, "algo.screen_k", self.algo.screen_k,
                   "0 with overlong.filter=true (its denominator counts the finished completions of the generated "
                   "groups, each divided by its keep probability pi_q pi_c: it depends on the draw, and the "
                   "weighted step is then not unbiased)")
            _check(self.reward.model.path is None, "algo.screen_k", self.algo.screen_k,
                   "0 with reward.model.path (a reward model's scores are continuous; the continuation rule needs "
                   "binary rewards)")
            _check(self.env is None, "algo.screen_k", self.algo.screen_k,
                   "0 with an env section (screens and continuations of multi-turn episodes are not joined)")
        if self.algo.pruner == "adaptive":  # the allocation reads a Beta posterior of binary rewards
            for key, value, ok, valid in (
                    ("overlong.buffer", self.overlong.buffer, self.overlong.buffer == 0,
                     "0 (the penalty makes the rewards continuous)"),
                    ("overlong.filter", self.overlong.filter, not self.overlong.filter,
                     "false (its denominator depends on the draw)"),
                    ("reward.model.path", self.reward.model.path, self.reward.model.path is None,
                     "null (a reward model's scores are continuous)"),
                    ("env", "set", self.env is None, "absent (multi-turn episodes are not allocated)"),
                    ("algo.posterior_rewards", self.algo.posterior_rewards, self.algo.posterior_rewards != "continuous",
                     "auto or binary"),
                    ("rollout.placement", self.rollout.placement, self.rollout.placement == "colocated",
                     "colocated (the allocation's slots are drawn where the step trains)"),
                    ("logging.audit_every", self.logging.audit_every, not self.logging.audit_every,
                     "0 (the audit compares with the full groups, which an allocated step never generates)")):
                _check(ok, key, value, f"{valid} with algo.pruner=adaptive")
        self._validate_placement()
        if (self.eval.every or self.eval.every_cpu_s) and self.data.task == "files" and not self.eval.files:
            raise ValueError("eval.every > 0 (or eval.every_cpu_s) needs eval.files (held-out JSONL/parquet files)")
        self._refuse_unused_options(frozenset(overridden))
        return self

    def _refuse_unused_options(self, overridden: frozenset[str]) -> None:
        """An option set away from its default that the chosen configuration does not read is an error naming it
        (``UNUSED_WHEN``), not a setting silently ignored (``data.dataset=gsm8k`` with ``data.task=arithmetic``
        trained on arithmetic). When the choice itself was changed on the command line (``--config
        examples/qwen3-4b-math.yaml rollout.engine=hf``), the file's options for the old choice are quiet (the
        override switched them off) and only options also given on the command line are refused."""
        problems = []
        for keys, selectors, unused, why in UNUSED_WHEN:
            if not unused(self):
                continue
            chosen_here = not overridden.isdisjoint((selectors,) if isinstance(selectors, str) else selectors)
            for key in keys:
                if chosen_here and key not in overridden:
                    continue
                section, name = key.split(".")
                value = getattr(getattr(self, section), name)
                if value != _default(getattr(self, section), name):
                    problems.append(f"{key}={value!r} ({why})")
        if problems:
            raise ValueError("options that this configuration does not use: " + "; ".join(problems) + ". Remove "
                             "them, or change the option that makes them unused")

    def _validate_placement(self) -> None:
        """rollout.placement / train.max_staleness across sections (their help says why)."""
        r, k = self.rollout, self.train.max_staleness
        if self.reward.model.path is not None and self.reward.model.engine == "megatron":
            _check(r.placement == "colocated", "reward.model.engine", "megatron",
                   "hf or vllm with rollout.placement=separate (the rollout workers score and hold no Megatron "
                   "engine); the Megatron reward model runs in the trainer's processes under parallel.tp/pp")
        planned = self.algo.cost_budget if self.algo.planned else None
        for key, value in (("train.cpu_budget_s", self.train.cpu_budget_s),
                           ("eval.every_cpu_s", self.eval.every_cpu_s), ("algo.cost_budget", planned)):
            _check(value is None or r.placement == "colocated", key, value, "null with rollout.placement=separate "
                   "(the rollout workers' seconds are not in the trainer's timers)")
        joined = (("env", self.env is not None), ("algo.screen_k", bool(self.algo.screens)),
                  ("dynamic_sampling.enable", self.dynamic_sampling.enable))  # rollouts joined from several calls
        if r.max_interruptions:
            _check(k >= 1, "train.max_staleness", k, ">= 1 with rollout.max_interruptions >= 1 (at 0 the batch of "
                   "step t needs version t, and no newer version arrives while it generates)")
            _check(self.train.staleness_mode == "newest", "train.staleness_mode", self.train.staleness_mode,
                   "newest with rollout.max_interruptions >= 1 (fixed mode's versions do not depend on timing; "
                   "when a version arrives mid-batch does)")
            for key, on in joined:
                _check(not on, "rollout.max_interruptions", r.max_interruptions,
                       f"0 with {key} (partial rollouts carry per-token versions through single-turn "
                       "generation only)")
            _check(r.tp == 1, "rollout.tp", r.tp, "1 with rollout.max_interruptions >= 1 (each worker takes a new "
                   "version mid-batch on its own; the ranks of one vLLM engine would have to agree on when)")
        if r.overprovision:
            _check(k >= 2, "train.max_staleness", k, ">= 2 with rollout.overprovision > 0 (batch t is generated "
                   "from version t - 1 or older, so with k = 1 none of its tokens may wait for step t + 1)")
            _check(self.train.staleness_mode == "newest", "train.staleness_mode", self.train.staleness_mode,
                   "newest with rollout.overprovision > 0 (fixed mode's exact resume does not cover the carried "
                   "groups)")
            _check(r.workers == 1, "rollout.workers", r.workers, "1 with rollout.overprovision > 0 (the pending "
                   "groups live on the one worker that generates them)")
            for key, on in (*joined, ("algo.pruner=adaptive", self.algo.pruner == "adaptive")):
                _check(not on, "rollout.overprovision", r.overprovision,
                       f"0 with {key} (over-provisioning carries whole single-turn groups of G completions)")
        if r.placement == "colocated":
            _check(k == 0, "train.max_staleness", k, "0 with rollout.placement=colocated (one process generates "
                   "and trains in turn: nothing to overlap); use rollout.placement=separate for k >= 1")

    # -- the bounds of one completion: a single-turn completion's, or a multi-turn episode's (env) ---------------
    @property
    def completion_budget(self) -> int:
        """The most tokens after a prompt: rollout.max_new_tokens, or with episodes env.max_tokens (sampled and
        observation tokens; rollout.max_new_tokens then bounds one turn)."""
        return self.rollout.max_new_tokens if self.env is None else self.env.max_tokens

    @property
    def completion_budget_key(self) -> str:
        return "rollout.max_new_tokens" if self.env is None else "env.max_tokens"

    @property
    def trained_token_limit(self) -> int:
        """The most trained (loss-mask 1) tokens of one completion, the L_max of the denominators and of the overlong
        penalty: rollout.max_new_tokens, or with episodes the env's assistant-token limit."""
        return self.rollout.max_new_tokens if self.env is None else self.env.assistant_token_limit

    @property
    def trained_token_limit_key(self) -> str:
        if self.env is None:
            return "rollout.max_new_tokens"
        return "env.max_tokens" if self.env.max_assistant_tokens is None else "env.max_assistant_tokens"

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.train.output_dir) / "checkpoints")

    def to_dict(self) -> dict:
        """The options, section by section (a field the run sets, ``metadata["set_by"]``, is not an option)."""
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                for sub in dataclasses.fields(section):
                    if "set_by" in sub.metadata:
                        del out[f.name][sub.name]
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _default(section, name: str):
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_FILE_DATA = ("data.dataset", "data.split", "data.subset", "data.revision", "data.bad_rows", "data.dedupe",
              "data.train_files", "data.preset", "data.prompt_field", "data.answer_field", "data.answer_format",
              "data.id_field", "data.limit")
_PROCEDURAL = ("data.procedural_task", "data.procedural_train_size", "data.procedural_seed", "data.procedural_options")
_ARITHMETIC = ("data.arithmetic_train_size", "data.arithmetic_min_terms", "data.arithmetic_max_terms",
               "data.arithmetic_max_operand", "data.arithmetic_ops", "data.arithmetic_eval_split",
               "data.arithmetic_worked")

# (options, the option(s) that choose, when the configuration reads something else in their place, why):
# Config._refuse_unused_options. An option of this table set away from its default under its condition is an error
# naming it (unless the choosing option was changed on the command line and it was not): the configuration picked
# another data source, pruner, engine or placement than the one the option belongs to, so the option suggests a run
# other than the one that would happen (data.dataset=gsm8k with data.task=arithmetic trained on arithmetic). The
# parameters of a feature turned off by its own switch (train.sft_steps=0, dynamic_sampling.enable=false,
# overlong.buffer=0, algo.pruner=none, optim.scheduler=constant, logging.wandb=off, parallel.cp=1) are not refused,
# so that one override turns a feature off in a config that tunes it.
UNUSED_WHEN = [
    (_FILE_DATA, "data.task", lambda c: c.data.task != "files",
     "only data.task=files reads it; data.task=arithmetic and data.task=procedural generate their prompts"),
    (_ARITHMETIC, "data.task", lambda c: c.data.task != "arithmetic", "only data.task=arithmetic reads it"),
    (_PROCEDURAL, "data.task", lambda c: c.data.task != "procedural", "only data.task=procedural reads it"),
    (("algo.r_q", "algo.r_o", "algo.dppo_keep", "algo.keep_floor", "algo.keep_length_exponent",
      "algo.history_ema"), "algo.pruner", lambda c: c.algo.pruner in ("cppo", "pods", "adaptive"),
     "only algo.pruner=dppo reads it"),
    (("algo.mode",), "algo.pruner", lambda c: c.algo.pruner in ("cppo", "pods"),
     "only algo.pruner=dppo and algo.pruner=adaptive read it"),
    (("algo.adaptive_budget", "algo.adaptive_min_size", "algo.adaptive_signal", "algo.adaptive_generation_share"),
     "algo.pruner", lambda c: c.algo.pruner != "adaptive", "only algo.pruner=adaptive reads it"),
    (("algo.cppo_rate", "algo.cppo_scope", "algo.cppo_allocation"), "algo.pruner",
     lambda c: c.algo.pruner in ("dppo", "pods", "adaptive"), "only algo.pruner=cppo reads it"),
    (("algo.pods_rate",), "algo.pruner", lambda c: c.algo.pruner in ("dppo", "cppo", "adaptive"),
     "only algo.pruner=pods reads it"),
    (("algo.posterior_max_weight", "algo.posterior_gamma", "algo.posterior_rewards"), ("algo.pruner", "algo.dppo_keep"),
     lambda c: c.algo.pruner in ("cppo", "pods") or (c.algo.pruner == "dppo" and c.algo.dppo_keep != "posterior"),
     "only algo.dppo_keep=posterior and algo.pruner=adaptive read it"),
    (("algo.history_ema", "algo.history_score"), ("algo.pruner", "algo.dppo_keep"),
     lambda c: (c.algo.pruner == "dppo" and c.algo.dppo_keep == "posterior") or c.algo.pruner == "adaptive",
     "algo.dppo_keep=posterior keeps the prompt posterior in place of the history"),
    (("rollout.gpu_memory_utilization", "rollout.enforce_eager", "rollout.sleep_level",
      "rollout.offload_train_state"), "rollout.engine", lambda c: c.rollout.engine != "vllm",
     "only rollout.engine=vllm reads it"),
    (("rollout.batch_size",), "rollout.engine", lambda c: c.rollout.engine != "hf", "only rollout.engine=hf reads it"),
    (("rollout.interrupt_chunk_tokens", "rollout.mask_offpolicy"), ("rollout.max_interruptions",
                                                                      "rollout.overprovision"),
     lambda c: c.rollout.max_interruptions == 0 and c.rollout.overprovision == 0,
     "only partial rollouts (rollout.max_interruptions >= 1) and over-provisioning read it"),
    (("rollout.workers", "rollout.tp", "rollout.worker_timeout_s", "train.staleness_mode"), "rollout.placement",
     lambda c: c.rollout.placement != "separate", "only rollout.placement=separate reads it"),
]
