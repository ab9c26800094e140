"""Mixture-of-Experts conversion (Qwen3-MoE in both router variants, Mixtral): the rules name exactly the tensors
transformers writes, Megatron logits after import equal transformers', HF -> Megatron -> HF is bit-exact, and
under EP2, TP2, EP2xTP2, ETP2, EP2xETP2 and PP2xEP2 (gloo) the logits equal the single-process ones, each EP
rank reads only its own experts, and the streamed export (gathered over EP / expert-TP in small buckets) is the
full, bit-exact model."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from _dist import run_distributed, single_process_world
from _hf_models import TINY_MOE, hf_logits, megatron_logits, save_hf_model, tokens
from safetensors.torch import load_file, save_file

from megatron_dppo.convert import export_hf_weights, load_hf_weights
from megatron_dppo.convert.checkpoint import (
    arch_to_hf_config,
    convert_hf_to_megatron,
    convert_megatron_to_hf,
    load_hf_folder,
)
from megatron_dppo.convert.hf_io import HFCheckpoint
from megatron_dppo.convert.mapping import (
    LOCAL_SPEC,
    TE_SPEC,
    ExpertGatedMLPMapping,
    ExpertRowParallelMapping,
    MappingIndex,
    ReplicatedMapping,
    detect_spec,
    expected_hf_shapes,
    mapping_table,
    validate_hf_tensors,
)
from megatron_dppo.megatron.model import ModelArch, build_model_chunks
from megatron_dppo.megatron.parallel import ParallelConfig

LOGITS_ATOL = 1e-4  # vs transformers, fp32 (measured ~1e-6)
LAYOUT_ATOL = 1e-5  # Megatron under EP/TP vs Megatron single-process, fp32 (measured: see the printed figures)
SEQ = 12  # divisible by tp=2: sequence parallelism splits the sequence
NAMES = sorted(TINY_MOE)


def _arch(name: str) -> ModelArch:
    return ModelArch.from_hf_config(TINY_MOE[name])


def _folder_state(folder: Path) -> dict[str, torch.Tensor]:
    source = HFCheckpoint(folder)
    return {n: source.get(n) for n in source.shapes}


def _assert_bit_exact(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    bad = [n for n in expected if got[n].dtype != expected[n].dtype or not torch.equal(got[n], expected[n])]
    assert not bad, bad[:5]


# ------------------------------------------------------------------------------------------------------------
# rules
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_rules_name_exactly_the_tensors_transformers_writes(name, tmp_path):
    """Per-expert names, routers only in sparse layers, dense MLP only in dense layers; the TE spec's table
    expects the same HF tensors."""
    saved = HFCheckpoint(save_hf_model(name, tmp_path / "hf")).shapes
    arch = _arch(name)
    assert expected_hf_shapes(arch, LOCAL_SPEC) == saved
    assert expected_hf_shapes(arch, TE_SPEC) == saved
    validate_hf_tensors(saved, arch)


def test_te_spec_names_resolve_to_global_hf_names():
    """TEGroupedMLP's ``linear_fc1.weight<i>`` / ``linear_fc2.weight<i>``, the separate pre-MLP norm of sparse
    layers and the fused one of dense layers (Megatron-Core 0.16 gpt_layer_specs / moe/experts.py)."""
    arch = _arch("qwen3_moe")  # layer 1 is dense (mlp_only_layers)
    index = MappingIndex(mapping_table(arch, TE_SPEC))
    r = index.resolve("decoder.layers.2.mlp.experts.linear_fc1.weight3")
    assert isinstance(r.mapping, ExpertGatedMLPMapping) and (r.layer, r.local_expert) == (2, 3)
    assert r.mapping.hf_names(r.layer, 3) == {"gate": "model.layers.2.mlp.experts.3.gate_proj.weight",
                                              "up": "model.layers.2.mlp.experts.3.up_proj.weight"}
    r = index.resolve("decoder.layers.0.mlp.experts.linear_fc2.weight1")
    assert isinstance(r.mapping, ExpertRowParallelMapping) and r.local_expert == 1
    r = index.resolve("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight")  # TE without grouped GEMM
    assert isinstance(r.mapping, ExpertRowParallelMapping) and r.local_expert == 1
    r = index.resolve("decoder.layers.0.pre_mlp_layernorm.weight")
    assert r.mapping.hf_names(0) == {"weight": "model.layers.0.post_attention_layernorm.weight"}
    assert not r.mapping.exists_in_layer(arch, 1) and r.mapping.exists_in_layer(arch, 0)
    r = index.resolve("decoder.layers.1.mlp.linear_fc1.layer_norm_weight")
    assert r.mapping.exists_in_layer(arch, 1) and not r.mapping.exists_in_layer(arch, 0)
    r = index.resolve("decoder.layers.0.mlp.router.weight")
    assert isinstance(r.mapping, ReplicatedMapping) and r.mapping.hf_names(0) == {
        "weight": "model.layers.0.mlp.gate.weight"}
    mixtral = MappingIndex(mapping_table(_arch("mixtral"), LOCAL_SPEC))
    r = mixtral.resolve("decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight")
    assert r.mapping.hf_names(3, 2) == {"gate": "model.layers.3.block_sparse_moe.experts.2.w1.weight",
                                        "up": "model.layers.3.block_sparse_moe.experts.2.w3.weight"}
    assert detect_spec(["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                        "decoder.layers.0.mlp.experts.linear_fc1.weight0"]) == TE_SPEC


@pytest.mark.parametrize("etp", [1, 2, 4])
def test_expert_fc1_etp_shard_is_gate_shard_then_up_shard(etp):
    """Like the dense gated MLP: expert-TP rank t holds [gate_t; up_t]; fc2 splits its input features."""
    arch = _arch("mixtral")
    m = mapping_table(arch)
    fc1 = next(r for r in m if isinstance(r, ExpertGatedMLPMapping))
    fc2 = next(r for r in m if isinstance(r, ExpertRowParallelMapping))
    gate, up, down = torch.randn(32, 64), torch.randn(32, 64), torch.randn(64, 32)
    full = fc1.hf_to_megatron({"gate": gate, "up": up}, arch, None)
    shards = [fc1.shard(full, t, etp) for t in range(etp)]
    for t, s in enumerate(shards):
        assert torch.equal(s, torch.cat([gate.chunk(etp)[t], up.chunk(etp)[t]]))
    assert torch.equal(fc1.unshard(shards), full)
    assert torch.equal(fc2.unshard([fc2.shard(down, t, etp) for t in range(etp)]), down)
    assert torch.equal(fc2.shard(down, etp - 1, etp), down[:, -32 // etp:])


def _edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_validation_names_missing_extra_and_misshaped_experts(tmp_path):
    src = save_hf_model("qwen3_moe", tmp_path / "hf")
    prefix = "model.layers.0.mlp"

    def edit(t):
        t.pop(f"{prefix}.experts.3.up_proj.weight")
        t[f"{prefix}.experts.4.up_proj.weight"] = torch.zeros(32, 64)  # a fifth expert the config lacks
        t[f"{prefix}.gate.weight"] = torch.zeros(5, 64)
        t["model.layers.1.mlp.gate.weight"] = torch.zeros(4, 64)  # a router in the dense layer

    _edit_weights(src, edit)
    with pytest.raises(ValueError) as err:
        validate_hf_tensors(HFCheckpoint(src).shapes, _arch("qwen3_moe"))
    message = str(err.value)
    assert "4 problems" in message
    assert f"missing tensor '{prefix}.experts.3.up_proj.weight' (expected shape (32, 64))" in message
    assert f"unexpected tensor '{prefix}.experts.4.up_proj.weight'" in message
    assert "unexpected tensor 'model.layers.1.mlp.gate.weight'" in message
    assert f"shape mismatch for '{prefix}.gate.weight': checkpoint has (5, 64), the config implies (4, 64)" in message


# ------------------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers_and_streamed_export_is_bit_exact(name, tmp_path):
    """Import -> logits == transformers'; export in many small buckets == export in one == the HF files."""
    src = save_hf_model(name, tmp_path / "hf")
    arch = _arch(name)
    ids = tokens(length=SEQ)
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
        assert load_hf_folder(chunks, src, arch) == arch
        got = megatron_logits(chunks, ids)
        small = list(export_hf_weights(chunks, arch, bucket_bytes=16 * 1024))
        whole = dict(export_hf_weights(chunks, arch, bucket_bytes=1 << 30))
    diff = (got - hf_logits(src, ids)).abs().max().item()
    print(f"\n{name} tp1: max |logit diff| vs transformers = {diff:.2e}")
    assert diff <= LOGITS_ATOL
    assert len({n for n, _ in small}) == len(small)
    _assert_bit_exact(dict(small), whole)
    _assert_bit_exact(whole, _folder_state(src))


