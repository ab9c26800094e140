"""LoRA runs through the real CLI (``model.lora``; docs/lora.md), quickstart-style on the tiny model, with a
pretrained stand-in base (``tiny_base``: a Hugging Face folder) and the grpo loss with a KL term:

* a run trains the adapters only and its reference is the base: the KL estimate is exactly 0 at step 0 (fresh
  adapters, B = 0: the policy IS the base) and positive afterwards; DPPO pruning, packing and the gradient audit run
  as in any run; after the first push (base + adapters) every weight push carries the adapters only (the bytes
  measured equal the adapters' size), and the checkpoints hold adapter tensors only;
* a crash after the step-2 checkpoint, then resume == the straight run, bit for bit (metrics, audit trail, adapters
  and their Adam state);
* ``megatron-dppo convert megatron-to-peft`` / ``megatron-to-hf`` export the run: PEFT's own model on the base with
  the exported adapter gives the merged export's logits, and the adapter tensors are the checkpoint's; the exported
  adapter starts a new run (``model.lora.init``), and is its reference too: the KL estimate is exactly 0 at step 0
  (not the distance from the bare base) and positive once the adapters moved;
* separate placement (1 trainer + 1 HF rollout worker, max_staleness 0), whose versions after the first carry the
  adapters only, equals the colocated run bit for bit;
* refused by name at start-up, before anything is written: LoRA with a warm start and a KL term.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from _e2e_helpers import (
    PY,
    REPO,
    checkpoint_tensors,
    env,
    latest_checkpoint,
    read_metrics,
    run_cli,
    stable_metrics,
    tiny_base,
    tiny_config,
    write_config,
)

ADAPTER_BYTES = 2 * 4 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192)  # layers x rank x fp32 x sum(in + out)


def lora_config(base, output_dir, **sections):
    model = {"path": str(base), "hf_config": {}, "tokenizer": "train-sentencepiece", "lora": {"rank": 4}}
    cfg = tiny_config(output_dir, model=model, loss={"preset": "grpo", "kl_coef": 0.05},
                      logging={"audit_log": True, "audit_every": 2})
    cfg["train"]["sft_steps"] = 0
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("base") / "hf")


def _rl(records):
    return [r for r in records if r.get("phase") == "rl"]


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=[pytest.mark.slow, pytest.mark.multiproc])],
                         ids=["one_process", "tp2"])
def test_lora_run_trains_adapters_against_the_base_resumes_exactly_and_exports(tmp_path, base, nproc):
    """(tp2: trained and resumed at TP2, the adapters' A or B split over the ranks; exported at TP1.)"""
    layout = {"parallel": {"tp": nproc}}
    straight = tmp_path / "straight"
    run_cli(write_config(tmp_path / "run.yaml", lora_config(base, straight, **layout)), nproc=nproc)
    records = read_metrics(straight)
    rl = _rl(records)
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    # the reference is the base: KL exactly 0 while the adapters are fresh (B = 0), > 0 once they were updated
    # (tp2 samples other completions: its step 0 has one reward for all, no gradient, so step 1 is still the base)
    assert rl[0]["train/kl"] == 0.0 and rl[-1]["train/kl"] > 0
    assert all(r["train/update_ok"] == 1.0 for r in rl) and sum(r["train/grad_norm"] > 0 for r in rl) >= 3
    assert all(r["train/kl"] > 0 for r in rl[1:]) or nproc > 1
    assert all(r["prune/completion_kept_fraction"] < 1.0 for r in rl)  # DPPO acted
    assert [r["step"] for r in rl if "audit/cosine" in r] == [0, 2]
    audited = [r for r in rl if "audit/cosine" in r and r["audit/full_grad_norm"] > 0]  # (no gradient: no cosine)
    assert audited and all(0.0 < r["audit/cosine"] <= 1.0 + 1e-9 for r in audited)
    # the set-up push carried the base and the adapters; each step's push carries the adapters only
    assert all(r["weight_sync/bytes"] == ADAPTER_BYTES for r in rl)
    final = checkpoint_tensors(latest_checkpoint(straight))
    assert final and all("_lora." in k for k in final), [k for k in final if "_lora." not in k][:3]

    # a crash right after the step-2 checkpoint, then resume
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    (resumed / "checkpoints" / "latest").write_text("step_00000002\n")
    proc = run_cli(write_config(tmp_path / "resumed.yaml", lora_config(base, resumed, **layout)), nproc=nproc)
    assert "resumed from" in proc.stdout and "RL step 2" in proc.stdout
    assert stable_metrics(read_metrics(resumed)) == stable_metrics(records)
    assert (resumed / "audit.jsonl").read_text() == (straight / "audit.jsonl").read_text()
    again = checkpoint_tensors(latest_checkpoint(resumed))
    assert sorted(again) == sorted(final) and all(torch.equal(again[k], final[k]) for k in final)

    # export: the adapters in PEFT's format, and the merged model
    for tool, out in (("megatron-to-peft", tmp_path / "peft"), ("megatron-to-hf", tmp_path / "merged")):
        cmd = [PY, "-m", "megatron_dppo.cli", "convert", tool, str(straight / "checkpoints"), str(out)]
        proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 7 * 2
    a = adapter["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    b = next(v for k, v in final.items() if k.endswith("layers.self_attention.linear_qkv_lora.pairs.v.lora_B"))
    assert torch.equal(a, b[1])  # the checkpoint stacks the layers
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                                      tmp_path / "peft").eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(ids).logits
    torch.testing.assert_close(merged, with_adapter, rtol=0, atol=1e-5)
    assert (merged - plain).abs().max() > 1e-3  # the adapters were trained

    # the exported adapter as the warm start of a new run (model.lora.init): it is the reference too, so the KL is
    # exactly 0 at step 0 (its policy is not the base) and positive once the adapters moved
    warm = tmp_path / "warm"
    cfg = lora_config(base, warm, train={"steps": 2}, logging={"audit_every": 0}, eval={"every": 0},
                      checkpoint={"every": 1})
    cfg["model"]["lora"] = {"init": str(tmp_path / "peft")}  # (rank, alpha, projections from the adapter)
    run_cli(write_config(tmp_path / "warm.yaml", cfg))
    warm_rl = _rl(read_metrics(warm))
    assert warm_rl[0]["train/kl"] == 0.0 and warm_rl[0]["train/grad_norm"] > 0 and warm_rl[1]["train/kl"] > 0
    # resumed after step 1: the reference is the init adapter again (same KL), the policy the checkpoint's adapters
    again = tmp_path / "warm_resumed"
    shutil.copytree(warm, again)
    shutil.rmtree(again / "checkpoints" / "step_00000002")
    (again / "checkpoints" / "latest").write_text("step_00000001\n")
    cfg["train"]["output_dir"] = str(again)
    assert "RL step 1" in run_cli(write_config(tmp_path / "warm_resumed.yaml", cfg)).stdout
    assert stable_metrics(read_metrics(again)) == stable_metrics(read_metrics(warm))


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_separate_placement_equals_colocated(tmp_path, base):
    """The workers get the base once (the first version), then adapter-only versions; at max_staleness 0 the run
    equals the colocated one record for record."""
    colocated, separate = tmp_path / "colocated", tmp_path / "separate"
    run_cli(write_config(tmp_path / "a.yaml", lora_config(base, colocated, logging={"audit_every": 0})))
    run_cli(write_config(tmp_path / "b.yaml", lora_config(base, separate, logging={"audit_every": 0})),
            "rollout.placement=separate", "train.max_staleness=0", nproc=2)
    records = stable_metrics(read_metrics(separate))
    assert [{k: v for k, v in r.items() if not k.startswith("async/")} for r in records] == \
        stable_metrics(read_metrics(colocated))
    assert all(r["weight_sync/bytes"] == ADAPTER_BYTES for r in _rl(read_metrics(separate)))


def test_lora_with_warm_start_and_kl_is_refused_by_name(tmp_path, base):
    out = tmp_path / "run"
    cfg = lora_config(base, out)
    cfg["train"]["sft_steps"] = 2
    proc = run_cli(write_config(tmp_path / "run.yaml", cfg), check=False)
    assert proc.returncode == 2
    assert "model.lora with train.sft_steps=2 and loss.kl_coef=0.05" in proc.stderr
    assert not (out / "checkpoints").exists()
