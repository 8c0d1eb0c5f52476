"""USP (Ulysses x ring) as a placement: valid for every factorisation and mask, each member
owning its share of tokens, Ulysses within a ring position (head ranges over its u members)
and the ring across positions, with u = g being Ulysses and u = 1 a ring placement."""

import pytest

from hf_cp.balance.placement import sample_slices
from hf_cp.balance.usp import usp_factorisations, usp_placement
from hf_cp.masks import SampleMask

MASKS = [SampleMask.causal(301), SampleMask.shared_prompt(17, [40, 33, 61]), SampleMask.sliding_window(190, 24)]
LENS = [m.length for m in MASKS]


def test_factorisations_divide_the_group_and_the_heads():
    assert usp_factorisations(8, 28) == [(1, 8), (2, 4), (4, 2)]
    assert usp_factorisations(8, 32) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert usp_factorisations(4, 28, max_ulysses=2) == [(1, 4), (2, 2)]


@pytest.mark.parametrize("u,r", [(2, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
@pytest.mark.parametrize("ring_layout", ["zigzag", "per_doc"])
def test_usp_placement_is_valid_and_runs_ulysses_within_a_ring_position(u, r, ring_layout):
    H = 8
    pl = usp_placement(LENS, u, r, H, MASKS, ring_layout)
    pl.check(LENS, sample_slices(LENS, MASKS))
    g = u * r
    tok = pl.member_tokens()
    assert max(tok) - min(tok) <= 2 * len(LENS) + 2  # equal shares up to the splits' remainders
    h = H // u
    for b in pl.compute:
        assert b.head_end - b.head_start == h
        pos_q = pl.chunks[b.q_chunk].owner // u
        assert b.executor == pos_q * u + b.head_start // h  # member i of the query's position
    # every member computes the same share of the masked pairs when the ring part is balanced
    pairs = pl.member_pairs()
    assert sum(pairs) == sum(m.pairs() for m in MASKS)
    if r == 1:  # pure Ulysses: each member runs all pairs on its heads
        assert max(pairs) == min(pairs)
    assert len(pairs) == g


def test_usp_refuses_a_head_count_it_cannot_split():
    with pytest.raises(ValueError, match="splits 28 query heads unevenly"):
        usp_placement([100], 8, 1, 28)
