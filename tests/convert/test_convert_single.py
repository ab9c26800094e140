"""Single-process conversion: HF logits == Megatron logits (TP1), bit-exact round trips, bad inputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _dist import single_process_world
from _hf_models import TINY, build_hf_model, hf_logits, megatron_logits, save_hf_model, tokens
from safetensors.torch import load_file, save_file

from megatron_dppo.convert import export_hf_weights, load_hf_weights
from megatron_dppo.convert.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf
from megatron_dppo.convert.hf_io import HFCheckpoint, portable_config
from megatron_dppo.megatron.model import ModelArch, build_model_chunks
from megatron_dppo.megatron.parallel import ParallelConfig

LOGITS_ATOL = 2e-5  # fp32; measured max |diff| ~1e-7 on these models


def _hf_state(model) -> dict[str, torch.Tensor]:
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


@pytest.mark.parametrize("name", sorted(TINY))
def test_tp1_logits_and_streaming_export(name):
    """Loading HF weights into a Megatron model reproduces HF logits; the export stream gives them back exactly."""
    hf = build_hf_model(name)
    arch = ModelArch.from_hf_config(TINY[name])
    ids = tokens()
    with torch.no_grad():
        expected = hf(ids).logits
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
        load_hf_weights(chunks, arch, hf.state_dict())
        got = megatron_logits(chunks, ids)
        exported = list(export_hf_weights(chunks, arch, bucket_bytes=64 * 1024))  # several buckets
    assert (got - expected).abs().max().item() < LOGITS_ATOL
    names = [n for n, _ in exported]
    assert len(names) == len(set(names))
    state = _hf_state(hf)
    assert set(names) == set(state)
    assert all(torch.equal(t, state[n]) for n, t in exported)


def test_load_hf_folder_matches_and_checks_arch(tmp_path):
    from megatron_dppo.convert.checkpoint import load_hf_folder

    src = save_hf_model("qwen3_untied", tmp_path / "hf")
    arch = ModelArch.from_hf_config(TINY["qwen3_untied"])
    ids = tokens()
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
        assert load_hf_folder(chunks, src, arch) == arch
        assert (megatron_logits(chunks, ids) - hf_logits(src, ids)).abs().max().item() < LOGITS_ATOL
        other = ModelArch.from_hf_config(dict(TINY["qwen3_untied"], rope_theta=5.0))
        with pytest.raises(ValueError, match="rope_theta"):
            load_hf_folder(chunks, src, other)


def _assert_same_folder_weights(a: Path, b: Path) -> None:
    x, y = HFCheckpoint(a), HFCheckpoint(b)
    assert set(x.shapes) == set(y.shapes)
    for n in x.shapes:
        assert torch.equal(x.get(n), y.get(n)), n
        assert x.get(n).dtype == y.get(n).dtype, n


@pytest.mark.parametrize("name", ["llama_tied", "qwen2_untied", "qwen3_tied"])
def test_folder_round_trip_is_bit_exact(name, tmp_path):
    """HF folder -> Megatron dist checkpoint -> HF folder: every tensor equal, config and tokenizer carried,
    transformers loads the result and computes the same logits."""
    src = save_hf_model(name, tmp_path / "hf")
    with single_process_world():
        meg = convert_hf_to_megatron(src, tmp_path / "meg")
        back = convert_megatron_to_hf(meg, tmp_path / "back")
    assert sorted(p.name for p in meg.iterdir()) == ["hf", "megatron_dppo.json", "model"]
    assert not list(tmp_path.glob(".*partial"))
    _assert_same_folder_weights(src, back)
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        assert (back / f).read_text() == (src / f).read_text()
    src_cfg, back_cfg = (json.loads((d / "config.json").read_text()) for d in (src, back))
    assert back_cfg == portable_config(src_cfg, torch.float32)  # + the transformers-4.x spellings
    assert back_cfg["rope_theta"] == TINY[name]["rope_theta"] and back_cfg["torch_dtype"] == "float32"
    ids = tokens()
    assert torch.equal(hf_logits(back, ids), hf_logits(src, ids))


def test_bf16_source_round_trips_exactly_in_bf16(tmp_path):
    """A bf16 checkpoint goes through the fp32 Megatron checkpoint and comes back in bf16, bit for bit."""
    hf = build_hf_model("qwen2_tied").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    with single_process_world():
        convert_hf_to_megatron(tmp_path / "hf", tmp_path / "meg")
        convert_megatron_to_hf(tmp_path / "meg", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"
    _assert_same_folder_weights(tmp_path / "hf", tmp_path / "back")


# ------------------------------------------------------------------------------------------------------------
# bad inputs: a ValueError naming the problem, and nothing left behind
# ------------------------------------------------------------------------------------------------------------
def _edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


BAD_INPUTS = {
    "missing": (lambda d: _edit_weights(d, lambda t: t.pop("model.layers.2.mlp.up_proj.weight")), {},
                "missing tensor 'model.layers.2.mlp.up_proj.weight'"),
    "unexpected": (lambda d: _edit_weights(d, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(2)})),
                   {}, "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
    "shape": (lambda d: _edit_weights(d, lambda t: t.update(
        {"model.layers.1.self_attn.k_proj.weight": torch.zeros(48, 64)})), {},
        r"shape mismatch for 'model.layers.1.self_attn.k_proj.weight': checkpoint has \(48, 64\)"),
    "config_vs_tensors": (lambda d: _edit_config(d, intermediate_size=80), {},
                          r"shape mismatch for 'model.layers.0.mlp.gate_proj.weight'.*\(96, 64\).*\(80, 64\)"),
    "model_type": (lambda d: _edit_config(d, model_type="gpt2"), {}, "model_type='gpt2' is not supported"),
    "activation": (lambda d: _edit_config(d, hidden_act="gelu"), {}, "hidden_act='gelu'"),
    "tp_heads": (lambda d: None, {"tp": 3}, "num_attention_heads=4 is not divisible by tp=3"),
    "pp_layers": (lambda d: None, {"pp": 3}, "num_layers=4 is not divisible by pp=3"),
    "world_size": (lambda d: None, {"tp": 2}, r"needs exactly tp\*pp=2 processes, this job has 1"),
    # damaged downloads / copies: one clear error naming the file, never a safetensors or OS traceback
    "truncated_data": (lambda d: _truncate(d / "model.safetensors", -1000), {},
                       r"model.safetensors \(\d+ bytes\) is not a readable safetensors file.*truncated or corrupt"),
    "truncated_header": (lambda d: _truncate(d / "model.safetensors", 20), {},
                         r"model.safetensors \(20 bytes\) is not a readable safetensors file.*invalid header"),
    "index_missing_shard": (lambda d: _split_with_missing_shard(d), {},
                            r"index.json names shard file\(s\) that do not exist: model-00002-of-00002"),
    "config_not_json": (lambda d: (d / "config.json").write_text('{"model_type": llama}'), {},
                        r"hf/config.json: not valid JSON \(Expecting value at line 1 column 16\)"),
    "config_not_an_object": (lambda d: (d / "config.json").write_text("[1, 2]"), {},
                             r"hf/config.json: expected a JSON object .* got list"),
}


def _truncate(path: Path, size: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:size])


def _split_with_missing_shard(folder: Path) -> None:
    """An index naming two shards, of which only the first was downloaded."""
    names = sorted(load_file(folder / "model.safetensors"))
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_and_leaves_no_directory(case, tmp_path):
    src = save_hf_model("llama_untied", tmp_path / "hf")
    corrupt, kwargs, message = BAD_INPUTS[case]
    corrupt(src)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        convert_hf_to_megatron(src, out, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_existing_output_is_refused_and_kept(tmp_path):
    src = save_hf_model("llama_tied", tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="output directory already exists"):
        convert_hf_to_megatron(src, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_megatron_to_hf_errors(tmp_path):
    with pytest.raises(ValueError, match="no Megatron dist checkpoint"):
        convert_megatron_to_hf(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_megatron_checkpoint_with_a_damaged_distcp_file_is_a_clear_error(damage, tmp_path):
    src = save_hf_model("llama_tied", tmp_path / "hf")
    with single_process_world():
        convert_hf_to_megatron(src, tmp_path / "meg")
    shard = sorted((tmp_path / "meg" / "model").glob("*.distcp"))[0]
    if damage == "missing":
        shard.unlink()
        message = rf"model is incomplete: missing {shard.name} \(of the \d+ files its .metadata names\)"
    else:
        _truncate(shard, shard.stat().st_size // 2)
        message = rf"model is incomplete: truncated {shard.name} \(\d+ of \d+ bytes\)"
    with single_process_world(), pytest.raises(ValueError, match=message):
        convert_megatron_to_hf(tmp_path / "meg", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failure_after_start_removes_partial_output(tmp_path, monkeypatch):
    """An error while writing (here: a failing tokenizer copy) removes the temporary folder."""
    from megatron_dppo.convert import checkpoint

    src = save_hf_model("llama_tied", tmp_path / "hf")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "copy_tokenizer_files", boom)
    with single_process_world(), pytest.raises(OSError, match="disk full"):
        convert_hf_to_megatron(src, tmp_path / "meg")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_cli_reports_error_with_status_2(tmp_path, capsys):
    from megatron_dppo.convert.tools import hf_to_megatron_main

    src = save_hf_model("llama_tied", tmp_path / "hf")
    _edit_config(src, model_type="gpt_oss")  # a refused family: named with the reason (mistral is supported now)
    assert hf_to_megatron_main([str(src), str(tmp_path / "out"), "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: HF config" in err and "model_type='gpt_oss' is refused: gpt-oss needs attention sinks" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_training_checkpoint_exports_to_hf(tmp_path):
    """A PolicyEngine training checkpoint (DDP-wrapped chunks, step_N/latest layout) converts back to HF:
    bit-exact with the original config, and loadable with a config rebuilt from the recorded architecture."""
    from megatron_dppo.convert.checkpoint import load_hf_folder
    from megatron_dppo.megatron.checkpoint import save_checkpoint
    from megatron_dppo.megatron.engine import PolicyEngine

    src = save_hf_model("qwen2_tied", tmp_path / "hf")
    arch = ModelArch.from_hf_config(TINY["qwen2_tied"])
    with single_process_world():
        engine = PolicyEngine(arch, ParallelConfig(), dtype=torch.float32)
        load_hf_folder(engine.model_chunks, src, arch)
        streamed = dict(export_hf_weights(engine.model_chunks, arch))
        save_checkpoint(engine, tmp_path / "train")
        with_cfg = convert_megatron_to_hf(tmp_path / "train", tmp_path / "back", hf_config=src)
        from_arch = convert_megatron_to_hf(tmp_path / "train", tmp_path / "back_arch")
    _assert_same_folder_weights(src, with_cfg)
    assert (with_cfg / "tokenizer_config.json").is_file()
    source = HFCheckpoint(src)
    assert all(torch.equal(streamed[n], source.get(n)) for n in source.shapes) and set(streamed) == set(source.shapes)
    _assert_same_folder_weights(src, from_arch)
    ids = tokens()
    assert torch.equal(hf_logits(from_arch, ids), hf_logits(src, ids))
