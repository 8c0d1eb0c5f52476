"""The `chunkflow` balancer: ChunkFlow's chunks placed by their real cost, within each rank's memory."""

import pytest
from hypothesis import HealthCheck, given, settings

from hf_cp.balance import PlanRequest, available_balancers, get_balancer
from hf_cp.balance.auto import default_members
from hf_cp.cost.simulate import simulate
from hf_cp.plan.chunks import chunked_memory_bytes, chunked_sample_cost, dependent_chunk_sizes, standalone_chunk_ms
from hf_cp.plan.cluster import ClusterSpec

from helpers.balancer_checks import check_balancer_properties, step_cases
from helpers.toy_cost import toy_cost


def test_registered_and_an_auto_member_since_the_trainer_runs_it():
    assert "chunkflow" in available_balancers()
    assert "chunkflow" in default_members()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_cases(max_world=16))
def test_every_sample_once_memory_within_the_cap_identical_plans(h200_cost, case):
    world, cap, lengths = case
    for options in ({}, {"keep": 2}, {"chunk_size": max(1, cap // 4), "keep": 2}):
        plan = check_balancer_properties("chunkflow", world, cap, lengths, h200_cost, **options)
        lens = plan.length_of()
        for w in plan.waves:
            for g in w.groups:
                for cs in g.chunked.values():
                    for c in cs:
                        sizes = dependent_chunk_sizes(lens[c.sample], c.chunk_size)
                        assert len(sizes) > 1, "a chunked sample is longer than its chunk size"
                        assert c.keep == options.get("keep", 1)
                        assert chunked_memory_bytes(h200_cost, sizes, c.keep) <= h200_cost.memory_bytes(cap)
                for ids in g.local.values():
                    assert sum(lens[s] for s in ids) <= options.get("chunk_size", cap // options.get("keep", 1)) or (
                        len(ids) == 1
                    ), "a standalone chunk holds at most chunk_size tokens (or one sample run whole)"


def test_places_by_real_cost_not_by_length():
    # toy cost: attention dominates. A 150-token sample runs as 2 chunks of 75; 30 samples of 10
    # tokens pack into 3 chunks of 100. By tokens, LPT would put the third pack beside the long
    # sample (150 + 100 < 200 + 100); by cost the long sample outweighs all three packs together.
    cost = toy_cost()
    lengths = [150] + [10] * 30
    req = PlanRequest(range(len(lengths)), lengths, ClusterSpec(2, 1000), cost)
    # (a CP group of 2 would be faster still: spread_stragglers is off to see the placement alone)
    plan = get_balancer("chunkflow", chunk_size=100, spread_stragglers=False).plan(req).validate(req.cluster, cost)
    chunked = [g for w in plan.waves for g in w.groups if g.chunked]
    assert len(chunked) == 1 and chunked[0].chunked == {chunked[0].ranks[0]: [(0, 75, 1)]}
    long_rank = chunked[0].ranks[0]
    assert all(g.ranks != (long_rank,) for w in plan.waves for g in w.groups if g.local), "nothing else on its rank"
    long_ms = chunked_sample_cost(cost, [75, 75], 1).compute_ms
    packs_ms = 3 * standalone_chunk_ms(cost, [10] * 10)
    assert long_ms > packs_ms
    assert simulate(plan, cost).makespan_ms == pytest.approx(long_ms)


def test_list_scheduling_bound(h200_cost):
    # every unit fits one rank here: LPT's makespan is within the heaviest unit of the mean load
    lengths = [300, 1200, 5000, 20000, 45000, 800, 64, 7000, 33000, 2500] * 3
    cl = ClusterSpec(4, 32768)
    plan = get_balancer("chunkflow").plan(PlanRequest(range(len(lengths)), lengths, cl, h200_cost))
    sim = simulate(plan.validate(cl, h200_cost), h200_cost)
    assert not plan.spreads_samples and len(plan.chunked_samples) == 6  # 3 x 45000 and 3 x 33000 tokens
    per_group = [run.duration_ms for run in sim.runs]
    assert sim.makespan_ms <= sum(per_group) / 4 + max(per_group) + 1e-6
    assert sim.imbalance < 1.2


def test_samples_that_do_not_fit_one_rank_in_chunks():
    cost = toy_cost()  # state 96 B/token against 100 B/token of activations
    cl = ClusterSpec(4, 1000)
    # 1500 tokens: its K/V store alone exceeds a rank (144,000 B > 100,000 B): a CP group of 2
    # 1000 tokens with chunks of <= 100: 40 tokens of activations left, under the minimum chunk: run whole
    # 900 tokens: chunks of 100 fit (86,400 B + 10,000 B)
    req = PlanRequest([7, 8, 9, 10], [1500, 1000, 900, 50], cl, cost)
    plan = get_balancer("chunkflow", chunk_size=100).plan(req).validate(cl, cost)
    groups = [g for w in plan.waves for g in w.groups]
    assert [(g.ranks, g.distributed) for g in groups if g.distributed] == [((0, 1), [7])]
    assert [g.local for g in groups if 8 in g.sample_ids()][0] in ({r: [8]} for r in range(4))
    assert [c for g in groups for cs in g.chunked.values() for c in cs] == [(9, 100, 1)]


def test_options_are_checked():
    with pytest.raises(ValueError, match=r"keep must be a positive integer"):
        get_balancer("chunkflow", keep=0)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        get_balancer("chunkflow", chunk_size=-5)
    req = PlanRequest([1], [10], ClusterSpec(1, 1000), toy_cost())
    with pytest.raises(
        ValueError, match=r"keep 3 x chunk_size 500 = 1500 tokens of activations exceed the cap of 1000"
    ):
        get_balancer("chunkflow", chunk_size=500, keep=3).plan(req)


def test_a_straggling_chunked_sample_moves_to_a_cp_group_when_faster(h200_cost):
    # 57K tokens chunked on one rank take longer than a rank's share of this step; on a CP group
    # of 2 they are faster. spread_stragglers=False keeps ChunkFlow's no-communication placement.
    lengths = [56963] + [2000] * 120
    cl = ClusterSpec(8, 32768)
    req = PlanRequest(range(len(lengths)), lengths, cl, h200_cost)
    mixed = get_balancer("chunkflow").plan(req).validate(cl, h200_cost)
    pure = get_balancer("chunkflow", spread_stragglers=False).plan(req).validate(cl, h200_cost)
    assert pure.chunked_samples == [0] and not pure.spreads_samples
    assert mixed.chunked_samples == [] and mixed.cp_size_of_samples()[0] > 1
    assert simulate(mixed, h200_cost).makespan_ms < 0.9 * simulate(pure, h200_cost).makespan_ms
