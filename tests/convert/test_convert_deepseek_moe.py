"""deepseek_v3 (multi-latent attention with and without q-LoRA, YaRN) and glm4_moe (q/k norm, q/k/v bias, partial
rotary), both with the sigmoid router's expert bias, group-limited routing, routed scaling, shared experts and a
dense first layer: the rules name exactly the tensors transformers writes, Megatron THD log-probs on packed
sequences of different lengths equal transformers', HF -> Megatron -> HF is bit-exact at TP1 and under TP2 x EP2,
TP2, PP2, EP2 (gloo), and each distinctive feature turned off in the Megatron config makes the logits check fail
(the negative controls). Refusals by name of what cannot be represented."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from _deepseek_models import TINY_DEEPSEEK, save_hf_model
from _dist import run_distributed, single_process_world
from _hf_models import megatron_logits, tokens

from megatron_dppo.convert import export_hf_weights, load_hf_weights
from megatron_dppo.convert.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf, load_hf_folder
from megatron_dppo.convert.hf_io import HFCheckpoint
from megatron_dppo.convert.mapping import LOCAL_SPEC, TE_SPEC, MappingIndex, expected_hf_shapes, validate_hf_tensors
from megatron_dppo.megatron.model import ModelArch, build_model_chunks
from megatron_dppo.megatron.parallel import ParallelConfig

LOGITS_ATOL = 1e-4  # vs transformers, fp32 (measured ~1e-6)
FAILS_ABOVE = 1e-2  # a negative control must move some log-prob by more than this (measured: see the printout)
NAMES = sorted(TINY_DEEPSEEK)
LENGTHS = (5, 17, 11, 23)  # packed, of different lengths, longer than the YaRN model's original 8 positions
SEQ = 12
# default suite: one MLA and one GLM model; the other variants (no q-LoRA, YaRN, GLM plain) are slow
FAST = ("deepseek_v3", "glm4_moe")
NAMES_FAST_FIRST = [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in NAMES]


def _arch(name: str) -> ModelArch:
    return ModelArch.from_hf_config(TINY_DEEPSEEK[name])


def _state(folder: Path) -> dict[str, torch.Tensor]:
    source = HFCheckpoint(folder)
    return {n: source.get(n) for n in source.shapes}


def _assert_bit_exact(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    bad = [n for n in expected if got[n].dtype != expected[n].dtype or not torch.equal(got[n], expected[n])]
    assert not bad, bad[:5]


def _sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in LENGTHS]


def _hf_logprobs(folder: Path, seqs) -> list[torch.Tensor]:
    """transformers' log p(next token) of each sequence run alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None]).squeeze(-1))
    return out


def _thd_logprobs(chunks, seqs) -> list[torch.Tensor]:
    """Megatron's log p(next token) of each sequence, all packed in one THD micro-batch (padded to 4)."""
    from megatron_dppo.megatron.logprobs import forward_thd, vocab_parallel_logprobs
    from megatron_dppo.packing import build_thd_batch

    batch = build_thd_batch(seqs, [1] * len(seqs), list(range(len(seqs))), [0.0] * len(seqs), [1.0] * len(seqs),
                            pad_multiple=4)
    (model,) = chunks
    model.eval()
    with torch.no_grad():
        logp, _ = vocab_parallel_logprobs(forward_thd(model, batch), batch.labels)
    starts = batch.cu_seqlens_padded[:-1].tolist()
    return [logp[a:a + len(s) - 1] for a, s in zip(starts, seqs)]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------------------
# rules
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_rules_name_exactly_the_tensors_transformers_writes(name, tmp_path):
    """Every tensor of the saved checkpoint, with its shape, for the local and the TE spec's tables."""
    saved = HFCheckpoint(save_hf_model(name, tmp_path / "hf")).shapes
    arch = _arch(name)
    assert expected_hf_shapes(arch, LOCAL_SPEC) == saved
    assert expected_hf_shapes(arch, TE_SPEC) == saved
    validate_hf_tensors(saved, arch)


