"""Plan one step and predict it: the one place where a balancer's plan is validated and
simulated (the planner worker, the dry run and `hf-cp plan` all come through here)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.toolkit.sample_limit import check_request_lengths
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.cost.simulate import SimResult, simulate
from hf_cp.plan.step_plan import PlanError, StepPlan


@dataclass
class PredictedPlan:
    plan: StepPlan
    predicted: SimResult
    planner_ms: float  # the balancer's own wall time (validation and simulation excluded)
    planner_cpu_ms: float = 0.0  # ... and this process's CPU time over it (solver worker processes not counted)


def predict(plan: StepPlan, req: PlanRequest) -> SimResult:
    """Validate `plan` against the request's cluster and model (Ulysses groups must split the
    heads), check that it plans the request's samples, and simulate it (with its lower bounds
    and flags: SimResult.charged_bound_ms, SimResult.flags)."""
    plan.validate(req.cluster, req.cost)
    if list(plan.sample_ids) != list(req.sample_ids):
        raise PlanError(
            f"step {req.step}: the {plan.balancer or 'balancer'!r} plan is for other samples than the step's"
        )
    return simulate(plan, req.cost, req.cluster)  # with the cluster: the bounds and the plan's flags


def fitted_plan(balancer, req: PlanRequest) -> StepPlan:
    """`balancer`'s plan of the request, fitted to the vision memory: a balancer that packs by
    tokens alone may put a rank over the cap with the activations of the images and clips it
    encodes, and what overflows moves to waves of its own (toolkit/vision_memory.py)."""
    return fit_vision_memory(balancer.plan(req), req)


def plan_and_predict(balancer, req: PlanRequest) -> PredictedPlan:
    """Plan the request with `balancer` (fitted_plan), timing only that, then validate and simulate."""
    # a request built for a balancer that trains longer samples (chunkflow) must not reach one
    # that cannot: refused here, naming the sample, rather than by whatever the balancer does
    check_request_lengths(balancer, req)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = fitted_plan(balancer, req)
    planner_ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
    return PredictedPlan(plan, predict(plan, req), planner_ms, cpu_ms)
