"""Dense Prompt Packing invariants (docs/algorithms.md): hard cap, every sequence exactly once, equal
micro-batch counts per DP rank, density on a realistic length distribution, and the baselines' behaviour."""

import math
import random

import pytest

from megatron_dppo.packing import (
    karmarkar_karp,
    min_bins,
    pack_ffd,
    pack_padded,
    pack_sequences,
    pack_verl_kk,
    packing_stats,
)
from megatron_dppo.packing.bins import make_count_multiple, window_best_fit


def assert_valid_plan(plan, lengths, capacity, dp_size, pad_multiple=1):
    """The three invariants, checked independently of packing_stats."""
    assert len(plan) == dp_size
    counts = {len(rank) for rank in plan}
    assert len(counts) == 1, f"unequal micro-batch counts per rank: {[len(r) for r in plan]}"
    placed = sorted(i for rank in plan for mb in rank for i in mb)
    assert placed == list(range(len(lengths))), "some index missing or placed twice"
    for rank in plan:
        for mb in rank:
            tokens = sum(-(-lengths[i] // pad_multiple) * pad_multiple for i in mb)
            assert tokens <= capacity, f"bin of {tokens} tokens exceeds capacity {capacity}"


def random_lengths(rng: random.Random, n: int, capacity: int) -> list[int]:
    kind = rng.choice(["uniform", "lognormal", "bimodal", "near_cap", "equal", "tiny", "half_plus"])
    if kind == "uniform":
        out = [rng.randint(1, capacity) for _ in range(n)]
    elif kind == "lognormal":
        out = [int(rng.lognormvariate(math.log(capacity / 12), 0.8)) for _ in range(n)]
    elif kind == "bimodal":
        out = [rng.choice([rng.randint(1, capacity // 10 + 1), rng.randint(capacity // 2, capacity)]) for _ in range(n)]
    elif kind == "near_cap":
        out = [rng.randint(int(0.8 * capacity), capacity) for _ in range(n)]
    elif kind == "equal":
        out = [rng.randint(1, capacity)] * n
    elif kind == "half_plus":  # every pair overflows: one sequence per bin
        out = [capacity // 2 + 1 + rng.randint(0, max(0, capacity // 2 - 1)) for _ in range(n)]
    else:
        out = [rng.randint(1, 3) for _ in range(n)]
    return [min(capacity, max(1, x)) for x in out]


CASES = 150


@pytest.mark.parametrize("packer", ["window_greedy", "ffd"])
def test_invariants_on_random_distributions(packer):
    rng = random.Random(1234)
    for _ in range(CASES):
        capacity = rng.choice([4, 7, 64, 1000, 4096])
        n = rng.choice([1, 2, 3, 5, 17, 64, 200])
        dp = rng.choice([1, 2, 3, 4, 8])
        lengths = random_lengths(rng, n, capacity)
        if packer == "ffd":
            plan = pack_ffd(lengths, capacity, dp)
        else:
            plan = pack_sequences(lengths, capacity, dp, window=rng.choice([1, 5, 64, 1000]),
                                  close_fraction=rng.choice([0.0, 0.02, 0.3]))
        assert_valid_plan(plan, lengths, capacity, dp)
        stats = packing_stats(plan, lengths, capacity)
        assert stats.overfilled_bins == 0 and stats.equal_counts and not stats.missing and not stats.duplicated
        # Empty micro-batches only when there are fewer sequences than micro-batches.
        if stats.empty_bins:
            assert n < stats.num_micro_batches


def test_best_fit_pairs_overflow():
    """Step 1 never opens a bin needlessly: any two bins together hold more than (1 - close_fraction) * C
    (so at most one bin is at most half full and bins <= 2 * sum(l) / C + 1)."""
    rng = random.Random(7)
    for _ in range(60):
        capacity = rng.choice([100, 4096])
        lengths = random_lengths(rng, rng.choice([10, 100, 300]), capacity)
        f = rng.choice([0.0, 0.02, 0.2])
        bins = window_best_fit(lengths, capacity, window=rng.choice([1, 8, 64]), close_fraction=f)
        loads = sorted(sum(lengths[i] for i in b) for b in bins)
        assert all(x <= capacity for x in loads)
        if len(loads) >= 2:
            assert loads[0] + loads[1] > (1 - f) * capacity


def realistic_lengths(seed=0, prompts=256, group=8):
    """GSM8K/MATH-like: prompt ~ lognormal(median 120), completion ~ lognormal(median 350), capped at 4096."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        p = int(rng.lognormvariate(math.log(120), 0.4)) + 1
        for _ in range(group):
            out.append(min(4096, p + int(rng.lognormvariate(math.log(350), 0.6)) + 1))
    return out


@pytest.mark.parametrize("capacity", [4096, 8192, 16384])
@pytest.mark.parametrize("dp", [1, 4, 8])
def test_realistic_density(capacity, dp):
    lengths = realistic_lengths()
    plan = pack_sequences(lengths, capacity, dp)
    assert_valid_plan(plan, lengths, capacity, dp)
    stats = packing_stats(plan, lengths, capacity)
    step1 = window_best_fit(lengths, capacity, window=64)
    # Step 1 fills its bins to >= 98.5% on average; step 2 adds at most the rounding to a multiple of dp.
    assert sum(lengths) / (len(step1) * capacity) >= 0.985
    assert stats.num_micro_batches <= -(-len(step1) // dp) * dp
    # No plan can use fewer bins than min_bins = ceil(sum/C) rounded up to a multiple of dp.
    assert min_bins(lengths, capacity, dp) <= stats.num_micro_batches
    if dp == 1:
        assert stats.density >= 0.98
    assert stats.rank_cost_imbalance <= 1.01


def test_dealing_balances_cost_with_refinement():
    lengths = realistic_lengths(seed=3, prompts=64)
    plan = pack_sequences(lengths, 8192, dp_size=8)
    stats = packing_stats(plan, lengths, 8192)
    assert stats.max_rank_cost - stats.min_rank_cost <= max(lengths) * 1.1
    assert stats.rank_cost_imbalance < 1.02


def test_attention_term_changes_dealing():
    """alpha weights l^2: with one very long sequence, a large alpha gives its rank fewer other tokens."""
    lengths = [4000] + [250] * 64
    flat = packing_stats(pack_sequences(lengths, 8192, 2, alpha=0.0), lengths, 8192, alpha=0.0)
    attn = packing_stats(pack_sequences(lengths, 8192, 2, alpha=1e-3), lengths, 8192, alpha=1e-3)
    assert max(flat.rank_tokens) - min(flat.rank_tokens) <= 250
    assert max(attn.rank_tokens) - min(attn.rank_tokens) > 2000  # the long sequence's rank takes fewer tokens


def test_rebalance_reaches_the_bound_when_greedy_rounds_past_it():
    """400 sequences that fit 7 bins only at 99.99% fill: best fit needs 8 bins, so at dp=7 the split step would
    give 14 micro-batches; the balanced repartition (step 2a) finds 7 bins under the cap."""
    rng = random.Random(0)
    lengths = [rng.randint(20, 300) for _ in range(400)]
    capacity = sum(lengths) // 7 + 3
    assert len(window_best_fit(lengths, capacity)) == 8
    plan = pack_sequences(lengths, capacity, dp_size=7)
    assert_valid_plan(plan, lengths, capacity, 7)
    assert packing_stats(plan, lengths, capacity).num_micro_batches == 7 == min_bins(lengths, capacity, 7)
    without = pack_sequences(lengths, capacity, dp_size=7, rebalance=False)
    assert_valid_plan(without, lengths, capacity, 7)
    assert packing_stats(without, lengths, capacity).num_micro_batches == 14


def test_rebalance_is_cheap_when_hopeless():
    """Sequences longer than C/2 can never share a bin: one failed attempt, then the split step."""
    lengths = [600 + i % 300 for i in range(3000)]
    plan = pack_sequences(lengths, 1000, dp_size=8)
    assert_valid_plan(plan, lengths, 1000, 8)
    assert packing_stats(plan, lengths, 1000).num_micro_batches == 3000


def test_split_reaches_multiple_of_dp_without_empty_bins():
    lengths = [10, 20, 30, 40, 50, 60, 70]
    plan = pack_sequences(lengths, capacity=10_000, dp_size=4)
    assert_valid_plan(plan, lengths, 10_000, 4)
    assert all(len(mb) > 0 for rank in plan for mb in rank)


def test_fewer_sequences_than_ranks_gives_empty_dummy_bins():
    lengths = [5, 3]
    plan = pack_sequences(lengths, capacity=100, dp_size=4)
    assert_valid_plan(plan, lengths, 100, 4)
    stats = packing_stats(plan, lengths, 100)
    assert stats.micro_batches_per_rank == [1, 1, 1, 1]
    assert stats.empty_bins == 2


def test_single_sequence_bins_padded_with_empty_bins():
    # Every pair overflows, 3 bins of one sequence each, dp=2 -> one empty bin.
    plan = pack_sequences([60, 70, 80], capacity=100, dp_size=2)
    assert_valid_plan(plan, [60, 70, 80], 100, 2)
    assert packing_stats(plan, [60, 70, 80], 100).empty_bins == 1


def test_make_count_multiple_never_grows_a_bin():
    lengths = [9, 1, 1, 1, 9, 2]
    bins = [[0, 1], [2, 3, 4], [5]]
    out = make_count_multiple(bins, lengths, 4)
    assert len(out) == 4
    before = max(sum(lengths[i] for i in b) for b in bins)
    assert max(sum(lengths[i] for i in b) for b in out) <= before
    # The fullest bin (indices 2, 3, 4: 11 tokens) was the one split, into balanced halves.
    assert sorted(map(sorted, out)) == sorted([[0, 1], [5], [4], [2, 3]])


def test_pad_multiple_caps_the_padded_size():
    rng = random.Random(5)
    lengths = [rng.randint(1, 500) for _ in range(300)]
    plan = pack_sequences(lengths, 2048, dp_size=2, pad_multiple=8)
    assert_valid_plan(plan, lengths, 2048, 2, pad_multiple=8)
    assert packing_stats(plan, lengths, 2048, pad_multiple=8).overfilled_bins == 0
    with pytest.raises(ValueError, match="9 tokens.*capacity 8"):
        pack_sequences([7, 9], capacity=8, pad_multiple=1)
    with pytest.raises(ValueError, match="8 tokens.*capacity 7"):
        pack_sequences([7], capacity=7, pad_multiple=4)  # 7 padded to 8 > 7


def test_micro_batch_multiple():
    lengths = realistic_lengths(seed=1, prompts=16)
    plan = pack_sequences(lengths, 4096, dp_size=2, micro_batch_multiple=4)
    assert_valid_plan(plan, lengths, 4096, 2)
    assert len(plan[0]) % 4 == 0


def test_deterministic():
    lengths = realistic_lengths(seed=2, prompts=32)
    assert pack_sequences(lengths, 4096, 4) == pack_sequences(list(lengths), 4096, 4)


def test_window_keeps_locality():
    """With window 1 nothing is reordered: each bin holds a contiguous run (next-fit-like), unlike full sorting."""
    lengths = [100] * 50
    plan = pack_sequences(lengths, 1000, dp_size=1, window=1)
    for mb in plan[0]:
        assert mb == list(range(mb[0], mb[0] + len(mb)))


@pytest.mark.parametrize("packer", [pack_sequences, pack_ffd, pack_verl_kk, pack_padded])
def test_errors_are_clear(packer):
    with pytest.raises(ValueError, match="empty"):
        packer([], 10)
    with pytest.raises(ValueError, match=r"lengths\[1\]=0"):
        packer([3, 0], 10)
    with pytest.raises(ValueError, match=r"lengths\[0\]=-2"):
        packer([-2], 10)
    with pytest.raises(ValueError, match="capacity=0"):
        packer([3], 0)
    with pytest.raises(ValueError, match="capacity=-5"):
        packer([3], -5)
    with pytest.raises(ValueError, match="dp_size=0"):
        packer([3], 10, 0)
    with pytest.raises(ValueError, match="sequence 1 has 4097 tokens.*capacity 4096"):
        packer([10, 4097], 4096)


def test_parameter_errors():
    with pytest.raises(ValueError, match="window=0"):
        pack_sequences([1], 10, window=0)
    with pytest.raises(ValueError, match="close_fraction=1.5"):
        pack_sequences([1], 10, close_fraction=1.5)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        pack_padded([1], 10, micro_batch_size=0)


# ---------------------------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------------------------


def test_verl_kk_can_overfill_and_stats_report_it():
    """verl PR 7553's example: 8 sequences of 7 tokens, cap 8. ceil(56/8) = 7 micro-batches, so one holds 14."""
    lengths = [7] * 8
    kk = pack_verl_kk(lengths, 8)
    stats = packing_stats(kk, lengths, 8)
    assert stats.num_micro_batches == 7
    assert stats.overfilled_bins == 1 and stats.max_bin_tokens == 14 and stats.max_bin_fill == 14 / 8
    ours = pack_sequences(lengths, 8)
    assert_valid_plan(ours, lengths, 8, 1)
    assert packing_stats(ours, lengths, 8).num_micro_batches == 8


def test_verl_kk_places_everything_with_equal_counts():
    rng = random.Random(11)
    for _ in range(30):
        dp = rng.choice([1, 2, 4, 8])
        n = dp * rng.randint(1, 40)
        lengths = random_lengths(rng, n, 1000)
        plan = pack_verl_kk(lengths, 1000, dp)
        assert len(plan) == dp and len({len(r) for r in plan}) == 1
        assert sorted(i for r in plan for mb in r for i in mb) == list(range(n))
        # _balance_batch stage: equal sequence counts per rank
        assert len({sum(len(mb) for mb in r) for r in plan}) == 1


def test_karmarkar_karp_partitions():
    values = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(values, 2, equal_size=False)
    assert sorted(i for p in parts for i in p) == list(range(5))
    sums = sorted(sum(values[i] for i in p) for p in parts)
    # Differencing pairs 8-7, 6-5, 4-1, 3-1: 14 / 16, the textbook case where LDM misses the perfect 15 / 15.
    assert sums == [14, 16]
    eq = karmarkar_karp(list(range(1, 13)), 3, equal_size=True)
    assert [len(p) for p in eq] == [4, 4, 4]
    assert max(sum(p) + len(p) for p in eq) - min(sum(p) + len(p) for p in eq) <= 2
    with pytest.raises(ValueError, match="multiple of k=3"):
        karmarkar_karp([1, 2], 3, equal_size=True)


def test_padded_baseline_and_its_density():
    lengths = [2, 4, 3, 3, 1]
    plan = pack_padded(lengths, capacity=8, dp_size=1, micro_batch_size=2)
    assert plan == [[[0, 1], [2, 3], [4]]]
    stats = packing_stats(plan, lengths, 8, layout="padded")
    # padded tokens: 2*4 + 2*3 + 1*1 = 15
    assert stats.allocated_tokens == 15 and stats.density == pytest.approx(13 / 15)
    # default micro_batch_size = C // max(l) keeps n * L_max <= C
    plan = pack_padded([5, 1, 1, 1, 5], capacity=11)
    assert all(len(mb) <= 2 for mb in plan[0])
    # rank slices differ by at most one sequence; counts can differ -> reported
    uneven = pack_padded([1] * 5, capacity=1, dp_size=2)
    assert not packing_stats(uneven, [1] * 5, 1, layout="padded").equal_counts


def test_packing_stats_by_hand():
    lengths = [3, 4, 5, 9]
    plan = [[[0, 1], [3]], [[2], []]]
    s = packing_stats(plan, lengths, 10, alpha=0.0)
    assert s.num_micro_batches == 4 and s.micro_batches_per_rank == [2, 2] and s.equal_counts
    assert s.density == pytest.approx(21 / 40)
    assert s.rank_tokens == [16, 5] and s.max_rank_tokens == 16 and s.min_rank_tokens == 5
    assert s.rank_costs == [16.0, 5.0] and s.rank_cost_imbalance == pytest.approx(16 / 10.5)
    assert s.max_bin_tokens == 9 and s.overfilled_bins == 0 and s.empty_bins == 1
    s = packing_stats([[[0, 0, 3]]], lengths, 10)
    assert s.missing == [1, 2] and s.duplicated == [0] and s.overfilled_bins == 1
    with pytest.raises(ValueError, match="index 7"):
        packing_stats([[[7]]], lengths, 10)
