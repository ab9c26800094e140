"""The contract every registered pruner meets (``algo.pruner.Pruner``), checked for each name in ``PRUNERS`` without
a test of its own: a new rule registered there is run through all of it.

* **Unbiasedness at both levels.** The potential groups are fixed (test_pruning.py's problem: 6 prompts x 4
  completions with their per-token log-probs, clipping active, a KL term); only the coins are drawn: the prompt
  level from the pruner's own state (primed with earlier groups), then the completion level on the kept prompts'
  full-group advantages, combined into w = 1/(pi_q pi_{i|q}). The pruned loss and its gradient, through the
  engine's loss path and with the denominator the step would use (the full batch's, or the kept completions' for
  a rule with ``kept_denominator``), must match the unpruned step within Z_OK measured standard errors for a rule
  registered ``unbiased``, and be beyond Z_BIASED for one registered biased (CPPO, PODS, DPPO's deterministic
  mode): the same check, which shows it can fail.
* **Resume equality.** A pruner rebuilt from the configuration and loaded with another's ``state_dict`` takes the
  same decisions with the same generators, and both states stay equal after the same new groups; a state of
  another format is refused.
* **Metrics.** Every pruner reports ``REQUIRED_METRICS`` as numbers (the prompts it has seen).
"""
import copy
import pickle

import pytest
import test_pruning as TP
import torch

from megatron_dppo.algo.advantages import compute_advantages
from megatron_dppo.algo.losses import loss_denominator
from megatron_dppo.algo.pruner import PRUNERS, REQUIRED_METRICS, Groups, Pruner
from megatron_dppo.algo.pruning import PruneResult, combine, make_generator
from megatron_dppo.config import load_config
from megatron_dppo.run.build import build_loss, build_pruner

DT = torch.float64
B, G, L = TP.B, TP.G, TP.L
DRAWS = 1200
AGGREGATION = "seq_mean_token_mean"
IDS = list(range(B))

# what a rule needs of the rest of the configuration (adaptive group sizes: the rloo estimator, unbiased at every n)
NEEDS = {"adaptive": ("loss.advantage_estimator=rloo",)}
# every registered pruner with its defaults, and the other keep rules and modes of the ones that have them
VARIANTS = {"adaptive": [("algo.mode=fixed_size", "algo.adaptive_budget=0.3")],
            "dppo": [("algo.dppo_keep=optimal", "algo.keep_floor=0.1"), ("algo.dppo_keep=posterior",),
                     ("algo.mode=fixed_size",), ("algo.mode=deterministic",)]}
CASES = [(name, ()) for name in PRUNERS.names()] + [(n, v) for n in PRUNERS.names() for v in VARIANTS.get(n, [])]
CASE_IDS = ["-".join((name, *(o.split("=", 1)[1] for o in extra))) for name, extra in CASES]


def make_pruner(name: str, extra=()) -> Pruner:
    cfg = load_config("examples/quickstart.yaml", [f"algo.pruner={name}", f"train.group_size={G}",
                                                   f"train.prompts_per_step={B}", "loss.kl_coef=0.1",
                                                   *NEEDS.get(name, ()), *extra])
    loss_cfg, estimator = build_loss(cfg)
    return build_pruner(cfg, loss_cfg, estimator)


def groups(ids, seed: int, version: int) -> Groups:
    """Binary-reward groups of ``ids`` (what a step would observe of them)."""
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(len(ids), G, generator=gen) < 0.5).double()
    lengths = torch.randint(1, L + 1, (len(ids), G), generator=gen).double()
    return Groups(list(ids), rewards, lengths, version, advantages=compute_advantages(rewards, "grpo"),
                  tokens=lengths + 3)


def primed(name: str, extra=()) -> Pruner:
    """A pruner that has seen prompts 1..5 (prompt 0 never), some twice, and prompt 3 with one reward for all."""
    pruner = make_pruner(name, extra)
    pruner.observe(groups(IDS[1:], seed=1, version=0))
    flat = groups([3], seed=2, version=1)
    flat.rewards[:], flat.advantages[:] = 1.0, 0.0
    pruner.observe(flat)
    pruner.observe(groups([1, 4], seed=3, version=1))
    return pruner


def decide(pruner: Pruner, p: dict, draw: int):
    """One step's decisions on the fixed groups: (prompt result, completion result, combined [B, G])."""
    prompt = pruner.select_prompts(IDS, 2, make_generator(0, draw, "prompts"))
    rows = prompt.keep.nonzero().flatten()
    if not len(rows):  # no prompt kept: nothing generated, no completion decision (as train.stages)
        nothing = torch.zeros(B, G, dtype=torch.bool)
        return prompt, None, PruneResult(keep=nothing, weight=nothing.float())
    completion = pruner.select_completions(p["adv"][rows], make_generator(0, draw, "completions"),
                                           prompt_prob=prompt.probabilities()[prompt.keep],
                                           lengths=p["lengths"][rows].double(),
                                           tokens=p["lengths"][rows].double() + 3)
    return prompt, completion, combine(prompt, completion)