def test_te_spec_names_of_multi_latent_attention():
    """Megatron-Core 0.16's TE MLA spec: separate input norm, replicated down projections, latent norms fused
    into the up projections."""
    from megatron_dppo.convert.mapping import detect_spec, mapping_table

    arch = _arch("deepseek_v3")
    index = MappingIndex(mapping_table(arch, TE_SPEC))
    a = "decoder.layers.1.self_attention."
    for name, hf in [(a + "linear_q_up_proj.layer_norm_weight", "model.layers.1.self_attn.q_a_layernorm.weight"),
                     (a + "linear_kv_up_proj.layer_norm_weight", "model.layers.1.self_attn.kv_a_layernorm.weight"),
                     (a + "linear_q_down_proj.weight", "model.layers.1.self_attn.q_a_proj.weight"),
                     ("decoder.layers.2.mlp.router.expert_bias", "model.layers.2.mlp.gate.e_score_correction_bias"),
                     ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                      "model.layers.0.post_attention_layernorm.weight")]:
        resolved = index.resolve(name)
        assert list(resolved.mapping.hf_names(resolved.layer).values()) == [hf]
    assert index.resolve(a + "linear_q_down_proj.weight").mapping.tp_dim is None  # TELinear, duplicated
    assert detect_spec([a + "linear_kv_up_proj.layer_norm_weight"]) == TE_SPEC  # every layer sparse: no fc1 norm
    local = MappingIndex(mapping_table(arch, LOCAL_SPEC))
    assert local.resolve(a + "linear_q_down_proj.weight").mapping.tp_dim is None  # Linear (deepseek_moe.py)


def test_mtp_layers_are_ignored_on_import(tmp_path):
    """The released checkpoints carry num_nextn_predict_layers MTP layers as model.layers.<L + i>: tolerated (as
    transformers ignores them); a layer beyond them is still an unexpected tensor."""
    arch = _arch("deepseek_v3")
    assert arch.mtp_layers == 1
    shapes = dict(expected_hf_shapes(arch))
    validate_hf_tensors({**shapes, "model.layers.4.eh_proj.weight": (64, 128)}, arch)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.5.eh_proj.weight'"):
        validate_hf_tensors({**shapes, "model.layers.5.eh_proj.weight": (64, 128)}, arch)


# ------------------------------------------------------------------------------------------------------------
# against transformers, one process
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES_FAST_FIRST)
def test_thd_logprobs_equal_transformers_and_export_is_bit_exact(name, tmp_path):
    """Packed THD log-probs == transformers' per sequence; sbhd logits too; the streamed export (small buckets
    and one) == the HF files, bit for bit."""
    src = save_hf_model(name, tmp_path / "hf")
    arch = _arch(name)
    seqs = _sequences()
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
        assert load_hf_folder(chunks, src, arch) == arch
        got = _thd_logprobs(chunks, seqs)
        small = list(export_hf_weights(chunks, arch, bucket_bytes=16 * 1024))
        whole = dict(export_hf_weights(chunks, arch, bucket_bytes=1 << 30))
    diff = _max_diff(got, _hf_logprobs(src, seqs))
    print(f"\n{name}: packed THD max |log-prob diff| vs transformers = {diff:.2e}")
    assert diff <= LOGITS_ATOL
    assert len({n for n, _ in small}) == len(small)
    _assert_bit_exact(dict(small), whole)
    _assert_bit_exact(whole, _state(src))


@pytest.mark.parametrize("name", ["deepseek_v3", pytest.param("deepseek_v3_noqlora", marks=pytest.mark.slow),
                                  pytest.param("glm4_moe_plain", marks=pytest.mark.slow)])