@pytest.mark.parametrize("name", NAMES)
def test_folder_round_trip_is_bit_exact_and_loads_in_transformers(name, tmp_path):
    """HF folder -> Megatron dist checkpoint -> HF folder: every tensor equal (names identical), and
    transformers' from_pretrained computes the same logits from it."""
    src = save_hf_model(name, tmp_path / "hf")
    with single_process_world():
        meg = convert_hf_to_megatron(src, tmp_path / "meg")
        back = convert_megatron_to_hf(meg, tmp_path / "back")
    _assert_bit_exact(_folder_state(back), _folder_state(src))
    ids = tokens(length=SEQ)
    assert torch.equal(hf_logits(back, ids), hf_logits(src, ids))
    assert json.loads((back / "config.json").read_text())["model_type"] == TINY_MOE[name]["model_type"]


@pytest.mark.parametrize("name", NAMES)
def test_streamed_export_fills_a_transformers_rollout_engine(name, tmp_path):
    """The per-expert stream (what vLLM takes) also fills transformers 5's fused in-memory experts of the CPU
    rollout engine: afterwards its every tensor equals the source model's; a stream lacking one expert's down
    projection is refused as incomplete."""
    from _hf_models import build_hf_model

    from megatron_dppo.rollout.hf_engine import HFRolloutEngine

    src = save_hf_model(name, tmp_path / "hf")
    arch = _arch(name)
    engine = HFRolloutEngine(build_hf_model(name, seed=1))  # other random weights
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
        load_hf_weights(chunks, arch, HFCheckpoint(src).get)
        stream = list(export_hf_weights(chunks, arch, bucket_bytes=16 * 1024))
    assert engine.load_weights(iter(stream)) == len(stream)
    expected = build_hf_model(name, seed=0).state_dict()
    got = engine.model.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[n], expected[n]) for n in expected)
    lacking = [(n, t) for n, t in stream if not n.endswith("experts.3.down_proj.weight")
               and not n.endswith("experts.3.w2.weight")]
    assert len(lacking) == len(stream) - arch.moe.num_sparse_layers
    with pytest.raises(ValueError, match="did not cover"):
        HFRolloutEngine(build_hf_model(name, seed=1)).load_weights(iter(lacking))


