"""The fast plan pricer equals the simulator; the cheap bounds auto prunes with are true bounds."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit.bounds import BoundCache, blocks_bound_ms, fixed_size_bound_ms
from hf_cp.balance.toolkit.pricing import PlanPricer
from hf_cp.cost.bounds import charged_lower_bound_ms, lower_bound_ms
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import simulate
from hf_cp.plan.cluster import ClusterSpec

from helpers.plan_gen import random_valid_plan

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")


def ulysses_ok(cost):
    def ok(g):
        try:
            cost.check_ulysses(g)
            return True
        except ValueError:
            return False

    return ok


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 120_000), min_size=1, max_size=40),
    seed=st.integers(0, 10**6),
    world=st.sampled_from([1, 2, 4, 8, 16, 32]),
    cap=st.sampled_from([4096, 32768]),
)
def test_pricer_equals_simulate_on_random_valid_plans(h200_cost, lengths, seed, world, cap):
    cl = ClusterSpec(world_size=world, max_tokens_per_rank=cap)
    lengths = [min(n, cl.largest_capacity) for n in lengths]
    plan = random_valid_plan(lengths, cl, seed, ulysses_ok(h200_cost)).validate(cl)
    sim = simulate(plan, h200_cost)
    fresh = PlanPricer(CostModel(h200_cost.dims, h200_cost.profile))  # empty tables
    assert fresh.makespan_ms(plan) == pytest.approx(sim.makespan_ms, rel=1e-12, abs=1e-9)
    clock = fresh.rank_finish_ms(plan)
    for r in range(world):  # every rank ends where the simulator's clock does
        ends = [
            run.start_ms + run.duration_ms
            for run in sim.runs
            for m, rr in enumerate(run.ranks)
            if rr == r and (run.n_distributed or run.member_compute_ms[m] > 0)  # members the group holds
        ]
        assert clock[r] == pytest.approx(max(ends, default=0.0), rel=1e-12, abs=1e-9)


@pytest.mark.parametrize("name", ["static", "wlb", "skrull", "dynamic_cp", "libra", "flexsp"])
def test_pricer_equals_simulate_on_balancer_plans(h200_cost, traces_dir, name):
    from hf_cp.samples.lengths import read_lengths

    lengths = read_lengths(traces_dir / "longdoc_leval_multiturn.txt")[:120]
    cl = ClusterSpec(16, 32768)
    req = PlanRequest(range(len(lengths)), lengths, cl, h200_cost, dataset_max_length=max(lengths))
    plan = get_balancer(name).plan(req)
    assert PlanPricer(h200_cost).makespan_ms(plan) == pytest.approx(simulate(plan, h200_cost).makespan_ms, rel=1e-12)


@pytest.mark.parametrize("spread_stragglers", [True, False])
def test_pricer_equals_simulate_on_chunkflow_plans_mixing_chunks_and_cp(h200_cost, traces_dir, spread_stragglers):
    # the pricer's cost-model path (plans with chunked samples): every rank ends where the simulator says
    from hf_cp.samples.lengths import read_lengths

    lengths = read_lengths(traces_dir / "longdoc_leval_multiturn.txt")[:120] + [100_000, 60_000]
    cl = ClusterSpec(16, 32768)
    req = PlanRequest(range(len(lengths)), lengths, cl, h200_cost, dataset_max_length=max(lengths))
    plan = get_balancer("chunkflow", chunk_size=8192, spread_stragglers=spread_stragglers).plan(req)
    plan.validate(cl, h200_cost)
    assert len(plan.chunked_samples) >= 5 and plan.spreads_samples  # the 100K sample has no rank to fit
    sim = simulate(plan, h200_cost)
    clock = PlanPricer(h200_cost).rank_finish_ms(plan)
    for r in range(cl.world_size):
        ends = [run.start_ms + run.duration_ms for run in sim.runs if r in run.ranks]
        assert clock[r] == pytest.approx(max(ends, default=0.0), rel=1e-12, abs=1e-9)
    assert float(clock.max()) == pytest.approx(sim.makespan_ms, rel=1e-12)


@st.composite
def steps(draw):
    world = draw(st.sampled_from([2, 4, 8, 16, 32]))
    cap = draw(st.sampled_from([2048, 8192, 32768]))
    n = draw(st.integers(1, 80))
    short = draw(st.lists(st.integers(1, min(3000, cap)), min_size=n, max_size=n))
    longs = draw(st.lists(st.integers(cap // 2 + 1, world * cap), min_size=0, max_size=5))
    return ClusterSpec(world, cap, gpus_per_node=draw(st.sampled_from([2, 8]))), short + longs


@pytest.mark.parametrize("name", ["static", "wlb", "libra", "skrull"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps(), dataset_extra=st.integers(0, 3))
def test_member_bounds_never_exceed_the_members_plan(h200_cost, name, case, dataset_extra):
    """auto skips a member when its bound is no better than the best plan so far: sound only
    if no plan of that member is ever faster than its bound."""
    cluster, lengths = case
    longest = min(cluster.largest_capacity, max(lengths) * (1 + dataset_extra))
    req = PlanRequest(range(len(lengths)), lengths, cluster, h200_cost, dataset_max_length=longest)
    balancer = get_balancer(name)
    bound = balancer.lower_bound_ms(req, BoundCache(req))
    assert bound <= simulate(balancer.plan(req), h200_cost).makespan_ms * (1 + 1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps(), seed=st.integers(0, 10**6))
def test_charged_bound_never_exceeds_per_document_and_local_plans(h200_cost, case, seed):
    """The charged bound holds for every plan whose distributed samples are per-document
    sharded: random valid plans restricted to that mode, and dynamic_cp's and flexsp's."""
    from hf_cp.modes.segments import ShardMode

    cluster, lengths = case
    plan = random_valid_plan(lengths, cluster, seed, lambda g: False)
    for w in plan.waves:
        for g in w.groups:
            g.mode = ShardMode.RING_PER_DOC  # per-document shards never hold more than zigzag's cap check allows
    try:
        plan.validate(cluster)
    except ValueError:
        return  # a zigzag pack that fits may not fit per document: not a plan of this kind
    charged = charged_lower_bound_ms(lengths, cluster, h200_cost)
    assert lower_bound_ms(lengths, cluster, h200_cost) <= charged * (1 + 1e-12)
    assert charged <= simulate(plan, h200_cost).makespan_ms * (1 + 1e-9)
    for name in ("dynamic_cp", "flexsp"):
        req = PlanRequest(range(len(lengths)), lengths, cluster, h200_cost)
        assert charged <= simulate(get_balancer(name).plan(req), h200_cost).makespan_ms * (1 + 1e-9)


def test_fixed_size_bound_charges_the_ring_traffic_of_large_groups(h200_cost):
    # 4,000 short documents: on 1-rank groups the bound is the work; spread over 64-rank
    # groups their K/V traffic dominates and the bound says so
    lengths = [500] * 4000
    cl = ClusterSpec(64, 32768)
    req = PlanRequest(range(len(lengths)), lengths, cl, h200_cost)
    work = lower_bound_ms(lengths, cl, h200_cost)
    assert fixed_size_bound_ms(req, 1) == pytest.approx(work, rel=0.01)
    assert fixed_size_bound_ms(req, 64) > 3 * work
    plan = get_balancer("static").plan(
        PlanRequest(range(len(lengths)), lengths, cl, h200_cost, dataset_max_length=64 * 32768)
    )
    assert fixed_size_bound_ms(req, 64) <= simulate(plan, h200_cost).makespan_ms


def test_blocks_bound_is_the_pigeonhole_of_the_heaviest_samples():
    import numpy as np

    # 2 blocks of 4 ranks; samples of 40, 30, 20 ms alone: two of the three share a block
    assert blocks_bound_ms(np.array([40.0, 30.0, 20.0]), 8, 4) == pytest.approx(max(40, 2 * 20) / 4)
    assert blocks_bound_ms(np.array([40.0, 30.0, 30.0, 30.0, 30.0]), 8, 4) == pytest.approx(3 * 30 / 4)
    assert blocks_bound_ms(np.array([]), 8, 4) == 0.0


def test_pricer_hands_masked_samples_and_other_modes_to_the_cost_model(h200_cost):
    from hf_cp.modes.segments import ShardMode
    from hf_cp.plan.block_layout import all_remote_layout, doc_slices, zigzag_layout
    from hf_cp.plan.step_plan import Group, StepPlan, Wave
    from hf_cp.samples.masks import SampleMask

    lengths = [30000, 12000, 5000, 700]
    masks = {1: SampleMask.shared_prompt(2000, [2500] * 4)}
    slices = doc_slices(lengths[:2], [None, masks[1]])
    lay = all_remote_layout(zigzag_layout(lengths[:2], 4, 28, slices), 4, seed=2)
    blocks = Group((0, 1, 2, 3), [0, 1], ShardMode.BLOCKS, blocks=lay)
    ring = Group((4, 5), [2], ShardMode.RING_ZIGZAG, local={5: [3]})
    plan = StepPlan(8, 32768, [0, 1, 2, 3], lengths, [Wave([blocks, ring]), Wave([Group((4,), local={4: [3]})])])
    plan.waves[1].groups[0].local[4] = []  # an empty group issues nothing
    plan.masks = masks
    plan.validate(ClusterSpec(8, 32768), h200_cost)
    pricer = PlanPricer(h200_cost)
    assert pricer.makespan_ms(plan) == pytest.approx(simulate(plan, h200_cost).makespan_ms, rel=1e-12)
    plan.masks = {}  # causal: the fast path, blocks still through the cost model
    assert pricer.makespan_ms(plan) == pytest.approx(simulate(plan, h200_cost).makespan_ms, rel=1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 120_000), min_size=1, max_size=30),
    seed=st.integers(0, 10**6),
    world=st.sampled_from([1, 2, 4, 8, 16]),
    execution=st.sampled_from(["zero2", "zero2-overlap", "ddp", "fsdp2", "zero3"]),
    cp_scale=st.sampled_from([1.0, 1.7]),
    message_ms=st.sampled_from([0.0, 2.5]),
)
def test_pricer_follows_the_execution_and_the_cp_attention_scale(
    h200_cost, lengths, seed, world, execution, cp_scale, message_ms
):
    # wall clock (hf_cp/cost/execution.py): dummies, barriers, reductions and the step's fixed cost;
    # under FSDP2/ZeRO-3 every wave's pass sequence and its parameter communication;
    # CP groups: the attention scale and the exchange's per-message cost
    from dataclasses import replace

    from hf_cp.cost.execution import execution_named

    profile = replace(
        h200_cost.profile,
        reduction_overhead_ms=3.0,
        step_overhead_ms=5.0,
        cp_attention_scale=cp_scale,
        cp_message_ms=message_ms,
    )
    cost = CostModel(h200_cost.dims, profile, execution_named(execution))
    cl = ClusterSpec(world_size=world, max_tokens_per_rank=32768)
    lengths = [min(n, cl.largest_capacity) for n in lengths]
    plan = random_valid_plan(lengths, cl, seed, ulysses_ok(cost)).validate(cl)
    assert PlanPricer(cost).makespan_ms(plan) == pytest.approx(simulate(plan, cost).makespan_ms, rel=1e-12, abs=1e-9)


@pytest.mark.parametrize("execution", ["fsdp2", "zero3", "zero2", "zero2-overlap", "ddp"])
@pytest.mark.parametrize("inter_node_gbps", [40.0, 5.0])
def test_pricer_equals_simulate_on_chunkflow_plans_under_every_execution(
    h200_cost, traces_dir, execution, inter_node_gbps
):
    # chunked samples run their own pass sequences (ffFBFB...), which every other rank follows
    # with dummy passes under FSDP2/ZeRO-3; a slow link makes the passes' communication show
    from dataclasses import replace

    from hf_cp.cost.execution import execution_named
    from hf_cp.cost.hardware import Link
    from hf_cp.samples.lengths import read_lengths

    links = dict(h200_cost.profile.links)
    links["inter_node"] = Link(inter_node_gbps, links["inter_node"].latency_us)
    profile = replace(h200_cost.profile, links=links, reduction_overhead_ms=3.0, step_overhead_ms=5.0)
    cost = CostModel(h200_cost.dims, profile, execution_named(execution))
    lengths = read_lengths(traces_dir / "longdoc_leval_multiturn.txt")[:120] + [100_000, 60_000]
    cl = ClusterSpec(16, 32768)
    req = PlanRequest(range(len(lengths)), lengths, cl, cost, dataset_max_length=max(lengths))
    plan = get_balancer("chunkflow", chunk_size=8192).plan(req)
    plan.validate(cl, cost)
    assert len(plan.chunked_samples) >= 5 and plan.spreads_samples
    sim = simulate(plan, cost)
    if cost.execution.shards_parameters:  # the case this checks: passes whose communication shows
        assert sim.parameter_comm_ms > 0 and any(len(p) > 2 for p in plan.wave_passes())
    assert PlanPricer(cost).makespan_ms(plan) == pytest.approx(sim.makespan_ms, rel=1e-12)
