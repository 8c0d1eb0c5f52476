import pytest

from hf_cp.balance import PlanRequest, available_balancers, get_balancer
from hf_cp.cluster import ClusterSpec
from hf_cp.sim import simulate


def request(lengths, world, cost, cap=32768):
    return PlanRequest(
        list(range(len(lengths))), lengths, ClusterSpec(world, cap), cost, dataset_max_length=max(lengths)
    )


LONG_TAIL = [120000, 60000, 33000] + [300 + (i * 7919) % 12000 for i in range(250)]


def test_default_members_are_every_registered_balancer_but_megatron_chunkflow_and_itself():
    auto = get_balancer("auto")
    names = [n for n, _ in auto.members]
    # chunkflow: CPTrainer does not execute chunked samples yet
    assert names == [n for n in available_balancers() if n not in ("auto", "megatron", "chunkflow")]
    assert {"static", "dynamic_cp", "flexsp"} <= set(names)


def test_never_worse_than_any_member_and_records_the_winner(h200_cost):
    req = request(LONG_TAIL, 16, h200_cost)
    auto = get_balancer("auto")
    plan = auto.plan(req).validate(req.cluster)
    t = simulate(plan, h200_cost).makespan_ms
    assert plan.balancer.startswith("auto:")
    winner = plan.balancer.split(":", 1)[1]
    assert t == pytest.approx(auto.last_makespans[winner])
    for name, _ in auto.members:
        member_plan = get_balancer(name).plan(req)
        assert t <= simulate(member_plan, h200_cost).makespan_ms + 1e-9, name
    assert t < simulate(get_balancer("static").plan(req), h200_cost).makespan_ms


def test_members_are_configurable(h200_cost):
    req = request(LONG_TAIL, 16, h200_cost)
    auto = get_balancer("auto", members=["static"])
    assert auto.plan(req).balancer == "auto:static"
    auto = get_balancer("auto", members=["static", "dynamic_cp"], member_options={"dynamic_cp": {"thetas": (1.0,)}})
    assert auto.plan(req).balancer == "auto:dynamic_cp"


def test_bad_member_lists_are_named():
    with pytest.raises(ValueError, match="cannot be a member of itself"):
        get_balancer("auto", members=["static", "auto"])
    with pytest.raises(KeyError, match="unknown balancer 'nope'"):
        get_balancer("auto", members=["nope"])
    with pytest.raises(ValueError, match="not members"):
        get_balancer("auto", members=["static"], member_options={"flexsp": {}})
    with pytest.raises(ValueError, match="at least one"):
        get_balancer("auto", members=[])
