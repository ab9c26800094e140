"""The receiving side of versioned weights inside vLLM: a worker extension (``rollout.placement=separate`` with
``rollout.engine=vllm``).

The pattern. vLLM's ``LLM(worker_extension_cls="pkg.module.Class")`` adds ``Class`` to the bases of its own Worker
class in every worker it starts, so the extension's methods are methods of the worker (``self`` is the worker:
``self.model_runner``, ``self.reload_weights``, ``self.model_config``), and the process that holds the ``LLM``
calls them by name with ``llm.collective_rpc("method", args=...)``, which runs the method in every worker (every
tensor-parallel rank) and returns their results. Only the arguments and results cross the RPC: an engine-core or
Ray worker process pickles them, so they stay small. The bulk data reaches the workers another way. verl's
``vLLMColocateWorkerExtension`` receives CUDA IPC handles of buckets the trainer filled on the same GPU, over a
ZMQ socket; NeMo-RL's ``VllmInternalWorkerExtension`` joins a collective (NCCL) group with the trainer
(``init_collective``), and on ``update_weights_from_collective`` takes part in the trainer's packed broadcasts,
loading each bucket into the model as it lands. In both, the RPC only says "join" or "receive now" and carries
names, shapes and dtypes.

Here. The methods below give the vLLM worker the rollout worker's end of the weights channel of
``distributed/transfer.py``, with the same wire protocol: ``dppo_join_weights`` connects to the job's rendezvous store
by host and port, joins the gloo group "weights" at the group rank of this rollout worker, and starts a
``transfer.WeightReceiver``. Its thread keeps a receive posted the whole time, so the trainer's send never waits
for a generation, and it keeps only the newest complete version, which it checks is newer than the last one.
Unlike NeMo-RL's synchronous receive, the trainer never has to call the workers. ``dppo_wait_weights`` blocks until a
version >= a minimum has arrived, pins it, and returns its number and the sender's ``extra`` (prompt history,
sampler position, RL step). ``dppo_load_weights`` loads the pinned version into the model through
``Worker.reload_weights`` (vLLM >= 0.16; the model's own ``load_weights`` before), the path
``VLLMRolloutEngine.load_weights`` takes, after checking each name and shape against the HF architecture; in a LoRA
run it writes the version's adapter tensors as an adapter folder, which the engine loads as a ``LoRARequest``. The
weight tensors never pass through ``collective_rpc``.

With ``distributed_executor_backend="external_launcher"`` (what ``VLLMRolloutEngine`` uses) the worker lives in
the rollout worker's own process, so the receiver thread runs there too. The code does not depend on that: under
vLLM's multiprocess executor each worker process would hold its own receiver, joined at its own group rank.
"""
from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from megatron_dppo.distributed.transfer import WeightReceiver, WeightVersion, process_group
from megatron_dppo.rollout.lora import split_adapters, write_adapter_folder
from megatron_dppo.rollout.vllm_engine import (
    _load_into_model,
    _reload_into_worker,
    checked_weights,
    expected_hf_weights,
    ties_embeddings,
    weight_push_api,
    with_tied_output,
)


class WeightSyncExtension:
    """Mixed into vLLM's Worker (``VLLMRolloutEngine(weight_sync=True)``); called through ``collective_rpc``.
    Names start with ``dppo_`` (vLLM refuses an extension attribute the Worker already has)."""

    def dppo_join_weights(self, host: str, port: int, rank: int, size: int, timeout_s: float, peer: str,
                          keep_all: bool = False) -> None:
        """Join the weights group of the job whose rendezvous store listens on ``host:port`` as group ``rank`` of
        ``size`` and start receiving (``transfer.WeightReceiver``, ``keep_all`` as there); ``peer`` names the
        sender in errors."""
        if getattr(self, "_dppo_receiver", None) is not None:
            raise RuntimeError("this vLLM worker already joined a weights group")
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        self._dppo_receiver = WeightReceiver(process_group(store, "weights", rank, size, timeout_s), peer,
                                             keep_all=keep_all)
        self._dppo_pinned: WeightVersion | None = None
        self._dppo_expected: dict[str, tuple[int, ...]] | None = None

    def dppo_wait_weights(self, min_version: int, timeout_s: float | None = None,
                          exact: bool = False) -> dict[str, Any] | None:
        """Block until a version >= ``min_version`` arrived; pin the newest (``exact``: version ``min_version``)
        and return {"version", "extra"}, or None after the stop message. A receive that failed (the sender died, a
        version that does not increase) raises ``transfer.PeerFailed``."""
        newest = self._dppo_joined().wait(min_version, timeout_s, exact=exact)
        if newest is None:
            return None
        self._dppo_pinned = newest
        return {"version": newest.version, "extra": newest.extra}

    def dppo_load_weights(self, version: int, adapter_folder: str | None = None,
                          adapter_config: dict | None = None) -> dict[str, Any]:
        """Load the pinned version (it must be ``version``) into the model; returns {"tensors": count, "base":
        whether it carried base weights}. LoRA (``rollout/lora.py``): the version's adapter tensors are written as a
        PEFT folder at ``adapter_folder`` (with ``adapter_config``), which the engine then loads as a LoRARequest."""
        pinned = self._dppo_pinned
        if pinned is None or pinned.version != version:
            held = None if pinned is None else pinned.version
            raise RuntimeError(f"weight version {version} is not the one dppo_wait_weights returned ({held}): "
                               "call wait_weights first and load the version it returned")
        adapters: dict = {}
        base = list(split_adapters(pinned.weights, adapters))
        if adapters and adapter_folder is None:
            raise ValueError(f"weight version {version} carries LoRA adapter tensors; this engine has no lora config")
        if adapter_folder is not None:
            if not adapters:
                raise ValueError(f"weight version {version} carries no LoRA adapter tensors (a LoRA run's do)")
            write_adapter_folder(adapters, adapter_config, adapter_folder)
        if not base:
            return {"tensors": len(adapters), "base": False}
        model_path = self.model_config.model
        if self._dppo_expected is None:
            self._dppo_expected = expected_hf_weights(model_path)
        counter = [0]
        stream = with_tied_output(checked_weights(iter(base), self._dppo_expected, model_path, counter),
                                  ties_embeddings(model_path))
        import vllm

        if weight_push_api(str(getattr(vllm, "__version__", "dev"))) == "reload_weights":
            _reload_into_worker(self, stream)
        else:
            _load_into_model(self, stream)
        return {"tensors": counter[0] + len(adapters), "base": True}

    def dppo_weights_arrived(self) -> list[int]:
        """Every version number received, in arrival order."""
        return self._dppo_joined().arrived

    def _dppo_joined(self) -> WeightReceiver:
        receiver = getattr(self, "_dppo_receiver", None)
        if receiver is None:
            raise RuntimeError("this vLLM worker has not joined a weights group: call join_weight_group first")
        return receiver
