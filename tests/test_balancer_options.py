"""Balancer options: one dataclass per balancer, built from plain data with named errors; plugins
join `auto` only when they ask."""

import pytest

import hf_cp.balance.registry as balance  # the registry module: its private tables are restored after each test
from hf_cp.balance import (
    BalancerOptionError,
    PlanRequest,
    auto_member_balancers,
    available_balancers,
    balancer_options,
    describe_options,
    get_balancer,
    parse_assignments,
    register_balancer,
)
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, Wave

BUILT_IN = ("auto", "dynamic_cp", "flexsp", "libra", "megatron", "skrull", "static", "wlb")


def test_an_unknown_option_is_named_with_the_nearest_valid_one():
    with pytest.raises(BalancerOptionError, match=r"wlb: unknown option 'fil'; did you mean 'fill'\?") as e:
        get_balancer("wlb", fil=0.9)
    assert "valid options: cp_scope, cp_size, fill, outlier_fraction" in str(e.value)
    with pytest.raises(BalancerOptionError, match="libra: unknown option 'pool'; did you mean 'pool_size'"):
        get_balancer("libra", pool=4)
    with pytest.raises(BalancerOptionError, match=r"static: unknown option 'cp_size' \(valid options: none\)"):
        get_balancer("static", cp_size=2)
    with pytest.raises(BalancerOptionError, match="unknown option 'zzz' \\(valid"):  # nothing close: no guess
        get_balancer("skrull", zzz=1)


def test_wrong_types_and_ranges_are_named():
    with pytest.raises(BalancerOptionError, match="wlb: option fill must be float, got 'abc'"):
        get_balancer("wlb", fill="abc")
    with pytest.raises(BalancerOptionError, match="skrull: option split_stragglers must be bool, got 1"):
        get_balancer("skrull", split_stragglers=1)
    with pytest.raises(BalancerOptionError, match=r"option thetas\[1\] must be float or null, got 'x'"):
        get_balancer("dynamic_cp", thetas=[1.0, "x"])
    with pytest.raises(BalancerOptionError, match="fill 1.5 must be in"):
        get_balancer("wlb", fill=1.5)
    assert issubclass(BalancerOptionError, ValueError)


def test_command_line_strings_become_typed_options():
    opts = parse_assignments(["thetas=[1.0, null]", "simulate_within=0.01", "simulate_samples_per_rank=8"])
    assert opts == {"thetas": "[1.0, null]", "simulate_within": "0.01", "simulate_samples_per_rank": "8"}
    b = get_balancer("dynamic_cp", **opts)
    assert b.options.thetas == (1.0, None)
    assert b.options.simulate_within == 0.01
    assert b.options.simulate_samples_per_rank == 8.0 and isinstance(b.options.simulate_samples_per_rank, float)
    w = get_balancer("wlb", **parse_assignments(["cp_size=4", "cp_scope=step"]))
    assert (w.cp_size, w.cp_scope) == (4, "step")
    assert get_balancer("wlb", cp_size="null").cp_size is None
    with pytest.raises(BalancerOptionError, match="must look like key=value"):
        parse_assignments(["fill"])
    with pytest.raises(BalancerOptionError, match="given twice"):
        parse_assignments(["fill=1", "fill=2"])


def test_auto_member_options_nest_by_dotted_keys_and_are_checked_by_the_member():
    auto = get_balancer("auto", **parse_assignments(["members=[static, wlb]", "member_options.wlb.fill=0.8"]))
    assert [n for n, _ in auto.members] == ["static", "wlb"]
    assert auto.members[1][1].fill == 0.8
    with pytest.raises(
        BalancerOptionError, match="auto: member_options.wlb: wlb: unknown option 'fll'; did you mean 'fill'"
    ):
        get_balancer("auto", members=["static", "wlb"], member_options={"wlb": {"fll": 0.8}})