def test_folder_round_trip_is_bit_exact(name, tmp_path):
    """HF folder -> Megatron dist checkpoint -> HF folder: every tensor equal; the config is the original."""
    src = save_hf_model(name, tmp_path / "hf")
    with single_process_world():
        meg = convert_hf_to_megatron(src, tmp_path / "meg")
        back = convert_megatron_to_hf(meg, tmp_path / "back")
    _assert_bit_exact(_state(back), _state(src))
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == TINY_DEEPSEEK[name]["model_type"]
    assert config.get("q_lora_rank", "absent") == TINY_DEEPSEEK[name].get("q_lora_rank", "absent")


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_streamed_export_fills_a_transformers_rollout_engine(name, tmp_path):
    """The stream pushed to the rollout engines (HF names, per expert: what vLLM's deepseek_v3 / glm4_moe loaders
    read) fills transformers' fused in-memory experts and the expert-bias buffer: every tensor equals the
    source's."""
    from _deepseek_models import build_hf_model

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
    assert any(n.endswith("e_score_correction_bias") for n in got)
    assert set(got) == set(expected) and all(torch.equal(got[n], expected[n]) for n in expected)


def test_vllm_push_check_knows_the_per_expert_names(tmp_path):
    """The vLLM engine checks each pushed name against the model: it must know the per-expert names of the
    checkpoint and of the export (transformers 5 keeps the experts fused in memory: they were all refused)."""
    from megatron_dppo.rollout.vllm_engine import expected_hf_weights

    src = save_hf_model("glm4_moe", tmp_path / "hf")
    expected = expected_hf_weights(src)
    shapes = HFCheckpoint(src).shapes
    assert all(expected[n] == tuple(s) for n, s in shapes.items())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in expected


def test_lora_is_refused_for_multi_latent_attention():
    from megatron_dppo.megatron.lora import LoraConfig, check_lora_supported

    with pytest.raises(ValueError, match="multi-latent attention"):
        check_lora_supported(_arch("deepseek_v3"), ParallelConfig(), LoraConfig(rank=4, target_modules=("qkv",)))
    check_lora_supported(_arch("glm4_moe"), ParallelConfig(), LoraConfig(rank=4, target_modules=("qkv", "proj")))


# ------------------------------------------------------------------------------------------------------------
# negative controls: one distinctive feature off in the Megatron config -> the check fails
# ------------------------------------------------------------------------------------------------------------
def _compose_q(state: dict, arch: ModelArch) -> dict:
    """q-LoRA ignored: a full-rank q_proj = q_b_proj @ q_a_proj (the latent norm between them dropped)."""
    out = dict(state)
    for layer in range(arch.num_layers):
        p = f"model.layers.{layer}.self_attn."
        out[p + "q_proj.weight"] = out.pop(p + "q_b_proj.weight") @ out.pop(p + "q_a_proj.weight")
        out.pop(p + "q_a_layernorm.weight")
    return out


NEGATIVE = {  # id -> (model, TransformerConfig overrides, ModelArch changes)
    "expert_bias_off": ("deepseek_v3", dict(moe_router_enable_expert_bias=False), {}),
    "sigmoid_to_softmax": ("deepseek_v3", dict(moe_router_score_function="softmax",
                                               moe_router_enable_expert_bias=False), {}),
    "shared_experts_off": ("deepseek_v3", dict(moe_shared_expert_intermediate_size=None), {}),
    "group_limit_off": ("deepseek_v3", dict(moe_router_num_groups=None, moe_router_group_topk=None), {}),
    "routed_scaling_off": ("deepseek_v3", dict(moe_router_topk_scaling_factor=None), {}),
    "latent_norms_off": ("deepseek_v3", dict(qk_layernorm=False), {}),
    "q_lora_ignored": ("deepseek_v3", dict(q_lora_rank=None), {"q_lora": None}),
    "yarn_off": ("deepseek_v3_yarn", dict(rope_type="rope"), {}),
    "glm_expert_bias_off": ("glm4_moe", dict(moe_router_enable_expert_bias=False), {}),
    "glm_qk_norm_off": ("glm4_moe", dict(qk_layernorm=False), {}),
    "glm_qkv_bias_off": ("glm4_moe", dict(add_qkv_bias=False), {}),
    "glm_partial_rotary_off": ("glm4_moe", {}, {"rotary_percent": 1.0}),
}


