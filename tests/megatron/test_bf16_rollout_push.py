"""A bf16 rollout engine fed by an fp32 Megatron trainer (``rollout.dtype=bfloat16``): the push through the
streaming export is the trainer's weights cast to bf16, and the mismatch the trainer then measures
(``rollout/kl_k1``, ``rollout/logprob_abs_diff``) is that of the bf16 samples' own log-probs against its fp32 ones."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))

from _dist import single_process_world
from _sampling_reference import teacher_forced
from test_behaviour_logprobs import EOS, HF_CONFIG, PROMPTS, G, _hf_model, _tokenizer


def test_fp32_trainer_push_into_a_bf16_engine_is_the_cast_and_the_trainer_sees_the_bf16_mismatch():
    from megatron_dppo.algo.losses import LossConfig, sequence_token_weights
    from megatron_dppo.config import load_config
    from megatron_dppo.convert.weights import export_hf_weights, load_hf_weights
    from megatron_dppo.megatron.engine import OptimConfig, PolicyEngine
    from megatron_dppo.megatron.model import ModelArch
    from megatron_dppo.megatron.parallel import ParallelConfig
    from megatron_dppo.packing import build_rank_micro_batches
    from megatron_dppo.rollout import HFRolloutEngine
    from megatron_dppo.rollout.handover import MemoryHandover
    from megatron_dppo.run.state import RolloutSide
    from megatron_dppo.train.rollouts import generate
    from megatron_dppo.train.stages import TrainBatch, correct_rollout_mismatch
    from megatron_dppo.train.step_metrics import logprob_mismatch

    trainer_hf = _hf_model(0)  # the fp32 policy
    arch = ModelArch.from_hf_config(HF_CONFIG)
    cfg = load_config(None, ["rollout.max_new_tokens=8", "train.seed=3", "rollout.dtype=bfloat16"], validate=False)
    with single_process_world(arch=arch):
        loss_cfg = LossConfig(kl_coef=0.0, rollout_correction="tis").resolved()
        engine = PolicyEngine(arch, ParallelConfig(), OptimConfig(lr=0.0), loss_cfg)
        load_hf_weights(engine.modules, arch, trainer_hf.state_dict())
        rollout_engine = HFRolloutEngine(_hf_model(7).to(torch.bfloat16), eos_token_ids=[EOS],
                                         release_weights_on_sleep=True)
        handover = MemoryHandover(rollout_engine, lambda: export_hf_weights(engine.modules, arch))
        handover.push()
        held = rollout_engine.model.state_dict()
        for name, w in trainer_hf.state_dict().items():
            assert held[name].dtype == torch.bfloat16 and torch.equal(held[name], w.to(torch.bfloat16)), name
        rollout_engine.sleep()  # freed: the handover pushes again before generating
        side = RolloutSide(cfg=cfg, tokenizer=_tokenizer(), engine=rollout_engine, eos_ids=[EOS], handover=handover,
                           scorer=None, train_prompts=[], sampler=None, pruner=None)
        prompts = [SimpleNamespace(id=f"q{q}", token_ids=p) for q, p in enumerate(PROMPTS)]
        rollout = generate(side, prompts, G, step=0, temperature=1.0)
        origin = [(r, i) for r in range(len(PROMPTS)) for i in range(G)]
        token_ids = [PROMPTS[r] + rollout.completions[r][i] for r, i in origin]
        n = len(token_ids)
        lengths = torch.tensor([len(rollout.completions[r][i]) for r, i in origin], dtype=torch.float32)
        batch = TrainBatch(token_ids=token_ids, prompt_lengths=[len(PROMPTS[r]) for r, _ in origin],
                           advantages=torch.ones(n), token_weights=sequence_token_weights(
                               loss_cfg.aggregation, torch.ones(n), lengths),
                           seq_weights=torch.ones(n), rewards=torch.zeros(n), origin=origin, denominator=float(n))
        micro_batches = build_rank_micro_batches([list(range(n))], token_ids, batch.prompt_lengths,
                                                 batch.advantages, batch.token_weights)
        engine.fill_logprobs(micro_batches, old=True)
        metrics = correct_rollout_mismatch(loss_cfg, rollout, [batch], [micro_batches])
        metrics.update(logprob_mismatch(rollout, [batch], [micro_batches]))
    behaviour = torch.cat([torch.tensor(rollout.behaviour_logprobs[r][i]) for r, i in origin]).double()
    fp32 = torch.cat([teacher_forced(trainer_hf, PROMPTS[r], rollout.completions[r][i]) for r, i in origin]).double()
    # The trainer's metrics are those of the engine's bf16 log-probs against the fp32 policy (Megatron fp32 = HF
    # fp32 within ~1e-6), and the mismatch is real: far above fp32 rounding (~1e-6), within bf16's (2^-4).
    assert metrics["rollout/kl_k1"] == pytest.approx(float((behaviour - fp32).mean()), abs=1e-5)
    assert metrics["rollout/logprob_abs_diff"] == pytest.approx(float((behaviour - fp32).abs().mean()),
                                                                              abs=1e-5)
    assert 1e-3 < metrics["rollout/logprob_abs_diff"] < 2.0**-4
