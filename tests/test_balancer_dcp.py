"""DCP's planner: every sample placed once, memory within the cap counting received rows,
groups from the placement (registered blocks, disjoint per wave), hierarchical partitioning,
the division schedule, determinism, and the Mt-KaHyPar refinement against the greedy."""

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.balancers.dcp import hypergraph
from hf_cp.balance.balancers.dcp.divisions import division_overlap_ms, schedule_divisions
from hf_cp.balance.balancers.dcp.layout import deadline_check, plan_layout
from hf_cp.balance.balancers.dcp.options import DcpError, DcpOptions
from hf_cp.balance.balancers.dcp.placement import covering_block
from hf_cp.balance.balancers.dcp.weights import Weights, cut_sample
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.balance.toolkit.placement import BlockPlacement, Chunk, ComputeBlock, sample_slices
from hf_cp.cost.bounds import lower_bound_ms
from hf_cp.cost.simulate import simulate
from hf_cp.modes.registry import rank_segments
from hf_cp.modes.segments import ShardMode, segment_tokens
from hf_cp.plan.block_layout import received_token_equivalent
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.samples.masks import SampleMask

from helpers.balancer_checks import check_auto_skips_behind_magi, check_balancer_properties, step_cases

BACKENDS = ["greedy"] + (["mtkahypar"] if hypergraph.available() else [])


def check_layout(layout, lengths, world, cap, cost, masks=None):
    """Independent checks of a DcpLayout; returns each rank's predicted time per wave."""
    cluster = ClusterSpec(world, cap)
    seen = []
    slices = sample_slices(lengths, masks)
    for groups in layout.waves:
        busy = set()
        for ranks, docs, pl, div, local in groups:
            assert cluster.is_registered(tuple(ranks)) or len(ranks) == 1
            assert not busy & set(ranks), "groups of a wave overlap"
            busy |= set(ranks)
            for r, ids in local.items():
                assert r in ranks
                seen.extend(ids)
            seen.extend(docs)
            if pl is None:  # samples too large for blocks run ring per-document
                for m in range(len(ranks)):
                    assert (
                        sum(
                            segment_tokens(
                                rank_segments(ShardMode.RING_PER_DOC, [lengths[i] for i in docs], len(ranks), m)
                            )
                            for _ in [0]
                        )
                        <= cap
                    )
                continue
            assert pl.group_size == len(ranks)
            pl.check([lengths[i] for i in docs], [slices[i] for i in docs])
            assert len(div) == len(pl.compute)
            owned = pl.member_tokens()
            layout = pl.to_layout()
            for m, r in enumerate(ranks):
                tokens = owned[m] + sum(lengths[i] for i in local.get(r, []))
                tokens += received_token_equivalent(layout, m, cost)  # what StepPlan.validate adds
                assert tokens <= cap
        for ranks, _docs, pl, _div, local in groups:
            for r, ids in local.items():
                assert sum(lengths[i] for i in ids) + (pl.member_tokens()[ranks.index(r)] if pl else 0) <= cap
    assert sorted(seen) == list(range(len(lengths))), "a sample is lost or placed twice"


@pytest.mark.parametrize("backend", BACKENDS)
def test_outlier_document_spreads_over_the_world_and_balances(backend, h200_cost):
    rng = random.Random(1)
    lengths = [400_000] + [rng.randint(50, 3000) for _ in range(300)]
    t0 = time.process_time()
    lay = plan_layout(lengths, 16, 8, 32768, h200_cost, options=DcpOptions(partitioner=backend))
    assert time.process_time() - t0 < 10
    assert lay.backend == backend
    check_layout(lay, lengths, 16, 32768, h200_cost)
    w = Weights(h200_cost)
    # the long document runs distributed over the whole world, its attention balanced
    spread = [(ranks, pl) for groups in lay.waves for ranks, docs, pl, div, local in groups if 0 in docs]
    assert len(spread) == 1
    ranks, pl = spread[0]
    assert len(ranks) == 16
    attn = [0.0] * 16
    for b in pl.compute:
        attn[b.executor] += w.attention_ms(b.pairs, pl.chunks[b.q_chunk].length)
    assert max(attn) / (sum(attn) / 16) < 1.10


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_and_short_samples_within_a_node(backend, h200_cost):
    rng = random.Random(2)
    masks, lengths = [], []
    for i in range(40):
        if i % 3 == 0:
            m = SampleMask.shared_prompt(rng.randint(10, 200), [rng.randint(100, 2500) for _ in range(8)])
        elif i % 3 == 1:
            m = SampleMask.sliding_window(rng.randint(3000, 20000), 1024)
        else:
            m = None
        masks.append(m)
        lengths.append(m.length if m is not None else rng.randint(100, 6000))
    lay = plan_layout(lengths, 8, 8, 16384, h200_cost, masks, DcpOptions(partitioner=backend))
    check_layout(lay, lengths, 8, 16384, h200_cost, masks)
    again = plan_layout(lengths, 8, 8, 16384, h200_cost, masks, DcpOptions(partitioner=backend))
    assert [[(r, d, pl.to_dict() if pl else None, dv, lo) for r, d, pl, dv, lo in g] for g in again.waves] == [
        [(r, d, pl.to_dict() if pl else None, dv, lo) for r, d, pl, dv, lo in g] for g in lay.waves
    ]


