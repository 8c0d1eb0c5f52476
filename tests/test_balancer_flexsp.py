import sys

import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.balancers import flexsp
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.cost.bounds import lower_bound_ms
from hf_cp.cost.simulate import simulate
from hf_cp.plan.cluster import ClusterSpec


def request(lengths, world, cost, cap=32768):
    return PlanRequest(
        list(range(len(lengths))), lengths, ClusterSpec(world, cap), cost, dataset_max_length=max(lengths)
    )


# FlexSP's Fig. 1 situation, scaled to 16 ranks of 16K tokens: one 100K and four 48K
# sequences plus short ones. Homogeneous groups sized for the 100K sample waste ranks.
FIG1 = [100000] + [48000] * 4 + [3000] * 40


def sizes_in_first_wave(plan):
    return sorted({g.size for g in plan.waves[0].groups})


def test_milp_runs_heterogeneous_groups_in_one_wave(h200_cost):
    req = request(FIG1, 16, h200_cost, cap=16384)
    bal = get_balancer("flexsp")
    assert bal.uses_milp()
    plan = bal.plan(req).validate(req.cluster)
    assert len([s for s in sizes_in_first_wave(plan) if s > 1]) >= 2, sizes_in_first_wave(plan)
    t = simulate(plan, h200_cost).makespan_ms
    static = get_balancer("static").plan(req).validate(req.cluster)
    assert t < simulate(static, h200_cost).makespan_ms
    assert t <= 1.25 * lower_bound_ms(req.lengths, req.cluster, h200_cost)


def test_milp_solution_meets_its_target(h200_cost):
    req = request(FIG1, 16, h200_cost, cap=16384)
    prob = flexsp.Problem(req, cost_memo(h200_cost), max_heavy=128, heavy_fraction=0.05)
    solver = flexsp.MilpSolver(prob, node_limit=200, time_limit_s=1.0)
    target = 1.3 * prob.lower_ms()
    sizes = solver.solve(target)
    assert sizes is not None
    for k, d in enumerate(sizes):
        assert d >= prob.min_sizes[prob.heavy[k]]
        assert prob.options[k][d] <= target
    area = sum(d * prob.options[k][d] for k, d in enumerate(sizes)) + prob.light_ms
    assert area <= 16 * target + 1e-6
    # far below the bound nothing is feasible
    assert solver.solve(0.5 * prob.lower_ms()) is None


def test_greedy_fallback_when_highspy_is_missing(h200_cost, monkeypatch):
    monkeypatch.setitem(sys.modules, "highspy", None)  # import highspy -> ImportError
    assert not flexsp.highs_available()
    bal = get_balancer("flexsp")
    assert not bal.uses_milp()
    req = request(FIG1, 16, h200_cost, cap=16384)
    plan = bal.plan(req).validate(req.cluster)
    t = simulate(plan, h200_cost).makespan_ms
    static = get_balancer("static").plan(req).validate(req.cluster)
    assert t < simulate(static, h200_cost).makespan_ms
    with pytest.raises(ImportError, match=r"hf_cp\[milp\]"):
        get_balancer("flexsp", solver="milp")


def test_greedy_meets_its_target_or_says_no(h200_cost):
    req = request(FIG1, 16, h200_cost, cap=16384)
    prob = flexsp.Problem(req, cost_memo(h200_cost), max_heavy=128, heavy_fraction=0.05)
    target = 1.5 * prob.lower_ms()
    sizes = flexsp.greedy_sizes(prob, target)
    assert sizes is not None
    assert all(prob.options[k][d] <= target for k, d in enumerate(sizes))
    assert flexsp.greedy_sizes(prob, 0.5 * prob.lower_ms()) is None


def test_milp_plans_are_deterministic(h200_cost):
    req = request(FIG1 + [700] * 30, 16, h200_cost, cap=16384)
    a = get_balancer("flexsp").plan(req).to_json()
    b = get_balancer("flexsp").plan(req).to_json()
    assert a == b


def test_bad_solver_name_is_an_error():
    with pytest.raises(ValueError, match="solver must be"):
        get_balancer("flexsp", solver="scip")


def test_milp_prints_nothing():
    # HiGHS prints a licence banner from C++ on its first construction in a process; in a job
    # that is one per rank and planner process. A fresh process shows whether it is gone.
    import subprocess

    script = (
        "import highspy\n"
        "from hf_cp.balance.balancers.flexsp import quiet_highs\n"
        "h = quiet_highs(); h2 = quiet_highs()\n"
        "h.addVar(0.0, 1.0)\n"
        "h.run()\n"
        "print('done')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n", proc.stdout  # our own output still goes through
    # and the banner is what it would have been: built plainly, it prints
    plain = subprocess.run(
        [sys.executable, "-c", "import highspy; highspy.Highs()"], capture_output=True, text=True, timeout=60
    )
    assert "HiGHS" in plain.stdout