@pytest.mark.parametrize("case", sorted(NEGATIVE))
def test_negative_control_feature_off_fails_the_check(case, tmp_path):
    name, overrides, arch_changes = NEGATIVE[case]
    src = save_hf_model(name, tmp_path / "hf")
    arch = _arch(name)
    state = _state(src)
    load_arch = arch
    if "q_lora" in arch_changes:
        load_arch = dataclasses.replace(arch, mla=dataclasses.replace(arch.mla, q_lora_rank=None))
        state = _compose_q(state, arch)
    elif arch_changes:
        load_arch = dataclasses.replace(arch, **arch_changes)
    seqs = _sequences()
    with single_process_world():
        chunks = build_model_chunks(load_arch, ParallelConfig(), torch.float32, **overrides)
        load_hf_weights(chunks, load_arch, state)
        got = _thd_logprobs(chunks, seqs)
    diff = _max_diff(got, _hf_logprobs(src, seqs))
    print(f"\n{case}: max |log-prob diff| vs transformers = {diff:.2e}")
    assert diff > FAILS_ABOVE


def test_negative_control_rope_interleave_false_is_refused_and_would_differ(tmp_path):
    """rope_interleave=False is refused by name; read as if it were True (what Megatron's MLA computes), the
    log-probs differ from transformers'."""
    cfg = dict(TINY_DEEPSEEK["deepseek_v3"], rope_interleave=False)
    with pytest.raises(ValueError, match="rope_interleave=False"):
        ModelArch.from_hf_config(cfg)
    from _deepseek_models import build_hf_model
    from transformers import AutoConfig

    model = build_hf_model("deepseek_v3")
    model.config.rope_interleave = False
    src = tmp_path / "hf"
    model.save_pretrained(src)
    assert AutoConfig.from_pretrained(src).rope_interleave is False
    arch = _arch("deepseek_v3")
    seqs = _sequences()
    with single_process_world():
        chunks = build_model_chunks(arch, ParallelConfig(), torch.float32)
        load_hf_weights(chunks, arch, _state(src))
        got = _thd_logprobs(chunks, seqs)
    assert _max_diff(got, _hf_logprobs(src, seqs)) > FAILS_ABOVE


# ------------------------------------------------------------------------------------------------------------
# refusals by name
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, match", [
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"n_group": 4, "topk_group": 2}, "num_experts_per_tok == 2 \\* topk_group"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0, "long_factor": [1.0] * 4,
                          "short_factor": [1.0] * 4, "original_max_position_embeddings": 64}}, "longrope"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 64}}, "mscale"),
])
def test_deepseek_fields_megatron_cannot_represent_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config(dict(TINY_DEEPSEEK["deepseek_v3"], **changes))


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear", "minimax", "deepseek_v32", "qwen3_5_moe"])
def test_refused_model_types_are_named(model_type):
    with pytest.raises(ValueError, match=f"model_type='{model_type}' is refused: .*"):
        ModelArch.from_hf_config({"model_type": model_type})


@pytest.mark.parametrize("name, changes, match", [
    ("qwen3_untied", {"attention_bias": True}, "attention_bias=True \\(qwen3: bias on q, k, v and o_proj\\)"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=True \\(qwen3_moe"),
    ("qwen3_untied", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen3_untied", {"layer_types": ["full_attention", "sliding_attention"] * 2}, "full_attention layers"),
])
def test_newest_qwen_fields_are_read_or_refused(name, changes, match):
    """Fields of transformers 5.19's qwen3 / qwen3_moe configs a bias-free, full-attention Megatron model cannot
    represent are refused by name (attention_bias was silently dropped before: Qwen3 puts it on o_proj too)."""
    from _hf_models import TINY, TINY_MOE

    with pytest.raises(ValueError, match=match):
        ModelArch.from_hf_config(dict({**TINY, **TINY_MOE}[name], **changes))


def test_refused_at_convert_and_at_train(tmp_path):
    """`convert` reads the folder's config first: a qwen3_next folder stops there, naming why; `train` refuses the
    model type in the config section (model.hf_config) and, for a pretrained model.path, by the same reader."""
    from megatron_dppo.config.sections import ModelConfig

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "hidden_size": 64}))
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    with single_process_world(), pytest.raises(ValueError, match="'qwen3_next' is refused: hybrid linear attention"):
        convert_hf_to_megatron(folder, tmp_path / "meg")
    with pytest.raises(ValueError, match="qwen3_next"):
        ModelConfig(hf_config={"model_type": "qwen3_next"}).validate()
    ModelConfig(hf_config=dict(TINY_DEEPSEEK["deepseek_v3"])).validate()


