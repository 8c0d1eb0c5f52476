import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.cost.bounds import alone_on_group_ms, charged_lower_bound_ms, lower_bound_ms
from hf_cp.cost.simulate import simulate
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan, Wave

from helpers.plan_gen import random_valid_plan


def ulysses_ok(cost):
    def ok(g):
        try:
            cost.check_ulysses(g)
            return True
        except ValueError:
            return False

    return ok


def test_wave_timing_rules(h200_cost):
    # rank 0 runs a long local doc in wave 0; in wave 1 it joins rank 1 in a group: rank 1 waits for it
    p = StepPlan(
        world_size=2,
        max_tokens_per_rank=32768,
        sample_ids=[0, 1, 2],
        lengths=[20000, 1000, 30000],
        waves=[
            Wave([Group(ranks=(0,), local={0: [0]}), Group(ranks=(1,), local={1: [1]})]),
            Wave([Group(ranks=(0, 1), distributed=[2])]),
        ],
    )
    s = simulate(p, h200_cost)
    oh = h200_cost.micro_batch_overhead_ms()
    t0 = h200_cost.sample_local_ms(20000) + oh
    t1 = h200_cost.sample_local_ms(1000) + oh
    assert s.runs[2].start_ms == pytest.approx(t0)  # the group starts when its last member is free
    assert s.idle_ms[1] >= t0 - t1 - 1e-6
    assert s.makespan_ms == pytest.approx(t0 + s.runs[2].duration_ms)
    assert s.cp_size_samples == {1: 2, 2: 1}
    assert s.comm_bytes > 0
    assert sum(s.busy_ms) + sum(s.idle_ms) == pytest.approx(2 * s.makespan_ms)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 120_000), min_size=1, max_size=30), st.integers(0, 10**6), st.sampled_from([1, 2, 8, 16])
)
def test_lower_bound_never_exceeds_a_valid_plan(h200_cost, lengths, seed, world):
    cl = ClusterSpec(world_size=world, max_tokens_per_rank=32768)
    lengths = [min(n, cl.largest_capacity) for n in lengths]
    lb = lower_bound_ms(lengths, cl, h200_cost)
    plan = random_valid_plan(lengths, cl, seed, ulysses_ok(h200_cost)).validate(cl)
    assert lb <= simulate(plan, h200_cost).makespan_ms * (1 + 1e-9)
    static = get_balancer("static").plan(PlanRequest(range(len(lengths)), lengths, cl, h200_cost))
    assert lb <= simulate(static, h200_cost).makespan_ms * (1 + 1e-9)


def test_simulation_is_deterministic(h200_cost):
    cl = ClusterSpec(world_size=8, max_tokens_per_rank=32768)
    lengths = [100, 5000, 70000, 300, 12000] * 10
    plan = random_valid_plan(lengths, cl, 3, ulysses_ok(h200_cost)).validate(cl, h200_cost)
    a, b = simulate(plan, h200_cost), simulate(plan, h200_cost)
    assert a == b


def test_bounds_of_a_sample_no_group_holds_charge_it_to_one_rank(h200_cost):
    # 2001 tokens fit no group of 2 x 1000: only ChunkFlow's dependent chunks on one rank run it,
    # in at least its single-rank compute (the simulator's plans of it: test_balance_long_samples)
    cl = ClusterSpec(world_size=2, max_tokens_per_rank=1000)
    alone = h200_cost.sample_local_ms(2001)
    assert charged_lower_bound_ms([5, 2001], cl, h200_cost) >= alone + h200_cost.micro_batch_overhead_ms()
    assert lower_bound_ms([5, 2001], cl, h200_cost) > 0
    with pytest.raises(ValueError, match="sample 1 has 0 tokens"):
        lower_bound_ms([5, 0], cl, h200_cost)


def test_validate_rejects_ulysses_group_that_does_not_divide_heads(h200_cost):
    from hf_cp.modes.segments import ShardMode
    from hf_cp.plan.step_plan import PlanError

    cl = ClusterSpec(world_size=8, max_tokens_per_rank=32768)
    p = StepPlan(
        world_size=8,
        max_tokens_per_rank=32768,
        sample_ids=[0],
        lengths=[50000],
        waves=[Wave([Group(ranks=tuple(range(8)), distributed=[0], mode=ShardMode.ULYSSES)])],
    )
    p.validate(cl)  # structurally fine
    with pytest.raises(
        PlanError,
        match=r"group \[0, 1, 2, 3, 4, 5, 6, 7\]: Ulysses over a CP group of 8 ranks needs the number of query heads to be divisible by 8",
    ):
        p.validate(cl, h200_cost)


def test_max_over_mean_is_the_one_definition():
    from hf_cp.cost.simulate import max_over_mean

    assert max_over_mean([1.0, 3.0]) == 1.5
    assert max_over_mean([0.0, 0.0]) == 1.0  # nothing to do is balanced
    assert max_over_mean([]) == 1.0
    assert max_over_mean([2.0, 2.0, 2.0, 6.0]) == 2.0


