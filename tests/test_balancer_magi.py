"""MagiAttention's dispatch solver: the reference cases of issue 16, exactness of the search
against brute force, and the group layout (chunks cover every sample once, blocks exactly the
masked pairs, K/V move only where needed)."""

import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit.magi_dispatch import (
    area_bound,
    equal_count,
    exact_dispatch,
    magi_placement,
    min_heap_dispatch,
    solve_dispatch,
    window_areas,
    windows,
    zigzag_placement,
)
from hf_cp.balance.toolkit.placement import sample_slices
from hf_cp.balance.toolkit.relayout import LayoutOptions, _candidates, choose_layout
from hf_cp.cost.blocks import block_group_costs
from hf_cp.cost.simulate import simulate
from hf_cp.modes.registry import rank_segments
from hf_cp.modes.segments import ShardMode, segment_tokens
from hf_cp.plan.block_layout import BlockLayoutError
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.samples.masks import SampleMask

from helpers.balancer_checks import check_balancer_properties, step_cases


# ---------------------------------------------------------------------- reference cases
def test_reference_eight_areas_into_four_buckets():
    areas = [2, 4, 3, 16, 13, 5, 9, 10]
    greedy = min_heap_dispatch(areas, 4, per_bucket=2)
    assert greedy.max_load == 18
    assert sorted(np.bincount(greedy.bucket_of, minlength=4).tolist()) == [2, 2, 2, 2]
    exact = exact_dispatch(areas, 4, per_bucket=2)
    assert exact.max_load == 18 and exact.optimal
    free = exact_dispatch(areas, 4, per_bucket=None)
    assert free.max_load == 16 and free.optimal
    assert area_bound(areas, 4) == 15.5


def test_reference_greedy_is_not_optimal_two_buckets_of_four():
    areas = [8, 7, 6, 5, 4, 2, 2, 2]
    greedy = min_heap_dispatch(areas, 2, per_bucket=4)
    assert sorted(greedy.loads, reverse=True) == [19, 17]
    exact = exact_dispatch(areas, 2, per_bucket=4)
    assert sorted(exact.loads) == [18, 18] and exact.optimal
    assert solve_dispatch(areas, 2, per_bucket=4).max_load == 18
    # the loads are those of the assignment returned
    for d in (greedy, exact):
        assert [sum(a for a, b in zip(areas, d.bucket_of) if b == k) for k in range(2)] == list(d.loads)


def brute_force(areas, n_buckets, per_bucket):
    best = float("inf")
    for assign in itertools.product(range(n_buckets), repeat=len(areas)):
        counts = np.bincount(assign, minlength=n_buckets)
        if per_bucket is not None and counts.max() > per_bucket:
            continue
        loads = np.bincount(assign, weights=areas, minlength=n_buckets)
        best = min(best, loads.max())
    return best


@settings(max_examples=40, deadline=None)
@given(
    areas=st.lists(st.integers(0, 50), min_size=1, max_size=8),
    n_buckets=st.integers(1, 3),
    limited=st.booleans(),
)
def test_exact_search_matches_brute_force(areas, n_buckets, limited):
    per = equal_count(len(areas), n_buckets) if limited else None
    d = exact_dispatch(areas, n_buckets, per)
    assert d.optimal
    assert d.max_load == brute_force(areas, n_buckets, per)
    if per is not None:
        assert max(np.bincount(d.bucket_of, minlength=n_buckets)) <= per
    assert d.max_load >= area_bound(areas, n_buckets) - 1e-9


def test_exact_search_reports_an_exhausted_node_budget():
    rng = random.Random(3)
    areas = [rng.randint(1, 1000) for _ in range(14)]
    d = exact_dispatch(areas, 4, 4, node_limit=5)
    assert not d.optimal
    assert d.max_load <= min_heap_dispatch(areas, 4, 4).max_load