def denominator(pruner: Pruner, p: dict, keep: torch.Tensor) -> float:
    """D as the step forms it (train.stages.denominator) for a fixed-denominator aggregation."""
    if pruner.kept_denominator:
        kept = p["lengths"][keep].double().view(-1, 1)
        return loss_denominator(AGGREGATION, max(1, kept.shape[0]), 1, kept, None, L)
    return loss_denominator(AGGREGATION, B, G, p["lengths"], None, L)


@pytest.mark.parametrize("name, extra", CASES, ids=CASE_IDS)
def test_unbiased_at_both_levels_or_registered_biased(name, extra):
    p = TP.make_problem()
    cfg = TP.config("ppo_clip", AGGREGATION)
    pruner = primed(name, extra)
    weights, dens, pruned = [], [], 0
    for draw in range(DRAWS):
        _, _, total = decide(pruner, p, draw)
        assert total.keep.shape == (B, G)
        weights.append(total.weight.to(DT))
        dens.append(denominator(pruner, p, total.keep))
        pruned += int((~total.keep).sum())
    if name != "none":
        assert pruned > 0, "the rule never pruned: the check would say nothing about it"
    z = TP.monte_carlo_z(p, cfg, torch.stack(weights), torch.tensor(dens, dtype=DT))
    if pruner.unbiased:
        assert z.max() < TP.Z_OK, f"{name} {extra}: max z {z.max():.2f} at statistic {int(z.argmax())}"
    else:
        assert z.max() > TP.Z_BIASED, f"{name} {extra} is registered biased but its bias is not detected"


def test_the_registered_biased_rules_are_the_expected_ones():
    """The suite expects PODS and CPPO to fail the unbiasedness check, and DPPO and keep-all to pass it."""
    biased = {name for name in PRUNERS.names() if not make_pruner(name).unbiased}
    assert {"pods", "cppo"} <= biased and not {"dppo", "none"} & biased


@pytest.mark.parametrize("name, extra", CASES, ids=CASE_IDS)
def test_resume_from_state_dict_takes_the_same_decisions(name, extra):
    p = TP.make_problem()
    first = primed(name, extra)
    state = first.state_dict()
    assert pickle.loads(pickle.dumps(state)) == state  # (checkpoints, and the weight versions sent to workers)
    second = make_pruner(name, extra)
    assert second.state_format == first.state_format == state["format"]
    second.load_state_dict(copy.deepcopy(state))
    assert second.state_dict() == state
    for draw in range(3):
        for a, b in zip(decide(first, p, draw), decide(second, p, draw)):
            assert (a is None and b is None) or (torch.equal(a.keep, b.keep) and torch.equal(a.weight, b.weight))
    first.observe(groups(IDS, seed=9, version=2))
    second.observe(groups(IDS, seed=9, version=2))
    assert first.state_dict() == second.state_dict()
    with pytest.raises(ValueError, match="format"):
        second.load_state_dict({"format": "not-a-prompt-state"})


@pytest.mark.parametrize("name, extra", CASES, ids=CASE_IDS)
def test_every_pruner_is_a_pruner_and_reports_the_required_metrics(name, extra):
    pruner = primed(name, extra)
    assert isinstance(pruner, Pruner)
    assert isinstance(pruner.unbiased, bool) and isinstance(pruner.kept_denominator, bool)
    assert pruner.prompts_to_draw() >= B
    metrics = pruner.metrics()
    assert set(REQUIRED_METRICS) <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["history/prompts_seen"] == 5.0  # prompts 1..5 (prompt 0 never generated)


def test_pods_keeps_the_max_variance_subset():
    """PODS keeps floor(G (1 - rate)) of each group: the highest and lowest rewards, whichever mix varies most."""
    pruner = make_pruner("pods", ("algo.pods_rate=0.5",))
    adv = torch.tensor([[0.9, 0.1, -0.2, -1.0], [1.0, 1.0, 1.0, -3.0], [2.0, 0.0, 0.0, 0.0]])
    out = pruner.select_completions(adv, make_generator(0, 0, "completions"), prompt_prob=torch.ones(3),
                                    lengths=torch.ones(3, G), tokens=torch.ones(3, G))
    assert out.keep.tolist() == [[True, False, False, True], [True, False, False, True],
                                 [True, True, False, False]]
    assert torch.equal(out.weight, out.keep.float())  # weight 1: no reweighting (biased)
    with pytest.raises(ValueError, match="algo.pods_rate"):
        make_pruner("pods", ("algo.pods_rate=0.9",))  # floor(4 * 0.1) = 0 < 2
