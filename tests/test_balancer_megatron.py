import sys

import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.cost.simulate import simulate
from hf_cp.plan.cluster import ClusterSpec

# megatron-core warns on import that Transformer Engine / Apex are missing (CPU): expected here
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:megatron", "ignore::DeprecationWarning")


def request(lengths, world, cost, cap=32768):
    return PlanRequest(list(range(len(lengths))), lengths, ClusterSpec(world, cap), cost)


LENGTHS = [150000, 70000, 40000, 30000, 9000, 5000] + [800 + 37 * i for i in range(60)]


def test_missing_megatron_core_names_the_extra(monkeypatch):
    for mod in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "megatron", None)
    with pytest.raises(ImportError, match=r"megatron-core==0\.16\.1.*|hf_cp\[megatron\]"):
        get_balancer("megatron")


def test_plan_follows_megatrons_own_schedule(h200_cost):
    from hf_cp.balance.balancers.megatron import megatron_rounds

    req = request(LENGTHS, 16, h200_cost)
    rounds = megatron_rounds(req)
    # Megatron's CP size of a sample: how many ranks of its round list it
    megatron_cp = {}
    for per_rank in rounds:
        for ids in per_rank:
            for s in ids:
                megatron_cp[s] = megatron_cp.get(s, 0) + 1
    assert sorted(megatron_cp) == list(range(len(LENGTHS)))
    plan = get_balancer("megatron").plan(req).validate(req.cluster)
    assert plan.balancer == "megatron"
    ours = plan.cp_size_of_samples()
    assert ours == megatron_cp
    # the long sample needs 8 ranks of 32K at least (Megatron: next power of two of 150K/32K)
    assert ours[0] == 8
    assert simulate(plan, h200_cost).makespan_ms > 0


def test_plans_are_deterministic(h200_cost):
    req = request(LENGTHS, 16, h200_cost)
    assert get_balancer("megatron").plan(req).to_json() == get_balancer("megatron").plan(req).to_json()
