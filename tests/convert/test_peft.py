"""PEFT parity of our LoRA adapters, with the real ``peft`` (0.21) on the real transformers model: our exported
adapter loaded by PEFT gives our logits; a PEFT adapter trained elsewhere imports and gives PEFT's logits; the
merged export is PEFT's ``merge_and_unload``. Unsupported PEFT options are refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from _dist import single_process_world
from _hf_models import TINY, build_hf_model, megatron_logits, tokens

from megatron_dppo.convert import load_hf_weights
from megatron_dppo.convert.peft import (
    export_merged_hf_weights,
    export_peft_adapter,
    load_peft_adapter,
    read_peft_adapter,
)
from megatron_dppo.megatron import lora as L
from megatron_dppo.megatron.model import ModelArch, build_model_chunks
from megatron_dppo.megatron.parallel import ParallelConfig

peft = pytest.importorskip("peft")

LOGITS_ATOL = 2e-5  # fp32 (as the conversion tests); measured ~1e-7


def _random_adapters(chunks, seed: int = 3, b_std: float = 0.05) -> None:
    """Non-zero A and B in every adapter (B = 0 at initialisation would make every comparison trivial)."""
    g = torch.Generator().manual_seed(seed)
    full = {}
    for layer, _, adapter in L.adapters(chunks):
        for name in adapter.pairs:
            out, inp = adapter.part_shapes[name]
            full[(layer, name, "lora_A")] = torch.randn(adapter.rank, inp, generator=g) / inp ** 0.5
            full[(layer, name, "lora_B")] = b_std * torch.randn(out, adapter.rank, generator=g)
    L.load_full_lora_tensors(chunks, full)


def _our_model(name: str, cfg: L.LoraConfig):
    hf = build_hf_model(name)
    arch = ModelArch.from_hf_config(TINY[name])
    chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
    L.add_lora_adapters(chunks, cfg)
    load_hf_weights(chunks, arch, hf.state_dict())
    return hf, arch, chunks


@pytest.mark.parametrize("name", ["qwen2_untied", "llama_tied", "qwen3_tied", "mistral_tied", "ministral_untied"])
def test_exported_adapter_in_peft_gives_our_logits_and_merged_export_is_merge_and_unload(name, tmp_path):
    cfg = L.LoraConfig(rank=4, alpha=8.0, target_modules=("qkv", "proj", "fc1", "fc2"))
    ids = tokens()
    with single_process_world():
        hf, arch, chunks = _our_model(name, cfg)
        _random_adapters(chunks)
        ours = megatron_logits(chunks, ids)
        folder = export_peft_adapter(chunks, cfg, tmp_path / "adapter", base_model_name_or_path="tiny")
        merged = dict(export_merged_hf_weights(chunks, arch))
        after = megatron_logits(chunks, ids)  # the base came back exactly: same logits
        with L.adapters_disabled(chunks):
            base = megatron_logits(chunks, ids)
    assert torch.equal(after, ours)
    with torch.no_grad():
        base_hf = hf(ids).logits
        model = peft.PeftModel.from_pretrained(hf, folder).eval()
        got = model(ids).logits
    assert (base - base_hf).abs().max().item() < LOGITS_ATOL
    assert (ours - base_hf).abs().max().item() > 100 * LOGITS_ATOL  # the adapters matter (negative case)
    assert (got - ours).abs().max().item() < LOGITS_ATOL
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    # merged export == PEFT's merge_and_unload, tensor by tensor
    unloaded = model.merge_and_unload().state_dict()
    assert set(merged) <= set(unloaded)
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, unloaded[key], rtol=0, atol=1e-6, msg=key)


def test_peft_adapter_trained_elsewhere_imports_with_peft_logits(tmp_path):
    """A PEFT adapter made by peft itself (random non-zero B, rsLoRA, a subset of projections) as a warm start."""
    name = "qwen2_untied"
    hf = build_hf_model(name)
    config = peft.LoraConfig(r=4, lora_alpha=6, use_rslora=True, init_lora_weights=False,
                             target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    torch.manual_seed(7)
    model = peft.get_peft_model(hf, config).eval()
    model.save_pretrained(tmp_path / "adapter")
    ids = tokens()
    with torch.no_grad():
        expected = model(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
    assert (expected - base).abs().max().item() > 100 * LOGITS_ATOL

    arch = ModelArch.from_hf_config(TINY[name])
    cfg, tensors = read_peft_adapter(tmp_path / "adapter", arch.num_layers)
    assert cfg.projections == ("q", "v", "up", "fc2") and cfg.rank == 4 and cfg.use_rslora
    assert cfg.scaling == pytest.approx(6 / 2)
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
        L.add_lora_adapters(chunks, cfg)
        load_hf_weights(chunks, arch, build_hf_model(name).state_dict())
        load_peft_adapter(chunks, tmp_path / "adapter", cfg, arch.num_layers)
        got = megatron_logits(chunks, ids)
        with pytest.raises(ValueError, match="rank, projections, scaling"):
            load_peft_adapter(chunks, tmp_path / "adapter", L.LoraConfig(rank=4, target_modules=("q", "v")),
                              arch.num_layers)
    assert (got - expected).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("field, value", [("use_dora", True), ("bias", "all"), ("layers_to_transform", [0]),
                                          ("modules_to_save", ["lm_head"]), ("rank_pattern", {"q_proj": 8})])
def test_unsupported_peft_options_are_refused_by_name(field, value, tmp_path):
    hf = build_hf_model("llama_tied")
    model = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path)
    read_peft_adapter(tmp_path, 4)  # as saved: accepted
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    config[field] = value
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        read_peft_adapter(tmp_path, 4)


def test_adapter_for_a_subset_of_layers_is_refused(tmp_path):
    hf = build_hf_model("llama_tied")
    model = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "adapter_model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".layers.3." not in k}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="every layer"):
        read_peft_adapter(tmp_path, 4)


# ----------------------------------------------------------------------------------------------------------
# The rollout side: the HF engine with pushed adapters (rollout/lora.py, convert.peft.export_rollout_weights)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen2_untied", "llama_tied", "ministral_untied"])
def test_hf_rollout_engine_with_pushed_adapters_computes_peft_and_our_logits(name, tmp_path):
    """The first push carries the base and the adapters, later ones the adapters only (their parameters' bytes);
    the engine's unmerged adapters give PEFT's logits and the Megatron policy's, before and after the adapters
    change; adapters before a base, a missing adapter and adapters for a LoRA-less engine are refused."""
    from megatron_dppo.convert.peft import export_rollout_weights, peft_config
    from megatron_dppo.rollout import HFRolloutEngine
    from megatron_dppo.rollout.lora import nbytes

    cfg = L.LoraConfig(rank=4, alpha=8.0, target_modules=("qkv", "proj", "fc1", "fc2"))
    build_hf_model(name).save_pretrained(tmp_path / "hf")
    engine = HFRolloutEngine.from_pretrained(tmp_path / "hf", load_weights=False, lora=peft_config(cfg))
    ids = tokens()
    with single_process_world():
        hf, arch, chunks = _our_model(name, cfg)
        _random_adapters(chunks)
        ours = megatron_logits(chunks, ids)
        assert engine.needs_base
        with pytest.raises(ValueError, match="LoRA adapters pushed before the base weights"):
            engine.load_weights(export_rollout_weights(chunks, arch, base=False))
        first = list(export_rollout_weights(chunks, arch, base=True))
        assert engine.load_weights(iter(first)) == len(first) and not engine.needs_base
        folder = export_peft_adapter(chunks, cfg, tmp_path / "adapter")
        _random_adapters(chunks, seed=4)
        ours_after = megatron_logits(chunks, ids)
        adapters_only = list(export_rollout_weights(chunks, arch, base=False))
        adapter_bytes = 4 * sum(p.numel() for p in L.lora_parameters(chunks))
    assert len(adapters_only) == 2 * 7 * arch.num_layers and nbytes(adapters_only) == adapter_bytes
    with torch.no_grad():
        got = engine.model(ids).logits
        with_peft = peft.PeftModel.from_pretrained(hf, folder).eval()(ids).logits
    assert (got - with_peft).abs().max().item() < LOGITS_ATOL and (got - ours).abs().max().item() < LOGITS_ATOL
    base_before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.load_weights(iter(adapters_only))
    with torch.no_grad():
        got_after = engine.model(ids).logits
    assert (got_after - ours_after).abs().max().item() < LOGITS_ATOL
    assert (got_after - got).abs().max().item() > 100 * LOGITS_ATOL  # the new adapters are served (negative case)
    assert all(torch.equal(v, base_before[k]) for k, v in engine.model.state_dict().items())  # the base stayed
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(iter(adapters_only[1:]))
    plain = HFRolloutEngine.from_pretrained(tmp_path / "hf", load_weights=True)
    with pytest.raises(ValueError, match="engine built without lora"):
        plain.load_weights(iter(adapters_only))
