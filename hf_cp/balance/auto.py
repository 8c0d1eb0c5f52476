"""`auto`: plan each step with several balancers and keep the fastest predicted plan, cheaply.

Members are planned in order (`dynamic_cp` first: it is the usual winner and among the
cheapest), each plan priced by `pricing.PlanPricer` (the simulator's makespan from
per-length tables shared by every member; no validation or simulation per member). Before
planning a member, `auto` skips it when it cannot matter:

* the best plan so far is within `stop_within` of the step's charged lower bound (within
  `stop_within_masked`, 0.3%, on a masked step, and for the `core_members` dynamic_cp and
  flexsp on a plain one: the promise that auto trails no member by more)
  (cost.bounds.charged_lower_bound_ms, masked samples by their masked area, as the simulator
  prices them: bounds.BoundCache.charged): no member can beat it by more than that fraction
  (the charged bound is proven for per-document and local plans; for zigzag packs it is
  checked on the traces only, see its docstring);
* the member's own bound (its `lower_bound_ms(request, bounds)`: static, wlb and libra,
  whose plans run every sample on groups of one size, skrull, whose samples stay in
  one block each, and dcp, whose first step fixes the ranks each sample's work runs on) is no
  better than the best plan so far.

A step with masked samples (shared prompts, windows) is planned only by the members that
declare `handles_masks` (they price samples by their masked area). So `auto` is never slower
(predicted) than any member it planned. The first member's plan
is not priced unless another member is planned: its own prediction (`last_predicted_ms`,
which dynamic_cp and flexsp set on every plan()) decides whether to stop; under an execution
rule (the cost model's `execution`: ZeRO-2, FSDP2, ...) it is priced at once, since members
predict compute alone and the wall clock can rank plans differently. Everything is a
pure function of the request: the same members are planned and skipped on every rank. No
member's plan is validated here: the caller validates the winner (the planner worker and
`hf-cp plan` do, before any collective). The winner is recorded in the plan as
`auto:<member>`; `last_makespans` and `last_skipped` say what happened to each member on
the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from hf_cp.balance.base import Balancer, PlanRequest, SampleTooLongError, UnsupportedMaskError, warm_up_balancer
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option
from hf_cp.balance.registry import (
    auto_member_balancers,
    balancers_handling_masks,
    describe_options,
    get_balancer,
    register_balancer,
)
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.balance.toolkit.pricing import pricer_for
from hf_cp.balance.toolkit.sample_limit import sample_token_limit, trains_length
from hf_cp.plan.step_plan import StepPlan

# The order members are planned in by default: the usual winners and cheap planners first,
# so that the bounds can skip the rest. Members not listed (plugins) come after, by name.
PLANNING_ORDER = (
    "dynamic_cp",
    "wlb",
    "skrull",
    "libra",
    "static",
    "flexsp",
    # the block-placement solvers (issue 16) and ChunkFlow: planned when the whole-document
    # members leave a gap to the bound (masks, windows, outliers, memory-bound samples)
    "magi",
    "usp",
    "dcp",
    "libra_tap",
    "chunkflow",
)
# ... and on a step with masked samples (shared prompts, windows), where `static` came first and
# stopped the search at plans up to 1.2% behind magi's and dcp's (issue 39): the block placers
# first (magi is also the cheapest), then static and the rest. Members not listed come after.
MASKED_PLANNING_ORDER = ("magi", "dcp", "static", "usp", "libra_tap")


def default_members() -> List[str]:
    """Every balancer registered with auto_member=True (the built-ins but `megatron`), in
    PLANNING_ORDER."""
    names = auto_member_balancers()
    first = [n for n in PLANNING_ORDER if n in names]
    return first + [n for n in names if n not in first]


@dataclass(frozen=True)
class AutoOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "auto"

    members: Optional[Tuple[str, ...]] = option(
        None,
        "balancers to plan with, in this order (default: every one registered with auto_member=True, dynamic_cp first)",
    )
    member_options: Dict[str, Dict[str, Any]] = option(
        {}, "per-member options, e.g. {wlb: {fill: 0.9}} (command line: member_options.wlb.fill=0.9)"
    )
    stop_within: float = option(
        0.015,
        "plan no further member once the best plan is within this fraction of the step's lower bound "
        "(0: plan every member a bound cannot rule out)",
    )
    stop_within_masked: float = option(
        0.003,
        "stop_within on a step with masked samples (shared prompts, windows), where no member is "
        "reliably best: auto then trails a member it skipped by at most this fraction of the bound",
    )
    core_members: Tuple[str, ...] = option(
        ("dynamic_cp", "flexsp"),
        "on a step without masks these members are planned until the best plan is within stop_within_masked "
        "of the bound, the others only until stop_within: on plain steps the others have not beaten these by "
        "0.3% on any shipped trace, and cost 10-100x their CPU (dynamic_cp alone trailed flexsp by 0.6% on "
        "long documents at 512 ranks)",
    )
    exhaustive_below: int = option(
        256,
        "a step of fewer samples is planned by every member its bound does not rule out (no early stop): each "
        "is cheap there, and the first member trailed the best by up to 0.4% on such steps; not a step whose "
        "every sample is masked, which stops within stop_within_masked of its bound (work / world: no member "
        "can be faster): planning every masked member cost 8-23x magi's CPU on grouped steps at 4 and 8 ranks",
    )
    any_size_groups: bool = option(
        False,
        "turn on option any_size_groups of every member that has it (dynamic_cp: CP groups of any size within "
        "a node); a member's own setting in member_options wins; needs ClusterSpec(any_size_groups=True)",
    )

    def check(self) -> None:
        names = list(default_members() if self.members is None else self.members)
        if not names:
            raise BalancerOptionError("auto: needs at least one member balancer")
        if "auto" in names:
            raise BalancerOptionError("auto: cannot be a member of itself")
        if len(set(names)) != len(names):
            raise BalancerOptionError(f"auto: members listed twice in {names}")
        unknown_core = [n for n in self.core_members if n not in names and n not in auto_member_balancers()]
        if unknown_core:
            raise BalancerOptionError(f"auto: core_members {unknown_core} are not balancers auto plans with")
        unknown = set(self.member_options) - set(names)
        if unknown:
            raise BalancerOptionError(f"auto: options given for {sorted(unknown)}, which are not members {names}")
        for key in ("stop_within", "stop_within_masked", "exhaustive_below"):
            if not getattr(self, key) >= 0:
                raise BalancerOptionError(f"auto: {key} {getattr(self, key)} must be >= 0")


@register_balancer("auto")
class AutoBalancer:
    """Plans with its members in order, skipping those that cannot win (module docstring)."""

    name = "auto"
    options_class = AutoOptions
    # a step with masked samples is planned only by the members that declare handles_masks
    handles_masks = True

    def __init__(self, **options):
        self.options = o = AutoOptions.from_dict(options)
        names = list(default_members() if o.members is None else o.members)
        self.members: List[Tuple[str, Balancer]] = []
        taking_any_size = [n for n in names if "any_size_groups" in {h.name for h in describe_options(n)}]
        if o.any_size_groups and not taking_any_size:
            raise BalancerOptionError(
                f"auto: any_size_groups is an option of none of its members {names}; add dynamic_cp to the members"
            )
        for n in names:
            kwargs = dict(o.member_options.get(n, {}))
            if o.any_size_groups and n in taking_any_size:
                kwargs.setdefault("any_size_groups", True)
            try:
                self.members.append((n, get_balancer(n, **kwargs)))
            except BalancerOptionError as e:
                raise BalancerOptionError(f"auto: member_options.{n}: {e}") from None
        # a member planning groups of any size needs a cluster that registers them (dynamic_cp.py)
        self.needs_any_size_groups = any(getattr(b, "needs_any_size_groups", False) for _, b in self.members)
        # a member whose plans depend on timing (a solver's time limit) makes auto's depend on it too
        self.timing_dependent = any(getattr(b, "timing_dependent", False) for _, b in self.members)
        self.last_makespans: Dict[str, float] = {}  # member -> predicted ms, for those planned on the last step
        self.last_skipped: Dict[str, str] = {}  # member -> why it was not planned on the last step
        self.last_lower_bound_ms = float("nan")

    def warm_up(self) -> None:
        """Every member's one-time start-up (Balancer.warm_up), at once."""
        for _, balancer in self.members:
            warm_up_balancer(balancer)

    def plan(self, req: PlanRequest) -> StepPlan:
        pricer = pricer_for(req.cost)
        bounds = BoundCache(req)
        lower = bounds.charged()
        o = self.options
        within = o.stop_within_masked if req.masks else o.stop_within
        tight = o.stop_within_masked
        # (a bound never decides the stop on a small step: every member is planned; but on a
        # step whose every sample is masked the charged bound is the step's work / world, below
        # any member's plan, so stopping within stop_within_masked of it keeps the promise)
        all_masked = len(req.masks or ()) >= len(req.sample_ids) and all(s in req.masks for s in req.sample_ids)
        exhaustive = len(req.sample_ids) < o.exhaustive_below and not all_masked
        stop_at = -1.0 if exhaustive else lower * (1.0 + within)
        core_stop_at = -1.0 if exhaustive else lower * (1.0 + tight)
        core = set(o.core_members) if not req.masks else set()
        best: Optional[List] = None  # [predicted ms, member, plan, priced by the pricer]
        self.last_makespans, self.last_skipped, self.last_lower_bound_ms = {}, {}, lower
        members = [(n, b, req) for n, b in self.members]
        if req.masks:  # members that price every sample as causal would mis-plan masked ones
            members = [(n, b, r) for n, b, r in members if getattr(b, "handles_masks", False)]
            rank = {n: i for i, n in enumerate(MASKED_PLANNING_ORDER)}
            members.sort(key=lambda m: rank.get(m[0], len(rank)))  # stable: the others keep their order
            if not members:
                raise UnsupportedMaskError(
                    f"step {req.step}: auto: none of its members {[n for n, _ in self.members]} plans masked samples "
                    f"({len(req.masks)} in the step); add one that does: {', '.join(balancers_handling_masks())}"
                )
        longest = max(req.lengths)
        if longest > req.cluster.largest_capacity or (req.dataset_max_length or 0) > req.cluster.largest_capacity:
            members = self._members_for_long_samples(req, members)
        for name, balancer, member_req in members:
            if best is not None:
                if best[0] <= (core_stop_at if name in core else stop_at):
                    self.last_skipped[name] = f"{best[1]} is within {tight if name in core else within:g} of the bound"
                    continue
                member_bound = getattr(balancer, "lower_bound_ms", None)
                bound = member_bound(member_req, bounds) if member_bound is not None else None
                if bound is not None and bound >= best[0]:
                    self.last_skipped[name] = f"its bound {bound:.1f} ms >= {best[1]}'s {best[0]:.1f} ms"
                    continue
            plan = balancer.plan(member_req)
            if best is None:
                # the first member's own prediction (built-ins set last_predicted_ms on every
                # plan()) decides whether anything else is planned; it is priced only if so
                # Members predict compute alone; under an execution rule (ZeRO-2's per-wave
                # reductions, FSDP2's per-pass gathers) only the pricer's wall clock may stop the search
                own = getattr(balancer, "last_predicted_ms", None) if req.cost.execution is None else None
                best = [own, name, plan, False] if own is not None else [pricer.makespan_ms(plan), name, plan, True]
                self.last_makespans[name] = best[0]
                continue
            if not best[3]:
                best[0], best[3] = pricer.makespan_ms(best[2]), True
                self.last_makespans[best[1]] = best[0]
            t = pricer.makespan_ms(plan)
            self.last_makespans[name] = t
            if t < best[0]:
                best = [t, name, plan, True]
        _, winner, plan, _ = best
        plan.balancer = f"{self.name}:{winner}"
        return plan

    def max_sample_tokens(self, cluster, cost, masked: bool = False) -> int:
        """The longest sample some member trains (balance/sample_limit.py); for a masked sample,
        some member that plans masked samples."""
        members = [b for _, b in self.members if not masked or getattr(b, "handles_masks", False)]
        return max([cluster.largest_capacity] + [sample_token_limit(b, cluster, cost, masked) for b in members])

    def trains_length(self, n: int, cluster, cost) -> bool:
        """Whether some member trains a causal sample of `n` tokens (sample_limit.trains_length)."""
        return any(trains_length(b, n, cluster, cost) for _, b in self.members)

    def _members_for_long_samples(self, req: PlanRequest, members) -> List[Tuple[str, Balancer, PlanRequest]]:
        """(name, balancer, its request) of the members that can plan a step with samples over
        the largest CP group (chunkflow trains them as dependent chunks); the others are
        skipped, saying why. A member whose limit is below the dataset's longest sample sizes
        its run-wide choices (static's one CP size) for the longest sample it trains: its
        request's dataset_max_length is capped there. SampleTooLongError, naming the sample,
        when no member can plan the step."""
        cl, cost = req.cluster, req.cost
        out = []
        over = None
        for name, balancer, _ in members:
            limit = sample_token_limit(balancer, cl, cost)
            masked_limit = sample_token_limit(balancer, cl, cost, masked=True) if req.masks else limit
            too_long = next(
                (
                    (s, n)
                    for s, n in zip(req.sample_ids, req.lengths)
                    if n > (min(limit, masked_limit) if req.masks and s in req.masks else limit)
                    or (n > cl.largest_capacity and not trains_length(balancer, n, cl, cost))
                ),
                None,
            )
            if too_long is not None:
                over = over or too_long
                self.last_skipped[name] = (
                    f"it trains samples up to {limit} tokens; sample {too_long[0]} has {too_long[1]}"
                )
                continue
            if (req.dataset_max_length or 0) > limit:
                out.append((name, balancer, replace(req, dataset_max_length=limit)))
            else:
                out.append((name, balancer, req))
        if not out:
            s, n = over
            raise SampleTooLongError(
                f"step {req.step}: auto: none of its members {[n for n, _, _ in members]} trains sample {s} ({n} "
                f"tokens): {'; '.join(f'{k}: {v}' for k, v in self.last_skipped.items())}. Add chunkflow to its "
                f"members (it trains long samples as dependent chunks on one rank), or "
                f"{'note chunkflow plans causal samples only; ' if req.masks and s in req.masks else ''}raise "
                f"cp_max_tokens_per_rank or the world size"
            )
        return out
