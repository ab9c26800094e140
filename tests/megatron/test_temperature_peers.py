"""Training at a sampling temperature T != 1 trains the distribution the rollout samples: our engine's loss AND
gradient equal verl's and TRL's for the same model, tokens, advantages and old / reference log-probs, each peer
running its own code (verl==0.9.1, trl==1.16.*; docs/algorithms.md, "Temperature and truncated sampling").

* TRL: a real ``GRPOTrainer`` (``temperature=0.7``, ``loss_type="grpo"``, ``beta > 0``) built on the HF model; its
  ``_compute_loss`` runs ``_get_per_token_logps_and_entropies`` through the fused LM head that
  ``add_fused_lm_head(model, temperature=...)`` installed (``trl/trainer/grpo_trainer.py``), so the logits are
  divided where TRL divides them.
* verl: the HF model's logits through verl's own ``_scale_logits_by_temperature``
  (``verl/workers/engine/fsdp/transformer_impl.py``), ``logprobs_from_logits``, ``compute_policy_loss_vanilla``,
  ``kl_penalty`` and ``agg_loss``, composed as ``verl/workers/utils/losses.py::ppo_loss`` composes them
  (pg_loss + kl_loss * kl_loss_coef). verl 0.9.1 lies in .peers/verl (``make peers``, tests/_peers.py); its
  engine module (``transformer_impl``) imports the FSDP training stack, so the named functions are compiled from
  verl's own files as they are (decorators dropped) into a namespace holding what their bodies reference
  (``verl_function``): verl's code, not a transcription.
* ours: ``PolicyEngine`` with ``LossConfig.temperature = 0.7`` and the same weights (loaded from the HF model),
  the full gradient (every parameter, exported to HF names) against the peer's.

The negative: the same engine at temperature 1 (what the trainer did before the temperature reached the loss)
differs from both peers in loss and gradient, so the comparison can fail.
"""
from __future__ import annotations

import ast
import dataclasses
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dist import single_process_world

pytest.importorskip("trl", reason="trl==1.16.* is not installed (requirements/cpu.txt)")
VERL_SRC = Path(__file__).resolve().parents[2] / ".peers" / "verl" / "verl"  # `make peers` (tests/_peers.py)
if not (VERL_SRC / "trainer/ppo/core_algos.py").is_file():
    pytest.skip(f"verl 0.9.1 is not installed under {VERL_SRC.parent} (make peers)", allow_module_level=True)

T = 0.7
HF_CONFIG = dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, max_position_embeddings=64)
N, P, R = 4, 3, 5  # completions of one prompt (no left padding: every framework sees positions 0..), prompt, max len
LENGTHS = [5, 3, 4, 2]
ADVANTAGES = [1.0, -0.5, 0.3, -1.0]
KL_COEF = 0.05


# --------------------------------------------------------------------------------------------------------------
# Inputs shared by all three
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Problem:
    folder: Path
    prompt: list[int]
    completions: list[list[int]]  # real tokens only
    padded: torch.Tensor  # [N, R] completion ids, right-padded with 0
    mask: torch.Tensor  # [N, R] float
    old: torch.Tensor | None = None  # [N, R] old log-probs (the tempered policy's, perturbed so ratios clip)
    ref: torch.Tensor | None = None  # [N, R] reference log-probs
    tempered: torch.Tensor | None = None  # [N, R] float64 log_softmax(logits / T) of the completion tokens


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)