def test_bad_dispatch_input_is_refused():
    with pytest.raises(ValueError, match="do not fit 2 buckets of 1"):
        min_heap_dispatch([1, 2, 3], 2, 1)
    with pytest.raises(ValueError, match="at least one bucket"):
        min_heap_dispatch([1], 0)


# ---------------------------------------------------------------------- group layout
def test_windows_cut_the_packed_sequence_and_never_span_samples():
    wins = windows([5, 3, 9], 4)
    assert [sum(p[2] for p in w) for w in wins] == [4, 4, 4, 4, 1]
    assert wins[1] == [(0, 4, 1), (1, 0, 3)]
    for w in wins:
        docs = [p[0] for p in w]
        assert len(docs) == len(set(docs))


def dense_pairs(mask_or_len, q0, q1, k0, k1):
    """Attended pairs of a rectangle from the mask's plain definition (dense, independent)."""
    m = mask_or_len if isinstance(mask_or_len, SampleMask) else SampleMask.causal(mask_or_len)
    n = m.length
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    if m.kind == "causal":
        d = k <= q
    elif m.kind == "sliding_window":
        d = (k <= q) & (k > q - m.window)
    elif m.kind == "shared_prompt":
        seg = np.zeros(n, dtype=int)
        s = m.prompt
        for j, a in enumerate(m.answers):
            seg[s : s + a] = j + 1
            s += a
        d = (k <= q) & ((seg[None, :] == seg[:, None]) | (seg[None, :] == 0))
    else:
        raise AssertionError(m.kind)
    return int(d[q0:q1, k0:k1].sum())


MASKS = [
    SampleMask.causal(37),
    SampleMask.shared_prompt(5, [9, 3, 12]),
    SampleMask.sliding_window(41, 6),
    SampleMask.causal(3),
    SampleMask.shared_prompt(11, [7, 7]),
]


@pytest.mark.parametrize("g,chunk", [(2, 8), (4, 8), (4, 5), (3, 16)])
def test_magi_placement_covers_every_pair_once(g, chunk):
    lens = [m.length for m in MASKS]
    pl = magi_placement(lens, g, chunk, num_heads=4, masks=MASKS)
    pl.check(lens, sample_slices(lens, MASKS))
    # blocks' pairs add up to every sample's masked pairs, counted densely
    total = sum(dense_pairs(m, 0, m.length, 0, m.length) for m in MASKS)
    assert sum(pl.member_pairs()) == total
    for b in pl.compute:
        q, k = pl.chunks[b.q_chunk], pl.chunks[b.k_chunk]
        assert b.pairs == dense_pairs(MASKS[q.doc], q.start, q.end, k.start, k.end) > 0
        assert b.executor == q.owner
    # equal windows per member (the last window may be short): tokens differ by under two windows
    tok = pl.member_tokens()
    assert max(tok) - min(tok) < 2 * chunk
    wins = windows(lens, chunk)
    assert max(tok) <= equal_count(len(wins), g) * chunk


def test_magi_balances_areas_where_zigzag_does_not():
    masks = [SampleMask.shared_prompt(64, [200, 180, 300, 250]), SampleMask.causal(900)]
    lens = [m.length for m in masks]
    mg = magi_placement(lens, 4, 64, 4, masks)
    zz = zigzag_placement(lens, 4, 4, masks)
    ratio = lambda pl: max(pl.member_pairs()) / (sum(pl.member_pairs()) / 4)
    assert ratio(mg) < 1.05 < ratio(zz)
    areas = window_areas(windows(lens, 64), lens, sample_slices(lens, masks))
    assert max(mg.member_pairs()) <= min_heap_dispatch(areas, 4, equal_count(len(areas), 4)).max_load


def test_zigzag_placement_needs_18_of_the_rings_24_transfers_at_cp4_and_84_of_112_at_cp8():
    assert zigzag_placement([4096], 4, 4).kv_transfers() == 18
    assert zigzag_placement([4096], 8, 4).kv_transfers() == 84