@pytest.mark.parametrize("change, field", [
    (dict(norm_topk_prob=False), "norm_topk_prob (moe_router_pre_softmax)"),
    (dict(mlp_only_layers=[2]), "mlp_only_layers / decoder_sparse_step (moe_layer_freq)"),
    (dict(num_experts_per_tok=1), "num_experts_per_tok (moe_router_topk)"),
    (dict(moe_intermediate_size=16), "moe_intermediate_size (moe_ffn_hidden_size)"),
])
def test_built_model_is_checked_against_the_moe_config(change, field):
    """A Megatron model that computes a different router / layer pattern than the HF config is refused by name."""
    from megatron_dppo.convert.validate import check_megatron_model

    arch = _arch("qwen3_moe")
    with single_process_world():
        (model,) = build_model_chunks(arch, ParallelConfig(), torch.float32)
        check_megatron_model(TINY_MOE["qwen3_moe"], arch, model)
        with pytest.raises(ValueError, match=re.escape(f"HF config field {field}")):
            check_megatron_model(dict(TINY_MOE["qwen3_moe"], **change), arch, model)


@pytest.mark.parametrize("name", NAMES)
def test_config_rebuilt_from_the_architecture_describes_the_same_model(name):
    """A training checkpoint carries only the ModelArch: the config.json rebuilt from it gives it back."""
    arch = _arch(name)
    cfg = arch_to_hf_config(arch)
    assert cfg["architectures"] == [{"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[
        arch.family]]
    assert ModelArch.from_hf_config(cfg) == arch


