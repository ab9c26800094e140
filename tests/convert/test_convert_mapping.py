"""Mapping rules on plain tensors (no Megatron process groups): layouts, TP sharding, tables, validation."""
from __future__ import annotations

import json

import pytest
import torch
from _hf_models import TINY, build_hf_model

from megatron_dppo.convert.hf_io import HFCheckpoint, write_safetensors_shards
from megatron_dppo.convert.mapping import (
    TE_SPEC,
    GatedMLPMapping,
    MappingIndex,
    QKVMapping,
    VocabParallelMapping,
    detect_spec,
    expected_hf_shapes,
    mapping_table,
    validate_hf_tensors,
)
from megatron_dppo.megatron.model import ModelArch


def _arch(name: str, **changes) -> ModelArch:
    return ModelArch.from_hf_config(dict(TINY[name], **changes))


@pytest.mark.parametrize("name", sorted(TINY))
def test_table_names_and_shapes_equal_the_transformers_model(name):
    """The table's HF names/shapes are exactly the transformers model's parameters (lm_head absent when tied)."""
    model = build_hf_model(name)
    actual = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if TINY[name]["tie_word_embeddings"]:
        actual.pop("lm_head.weight")
    assert expected_hf_shapes(_arch(name)) == actual


def test_qkv_layout_is_per_query_group_interleaved():
    """Rows of linear_qkv: [q heads of group 0, k0, v0, q heads of group 1, k1, v1] (attention.py layout)."""
    arch = _arch("llama_untied", hidden_size=8, num_attention_heads=4, num_key_value_heads=2)  # d=2, r=2
    d = arch.head_dim
    q = torch.arange(4 * d).float().view(4 * d, 1)          # query head h has rows [h*d, (h+1)*d)
    k = 100 + torch.arange(2 * d).float().view(2 * d, 1)
    v = 200 + torch.arange(2 * d).float().view(2 * d, 1)
    m = QKVMapping("x", {"q": "q", "k": "k", "v": "v"}, {})
    fused = m.hf_to_megatron({"q": q, "k": k, "v": v}, arch, None).flatten().tolist()
    expected = ([0, 1, 2, 3] + [100, 101] + [200, 201]      # group 0: q heads 0,1, k0, v0
                + [4, 5, 6, 7] + [102, 103] + [202, 203])   # group 1: q heads 2,3, k1, v1
    assert fused == expected
    back = m.megatron_to_hf(torch.tensor(expected).float().view(-1, 1), arch)
    assert torch.equal(back["q"], q) and torch.equal(back["k"], k) and torch.equal(back["v"], v)
    # TP=2: rank t holds whole groups (its own q heads with their k, v)
    assert m.shard(torch.tensor(expected), 1, 2).tolist() == expected[8:]


def test_qkv_bias_round_trip_mha_and_gqa():
    for kv in (1, 2, 4):
        arch = _arch("qwen2_untied", num_key_value_heads=kv)
        m = QKVMapping("x", {"q": "q", "k": "k", "v": "v"}, {})
        q, k, v = torch.randn(64), torch.randn(kv * 16), torch.randn(kv * 16)
        back = m.megatron_to_hf(m.hf_to_megatron({"q": q, "k": k, "v": v}, arch, None), arch)
        assert all(torch.equal(a, b) for a, b in zip((back["q"], back["k"], back["v"]), (q, k, v)))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_mlp_tp_shard_is_gate_shard_then_up_shard(tp):
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    m = GatedMLPMapping("x", {"gate": "g", "up": "u"}, {})
    full = m.hf_to_megatron({"gate": gate, "up": up}, None, None)
    shards = [m.shard(full, t, tp) for t in range(tp)]
    for t, s in enumerate(shards):  # Megatron chunks each rank's local output in two: silu(first) * second
        assert torch.equal(s, torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]]))
    assert torch.equal(m.unshard(shards), full)
    back = m.megatron_to_hf(m.unshard(shards), None)
    assert torch.equal(back["gate"], gate) and torch.equal(back["up"], up)


