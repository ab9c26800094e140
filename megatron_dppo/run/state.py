"""The state of one training run: :class:`Run`, what ``run.setup`` builds, made of the two halves a step uses.

* :class:`RolloutSide`: what steps 1-4 of a step read and evaluation reads (``train.draw``, ``train.dapo``,
  ``train.evaluation``): the rollout engine, the tokenizer, rewards, prompts, the sampler, the pruner (which
  holds its per-prompt state). A rollout worker (``rollout.placement=separate``) builds only this half.
* :class:`TrainSide`: what steps 5-12 read (``train.stages``, ``train.warm_start``): the Megatron engine, the
  loss, the completion-level pruner, the packing settings.

The stages take the half they use, never the whole run; the loop (``train.loop``) holds the run and adds what
only it owns: checkpoints, metrics sinks, the link to rollout workers, the step counters. Data only, no logic
(a module of its own so that ``lifecycle.py`` and ``console.py`` can name it while ``setup.py`` imports them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only (``from __future__ import annotations``): nothing is imported at run time
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.algo.pruner import Pruner
    from megatron_dppo.config import Config
    from megatron_dppo.data import Prompt
    from megatron_dppo.run.metrics import MetricsSink


@dataclass
class RolloutSide:
    """Steps 1-4 of a step (draw, prompt-prune, generate, score) and evaluation: here in the trainer, or on the
    rollout workers."""

    cfg: Config
    tokenizer: Any
    engine: Any  # rollout.RolloutEngine (None in a trainer whose rollout workers generate: placement=separate)
    handover: Any  # rollout.handover.MemoryHandover (GPU memory order around generation and weight pushes)
    eos_ids: list[int]
    scorer: Any  # rewards.RewardScorer of the training data
    train_prompts: list[Prompt]
    sampler: Any  # data.PromptSampler (resumable)
    pruner: Pruner  # algo.pruner: how many prompts to draw, the prompt level, and its per-prompt state (train.draw:
    # read before generation, updated by the trainer from each step's groups)
    eval_sets: dict[str, list[Prompt]] = field(default_factory=dict)
    eval_scorers: dict[str, Any] = field(default_factory=dict)
    reward_model: Any = None  # rewards.RewardModel (reward.model.path), scored beside ``scorer``; None: rules only
    env_factory: Any = None  # multi-turn episodes (cfg.env): a fresh Environment per call; None = single-turn
    chat: Any = None  # env.tokens.ChatTokens of the tokenizer (observation tokens of the episodes), with env_factory


@dataclass
class TrainSide:
    """Steps 5-12 of a step (advantages to policy update) and the warm start: the trainer's half."""

    cfg: Config
    engine: Any  # megatron.engine.PolicyEngine
    loss_cfg: LossConfig
    estimator: str  # advantage estimator: grpo | dr_grpo | rloo
    pruner: Pruner  # the same object: the completion level and the denominator rule
    pad_id: int = 0

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_world_size()


@dataclass
class Run:
    """Everything one training run holds; built by :func:`megatron_dppo.run.setup.setup`."""

    cfg: Config
    info: Any  # dist.launch.LaunchInfo
    hf_config: dict
    arch: Any  # megatron.arch.ModelArch
    rollout_side: RolloutSide
    train_side: TrainSide
    sink: MetricsSink
    sft_pairs: list[tuple] = field(default_factory=list)  # (prompt ids, gold completion ids[, loss mask])
    rl_step: int = 0  # next RL step to run
    sft_step: int = 0  # warm-start steps done
    rl_cpu_s: float = 0.0  # process CPU seconds of the RL steps done (cumulative time/step_cpu: train.cpu_budget_s)
    audit: Any = None  # open file (rank 0, logging.audit_log)
    lock: Any = None  # lifecycle.OutputLock (rank 0): one run per output folder
    link: Any = None  # dist.placement.TrainerLink (rollout.placement=separate): weights out, batches in
    planner: Any = None  # train.plan.RatePlanner (algo.cost_budget): the rates of each step