def completion_logits(model, problem) -> torch.Tensor:
    """[N, R, V] logits at the positions that predict each completion token (HF forward, right padding)."""
    ids = torch.cat([torch.tensor(problem.prompt).expand(N, P), problem.padded], dim=1)
    return model(ids).logits[:, P - 1: P - 1 + R]


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**HF_CONFIG), dtype=torch.float32)
    with torch.no_grad():  # sharper logits than the default init: T visibly reshapes the distribution
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(folder)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 256, (P,), generator=g).tolist()
    completions = [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]
    padded = torch.zeros(N, R, dtype=torch.long)
    for i, c in enumerate(completions):
        padded[i, :len(c)] = torch.tensor(c)
    mask = (torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    p = Problem(folder, prompt, completions, padded, mask)
    with torch.no_grad():  # an independent tempered log-prob in float64: log_softmax(logits / T)
        logits = completion_logits(hf_model(folder), p).double()
    tempered = torch.log_softmax(logits / T, -1).gather(-1, padded[..., None]).squeeze(-1)
    t = torch.arange(R, dtype=torch.float64)[None, :]
    s = torch.arange(N, dtype=torch.float64)[:, None]
    pert = 0.3 * torch.sin(1.7 * t + 0.9 * s)
    pert[3, 0] = -1.5  # a negative-advantage token with ratio e^1.5 > 3: verl's dual clip acts
    p.old = ((tempered - pert) * mask).float()
    p.ref = ((tempered + 0.2 * torch.cos(1.3 * t + s)) * mask).float()
    p.tempered = tempered
    return p


# --------------------------------------------------------------------------------------------------------------
# Ours: PolicyEngine with LossConfig.temperature
# --------------------------------------------------------------------------------------------------------------
def _packed_values(batch, values: torch.Tensor) -> torch.Tensor:
    """[N, R] per-completion-token values written at each sequence's loss positions of a packed micro-batch."""
    out = torch.zeros(batch.tokens.shape, dtype=torch.float32)
    mask = batch.loss_mask > 0
    bounds = batch.cu_seqlens_padded.tolist()
    for sid, a, b in zip(batch.sample_ids.tolist(), bounds[:-1], bounds[1:]):
        positions = mask[a:b].nonzero().flatten() + a
        out[positions] = values[sid, : positions.numel()].float()
    return out


def ours(problem, loss_cfg) -> tuple[float, dict[str, torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(loss, gradient by HF name, the engine's own old and reference log-probs per sequence) of one step."""
    from megatron_dppo.algo.losses import loss_denominator, sequence_token_weights
    from megatron_dppo.convert.weights import export_hf_weights, load_hf_weights
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.model import ModelArch, build_model_chunks
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.packing import build_rank_micro_batches

    arch = ModelArch.from_hf_config(HF_CONFIG)
    with single_process_world(arch=arch):
        engine = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=0.0, grad_clip=0.0), loss_cfg)
        load_hf_weights(engine.modules, arch, hf_model(problem.folder).state_dict())
        engine.sync_reference_from_policy()
        lengths = torch.tensor(LENGTHS, dtype=torch.float32)
        tw = sequence_token_weights(loss_cfg.aggregation, torch.ones(N), lengths)
        batches = build_rank_micro_batches([[0, 2], [1, 3]], [problem.prompt + c for c in problem.completions],
                                           [P] * N, torch.tensor(ADVANTAGES), tw)
        engine.fill_logprobs(batches, old=True, reference=True)  # the engine's own passes (checked below)
        own_old = [v for b in batches for v in b.completion_values(b.old_logprobs)]
        own_ref = [v for b in batches for v in b.completion_values(b.ref_logprobs)]
        own_old = [own_old[i] for i in torch.cat([b.sample_ids for b in batches]).argsort().tolist()]
        own_ref = [own_ref[i] for i in torch.cat([b.sample_ids for b in batches]).argsort().tolist()]
        for b in batches:  # the shared old / reference log-probs, as the peers get them
            b.old_logprobs, b.ref_logprobs = _packed_values(b, problem.old), _packed_values(b, problem.ref)
        D = loss_denominator(loss_cfg.aggregation, 1, N, lengths.view(1, N).double())
        metrics = engine.train_step(batches, D)
        # the gradient under HF names: main_grad copied into a twin model, exported like weights (linear maps)
        (twin,) = build_model_chunks(arch, ParallelConfig(), torch.float32)
        grads = dict(engine.modules[0].named_parameters())
        with torch.no_grad():
            for name, p in twin.named_parameters():
                p.copy_(grads[name].main_grad)
        exported = {name: t.clone() for name, t in export_hf_weights([twin], arch)}
    return metrics["loss"], exported, own_old, own_ref


# --------------------------------------------------------------------------------------------------------------
# TRL 1.16: GRPOTrainer._compute_loss
# --------------------------------------------------------------------------------------------------------------
def trl_step(problem) -> tuple[float, dict[str, torch.Tensor]]:
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = {f"t{i}": i for i in range(HF_CONFIG["vocab_size"])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                        eos_token="t2", pad_token="t0", unk_token="t1")
    args = GRPOConfig(output_dir=str(problem.folder / "trl"), use_cpu=True, bf16=False, temperature=T,
                      beta=KL_COEF, epsilon=0.2, epsilon_high=0.28, loss_type="grpo", per_device_train_batch_size=N,
                      num_generations=N, gradient_accumulation_steps=1, report_to="none", save_strategy="no",
                      max_completion_length=R, seed=0)
    trainer = GRPOTrainer(model=hf_model(problem.folder), reward_funcs=lambda completions, **_: [0.0] * N,
                          args=args, train_dataset=Dataset.from_list([{"prompt": "t5"}] * N),
                          processing_class=tokenizer)
    assert trainer.temperature == T and trainer.args.use_bias_correction_kl  # TRL's default: KL times the ratio
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the Trainer's training loop
    inputs = dict(prompt_ids=torch.tensor(problem.prompt).expand(N, P).clone(),
                  prompt_mask=torch.ones(N, P, dtype=torch.long), completion_ids=problem.padded,
                  completion_mask=problem.mask.long(), advantages=torch.tensor(ADVANTAGES),
                  old_per_token_logps=problem.old, ref_per_token_logps=problem.ref)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


# --------------------------------------------------------------------------------------------------------------
# verl 0.9.1: its own functions from the installed wheel
# --------------------------------------------------------------------------------------------------------------
def verl_function(relative_path: str, name: str, namespace: dict):
    """The top-level function ``name`` of ``verl/<relative_path>`` (the unpacked verl 0.9.1 wheel), compiled from
    that file unchanged but for its decorators, into ``namespace`` (which must hold the globals its body uses).
    Tracebacks point at the wheel's own lines."""
    path = VERL_SRC / relative_path
    (node,) = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == name]
    node.decorator_list = []
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102 - verl's own code
    return namespace[name]


class _VerlConfig(dict):
    """verl's ActorConfig as compute_policy_loss_vanilla reads it: attributes and ``.get``."""

    __getattr__ = dict.__getitem__


def verl_functions() -> SimpleNamespace:
    import torch.nn.functional as F

    tf = {"torch": torch, "os": os, "F": F, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE": False,
          "NPU_CROSS_ENTROPY_LOSS_AVAILABLE": False}
    for name in ("masked_sum", "masked_mean", "logprobs_from_logits_v2", "logprobs_from_logits"):
        verl_function("utils/torch_functional.py", name, tf)
    algos = {"torch": torch, "verl_F": SimpleNamespace(**tf), "Optional": __import__("typing").Optional,
             "Any": __import__("typing").Any, "ActorConfig": _VerlConfig, "AlgoConfig": type("AlgoConfig", (), {})}
    for name in ("agg_loss", "kl_penalty_forward", "kl_penalty", "compute_policy_loss_vanilla"):
        verl_function("trainer/ppo/core_algos.py", name, algos)
    engine = {"torch": torch}
    verl_function("workers/engine/fsdp/transformer_impl.py", "_scale_logits_by_temperature", engine)
    return SimpleNamespace(scale=engine["_scale_logits_by_temperature"], logprobs=tf["logprobs_from_logits"],
                           policy_loss=algos["compute_policy_loss_vanilla"], kl_penalty=algos["kl_penalty"],
                           agg_loss=algos["agg_loss"])


def verl_step(problem) -> tuple[float, dict[str, torch.Tensor]]:
    verl = verl_functions()
    model = hf_model(problem.folder)
    model.train()
    temperature = torch.full((N,), T, dtype=torch.float32)
    # prepare_model_outputs (padded path): logits / temperature[:, None, None], then logprobs_from_logits
    logits = verl.scale(completion_logits(model, problem), temperature.unsqueeze(-1).unsqueeze(-1),
                        is_unit_temperature=False)
    log_prob = verl.logprobs(logits, problem.padded)
    mask = problem.mask.bool()
    config = _VerlConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                         global_batch_info={})
    advantages = torch.tensor(ADVANTAGES)[:, None].expand(N, R)
    pg_loss, _ = verl.policy_loss(problem.old, log_prob, advantages, mask, "token-mean", config, None)
    kld = verl.kl_penalty(logprob=log_prob, ref_logprob=problem.ref, kl_penalty="low_var_kl")
    kl_loss = verl.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode="token-mean", **config.global_batch_info)
    loss = pg_loss + kl_loss * KL_COEF  # verl/workers/utils/losses.py ppo_loss, use_kl_loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------------------------