def test_every_built_in_balancer_lists_its_options_with_help():
    for name in BUILT_IN:
        cls = balancer_options(name)
        assert cls is not None, name
        for h in describe_options(name):
            assert h.help, f"{name}.{h.name} has no help text"
            assert h.line().startswith(f"{h.name} (")
    wlb = {h.name: h for h in describe_options("wlb")}
    assert wlb["fill"].default == 0.95 and wlb["fill"].type == "float"
    assert wlb["cp_size"].type == "int or null"
    assert {h.name for h in describe_options("dynamic_cp")} == {
        "thetas",
        "simulate_within",
        "simulate_samples_per_rank",
        "refine_candidates",
        "spread_sizes",
        "spread_samples_per_rank",
        "any_size_groups",
    }
    assert describe_options("static") == []
    # options round-trip through plain data
    b = get_balancer("dynamic_cp", thetas=(0.5,))
    assert type(b.options).from_dict(b.options.to_dict()) == b.options


class Rank0Balancer:
    """Everything on rank 0, one sample per wave: a deliberately bad plugin."""

    def __init__(self, name):
        self.name = name

    def plan(self, req):
        p = req.empty_plan(self.name)
        p.waves = [Wave([Group(ranks=(0,), local={0: [s]})]) for s in req.sample_ids]
        return p


@pytest.fixture
def clean_registry():
    saved = dict(balance._REGISTRY), dict(balance._AUTO_MEMBERS), balance._entry_points_loaded
    yield
    balance._REGISTRY.clear()
    balance._REGISTRY.update(saved[0])
    balance._AUTO_MEMBERS.clear()
    balance._AUTO_MEMBERS.update(saved[1])
    balance._entry_points_loaded = saved[2]


def test_a_registered_plugin_joins_auto_only_when_it_asks(clean_registry, h200_cost):
    register_balancer("test_plugin_quiet")(lambda: Rank0Balancer("test_plugin_quiet"))
    register_balancer("test_plugin_member", auto_member=True)(lambda: Rank0Balancer("test_plugin_member"))
    assert {"test_plugin_quiet", "test_plugin_member"} <= set(available_balancers())
    assert "test_plugin_quiet" not in auto_member_balancers()
    assert "test_plugin_member" in auto_member_balancers()
    names = [n for n, _ in get_balancer("auto").members]
    assert "test_plugin_member" in names and "test_plugin_quiet" not in names
    # the quiet one still works by name, and as an explicit member
    req = PlanRequest([1, 2], [10, 20], ClusterSpec(2, 100), h200_cost)
    assert get_balancer("test_plugin_quiet").plan(req).balancer == "test_plugin_quiet"
    explicit = get_balancer("auto", members=["test_plugin_quiet"])
    assert explicit.plan(req).balancer == "auto:test_plugin_quiet"


class FakeEntryPoint:
    def __init__(self, name, factory):
        self.name, self._factory = name, factory

    def load(self):
        return self._factory


def test_an_entry_point_plugin_joins_auto_only_with_an_auto_member_attribute(clean_registry, monkeypatch):
    def quiet():
        return Rank0Balancer("test_ep_quiet")

    def member():
        return Rank0Balancer("test_ep_member")

    member.auto_member = True
    quiet.auto_member = "yes"  # only True counts: a truthy stray attribute does not opt in

    def fake_entry_points(group):
        assert group == "hf_cp.balancers"
        return [FakeEntryPoint("test_ep_quiet", quiet), FakeEntryPoint("test_ep_member", member)]

    monkeypatch.setattr(balance, "entry_points", fake_entry_points)
    balance._entry_points_loaded = False
    assert {"test_ep_quiet", "test_ep_member"} <= set(available_balancers())
    assert "test_ep_member" in auto_member_balancers()
    assert "test_ep_quiet" not in auto_member_balancers()
    assert balancer_options("test_ep_quiet") is None and describe_options("test_ep_quiet") == []
