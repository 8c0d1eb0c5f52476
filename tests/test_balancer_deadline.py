"""Solver deadlines are enforced from outside the solver: a solver that never returns costs the
step its deadline plus the fallback, never the run."""

import os
import time

import pytest

from hf_cp.balance import PlanRequest, get_balancer
from hf_cp.balance.balancers import flexsp
from hf_cp.balance.toolkit.deadline import DeadlinePassed, SolverWorker, deadlines_enforceable
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import StepPlan

pytestmark = pytest.mark.skipif(not deadlines_enforceable(), reason="needs fork to kill a solver worker")

LONG_TAIL = [120000, 60000, 33000, 40000] + [300 + (i * 7919) % 12000 for i in range(250)]


def never_returns(*args):
    while True:  # a busy solver, as HiGHS in presolve: no sleep a signal could end
        pass


def _worker_pid():
    return os.getpid()


def test_one_solver_worker_serves_every_solve_and_is_replaced_after_a_deadline():
    """Forking the planner (a fork of the training process) per solve cost 27-37 ms of CPU: the
    worker is started once and reused; only a passed deadline replaces it."""
    worker = SolverWorker()
    try:
        first = worker.call(_worker_pid, (), deadline_s=5)
        assert first != os.getpid() and first == worker.pid
        assert worker.call(sum, ([1, 2, 3],), deadline_s=5) == 6
        with pytest.raises(ZeroDivisionError):
            worker.call(divmod, (1, 0), deadline_s=5)
        assert worker.call(_worker_pid, (), deadline_s=5) == first and worker.started == 1
        t0 = time.monotonic()
        with pytest.raises(DeadlinePassed, match="0.3 s deadline"):
            worker.call(never_returns, (), deadline_s=0.3)
        assert time.monotonic() - t0 < 1.3
        assert worker.pid is None  # killed
        second = worker.call(_worker_pid, (), deadline_s=5)
        assert second != first and worker.started == 2
        with pytest.raises(TypeError, match="must pickle"):
            worker.call(lambda: 1, (), deadline_s=5)
    finally:
        worker.close()


def test_a_milp_that_never_returns_gets_the_greedy_fallback_within_deadline_plus_one_second(monkeypatch, h200_cost):
    pytest.importorskip("highspy")
    req = PlanRequest(range(len(LONG_TAIL)), LONG_TAIL, ClusterSpec(16, 32768), h200_cost)
    monkeypatch.setattr(flexsp, "milp_search", never_returns)  # the worker forks with it in place
    balancer = get_balancer("flexsp", solver="milp", deadline_s=0.5)
    t0 = time.monotonic()
    plan = balancer.plan(req)
    elapsed = time.monotonic() - t0
    assert elapsed < 0.5 + 1.0, f"the step waited {elapsed:.2f} s"
    plan.validate(req.cluster, h200_cost)
    assert plan.notes == ["flexsp: the MILP passed its 0.5 s deadline; planned with the greedy sizes"]
    # the fallback is the greedy solver's plan, which every rank can rebuild without a solver
    greedy = get_balancer("flexsp", solver="greedy").plan(req)
    assert [w.to_dict() for w in plan.waves] == [w.to_dict() for w in greedy.waves]
    assert balancer.plan_fallback(req).to_json() == greedy.to_json()
    # the note travels with the plan (it is part of the plan every rank compares)
    again = StepPlan.from_json(plan.to_json())
    assert again.notes == plan.notes and again.digest() == plan.digest() != greedy.digest()


def test_auto_keeps_going_when_a_members_solver_passes_its_deadline(monkeypatch, h200_cost):
    pytest.importorskip("highspy")
    req = PlanRequest(range(len(LONG_TAIL)), LONG_TAIL, ClusterSpec(16, 32768), h200_cost)
    monkeypatch.setattr(flexsp, "milp_search", never_returns)
    auto = get_balancer(
        "auto", members=["flexsp", "static"], member_options={"flexsp": {"solver": "milp", "deadline_s": 0.5}}
    )
    t0 = time.monotonic()
    plan = auto.plan(req)
    assert time.monotonic() - t0 < 0.5 + 1.0 + 1.0  # + static's plan and the pricing
    plan.validate(req.cluster)
    assert plan.balancer == "auto:flexsp" and "deadline" in plan.notes[0]


def test_a_plan_without_notes_serialises_as_before():
    plan = StepPlan(1, 10, [0], [5])
    assert "notes" not in plan.to_dict()
    assert StepPlan.from_json(plan.to_json()).notes == []
