import pytest

from hf_cp.balance import PlanRequest, auto_member_balancers, get_balancer
from hf_cp.cost.bounds import charged_lower_bound_ms
from hf_cp.cost.simulate import simulate
from hf_cp.plan.cluster import ClusterSpec


def request(lengths, world, cost, cap=32768):
    return PlanRequest(
        list(range(len(lengths))), lengths, ClusterSpec(world, cap), cost, dataset_max_length=max(lengths)
    )


LONG_TAIL = [120000, 60000, 33000] + [300 + (i * 7919) % 12000 for i in range(250)]


def test_default_members_are_the_auto_members_every_built_in_but_megatron_and_itself():
    auto = get_balancer("auto")
    names = [n for n, _ in auto.members]
    assert sorted(names) == auto_member_balancers()
    assert names[0] == "dynamic_cp"  # planned first: the usual winner, so the bounds can skip the rest
    built_in = {"dynamic_cp", "flexsp", "libra", "skrull", "static", "wlb"}
    assert built_in <= set(names) and {"auto", "megatron"}.isdisjoint(names)


def member_makespans(req, cost):
    return {n: simulate(get_balancer(n).plan(req), cost).makespan_ms for n in auto_member_balancers()}


def test_with_stop_within_zero_never_worse_than_any_member_and_records_the_winner(h200_cost):
    req = request(LONG_TAIL, 16, h200_cost)
    auto = get_balancer("auto", stop_within=0)
    plan = auto.plan(req).validate(req.cluster)
    t = simulate(plan, h200_cost).makespan_ms
    assert plan.balancer.startswith("auto:")
    winner = plan.balancer.split(":", 1)[1]
    assert t == pytest.approx(auto.last_makespans[winner], rel=1e-12)
    for name, member_t in member_makespans(req, h200_cost).items():
        assert t <= member_t + 1e-9, name
    assert set(auto.last_makespans) | set(auto.last_skipped) == set(auto_member_balancers())
    for name, why in auto.last_skipped.items():  # with stop_within 0 only a bound skips a member
        assert why.startswith("its bound"), (name, why)
    assert t < simulate(get_balancer("static").plan(req), h200_cost).makespan_ms


def test_stops_planning_once_within_stop_within_of_the_charged_bound(h200_cost):
    req = request(LONG_TAIL, 16, h200_cost)
    auto = get_balancer("auto", stop_within=0.5, exhaustive_below=0, core_members=[])
    plan = auto.plan(req)
    assert list(auto.last_makespans) == ["dynamic_cp"]  # the first member was close enough
    assert all("within 0.5 of the bound" in why for why in auto.last_skipped.values())
    bound = charged_lower_bound_ms(req.lengths, req.cluster, h200_cost)
    t = simulate(plan, h200_cost).makespan_ms
    assert t <= 1.5 * bound
    # the contract: no skipped member could have been more than stop_within faster
    assert min(member_makespans(req, h200_cost).values()) * 1.5 >= t


def test_core_members_stop_only_within_stop_within_masked(h200_cost):
    """The default core members (dynamic_cp, flexsp) are planned until the best plan is within 0.3%
    of the bound, however loose stop_within is; the other members stop at stop_within."""
    req = request(LONG_TAIL, 16, h200_cost)
    auto = get_balancer("auto", stop_within=0.5, stop_within_masked=0, exhaustive_below=0)
    auto.plan(req)
    assert list(auto.last_makespans) == ["dynamic_cp", "flexsp"]
    assert all("within 0.5 of the bound" in why for why in auto.last_skipped.values())
    # dynamic_cp's plan is within 0.3% of this step's bound: then flexsp is skipped too
    auto = get_balancer("auto", stop_within=0.5, exhaustive_below=0)
    auto.plan(req)
    assert list(auto.last_makespans) == ["dynamic_cp"]
    assert "within 0.003 of the bound" in auto.last_skipped["flexsp"]