def test_vocab_padding_added_on_import_and_removed_on_export():
    arch = _arch("llama_untied")
    m = VocabParallelMapping("x", {"weight": "w"}, {})
    w = torch.randn(arch.vocab_size, 4)
    full = m.hf_to_megatron({"weight": w}, arch, (arch.vocab_size + 6, 4))
    assert full.shape == (arch.vocab_size + 6, 4) and torch.count_nonzero(full[arch.vocab_size:]) == 0
    assert torch.equal(m.megatron_to_hf(full, arch)["weight"], w)


def test_spec_detection_and_te_names():
    arch = _arch("qwen3_tied")
    te_names = ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"]
    assert detect_spec(te_names + ["embedding.word_embeddings.weight"]) == TE_SPEC
    assert detect_spec(["decoder.layers.0.input_layernorm.weight"]) == "local"
    index = MappingIndex(mapping_table(arch, TE_SPEC))
    m, layer = index.lookup("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
    assert layer == 3 and m.hf_names(layer) == {"weight": "model.layers.3.input_layernorm.weight"}
    m, layer = index.lookup("decoder.layers.2.mlp.linear_fc1.layer_norm_weight")
    assert m.hf_names(layer) == {"weight": "model.layers.2.post_attention_layernorm.weight"}
    m, layer = index.lookup("decoder.layers.1.self_attention.k_layernorm.weight")
    assert m.hf_names(layer) == {"weight": "model.layers.1.self_attn.k_norm.weight"}
    # the same names in both specs produce the same HF checkpoint
    assert expected_hf_shapes(arch, TE_SPEC) == expected_hf_shapes(arch)
    with pytest.raises(ValueError, match="no HF mapping for Megatron parameter 'decoder.layers.0.input_layernorm"):
        index.lookup("decoder.layers.0.input_layernorm.weight")


def test_validate_names_every_problem():
    arch = _arch("qwen2_untied")
    shapes = dict(expected_hf_shapes(arch))
    del shapes["model.layers.1.self_attn.k_proj.bias"]
    shapes["model.layers.0.mlp.extra.weight"] = (3, 3)
    shapes["model.layers.2.mlp.up_proj.weight"] = (80, 64)
    shapes["model.layers.0.self_attn.rotary_emb.inv_freq"] = (8,)  # an old transformers buffer: tolerated
    with pytest.raises(ValueError) as err:
        validate_hf_tensors(shapes, arch)
    text = str(err.value)
    assert "missing tensor 'model.layers.1.self_attn.k_proj.bias'" in text
    assert "unexpected tensor 'model.layers.0.mlp.extra.weight'" in text
    assert "shape mismatch for 'model.layers.2.mlp.up_proj.weight': checkpoint has (80, 64)" in text
    assert "(96, 64)" in text and "inv_freq" not in text


def test_validate_tolerates_lm_head_only_when_tied():
    tied, untied = _arch("llama_tied"), _arch("llama_untied")
    shapes = dict(expected_hf_shapes(tied), **{"lm_head.weight": (128, 64)})
    validate_hf_tensors(shapes, tied)
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        validate_hf_tensors(expected_hf_shapes(tied), untied)


def test_family_flags_must_match_table():
    arch = _arch("llama_untied")
    with pytest.raises(ValueError, match="family 'llama' expects"):
        mapping_table(type(arch)(**{**arch.__dict__, "qkv_bias": True}))


def test_sharded_safetensors_writer(tmp_path):
    tensors = [(f"t{i}", torch.full((256,), float(i))) for i in range(5)]  # 1 KiB each
    weight_map = write_safetensors_shards(iter(tensors), tmp_path, max_shard_bytes=2048)
    files = sorted(set(weight_map.values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map and index["metadata"]["total_size"] == 5 * 1024
    (tmp_path / "config.json").write_text("{}")
    ckpt = HFCheckpoint(tmp_path)
    assert all(torch.equal(ckpt.get(n), t) for n, t in tensors)
    with pytest.raises(ValueError, match="written twice"):
        write_safetensors_shards(iter(tensors + tensors[:1]), tmp_path / "x")


def test_gguf_errors_leave_nothing(tmp_path):
    from megatron_dppo.convert.gguf import gguf_to_hf

    with pytest.raises(ValueError, match="GGUF file not found"):
        gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "model.gguf").write_bytes(b"x")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="output directory already exists"):
        gguf_to_hf(tmp_path / "model.gguf", tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "taken"]