def test_simulate_with_the_cluster_carries_both_bounds_and_flags_a_balanced_plan_far_above_them(h200_cost):
    from hf_cp.cost.bounds import charged_lower_bound_ms
    from hf_cp.cost.simulate import FAR_ABOVE_BOUND
    from hf_cp.modes.segments import ShardMode

    # 64 short documents zigzag-split over all 16 ranks: perfectly balanced, mostly ring traffic
    lengths = [400] * 64
    cl = ClusterSpec(world_size=16, max_tokens_per_rank=32768, gpus_per_node=8)
    ids = list(range(len(lengths)))
    shredded = StepPlan(16, 32768, ids, lengths, [Wave([Group(tuple(range(16)), ids, ShardMode.RING_ZIGZAG)])])
    s = simulate(shredded, h200_cost, cl)
    assert s.lower_bound_ms == pytest.approx(lower_bound_ms(lengths, cl, h200_cost))
    assert s.charged_bound_ms == pytest.approx(charged_lower_bound_ms(lengths, cl, h200_cost))
    assert s.imbalance < 1.01
    assert s.ratio_to_bound >= FAR_ABOVE_BOUND and s.far_above_bound
    assert "far above the bound" in s.flags[0] and "max/mean" in s.flags[0]
    # four documents per rank, local: near the bound, no flag; without the cluster no bounds at all
    local = StepPlan(
        16, 32768, ids, lengths, [Wave([Group((r,), local={r: ids[4 * r : 4 * r + 4]}) for r in range(16)])]
    )
    ok = simulate(local, h200_cost, cl)
    assert ok.flags == [] and ok.ratio_to_bound < 1.1  # each rank pays one micro-batch overhead
    bare = simulate(local, h200_cost)
    assert bare.lower_bound_ms is None and bare.flags == [] and bare.makespan_ms == ok.makespan_ms


def test_charged_bound_charges_the_critical_sample_its_group(h200_cost):
    from hf_cp.cost.bounds import charged_lower_bound_ms

    # one 8,818-token sample on 512 ranks: the old bound spreads it over the whole world for
    # free; alone on its best group it cannot run faster than that group allows
    cl = ClusterSpec(world_size=512, max_tokens_per_rank=32768)
    lengths = [8818] + [300] * 50
    old, charged = lower_bound_ms(lengths, cl, h200_cost), charged_lower_bound_ms(lengths, cl, h200_cost)
    assert charged > 3 * old
    one = StepPlan(512, 32768, [0], [8818], [Wave([Group(tuple(range(16)), [0])])])
    assert charged_lower_bound_ms([8818], cl, h200_cost) <= simulate(one, h200_cost).makespan_ms


def test_charged_bound_charges_a_sample_that_fits_only_the_whole_world_the_whole_world(h200_cost):
    from hf_cp.balance import PlanRequest, get_balancer
    from hf_cp.cost.bounds import charged_lower_bound_ms

    # a sample that fits only the whole world holds all 32 ranks for its time alone there;
    # everything else comes on top of that, not beside it
    cl = ClusterSpec(world_size=32, max_tokens_per_rank=2048)
    big = 32 * 2048 - 8
    lengths = [big] + [1500] * 100
    alone = max(
        c.total_ms for c in h200_cost.distributed_rank_costs([big], "ring_per_doc", list(range(32)), list(range(32)))
    )
    rest = sum(h200_cost.sample_local_ms(n) for n in lengths[1:])
    charged = charged_lower_bound_ms(lengths, cl, h200_cost)
    assert charged >= alone + rest / 32
    assert charged > 1.05 * max(lower_bound_ms(lengths, cl, h200_cost), alone)
    for name in ("dynamic_cp", "flexsp"):
        plan = get_balancer(name).plan(PlanRequest(range(len(lengths)), lengths, cl, h200_cost))
        assert charged <= simulate(plan, h200_cost).makespan_ms


def test_forward_only_passes_add_the_busiest_ranks_forward_share(h200_cost):
    # DPO's log-prob and reference passes run the same plan forward-only: the step's prediction
    # is the training pass's makespan plus, per pass, the forward's share of the busiest rank's time
    from hf_cp.train.measure.record_builder import predicted_step_ms

    p = StepPlan(
        world_size=2,
        max_tokens_per_rank=32768,
        sample_ids=[0, 1],
        lengths=[20000, 1000],
        waves=[Wave([Group(ranks=(0,), local={0: [0]}), Group(ranks=(1,), local={1: [1]})])],
    )
    s = simulate(p, h200_cost)
    share = h200_cost.profile.forward_share
    assert s.forward_only_ms(0, share) == 0.0
    assert s.forward_only_ms(2, share) == pytest.approx(2 * share * max(s.occupied_ms))
    assert max(s.occupied_ms) > 10 * min(s.occupied_ms)  # the busiest rank, not the mean, sets it
    assert predicted_step_ms(s, 2, share) == pytest.approx(s.makespan_ms + 2 * share * max(s.occupied_ms))
    assert predicted_step_ms(s, 0, share) == s.makespan_ms


@pytest.mark.parametrize("length", [40000, 123457, 1000003])
@pytest.mark.parametrize("group", [2, 16, 256])
def test_a_sample_alone_on_a_group_is_priced_once_from_its_end_members(h200_cost, length, group):
    """Issue 39: the charged bound costs a long sample alone on each group size from the block's
    two end members (costing every member made a 4096-rank step's bound take 140 s). It is
    never above the slowest member (the bound stays a bound), within 1e-4 of it, and the
    balancers' per-length cache gives the same number."""
    ranks = list(range(group))
    every = max(c.total_ms for c in h200_cost.distributed_rank_costs([length], ShardMode.RING_PER_DOC, ranks, ranks))
    ends = alone_on_group_ms(h200_cost, length, group)
    assert every * (1 - 1e-4) <= ends <= every
    assert cost_memo(h200_cost).doc_on_group_ms(length, group) == ends
