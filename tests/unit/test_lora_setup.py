"""How a run turns ``model.lora`` into the engine's LoRA config (``run/lora.py``): defaults, the values of a PEFT
adapter given as ``model.lora.init`` (null fields take them, set ones must agree), and the combinations refused by
name before anything is built."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "megatron"))

from _tiny import TINY_CONFIGS, TINY_MOE_CONFIGS  # noqa: E402

from megatron_dppo.config import load_config  # noqa: E402
from megatron_dppo.megatron.arch import ModelArch  # noqa: E402
from megatron_dppo.megatron.lora import LoraConfig  # noqa: E402
from megatron_dppo.megatron.parallel import ParallelConfig  # noqa: E402
from megatron_dppo.run.lora import check_lora_run, lora_config  # noqa: E402

DENSE = ModelArch.from_hf_config(TINY_CONFIGS["qwen2"])
MOE = ModelArch.from_hf_config(TINY_MOE_CONFIGS["qwen3_moe"])


@pytest.fixture
def hf_dir(tmp_path):
    """A base folder as check_lora_run sees it (safetensors present; nothing is read)."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.safetensors").write_bytes(b"")
    return tmp_path / "base"


def _cfg(*overrides):
    return load_config(None, ["data.task=arithmetic", "model.path=/tmp", *overrides])


def _peft_adapter(folder: Path, **kw) -> Path:
    """A PEFT adapter made by peft itself on a transformers model of the DENSE architecture."""
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in TINY_CONFIGS["qwen2"].items() if k != "model_type"}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **fields))
    peft.get_peft_model(hf, peft.LoraConfig(**kw)).save_pretrained(folder)
    return folder


def test_defaults_full_fine_tuning_and_moe_targets():
    assert lora_config(_cfg(), DENSE) is None
    assert lora_config(_cfg("model.lora.rank=8"), DENSE) == LoraConfig(rank=8, alpha=16.0)
    assert lora_config(_cfg("model.lora.seed=3"), DENSE) == LoraConfig(rank=16, alpha=32.0, seed=3)
    moe = lora_config(_cfg("model.lora.rank=4"), MOE)  # the experts are not adapted: attention only by default
    assert moe.target_modules == ("qkv", "proj")
    assert lora_config(_cfg("model.lora.rank=4", "model.lora.target_modules=[q,v]", "model.lora.use_rslora=true",
                            "model.lora.alpha=3"), DENSE) == LoraConfig(4, 3.0, target_modules=("q", "v"),
                                                                       use_rslora=True)


def test_init_adapter_fills_the_null_fields_and_must_agree_with_set_ones(tmp_path):
    folder = _peft_adapter(tmp_path / "adapter", r=4, lora_alpha=6, use_rslora=True, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    got = lora_config(_cfg(f"model.lora.init={folder}", "model.lora.dropout=0.1"), DENSE)
    assert (got.rank, got.alpha, got.projections, got.use_rslora, got.dropout) == (4, 6.0, ("q", "v", "fc2"), True,
                                                                                    0.1)
    agreeing = lora_config(_cfg(f"model.lora.init={folder}", "model.lora.rank=4",
                                "model.lora.target_modules=[v,q,fc2]"), DENSE)
    assert agreeing.projections == got.projections
    with pytest.raises(ValueError, match=r"model.lora.rank=8, but the adapter of model.lora.init=.* has 4; set "
                                         r"model.lora.rank=4 or null"):
        lora_config(_cfg(f"model.lora.init={folder}", "model.lora.rank=8"), DENSE)
    with pytest.raises(ValueError, match=r"model.lora.target_modules=\('qkv',\).*has \['q', 'v', 'fc2'\]"):
        lora_config(_cfg(f"model.lora.init={folder}", "model.lora.target_modules=[qkv]"), DENSE)


@pytest.mark.parametrize("overrides, arch, parallel, pattern", [
    (["model.lora.target_modules=[qkv,fc1]"], MOE, ParallelConfig(),
     r"model.lora.target_modules=\['qkv', 'fc1'\]: LoRA: target_modules \['gate', 'up'\] on the Mixture-of-Experts"),
    (["model.lora.target_modules=[qkv]"], DENSE, ParallelConfig(tp=4),
     r"num_kv_heads=2 < tp=4"),
    (["train.sft_steps=2"], DENSE, ParallelConfig(),
     r"model.lora with train.sft_steps=2 and loss.kl_coef=0.05: the warm start trains the adapters"),
    (["model.lora.rank=1024", "rollout.engine=vllm"], DENSE, ParallelConfig(),
     r"model.lora.rank=1024 with rollout.engine=vllm: vLLM serves adapters up to rank 512"),
])
def test_unsupported_combinations_are_refused_by_name(overrides, arch, parallel, pattern, hf_dir):
    cfg = _cfg("model.lora.rank=4", *overrides)
    with pytest.raises(ValueError, match=pattern):
        check_lora_run(cfg, arch, parallel, lora_config(cfg, arch), hf_dir, kl_coef=0.05)
    check_lora_run(_cfg(), arch, parallel, None, hf_dir, kl_coef=0.05)  # full fine-tuning: nothing refused


def test_supported_combinations_pass(hf_dir):
    cfg = _cfg("model.lora.rank=4", "train.sft_steps=2")  # a warm start without KL: the adapters warm up
    check_lora_run(cfg, DENSE, ParallelConfig(tp=2), lora_config(cfg, DENSE), hf_dir, kl_coef=0.0)
    moe = _cfg("model.lora.rank=4", "model.moe_routing_replay=true")
    check_lora_run(moe, MOE, ParallelConfig(), lora_config(moe, MOE), hf_dir, kl_coef=0.05)


def test_a_converted_megatron_checkpoint_as_base_is_refused(tmp_path):
    converted = tmp_path / "converted"
    (converted / "model").mkdir(parents=True)
    (converted / "hf").mkdir()
    (converted / "model" / "metadata.json").write_text("{}")
    (converted / "hf" / "config.json").write_text("{}")
    cfg = _cfg("model.lora.rank=4", f"model.path={converted}")
    with pytest.raises(ValueError, match="not Hugging Face safetensors .a converted Megatron checkpoint"):
        check_lora_run(cfg, DENSE, ParallelConfig(), lora_config(cfg, DENSE), converted / "hf", kl_coef=0.0)