def test_a_small_step_is_planned_by_every_member_a_bound_does_not_rule_out(h200_cost):
    # 253 samples, under exhaustive_below: the early stop is off however loose stop_within is
    req = request(LONG_TAIL, 16, h200_cost)
    auto = get_balancer("auto", stop_within=0.5)
    plan = auto.plan(req)
    assert all(why.startswith("its bound") for why in auto.last_skipped.values()), auto.last_skipped
    assert simulate(plan, h200_cost).makespan_ms <= min(member_makespans(req, h200_cost).values()) + 1e-9
    auto = get_balancer("auto", stop_within=0.5, exhaustive_below=len(LONG_TAIL))  # the step is not below it
    auto.plan(req)
    assert list(auto.last_makespans) == ["dynamic_cp"]


def test_skips_a_member_whose_bound_cannot_win(h200_cost):
    # thousands of short documents and a dataset whose longest sample needs the whole world:
    # static shreds every pack over 16 ranks, and its bound (ring traffic) shows it cannot win
    lengths = [300 + (i * 7919) % 1500 for i in range(3000)]
    req = PlanRequest(range(len(lengths)), lengths, ClusterSpec(16, 32768), h200_cost, dataset_max_length=16 * 32768)
    auto = get_balancer("auto", members=["dynamic_cp", "static"], stop_within=0)
    auto.plan(req)
    assert list(auto.last_makespans) == ["dynamic_cp"]
    assert auto.last_skipped["static"].startswith("its bound")
    assert simulate(get_balancer("static").plan(req), h200_cost).makespan_ms > auto.last_makespans["dynamic_cp"]


def test_plans_are_identical_across_fresh_instances_and_cost_models(h200_cost):
    from hf_cp.cost.model import CostModel

    req = request(LONG_TAIL, 16, h200_cost)
    a = get_balancer("auto").plan(req)
    fresh = CostModel(h200_cost.dims, h200_cost.profile)
    b = get_balancer("auto").plan(request(LONG_TAIL, 16, fresh))
    assert a.to_json() == b.to_json()


def test_members_are_configurable(h200_cost):
    req = request(LONG_TAIL, 16, h200_cost)
    auto = get_balancer("auto", members=["static"])
    assert auto.plan(req).balancer == "auto:static"
    auto = get_balancer("auto", members=["static", "dynamic_cp"], member_options={"dynamic_cp": {"thetas": (1.0,)}})
    assert auto.plan(req).balancer == "auto:dynamic_cp"


@pytest.mark.parametrize("key", ["stop_within", "stop_within_masked", "exhaustive_below"])
def test_negative_stop_settings_are_refused_by_name(key):
    with pytest.raises(ValueError, match=f"auto: {key} -1.* must be >= 0"):
        get_balancer("auto", **{key: -1})


def test_bad_member_lists_are_named():
    with pytest.raises(ValueError, match="cannot be a member of itself"):
        get_balancer("auto", members=["static", "auto"])
    with pytest.raises(KeyError, match="unknown balancer 'nope'"):
        get_balancer("auto", members=["nope"])
    with pytest.raises(ValueError, match="not members"):
        get_balancer("auto", members=["static"], member_options={"flexsp": {}})
    with pytest.raises(ValueError, match="at least one"):
        get_balancer("auto", members=[])


def test_dcp_and_flexsp_warm_up_pay_their_solvers_start_up_through_auto(monkeypatch):
    pytest.importorskip("mtkahypar")
    pytest.importorskip("highspy")
    from hf_cp.balance.balancers.dcp import hypergraph
    from hf_cp.balance.toolkit import deadline as deadline_mod

    auto = get_balancer(
        "auto",
        members=["dynamic_cp", "dcp", "flexsp"],
        member_options={"dcp": {"partitioner": "mtkahypar"}, "flexsp": {"solver": "milp", "deadline_s": 5}},
    )
    monkeypatch.setattr(hypergraph, "_MT", None)
    worker = deadline_mod.SolverWorker()
    monkeypatch.setattr(deadline_mod, "_SHARED", worker)
    try:
        auto.warm_up()
        assert hypergraph._MT is not None  # Mt-KaHyPar imported and initialised
        assert worker.pid is not None and worker.started == 1  # the MILP's solver worker is running
        auto.warm_up()
        assert worker.started == 1  # a running worker is kept
    finally:
        worker.close()
