"""Balancers see the price of extra waves under parameter sharding (issue 29): under FSDP2 every
wave runs at least one forward and one backward, each re-gathering every layer's parameters,
so `auto` (through pricing.PlanPricer) prefers a plan with fewer waves to one whose compute
alone is faster but that needs more waves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.toolkit.pricing import PlanPricer
from hf_cp.cost.execution import execution_named
from hf_cp.cost.hardware import Link
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import simulate
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.samples.lengths import read_lengths

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")


def slow_link_cost(h200_cost, execution):
    """The H200 profile over two nodes joined by a 20 GB/s link (half the profile's): every
    world-wide collective crosses it, a parameter pass's communication outlasts a short
    micro-batch's compute."""
    links = dict(h200_cost.profile.links)
    links["inter_node"] = Link(20.0, links["inter_node"].latency_us)
    return CostModel(h200_cost.dims, replace(h200_cost.profile, links=links), execution_named(execution))


def test_auto_prefers_fewer_waves_under_fsdp2_over_a_slow_link(h200_cost, traces_dir):
    lengths = read_lengths(traces_dir / "code_numpy_files.txt")[:200]
    cl = ClusterSpec(16, 16384)  # two nodes of 8
    fsdp2 = slow_link_cost(h200_cost, "fsdp2")
    compute = slow_link_cost(h200_cost, None)
    req = PlanRequest(range(len(lengths)), lengths, cl, fsdp2, dataset_max_length=max(lengths))
    many = get_balancer("dynamic_cp").plan(req)
    few = get_balancer("static").plan(req)
    assert len(few.waves) < len(many.waves)

    # compute alone, the plan with more waves is clearly faster ...
    by_compute = PlanPricer(compute)
    assert by_compute.makespan_ms(many) < 0.9 * by_compute.makespan_ms(few)
    # ... but under FSDP2 each of its waves pays a forward's and a backward's parameter
    # communication, which its short micro-batches do not hide
    by_fsdp2 = PlanPricer(fsdp2)
    per_wave = fsdp2.parameter_pass_comm_ms(cl.world_size, backward=False) + fsdp2.parameter_pass_comm_ms(
        cl.world_size, backward=True
    )
    for plan in (many, few):
        priced = by_fsdp2.makespan_ms(plan)
        assert priced == pytest.approx(simulate(plan, fsdp2).makespan_ms, rel=1e-12)
        assert priced >= len(plan.waves) * per_wave
    assert by_fsdp2.makespan_ms(few) < by_fsdp2.makespan_ms(many)
    assert simulate(many, fsdp2).parameter_comm_ms > simulate(few, fsdp2).parameter_comm_ms

    # auto with its default early stop: under an execution rule the first member's plan is priced
    # by the wall clock (its own prediction, compute alone, was within 1.5% of the compute bound
    # and kept dynamic_cp's 4 waves before), so static is planned and wins
    for stop_within in (0.0, None):
        opts = {} if stop_within is None else {"stop_within": stop_within}
        chosen = get_balancer("auto", members=["dynamic_cp", "static"], **opts).plan(req)
        assert chosen.balancer == "auto:static" and len(chosen.waves) == len(few.waves)
    # without the execution, auto keeps the plan that is faster by compute alone
    req_compute = PlanRequest(range(len(lengths)), lengths, cl, compute, dataset_max_length=max(lengths))
    assert get_balancer("auto", members=["dynamic_cp", "static"], stop_within=0.0).plan(req_compute).balancer == (
        "auto:dynamic_cp"
    )
