"""GPU memory handover between training and a colocated rollout engine (verl's order, docs/architecture.md).

After a policy update (``push``):

1. ``empty_cache``: return PyTorch's cached blocks to the driver. vLLM's ``wake_up`` allocates through its own
   allocator and checks *free driver memory*; blocks cached by PyTorch count as used.
2. wake the rollout **weights** only (a level-2 sleep re-allocates them empty);
3. push the policy weights (a stream of HF-named tensors).

Right before generating (``before_generation``): push again if the engine discarded its weights (a level-2 sleep
with no update since, e.g. an evaluation after a skipped step); optionally offload the training state
(parameters, gradients, fp32 master weights, Adam) to host memory and ``empty_cache`` (``rollout.offload_train_state``);
then wake the **KV cache**, which gets the memory the training state gave up. The KV cache wakes as late as
possible, and the training state is resident whenever anything else (a checkpoint, the warm start) reads it.

After generating (``after_generation``): the rollout engine sleeps (``rollout.sleep_between_steps``), then the
training state comes back.

Around reward-model scoring (``before_scoring`` / ``after_scoring``, ``train.rollouts.scoring_window``) the same
order holds for the reward model's engine: (offload the training state and ``empty_cache``,) wake it, score, sleep
it (``rollout.sleep_between_steps``), bring the training state back. The policy's rollout engine is asleep by then
(it slept after generating), so the reward model gets the memory both gave up.

GPU memory (allocated / reserved by PyTorch, free at the driver) is recorded after each phase as
``memory/<phase>_{allocated,reserved,free}_gib`` (``metrics``). Without CUDA the cache and memory calls do
nothing, so the order is the same everywhere; vLLM's sleep/wake are no-ops on CPU, and the colocated HF engine on
CPU frees its weights while asleep (``rollout/hf_memory.py``: the rollout copy is absent while the trainer holds its
activations, gradients and Adam state), which makes it ``needs_weights`` like vLLM after a level-2 sleep.
Every push also counts what it moved: ``weight_sync/bytes`` and ``weight_sync/tensors`` of the last push
(``metered``; a LoRA run's pushes carry the adapters only, after the first of the process: ``rollout/lora.py``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from megatron_dppo.rollout.base import WeightStream


def gpu_memory(phase: str) -> dict[str, float]:
    """``memory/<phase>_*`` metrics of the current CUDA device (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    free, _total = torch.cuda.mem_get_info()
    gib = float(2**30)
    return {f"memory/{phase}_allocated_gib": torch.cuda.memory_allocated() / gib,
            f"memory/{phase}_reserved_gib": torch.cuda.memory_reserved() / gib,
            f"memory/{phase}_free_gib": free / gib}


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class MemoryHandover:
    """The handover for one rollout engine (see the module docstring).

    ``weights``: returns a fresh stream of the policy's HF-named weights. ``offload``/``onload``: move the
    training state off / back onto the GPU (None = it stays resident). ``empty_cache`` and ``memory`` are
    injectable so that the order can be tested on a CPU.
    """

    def __init__(self, rollout: Any, weights: Callable[[], WeightStream], *,
                 offload: Optional[Callable[[], Any]] = None, onload: Optional[Callable[[], Any]] = None,
                 empty_cache: Callable[[], None] = _empty_cache, memory: Callable[[str], dict] = gpu_memory):
        if (offload is None) != (onload is None):
            raise ValueError("pass both offload and onload, or neither")
        self.rollout = rollout
        self.weights = weights
        self.offload = offload
        self.onload = onload
        self.empty_cache = empty_cache
        self.memory = memory
        self.metrics: dict[str, float] = {}
        self.train_state_away = False

    def _record(self, phase: str) -> None:
        self.metrics.update(self.memory(phase))

    def push(self) -> int:
        """empty_cache -> wake weights -> push; returns the number of tensors pushed."""
        if self.train_state_away:
            raise RuntimeError("push() while the training state is offloaded; call after_generation() first")
        self.empty_cache()
        self._record("before_push")
        self.rollout.wake_up(["weights"])
        count = self.rollout.load_weights(self.metered(self.weights()))
        self._record("weights_pushed")
        return count

    def metered(self, weights: WeightStream) -> WeightStream:
        """``weights``, counted as they pass into ``weight_sync/bytes`` and ``weight_sync/tensors``: the last push's
        (a step's metrics then show the step's own push, whatever pushes came before it: the set-up's, a resumed
        process's first, which carries a LoRA run's base)."""
        self.metrics["weight_sync/bytes"] = self.metrics["weight_sync/tensors"] = 0.0
        for name, tensor in weights:
            self.metrics["weight_sync/bytes"] += float(tensor.numel() * tensor.element_size())
            self.metrics["weight_sync/tensors"] += 1.0
            yield name, tensor

    def before_generation(self) -> None:
        """(push if the weights were discarded) -> (offload the training state) -> wake the KV cache."""
        if getattr(self.rollout, "needs_weights", False):
            self.push()
        else:
            self.rollout.wake_up(["weights"])
        if self.offload is not None and not self.train_state_away:
            self.offload()
            self.train_state_away = True
            self.empty_cache()
            self._record("train_offloaded")
        self.rollout.wake_up(["kv_cache"])
        self._record("rollout_awake")

    def after_generation(self, *, sleep: bool) -> None:
        """Sleep the rollout engine (``sleep``), then bring an offloaded training state back."""
        if sleep:
            self.rollout.sleep()
            self._record("rollout_asleep")
        if self.train_state_away:
            self.onload()
            self.train_state_away = False
            self._record("train_onloaded")

    def before_scoring(self, engine: Any) -> None:
        """(offload the training state) -> wake the reward model's ``engine``."""
        if self.offload is not None and not self.train_state_away:
            self.offload()
            self.train_state_away = True
            self.empty_cache()
            self._record("train_offloaded")
        engine.wake_up()
        self._record("reward_model_awake")

    def after_scoring(self, engine: Any, *, sleep: bool) -> None:
        """Sleep the reward model (``sleep``), then bring an offloaded training state back."""
        if sleep:
            engine.sleep()
            self.empty_cache()
            self._record("reward_model_asleep")
        if self.train_state_away:
            self.onload()
            self.train_state_away = False
            self._record("train_onloaded")

    def take_metrics(self) -> dict[str, float]:
        """The memory metrics recorded since the last call."""
        metrics, self.metrics = self.metrics, {}
        return metrics
