"""`auto`: plan each step with several balancers, simulate every plan, keep the fastest.

Never slower (predicted) than any of its members by construction: every member's plan is
validated and run through `hf_cp.sim.simulate` with the request's cost model, and the one
with the smallest makespan wins (the first member in order on ties). The winner is
recorded in the plan as `auto:<member>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from ..plan import StepPlan
from ..sim import simulate
from . import auto_member_balancers, get_balancer, register_balancer
from .base import Balancer, PlanRequest
from .options import BalancerOptionError, BalancerOptions, option


def default_members() -> List[str]:
    """Every balancer registered with auto_member=True (the built-ins but `megatron`)."""
    return auto_member_balancers()


@dataclass(frozen=True)
class AutoOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "auto"

    members: Optional[Tuple[str, ...]] = option(
        None, "balancers to plan with (default: every one registered with auto_member=True)"
    )
    member_options: Dict[str, Dict[str, Any]] = option(
        {}, "per-member options, e.g. {wlb: {fill: 0.9}} (command line: member_options.wlb.fill=0.9)"
    )

    def check(self) -> None:
        names = list(default_members() if self.members is None else self.members)
        if not names:
            raise BalancerOptionError("auto: needs at least one member balancer")
        if "auto" in names:
            raise BalancerOptionError("auto: cannot be a member of itself")
        if len(set(names)) != len(names):
            raise BalancerOptionError(f"auto: members listed twice in {names}")
        unknown = set(self.member_options) - set(names)
        if unknown:
            raise BalancerOptionError(f"auto: options given for {sorted(unknown)}, which are not members {names}")


@register_balancer("auto")
class AutoBalancer:
    """Plans with every member and keeps the fastest predicted plan (see the module docstring)."""

    name = "auto"
    options_class = AutoOptions

    def __init__(self, **options):
        self.options = o = AutoOptions.from_dict(options)
        names = list(default_members() if o.members is None else o.members)
        self.members: List[Tuple[str, Balancer]] = []
        for n in names:
            try:
                self.members.append((n, get_balancer(n, **o.member_options.get(n, {}))))
            except BalancerOptionError as e:
                raise BalancerOptionError(f"auto: member_options.{n}: {e}") from None
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