def test_cli_round_trip_and_expert_parallel_world_check(tmp_path, capsys):
    """The conversion tools take MoE folders (hf -> megatron -> hf bit-exact) and --ep / --etp: at ep=2 one
    process is refused with the world size the layout needs."""
    from megatron_dppo.convert.tools import hf_to_megatron_main, megatron_to_hf_main

    src = save_hf_model("mixtral", tmp_path / "hf")
    assert hf_to_megatron_main([str(src), str(tmp_path / "meg")]) == 0
    assert megatron_to_hf_main([str(tmp_path / "meg"), str(tmp_path / "back")]) == 0
    _assert_bit_exact(_folder_state(tmp_path / "back"), _folder_state(src))
    capsys.readouterr()
    assert hf_to_megatron_main([str(src), str(tmp_path / "out"), "--tp", "2", "--ep", "4"]) == 2
    assert (r"needs exactly lcm(tp, ep*etp)*pp=4 processes, this job has 1" in capsys.readouterr().err)
    assert hf_to_megatron_main([str(src), str(tmp_path / "out"), "--ep", "3"]) == 2
    assert "num_experts=4 is not divisible by ep=3" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_moe_training_checkpoint_exports_to_hf(tmp_path):
    """A PolicyEngine training checkpoint of an MoE policy converts back to HF bit-exact, also with the config
    rebuilt from the architecture the checkpoint records (its MoE part included)."""
    from megatron_dppo.megatron.checkpoint import save_checkpoint
    from megatron_dppo.megatron.engine import PolicyEngine

    src = save_hf_model("qwen3_moe", tmp_path / "hf")
    arch = _arch("qwen3_moe")
    with single_process_world():
        engine = PolicyEngine(arch, ParallelConfig(), dtype=torch.float32)
        load_hf_folder(engine.model_chunks, src, arch)
        save_checkpoint(engine, tmp_path / "train")
        from_arch = convert_megatron_to_hf(tmp_path / "train", tmp_path / "back_arch")
    _assert_bit_exact(_folder_state(from_arch), _folder_state(src))
    ids = tokens(length=SEQ)
    assert torch.equal(hf_logits(from_arch, ids), hf_logits(src, ids))


# ------------------------------------------------------------------------------------------------------------
# several processes (gloo)
# ------------------------------------------------------------------------------------------------------------
LAYOUTS = {  # name -> (tp, pp, ep, etp, sp); world lcm(tp, ep * etp) * pp: 2, or 4 for the last two
    "ep2xtp2": (2, 1, 2, 1, True),
    "ep2": (1, 1, 2, 1, False),
    "tp2": (2, 1, 1, 1, True),
    "etp2": (1, 1, 1, 2, False),
    "ep2xetp2": (1, 1, 2, 2, False),  # both expert gathers at once
    "pp2xep2": (1, 2, 2, 1, False),  # expert buckets broadcast over PP, then gathered over EP
}
# Fresh processes per case (~10 s of imports) and the per-model work: the default suite runs EP2xTP2 (experts over
# EP, attention over TP, a checkpoint written and exported at that layout) on Qwen3-MoE (dense and sparse layers);
# every layout on all three models is slow (~15-35 s each at world 2).
LAYOUT_CASES = [pytest.param("ep2xtp2", ("qwen3_moe",), id="ep2xtp2-qwen3_moe")] + [
    pytest.param(layout, tuple(NAMES), id=f"{layout}-all", marks=pytest.mark.slow) for layout in LAYOUTS]


