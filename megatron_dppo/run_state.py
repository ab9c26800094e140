"""The state of one training run, :class:`Run`: what ``run.setup`` builds and every phase (stages, warm start,
evaluation, checkpoints, console) reads. A module of its own so that ``lifecycle.py`` and ``console.py`` can name
it while ``run.py`` imports them (imports flow one way: docs/architecture.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only (``from __future__ import annotations``): nothing is imported at run time
    from megatron_dppo.algo.losses import LossConfig
    from megatron_dppo.algo.prompt_history import PromptHistory
    from megatron_dppo.algo.pruning import CPPOPruner, DPPOPruner
    from megatron_dppo.build import Prompt
    from megatron_dppo.config import Config
    from megatron_dppo.metrics import MetricsSink


@dataclass
class Run:
    """Everything one training run holds; built by :func:`megatron_dppo.run.setup`."""

    cfg: Config
    info: Any  # launch.LaunchInfo
    tokenizer: Any
    hf_config: dict
    arch: Any  # megatron.arch.ModelArch
    engine: Any  # megatron.train_step.PolicyEngine
    rollout: Any  # rollout.RolloutEngine
    scorer: Any  # rewards.RewardScorer
    eval_scorers: dict[str, Any]
    train_prompts: list[Prompt]
    eval_sets: dict[str, list[Prompt]]
    sampler: Any  # data.PromptSampler
    pruner: DPPOPruner | CPPOPruner | None
    history: PromptHistory
    loss_cfg: LossConfig
    estimator: str
    sink: MetricsSink
    sft_pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (prompt ids, gold completion ids)
    rl_step: int = 0  # next RL step to run
    sft_step: int = 0  # warm-start steps done
    eos_ids: list[int] = field(default_factory=list)
    pad_id: int = 0
    audit: Any = None  # open file (rank 0, logging.audit_log)
    handover: Any = None  # rollout.handover.MemoryHandover (GPU memory order around weight pushes)
    lock: Any = None  # lifecycle.OutputLock (rank 0): one run per output folder
    link: Any = None  # placement.TrainerLink (rollout.placement=separate): weights out, batches in

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_world_size()