def _assert_same_gradient(ours_grad: dict, peer_grad: dict):
    assert set(ours_grad) == set(peer_grad)
    scale = max(float(g.abs().max()) for g in peer_grad.values())
    for name, g in peer_grad.items():
        torch.testing.assert_close(ours_grad[name], g, rtol=1e-4, atol=1e-5 * scale, msg=name)


def _gradient_gap(ours_grad: dict, peer_grad: dict) -> float:
    num = sum(float((ours_grad[n] - g).norm() ** 2) for n, g in peer_grad.items())
    return math.sqrt(num / sum(float(g.norm() ** 2) for g in peer_grad.values()))


def test_engine_old_and_reference_passes_are_tempered(problem):
    """The engine's forward-only policy and reference log-probs at LossConfig.temperature = T are log_softmax of
    logits / T (float64 reference from the HF model), not the temperature-1 ones."""
    from megatron_dppo.algo.losses import LossConfig

    _, _, own_old, own_ref = ours(problem, LossConfig(kl_coef=KL_COEF, temperature=T, kl_estimator="k1").resolved())
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(own_old[i].double(), problem.tempered[i, :n], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(own_ref[i].double(), problem.tempered[i, :n], atol=2e-5, rtol=1e-5)
    _, _, untempered, _ = ours(problem, LossConfig(kl_coef=KL_COEF, temperature=1.0, kl_estimator="k1").resolved())
    assert max(float((u.double() - problem.tempered[i, :len(u)]).abs().max()) for i, u in enumerate(untempered)) > 0.1


def test_loss_and_gradient_equal_trl_grpo_trainer_at_temperature(problem):
    from megatron_dppo.algo.losses import LossConfig

    trl_loss, trl_grad = trl_step(problem)
    cfg = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=KL_COEF, kl_estimator="k3",
                     aggregation="seq_mean_token_mean", kl_bias_correction=True, temperature=T).resolved()
    loss, grad, _, _ = ours(problem, cfg)
    assert loss == pytest.approx(trl_loss, rel=1e-5, abs=2e-6)  # fp32 terms of size ~1, summed
    _assert_same_gradient(grad, trl_grad)
    loss_t1, grad_t1, _, _ = ours(problem, dataclasses.replace(cfg, temperature=1.0))  # the old trainer
    assert abs(loss_t1 - trl_loss) > 1e-3 and _gradient_gap(grad_t1, trl_grad) > 0.1


def test_loss_and_gradient_equal_verl_ppo_loss_at_temperature(problem):
    from megatron_dppo.algo.losses import LossConfig

    verl_loss, verl_grad = verl_step(problem)
    cfg = LossConfig(policy_loss="ppo_clip", eps_low=0.2, eps_high=0.28, kl_coef=KL_COEF, kl_estimator="k3",
                     aggregation="token_mean", clip_ratio_c=3.0, kl_clamp=10.0, temperature=T).resolved()
    loss, grad, _, _ = ours(problem, cfg)
    assert loss == pytest.approx(verl_loss, rel=1e-5, abs=2e-6)  # fp32 terms of size ~1, summed
    _assert_same_gradient(grad, verl_grad)
    loss_t1, grad_t1, _, _ = ours(problem, dataclasses.replace(cfg, temperature=1.0))  # the old trainer
    assert abs(loss_t1 - verl_loss) > 1e-3 and _gradient_gap(grad_t1, verl_grad) > 0.1