def test_check_names_the_broken_rule():
    lens = [16]
    pl = magi_placement(lens, 2, 4, 2)
    sl = sample_slices(lens)
    bad = magi_placement(lens, 2, 4, 2)
    bad.compute.pop()
    with pytest.raises(BlockLayoutError, match="but no block computes them"):
        bad.check(lens, sl)
    bad = magi_placement(lens, 2, 4, 2)
    bad.chunks.pop()
    with pytest.raises(BlockLayoutError, match="are in no chunk"):
        bad.check(lens, sl)
    pl.check(lens, sl)


# ---------------------------------------------------------------------- the magi and usp balancers
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=step_cases(max_world=16))
def test_magi_and_usp_plans_are_valid_complete_capped_and_deterministic(case, h200_cost):
    world, cap, lengths = case
    for name in ("magi", "usp"):
        check_balancer_properties(name, world, cap, lengths, h200_cost)


def shared_prompt_request(cost, world, cap, seed=0, n=40):
    rng = random.Random(seed)
    masks, ids = {}, []
    for i in range(n):
        m = SampleMask.shared_prompt(rng.randint(5, 80), [rng.randint(50, 900) for _ in range(rng.randint(2, 8))])
        masks[100 + i] = m
        ids.append(100 + i)
    lengths = [masks[i].length for i in ids]
    # a long causal sample so that the base plan distributes something
    ids.append(7)
    lengths.append(cap * world // 2)
    req = PlanRequest(ids, lengths, ClusterSpec(world, cap), cost)
    object.__setattr__(req, "masks", masks)  # PlanRequest.masks (the mask data path) sets this field
    return req


@pytest.mark.parametrize("world", [4, 8])
def test_relayout_never_predicts_a_slower_step_than_its_base(world, h200_cost):
    # shared prompts too long for one rank's 2048 tokens: the base distributes many of them
    req = shared_prompt_request(h200_cost, world, 2048, seed=world)
    base = get_balancer("dynamic_cp").plan(req)
    base.masks = dict(req.masks)
    relaid = 0
    for name in ("magi", "usp"):
        plan = get_balancer(name).plan(req)
        plan.validate(req.cluster, h200_cost)
        assert plan.masks == req.masks and plan.balancer == name
        assert simulate(plan, h200_cost).makespan_ms <= simulate(base, h200_cost).makespan_ms + 1e-6
        # every group the base distributed is there with the same samples, possibly laid out anew
        same = lambda p: [(g.ranks, g.distributed, g.local) for w in p.waves for g in w.groups]
        assert same(plan) == same(base)
        relaid += sum(g.mode == ShardMode.BLOCKS for w in plan.waves for g in w.groups)
    assert relaid, "no group was laid out anew: the comparison above proves nothing"


def test_choose_layout_picks_the_fastest_candidate_that_fits(h200_cost):
    rng = random.Random(4)
    masks = [SampleMask.shared_prompt(20, [rng.randint(200, 3000) for _ in range(6)]) for _ in range(3)]
    lens = [m.length for m in masks]
    ranks = list(range(8))
    choice = choose_layout(h200_cost, lens, ranks, 32768, masks)
    # price every candidate independently with the simulator's group costs
    times = {}
    for name, mode, placement in _candidates(h200_cost, lens, masks, 8, LayoutOptions(), {}, {}):
        if placement is None:
            costs = [h200_cost.distributed_rank_cost(lens, mode, ranks, m, (), masks) for m in ranks]
        else:
            costs = block_group_costs(placement[1]().to_layout(), lens, ranks, h200_cost, masks)
        times[name] = max(c.total_ms for c in costs)
    assert choice.name in times
    assert choice.ms == pytest.approx(min(times.values()))
    # with a cap below every block layout's memory, only the whole-document modes remain
    tight = max(
        max(segment_tokens(rank_segments(m, lens, 8, r)) for r in ranks)
        for m in (ShardMode.RING_ZIGZAG, ShardMode.RING_PER_DOC)
    )
    limited = choose_layout(h200_cost, lens, ranks, tight, masks)
    assert limited is not None and limited.layout is None