def _worker(hf_dirs: dict[str, str], tp: int, pp: int, ep: int, etp: int, sp: bool, save_to: str | None):
    """Every rank, for every model: load its share, run the forward, export twice (small and large buckets)."""
    from megatron.core import parallel_state as ps

    from megatron_dppo.megatron.parallel import initialize_parallel

    out = {}
    for name, hf_dir in hf_dirs.items():
        source = HFCheckpoint(hf_dir)
        arch = ModelArch.from_hf_config(source.config)
        parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, sp=sp)
        initialize_parallel(parallel, seed=7, arch=arch)
        chunks = build_model_chunks(arch, parallel, torch.float32)
        read = load_hf_weights(chunks, arch, source.get)
        logits = megatron_logits(chunks, tokens(length=SEQ))  # None off the last pipeline stage
        start = time.perf_counter()
        small = list(export_hf_weights(chunks, arch, bucket_bytes=16 * 1024))
        seconds = time.perf_counter() - start
        whole = dict(export_hf_weights(chunks, arch, bucket_bytes=1 << 30))
        out[name] = {"logits": logits, "small": small, "whole": whole, "read": sorted(set(read)),
                     "ep_rank": ps.get_expert_model_parallel_rank(), "export_s": seconds}
    if save_to is not None:  # the last model, written at this layout (resharded to TP1/EP1 by the test) and
        convert_hf_to_megatron(hf_dir, save_to, tp=tp, ep=ep, etp=etp)  # exported back at this layout
        convert_megatron_to_hf(save_to, save_to + "_back", tp=tp, ep=ep, etp=etp)
    return out


def _experts_read(read: list[str]) -> set[int]:
    return {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}


@pytest.mark.multiproc
@pytest.mark.parametrize("layout, names", LAYOUT_CASES)
def test_layout_logits_and_export_equal_single_process(layout, names, tmp_path):
    from megatron_dppo.convert.checkpoint import conversion_world_size

    tp, pp, ep, etp, sp = LAYOUTS[layout]
    hf_dirs = {name: save_hf_model(name, tmp_path / name) for name in names}
    ids = tokens(length=SEQ)
    single = {}
    with single_process_world():
        for name, folder in hf_dirs.items():
            arch = _arch(name)
            chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
            load_hf_weights(chunks, arch, HFCheckpoint(folder).get)
            single[name] = megatron_logits(chunks, ids)
    save_to = tmp_path / "meg" if layout == "ep2xtp2" else None
    start = time.perf_counter()
    world = conversion_world_size(tp, pp, ep, etp)
    results = run_distributed(_worker, world_size=world, args=({n: str(d) for n, d in hf_dirs.items()}, tp, pp, ep,
                                                               etp, sp, str(save_to) if save_to else None),
                              timeout=400)
    print(f"\n{layout}: {time.perf_counter() - start:.1f} s for the {world}-rank run")
    for name, folder in hf_dirs.items():
        state = _folder_state(folder)
        reference = hf_logits(folder, ids)
        experts = _arch(name).moe.num_experts
        assert sum(result[name]["logits"] is not None for result in results) == world // pp
        for rank, result in enumerate(results):
            r = result[name]
            if r["logits"] is not None:  # every rank of the last pipeline stage
                vs_single = (r["logits"] - single[name]).abs().max().item()
                vs_hf = (r["logits"] - reference).abs().max().item()
                print(f"  {name} rank {rank}: max |logit diff| vs single process {vs_single:.2e}, vs transformers "
                      f"{vs_hf:.2e}; small-bucket export {r['export_s']:.2f} s")
                assert vs_single <= LAYOUT_ATOL and vs_hf <= LOGITS_ATOL
            # each EP rank reads exactly its own block of experts
            per_rank = experts // ep
            assert _experts_read(r["read"]) == set(range(r["ep_rank"] * per_rank, (r["ep_rank"] + 1) * per_rank))
            # every rank yields every expert of every layer, bit-exact, in small buckets as in one
            assert len({n for n, _ in r["small"]}) == len(r["small"])
            _assert_bit_exact(dict(r["small"]), r["whole"])
            _assert_bit_exact(r["whole"], state)
    if save_to is not None:  # the checkpoint written at tp2 x ep2 reads back at TP1/EP1 and at tp2 x ep2, bit-exact
        with single_process_world():
            back = convert_megatron_to_hf(save_to, tmp_path / "back")
        _assert_bit_exact(_folder_state(back), _folder_state(hf_dirs[names[-1]]))
        _assert_bit_exact(_folder_state(tmp_path / "meg_back"), _folder_state(hf_dirs[names[-1]]))