def test_mla_refuses_context_parallelism_tp_without_sp_and_the_varlen_backend():
    from megatron_dppo.megatron.attention import BackendProbe, resolve_attention_backend
    from megatron_dppo.megatron.model import build_transformer_config

    with pytest.raises(ValueError, match="cp=2 with multi-latent attention"):
        build_transformer_config(_arch("deepseek_v3"), ParallelConfig(cp=2), torch.float32)
    with pytest.raises(ValueError, match="tp=2 without sequence parallelism"):
        build_transformer_config(_arch("deepseek_v3"), ParallelConfig(tp=2, sp=False), torch.float32)
    probe = BackendProbe(cuda=True, te="not installed", varlen=None)
    with pytest.raises(ValueError, match="value head dim 12 != query/key head dim 24"):
        resolve_attention_backend("varlen", probe, dtype=torch.bfloat16, head_dim=24, v_head_dim=12)
    assert resolve_attention_backend("auto", probe, dtype=torch.bfloat16, head_dim=24, v_head_dim=12) == "sdpa"


# ------------------------------------------------------------------------------------------------------------
# several processes (gloo): TP / PP / EP layouts
# ------------------------------------------------------------------------------------------------------------
LAYOUTS = {"tp2xep2": (2, 1, 2, True), "tp2": (2, 1, 1, True), "pp2": (1, 2, 1, False), "ep2": (1, 1, 2, False)}
LAYOUT_CASES = [pytest.param("tp2xep2", ("deepseek_v3", "glm4_moe"), id="tp2xep2")] + [
    pytest.param(layout, tuple(NAMES), id=f"{layout}-all", marks=pytest.mark.slow) for layout in LAYOUTS]


def _worker(hf_dirs: dict[str, str], tp: int, pp: int, ep: int, sp: bool):
    from megatron_dppo.megatron.parallel import initialize_parallel

    out = {}
    for name, hf_dir in hf_dirs.items():
        source = HFCheckpoint(hf_dir)
        arch = ModelArch.from_hf_config(source.config)
        parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, sp=sp)
        initialize_parallel(parallel, seed=7, arch=arch)
        chunks = build_model_chunks(arch, parallel, torch.float32)
        load_hf_weights(chunks, arch, source.get)
        logits = megatron_logits(chunks, tokens(length=SEQ))
        out[name] = {"logits": logits, "export": dict(export_hf_weights(chunks, arch, bucket_bytes=16 * 1024))}
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("layout, names", LAYOUT_CASES)
def test_layout_logits_equal_transformers_and_export_is_bit_exact(layout, names, tmp_path):
    from _hf_models import hf_logits

    from megatron_dppo.convert.checkpoint import conversion_world_size

    tp, pp, ep, sp = LAYOUTS[layout]
    hf_dirs = {name: save_hf_model(name, tmp_path / name) for name in names}
    world = conversion_world_size(tp, pp, ep, 1)
    results = run_distributed(_worker, world_size=world, args=({n: str(d) for n, d in hf_dirs.items()}, tp, pp, ep,
                                                               sp), timeout=400)
    ids = tokens(length=SEQ)
    for name, folder in hf_dirs.items():
        reference, state = hf_logits(folder, ids), _state(folder)
        assert sum(r[name]["logits"] is not None for r in results) == world // pp
        for rank, r in enumerate(results):
            if r[name]["logits"] is not None:
                diff = (r[name]["logits"] - reference).abs().max().item()
                print(f"\n{layout} {name} rank {rank}: max |logit diff| vs transformers {diff:.2e}")
                assert diff <= LOGITS_ATOL
            _assert_bit_exact(r[name]["export"], state)
