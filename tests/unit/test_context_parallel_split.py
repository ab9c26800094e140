"""The context-parallel layout (packing/context_parallel.py): zigzag chunks per sequence, round trip, load
balance, global positions, and the packer's padding rule reserving the 2*cp multiple."""

import pytest
import torch

from megatron_dppo.packing import build_rank_micro_batches, build_thd_batch, pack_sequences, thd_pad_multiple
from megatron_dppo.packing.context_parallel import (
    check_cp_layout,
    cp_gather_order,
    cp_partition_indices,
    cp_positions,
    merge_from_cp,
    split_for_cp,
)


def test_zigzag_by_hand():
    # two sequences of padded length 8 and 4 at cp=2: chunks of 2 and 1
    cu = [0, 8, 12]
    assert cp_partition_indices(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_partition_indices(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert cp_positions(cu, 2, 0).tolist() == [0, 1, 6, 7, 0, 3]
    assert cp_positions(cu, 2, 1).tolist() == [2, 3, 4, 5, 1, 2]
    assert cp_partition_indices(cu, 1, 0).tolist() == list(range(12))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_round_trip_and_order(cp):
    lengths = [8 * cp, 2 * cp, 14 * cp, 4 * cp]
    cu = torch.tensor([0] + lengths).cumsum(0)
    full = torch.randn(int(cu[-1]), 3, 2)
    parts = [split_for_cp(full, cu, cp, r) for r in range(cp)]
    assert all(p.shape[0] == full.shape[0] // cp for p in parts)
    assert torch.equal(merge_from_cp(parts, cu), full)
    assert torch.equal(torch.cat(parts)[cp_gather_order(cu, cp)], full)
    # every position belongs to exactly one rank
    owned = torch.cat([cp_partition_indices(cu, cp, r) for r in range(cp)])
    assert sorted(owned.tolist()) == list(range(int(cu[-1])))
    # along another dimension too
    assert torch.equal(merge_from_cp([split_for_cp(full.transpose(0, 1), cu, cp, r, dim=1) for r in range(cp)],
                                     cu, dim=1), full.transpose(0, 1))


@pytest.mark.parametrize("cp", [2, 4])
def test_load_balance_of_causal_work(cp):
    # causal attention work of a position = its position + 1 keys; every rank gets the same total
    lengths = [16 * cp, 6 * cp, 2 * cp]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    work = [int((cp_positions(cu, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work
    sizes = [cp_partition_indices(cu, cp, r).numel() for r in range(cp)]
    assert len(set(sizes)) == 1


def test_positions_are_global_within_each_sequence():
    cp = 2
    cu = [0, 12, 20]
    full_pos = torch.cat([torch.arange(12), torch.arange(8)])
    for r in range(cp):
        assert torch.equal(cp_positions(cu, cp, r), split_for_cp(full_pos, cu, cp, r))


def test_matches_megatron_rope_layout():
    # Megatron's THD RoPE (rope_utils._get_thd_freqs_on_this_cp_rank) gives rank r, for a sequence of local
    # length x = L / cp, positions [r*x/2, (r+1)*x/2) and [L - (r+1)*x/2, L - r*x/2)
    cp, L = 4, 24
    x = L // cp
    for r in range(cp):
        seg = x // 2
        expected = list(range(r * seg, (r + 1) * seg)) + list(range(L - (r + 1) * seg, L - r * seg))
        assert cp_positions([0, L], cp, r).tolist() == expected


def test_bad_layouts_name_the_numbers():
    with pytest.raises(ValueError, match="sequence 1 has padded length 6.*2\\*cp=4"):
        check_cp_layout([0, 8, 14], 2)
    with pytest.raises(ValueError, match="cp_rank=2"):
        cp_partition_indices([0, 8], 2, 2)
    with pytest.raises(ValueError, match="cp_size=0"):
        cp_partition_indices([0, 8], 0, 0)
    with pytest.raises(ValueError, match="5 positions"):
        split_for_cp(torch.zeros(5), [0, 8], 2, 0)


@pytest.mark.parametrize("tp,cp,sp", [(1, 2, False), (2, 2, True), (1, 4, False), (4, 2, True)])
def test_packer_padding_reserves_the_cp_multiple(tp, cp, sp):
    pad = thd_pad_multiple(tp, cp, sp)
    assert pad % (2 * cp) == 0
    lengths = [5, 17, 3, 30, 11, 8, 1 + 2 * cp]
    seqs = [list(range(1, n + 1)) for n in lengths]
    plan = pack_sequences(lengths, 64, 2, pad_multiple=pad)
    for rank_plan in plan:
        for batch in build_rank_micro_batches(rank_plan, seqs, [1] * len(seqs), [0.0] * len(seqs),
                                              [1.0] * len(seqs), pad_multiple=pad):
            check_cp_layout(batch.cu_seqlens_padded, cp)
            local = int(batch.tokens.numel()) // cp
            if sp:  # sequence parallel then splits each rank's part over tp
                assert local % tp == 0
            assert int(batch.cu_seqlens_padded[-1]) <= 64
    dummy = build_thd_batch([], [], [], [], [], pad_multiple=pad)
    check_cp_layout(dummy.cu_seqlens_padded, cp)