@pytest.mark.parametrize("doc,nodes", [(40_000, 1), (100_000, 2)])
def test_hierarchical_levels_spread_a_document_over_as_few_nodes_as_its_time_needs(doc, nodes, h200_cost):
    # 4 nodes of 8 ranks; 500 short samples; a 40K document needs ~5 ranks' share of the step's
    # time (one node), a 100K one ~14 (two nodes)
    rng = random.Random(3)
    lengths = [doc] + [rng.randint(100, 2000) for _ in range(500)]
    lay = plan_layout(lengths, 32, 8, 32768, h200_cost, options=DcpOptions(partitioner="greedy"))
    check_layout(lay, lengths, 32, 32768, h200_cost)
    spread = [ranks for groups in lay.waves for ranks, docs, pl, div, local in groups if 0 in docs]
    assert len(spread) == 1
    assert len({r // 8 for r in spread[0]}) == nodes


def test_a_sample_whose_received_rows_do_not_fit_runs_ring_per_document(h200_cost):
    # 1999 tokens on 2 ranks of 1000: as blocks a member would own ~1000 and receive the other
    # half's K/V; per-document on a ring it holds 999 and streams K/V
    lay = plan_layout([1990, 1999], 2, 8, 1000, h200_cost, options=DcpOptions(fill=1.0))
    ring = [(ranks, docs) for groups in lay.waves for ranks, docs, pl, _, _ in groups if docs and pl is None]
    assert sorted(d for _, docs in ring for d in docs) == [0, 1]
    plan = get_balancer("dcp", fill=1.0).plan(PlanRequest([7, 9], [1990, 1999], ClusterSpec(2, 1000), h200_cost))
    plan.validate(ClusterSpec(2, 1000), h200_cost)
    assert {g.mode for w in plan.waves for g in w.groups if g.distributed} == {ShardMode.RING_PER_DOC}
    with pytest.raises(DcpError, match=r"sample 0 \(2100 tokens\) does not fit 2 ranks x 1000 tokens"):
        plan_layout([2100], 2, 8, 1000, h200_cost)


def test_covering_block_is_the_smallest_aligned_block():
    assert covering_block([5], 16) == (5,)
    assert covering_block([4, 5], 16) == (4, 5)
    assert covering_block([3, 4], 16) == tuple(range(8))
    assert covering_block([1, 9], 16) == tuple(range(16))


def test_cut_sample_blocks_cover_and_skip_empty_pairs():
    s = cut_sample(7, 1000, sample_slices([1000])[0], 4)
    assert [b[1] for b in s.blocks] == [250] * 4
    assert [(q, k) for q, k, _ in s.compute] == [(q, k) for q in range(4) for k in range(q + 1)]
    sw = cut_sample(0, 1000, SampleMask.sliding_window(1000, 100).slices(), 4)
    assert all(q - k <= 1 for q, k, _ in sw.compute)  # a 100-token window reaches one block back
    assert sum(p for *_, p in sw.compute) == SampleMask.sliding_window(1000, 100).pairs()


# ---------------------------------------------------------------------- divisions
def two_member_placement():
    # member 0 owns chunks 0, 1; member 1 owns chunks 2, 3 (one causal sample of 4 x 10 tokens)
    pl = BlockPlacement(2, 4, [Chunk(0, 10 * i, 10, 0 if i < 2 else 1) for i in range(4)])
    for q in range(4):
        for k in range(q + 1):
            pl.compute.append(ComputeBlock(q, k, 0, 4, pl.chunks[q].owner, 55 if q == k else 100))
    return pl


def test_division_zero_holds_the_local_blocks_and_middle_divisions_respect_the_traffic_share():
    pl = two_member_placement()
    div = schedule_divisions(pl, [1.0] * len(pl.compute), 4)
    assert len(div) == len(pl.compute) and set(div) <= {0, 1, 2, 3}
    for d, b in zip(div, pl.compute):
        local = pl.chunks[b.q_chunk].owner == b.executor == pl.chunks[b.k_chunk].owner
        assert (d == 0) == local
    # member 1 receives chunks 0 and 1 (20 rows) in all: a share of 20/4 = 5 rows per middle
    # division is less than a chunk, so each middle division brings one chunk (the unit of transfer)
    arrival = {}
    for d, b in zip(div, pl.compute):
        if pl.chunks[b.k_chunk].owner != b.executor:
            arrival[b.k_chunk] = min(arrival.get(b.k_chunk, 9), d)
    assert sorted(arrival.values()) == [1, 2]
    assert schedule_divisions(pl, [1.0] * len(pl.compute), 1) == [0] * len(pl.compute)


def test_division_overlap_hides_transfers_behind_the_previous_division():
    assert division_overlap_ms([5, 5, 5], [0, 3, 7]) == 0 + 5 + 7 + 5
    assert division_overlap_ms([5], [2]) == 7
    assert division_overlap_ms([], []) == 0


@pytest.mark.skipif(not hypergraph.available(), reason="needs Mt-KaHyPar (pip install mtkahypar)")
def test_refinement_never_moves_more_bytes_than_the_greedy(h200_cost):
    rng = random.Random(5)
    masks = [SampleMask.shared_prompt(64, [rng.randint(2000, 9000) for _ in range(6)]) for _ in range(4)]
    lengths = [m.length for m in masks] + [rng.randint(100, 1000) for _ in range(60)]
    masks += [None] * 60
    moved = {}
    for backend in ("greedy", "mtkahypar"):
        lay = plan_layout(lengths, 8, 8, 32768, h200_cost, masks, DcpOptions(partitioner=backend))
        check_layout(lay, lengths, 8, 32768, h200_cost, masks)
        moved[backend] = sum(pl.kv_transfers() for groups in lay.waves for _, _, pl, _, _ in groups if pl is not None)
    assert moved["mtkahypar"] <= moved["greedy"]


# ---------------------------------------------------------------------- the dcp balancer
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=step_cases(max_world=16))
def test_dcp_plans_are_valid_complete_capped_and_deterministic(case, h200_cost):
    world, cap, lengths = case
    check_balancer_properties("dcp", world, cap, lengths, h200_cost)


def test_dcp_plans_the_outlier_within_ten_percent_of_the_bound_and_reports_its_time(h200_cost):
    rng = random.Random(7)
    lengths = [300_000] + [rng.randint(50, 3000) for _ in range(600)]
    cluster = ClusterSpec(16, 32768)
    bal = get_balancer("dcp", divisions=4, keep_fallback=False)  # the blocks, which its fallback beats here
    plan = bal.plan(PlanRequest(list(range(len(lengths))), lengths, cluster, h200_cost))
    plan.validate(cluster, h200_cost)
    ratio = simulate(plan, h200_cost).makespan_ms / lower_bound_ms(lengths, cluster, h200_cost)
    assert ratio < 1.10
    assert 0 < bal.last_planner_s < 10 and bal.last_backend in ("greedy", "mtkahypar")
    # the long sample runs as blocks over the whole world; the layout carries DCP's divisions
    spread = [g for w in plan.waves for g in w.groups if 0 in g.distributed]
    assert len(spread) == 1 and spread[0].mode == ShardMode.BLOCKS and spread[0].size == 16
    assert spread[0].blocks.divisions is not None and max(spread[0].blocks.divisions) > 0
    # by default (the executor runs one exchange per layer) the layouts carry no divisions
    plain = get_balancer("dcp", keep_fallback=False).plan(
        PlanRequest(list(range(len(lengths))), lengths, cluster, h200_cost)
    )
    assert all(g.blocks.divisions is None for w in plain.waves for g in w.groups if g.blocks is not None)


def test_dcp_respects_the_largest_group_size(h200_cost):
    rng = random.Random(8)
    lengths = [100_000, 90_000] + [rng.randint(50, 3000) for _ in range(300)]
    cluster = ClusterSpec(16, 32768, max_group_size=4)
    plan = get_balancer("dcp").plan(PlanRequest(list(range(len(lengths))), lengths, cluster, h200_cost))
    plan.validate(cluster, h200_cost)  # every group registered: none larger than 4
    assert max(g.size for w in plan.waves for g in w.groups) == 4


def _dcp_bound_holds(req, cost):
    """dcp's lower_bound_ms is at most its plan's and its fallback's simulated step time."""
    dcp = get_balancer("dcp", deadline_s=None)
    bound = dcp.lower_bound_ms(req, BoundCache(req))
    blocks = simulate(dcp._plan(req, deadline_check(None)), cost).makespan_ms
    fallback = simulate(dcp.plan_fallback(req), cost).makespan_ms
    assert bound <= min(blocks, fallback) * (1 + 1e-9), (bound, blocks, fallback)
    return bound


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=step_cases(max_world=16))
def test_dcp_bound_is_below_its_block_placement_and_its_fallback(case, h200_cost):
    """auto skips dcp on this bound (issue 39): every aligned block of ranks runs at least the
    single-rank work of the samples dcp's first step puts inside it."""
    world, cap, lengths = case
    cluster = ClusterSpec(world, cap)
    lengths = [n for n in lengths if n <= cluster.largest_capacity] or [1]
    try:
        req = PlanRequest(list(range(len(lengths))), lengths, cluster, h200_cost)
        _dcp_bound_holds(req, h200_cost)
    except DcpError:
        pass  # a step dcp refuses: lower_bound_ms says None and plan() raises


@pytest.mark.parametrize("world", [4, 8, 64])
@pytest.mark.parametrize("kind", ["g16", "g8long"])
def test_dcp_bound_on_grouped_steps_rules_it_out_behind_magi(h200_cost, traces_dir, kind, world):
    """On shared-prompt steps dcp's first step leaves its blocks of ranks unbalanced: its bound
    is above magi's plan (up to 1.27x the charged bound on the 64-rank GRPO-like step), and
    auto no longer plans it (it cost auto ~200 ms there)."""
    check_auto_skips_behind_magi("dcp", _dcp_bound_holds, traces_dir, kind, world, h200_cost)
