"""`auto`: plan each step with several balancers, simulate every plan, keep the fastest.

Never slower (predicted) than any of its members by construction: every member's plan is
validated and run through `hf_cp.sim.simulate` with the request's cost model, and the one
with the smallest makespan wins (the first member in order on ties). The winner is
recorded in the plan as `auto:<member>`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..plan import StepPlan
from ..sim import simulate
from . import available_balancers, get_balancer, register_balancer
from .base import Balancer, PlanRequest

# Not members by default: itself, the external peer it is compared against, and chunkflow,
# whose chunked samples CPTrainer does not execute yet (the collator refuses them).
EXCLUDED_BY_DEFAULT = ("auto", "megatron", "chunkflow")


def default_members() -> List[str]:
    return [n for n in available_balancers() if n not in EXCLUDED_BY_DEFAULT]


@register_balancer("auto")
class AutoBalancer:
    """members: balancer names (default: every registered one but `megatron` and `auto`);
    member_options: per-member keyword options for their factories."""

    name = "auto"

    def __init__(self, members: Optional[Sequence[str]] = None, member_options: Optional[Dict[str, dict]] = None):
        names = list(default_members() if members is None else members)
        if not names:
            raise ValueError("auto: needs at least one member balancer")
        if "auto" in names:
            raise ValueError("auto: cannot be a member of itself")
        if len(set(names)) != len(names):
            raise ValueError(f"auto: members listed twice in {names}")
        member_options = dict(member_options or {})
        unknown = set(member_options) - set(names)
        if unknown:
            raise ValueError(f"auto: options given for {sorted(unknown)}, which are not members {names}")
        self.members: List[Tuple[str, Balancer]] = [(n, get_balancer(n, **member_options.get(n, {}))) for n in names]
        self.last_makespans: Dict[str, float] = {}  # member -> predicted ms of the last step

    def plan(self, req: PlanRequest) -> StepPlan:
        best: Optional[Tuple[float, str, StepPlan]] = None
        self.last_makespans = {}
        for name, balancer in self.members:
            plan = balancer.plan(req)
            plan.validate(req.cluster)
            t = simulate(plan, req.cost).makespan_ms
            self.last_makespans[name] = t
            if best is None or t < best[0]:
                best = (t, name, plan)
        _, winner, plan = best
        plan.balancer = f"{self.name}:{winner}"
        return plan
