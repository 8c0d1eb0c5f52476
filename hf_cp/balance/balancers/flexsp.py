"""`flexsp` (FlexSP, survey 3.1): heterogeneous CP groups running concurrently, sized by a MILP.

One step = one partition of the ranks into groups of different power-of-two sizes, all
running at once; each group works through the samples assigned to it (as many micro-batches
as the cap needs), and every rank then runs its share of the light samples locally.

Time-balanced assignment (FlexSP's min-max over group completion times), for a target
makespan C found by bisection:

    variables  x[k, d] in {0, 1}: heavy sample k runs on a group of size d (only d with
               t_k(d) <= C and whose shards fit the cap); m[d] in Z>=0: groups of size d
    s.t.       sum_d x[k, d] = 1                                  every heavy sample once
               sum_k t_k(d) x[k, d] <= C * m[d]        (d >= 2)   the size-d groups finish by C
               sum_d d * m[d] <= world                            ranks
               sum_k d * t_k(d) x[k, d] + light work <= world * C   all work fits by C
    minimise   sum_k d * t_k(d) x[k, d]                           rank-time spent

t_k(d) is the cost model's time of sample k on d ranks (CostModel via costs.CostMemo).
Heavy samples: those too long for one rank and the heaviest others (FlexSP solves per
sequence; the light tail is filled by LPT, which the MILP accounts for as divisible work).
The MILP runs in highspy (optional extra `milp`) under node and time limits; without
highspy, a greedy picks for every heavy sample the smallest group that meets C and counts
groups by first-fit decreasing. Plans realised from the best few targets are priced and
the fastest is kept.

HiGHS can ignore its own time limit (inside MIP presolve it ran one 1,000-sample MILP for
more than 4 minutes), so the MILP search runs in a worker process killed at `deadline_s`
(deadline.SolverWorker: one long-lived worker serves every solve); past it the step is
planned with the greedy sizes and the plan says so in its notes.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.costs import CostMemo, cost_memo
from hf_cp.balance.toolkit.cp_candidates import (
    Candidate,
    fill_ranks,
    memory_min_sizes,
    per_rank_ms,
    pick_fastest,
    refine_best,
)
from hf_cp.balance.toolkit.deadline import DeadlinePassed, solver_worker
from hf_cp.plan.step_plan import StepPlan


def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


_HIGHS_BANNER_LOCK = threading.Lock()
_highs_banner_done = False


def quiet_highs():
    """A highspy.Highs that prints nothing. HiGHS prints its licence banner from C++ on the first
    construction in a process, before any option can be set: at one banner per planner process
    and rank, a 512-rank job's log would open with a thousand of them. So the first one is
    built with the process's stdout pointed at /dev/null for that moment."""
    global _highs_banner_done
    import highspy

    with _HIGHS_BANNER_LOCK:
        if _highs_banner_done:
            h = highspy.Highs()
        else:
            sys.stdout.flush()
            saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, 1)
                h = highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
                os.close(devnull)
            _highs_banner_done = True
    h.setOptionValue("output_flag", False)
    return h


class Problem:
    """The heavy samples' per-size times and the light work, for one request."""

    def __init__(self, req: PlanRequest, memo: CostMemo, max_heavy: int, heavy_fraction: float):
        cl = req.cluster
        self.world = cl.world_size
        self.lengths = req.length_array
        self.local_ms = memo.step_local_ms(req.lengths, req.length_array)
        self.min_sizes = memory_min_sizes(memo, self.lengths, req)
        self.quota = float(self.local_ms.sum()) / self.world
        forced = np.flatnonzero(self.min_sizes > 1)
        order = np.argsort(-self.local_ms, kind="stable")
        optional = [
            i
            for i in order[:max_heavy].tolist()
            if self.min_sizes[i] == 1 and self.local_ms[i] > heavy_fraction * self.quota
        ]
        self.heavy = sorted(set(forced.tolist()) | set(optional), key=lambda i: (-self.local_ms[i], i))
        heavy_mask = np.zeros(len(self.lengths), dtype=bool)
        heavy_mask[self.heavy] = True
        self.light = np.flatnonzero(~heavy_mask)
        self.light_ms = float(self.local_ms[self.light].sum())
        # per heavy sample: {size: time per member}, sizes from the memory minimum up while faster
        self.options: List[Dict[int, float]] = []
        for i in self.heavy:
            n, g = int(self.lengths[i]), int(self.min_sizes[i])
            opts = {g: per_rank_ms(memo, n, g)}
            while g < cl.group_sizes[-1]:
                t = per_rank_ms(memo, n, 2 * g)
                if t >= opts[g]:
                    break
                g *= 2
                opts[g] = t
            self.options.append(opts)
        self.sizes = sorted({d for o in self.options for d in o})

    def lower_ms(self) -> float:
        best_each = [min(o.values()) for o in self.options]
        return max([self.quota] + best_each)

    def upper_ms(self) -> float:
        """Makespan target that is always feasible: every heavy sample alone at its fastest size
        one after the other on the whole world, then the light work spread evenly."""
        return sum(min(o.values()) for o in self.options) + self.light_ms / self.world + self.quota


# ----------------------------------------------------------------------------- solvers
class MilpSolver:
    """The assignment MILP in highspy, built once and re-targeted for every C."""

    def __init__(self, prob: Problem, node_limit: int, time_limit_s: float):
        import highspy

        self.prob = prob
        h = self.h = quiet_highs()
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", 0)
        h.setOptionValue("mip_rel_gap", 0.01)
        h.setOptionValue("mip_max_nodes", int(node_limit))
        h.setOptionValue("time_limit", float(time_limit_s))
        inf = highspy.kHighsInf
        self.x: List[Tuple[int, int, int, float]] = []  # (column, heavy index, size, time)
        col = 0
        for k, opts in enumerate(prob.options):
            for d, t in sorted(opts.items()):
                h.addVar(0.0, 1.0)
                h.changeColCost(col, d * t)
                h.changeColIntegrality(col, highspy.HighsVarType.kInteger)
                self.x.append((col, k, d, t))
                col += 1
        self.m: Dict[int, int] = {}
        for d in prob.sizes:
            if d >= 2:
                h.addVar(0.0, float(prob.world // d))
                h.changeColIntegrality(col, highspy.HighsVarType.kInteger)
                self.m[d] = col
                col += 1
        for k in range(len(prob.options)):
            cols = [c for c, kk, _, _ in self.x if kk == k]
            h.addRow(1.0, 1.0, len(cols), np.array(cols, dtype=np.int32), np.ones(len(cols)))
        self.class_rows: Dict[int, int] = {}
        row = len(prob.options)
        for d, mcol in self.m.items():
            cols = [c for c, _, dd, _ in self.x if dd == d] + [mcol]
            vals = [t for _, _, dd, t in self.x if dd == d] + [-1.0]  # -C set per target
            h.addRow(-inf, 0.0, len(cols), np.array(cols, dtype=np.int32), np.array(vals))
            self.class_rows[d] = row
            row += 1
        if self.m:
            cols = list(self.m.values())
            h.addRow(
                -inf, float(prob.world), len(cols), np.array(cols, dtype=np.int32), np.array([float(d) for d in self.m])
            )
            row += 1
        cols = [c for c, _, _, _ in self.x]
        h.addRow(-inf, 0.0, len(cols), np.array(cols, dtype=np.int32), np.array([d * t for _, _, d, t in self.x]))
        self.area_row = row

    def solve(self, target_ms: float) -> Optional[List[int]]:
        """Sizes of the heavy samples meeting the target, or None when none was found."""
        import highspy

        h, prob = self.h, self.prob
        for d, r in self.class_rows.items():
            h.changeCoeff(r, self.m[d], -target_ms)
        h.changeRowBounds(self.area_row, -highspy.kHighsInf, prob.world * target_ms - prob.light_ms)
        for c, _, _, t in self.x:
            h.changeColBounds(c, 0.0, 1.0 if t <= target_ms else 0.0)
        h.run()
        status = h.getModelStatus()
        if h.getInfo().primal_solution_status != 2:  # 2: a feasible solution exists
            return None
        del status
        vals = h.getSolution().col_value
        sizes = [0] * len(prob.options)
        for c, k, d, _ in self.x:
            if vals[c] > 0.5:
                sizes[k] = d
        return sizes if all(sizes) else None


def greedy_sizes(prob: Problem, target_ms: float) -> Optional[List[int]]:
    """Fallback without highspy: smallest group meeting the target per heavy sample; feasible
    when the groups first-fit-decreasing needs fit the world and all work fits by the target."""
    sizes: List[int] = []
    for opts in prob.options:
        d = next((d for d, t in sorted(opts.items()) if t <= target_ms), None)
        if d is None:
            return None
        sizes.append(d)
    ranks_used, area = 0, prob.light_ms
    for d in sorted(set(sizes)):
        times = sorted((prob.options[k][d] for k, s in enumerate(sizes) if s == d), reverse=True)
        area += sum(times) * d
        if d >= 2:
            ranks_used += d * len(first_fit_decreasing(times, target_ms))
    if ranks_used > prob.world or area > prob.world * target_ms:
        return None
    return sizes


def first_fit_decreasing(times: Sequence[float], capacity: float) -> List[List[int]]:
    bins: List[List[int]] = []
    free: List[float] = []
    for i, t in enumerate(times):
        for b, f in enumerate(free):
            if f >= t:
                bins[b].append(i)
                free[b] = f - t
                break
        else:
            bins.append([i])
            free.append(capacity - t)
    return bins


# ----------------------------------------------------------------------------- realisation
def realise(req: PlanRequest, memo: CostMemo, prob: Problem, heavy_sizes: Sequence[int], target_ms: float) -> Candidate:
    """One partition: per size, the fewest groups that hold its samples within the target
    (first-fit decreasing), then LPT inside the size class; blocks placed largest first;
    light samples and heavy local ones filled in by LPT."""
    world = prob.world
    loads = np.zeros(world, dtype=np.float64)
    placed: Dict[Tuple[int, int], List[int]] = {}
    by_size: Dict[int, List[int]] = {}
    for k, d in enumerate(heavy_sizes):
        by_size.setdefault(d, []).append(k)
    start = 0
    for d in sorted((d for d in by_size if d >= 2), reverse=True):
        ks = sorted(by_size[d], key=lambda k: (-prob.options[k][d], k))
        times = [prob.options[k][d] for k in ks]
        n_groups = len(first_fit_decreasing(times, target_ms))
        group_load = [0.0] * n_groups
        members: List[List[int]] = [[] for _ in range(n_groups)]
        for k, t in zip(ks, times):  # LPT inside the class
            j = min(range(n_groups), key=lambda j: (group_load[j], j))
            group_load[j] += t
            members[j].append(prob.heavy[k])
        for j in sorted(range(n_groups), key=lambda j: (-group_load[j], j)):
            if start + d <= world:  # a free block (sizes go largest first, so it is aligned)
                b = start // d
                start += d
            else:  # the partition is full: share the block whose busiest member is least loaded
                b = int(np.argmin(loads.reshape(world // d, d).max(axis=1)))
            placed.setdefault((d, b), []).extend(members[j])
            loads[b * d : (b + 1) * d] += group_load[j]
    local = np.array(sorted([prob.heavy[k] for k in by_size.get(1, [])] + prob.light.tolist()), dtype=np.int64)
    rank_of, loads = fill_ranks(prob.local_ms[local], loads, lengths=prob.lengths[local])
    cand = Candidate.__new__(Candidate)
    cand.placed, cand.local_idx, cand.local_rank_of, cand.loads = placed, local, rank_of, loads
    cand.refined = False
    cand.estimate(req, memo, prob.lengths)
    return cand


@dataclass(frozen=True)
class FlexSPOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "flexsp"

    solver: str = option("auto", "auto (the MILP when highspy imports, else greedy), milp or greedy")
    time_limit_s: float = option(1.5, "HiGHS's own time limit for the whole MILP search, split over the solves")
    node_limit: int = option(200, "branch-and-bound nodes per MILP solve (keeps results deterministic)")
    bisection_steps: int = option(10, "bisection steps on the target makespan")
    max_heavy: int = option(128, "at most this many optional heavy samples in the MILP")
    heavy_fraction: float = option(0.05, "samples heavier than this fraction of a rank's quota are heavy")
    simulate_within: float = option(0.003, "candidates predicted within this fraction of the best are simulated")
    deadline_s: Optional[float] = option(
        3.0,
        "wall-clock deadline of the MILP search, enforced by killing its worker process (HiGHS can ignore its own "
        "time limit); past it the plan takes the greedy sizes and says so in its notes (null: no deadline)",
    )

    def check(self) -> None:
        if self.solver not in ("auto", "milp", "greedy"):
            raise BalancerOptionError(f"flexsp: solver must be 'auto', 'milp' or 'greedy', got {self.solver!r}")
        if self.time_limit_s <= 0 or self.bisection_steps < 1 or self.max_heavy < 0:
            raise BalancerOptionError("flexsp: time_limit_s must be positive, bisection_steps >= 1, max_heavy >= 0")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise BalancerOptionError(f"flexsp: deadline_s {self.deadline_s} must be positive (or null)")


@register_balancer("flexsp", auto_member=True)
class FlexSPBalancer:
    # HiGHS's time limit and the search deadline make a plan depend on the machine's speed: ranks
    # that planned the same step may differ, and the trainer then runs the first rank's plan
    timing_dependent = True
    name = "flexsp"
    options_class = FlexSPOptions

    last_predicted_ms: Optional[float] = None  # set by every plan(): the kept candidate's predicted makespan

    def __init__(self, **options):
        self.options = o = FlexSPOptions.from_dict(options)
        if o.solver == "milp" and not highs_available():
            raise ImportError(
                "flexsp: solver='milp' needs highspy, the optional extra `milp`: pip install 'hf_cp[milp]'"
            )
        self.solver = o.solver
        self.time_limit_s = o.time_limit_s
        self.node_limit = o.node_limit
        self.bisection_steps = o.bisection_steps
        self.max_heavy = o.max_heavy
        self.heavy_fraction = o.heavy_fraction
        self.simulate_within = o.simulate_within
        self.deadline_s = o.deadline_s

    def uses_milp(self) -> bool:
        return self.solver == "milp" or (self.solver == "auto" and highs_available())

    def warm_up(self) -> None:
        """Start the MILP's solver worker now (Balancer.warm_up)."""
        if self.uses_milp() and self.deadline_s is not None:
            solver_worker().start()

    def plan(self, req: PlanRequest) -> StepPlan:
        return self._plan(req, solve=self.uses_milp())

    def plan_fallback(self, req: PlanRequest) -> StepPlan:
        """The plan a passed deadline leads to: the greedy sizes, with no solver (deterministic,
        for ranks that must agree on a step one of them planned past the deadline)."""
        return self._plan(req, solve=False)

    def _plan(self, req: PlanRequest, solve: bool) -> StepPlan:
        """Sizes from the MILP (`solve`, under the deadline: the greedy sizes past it) or the
        greedy search, realised, refined, and the fastest of the last three taken."""
        memo = cost_memo(req.cost)
        prob = Problem(req, memo, self.max_heavy, self.heavy_fraction)
        if not prob.heavy:
            plan, self.last_predicted_ms = pick_fastest(
                req, memo, [realise(req, memo, prob, [], math.inf)], self.name, 0.0
            )
            return plan
        notes: List[str] = []
        if solve:
            search = (milp_search, (prob, self.node_limit, self.time_limit_s, self.bisection_steps))
            if self.deadline_s is None:
                found = search[0](*search[1])
            else:
                try:
                    found = solver_worker().call(*search, deadline_s=self.deadline_s)
                except DeadlinePassed:
                    found = greedy_search(prob, self.bisection_steps)
                    notes.append(
                        f"flexsp: the MILP passed its {self.deadline_s:g} s deadline; planned with the greedy sizes"
                    )
        else:
            found = greedy_search(prob, self.bisection_steps)
        candidates = [realise(req, memo, prob, sizes, c) for c, sizes in found[-3:]]
        refine_best(req, memo, candidates, prob.lengths, prob.local_ms, 2)
        plan, self.last_predicted_ms = pick_fastest(req, memo, candidates, self.name, self.simulate_within)
        plan.notes.extend(notes)
        return plan


def bisect_targets(
    prob: Problem, solve, steps: int, start: Optional[Tuple[float, List[int]]] = None
) -> List[Tuple[float, List[int]]]:
    """(target makespan, heavy samples' sizes) of every feasible target of a geometric
    bisection between the problem's lower makespan and `start` (a feasible target and its
    sizes; default: the upper makespan, solved), the best last."""
    lo = prob.lower_ms()
    if start is None:
        hi = prob.upper_ms()
        best = solve(hi)
        if best is None:  # the upper target holds by construction for the greedy; guard the MILP
            best = [max(o) for o in prob.options]
        start = (hi, best)
    hi = start[0]
    found: List[Tuple[float, List[int]]] = [start]
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        sizes = solve(mid)
        if sizes is None:
            lo = mid
        else:
            hi = mid
            found.append((mid, sizes))
    return found


def milp_search(prob: Problem, node_limit: int, time_limit_s: float, steps: int) -> List[Tuple[float, List[int]]]:
    """The greedy's bisection, then the MILP's below the greedy's best target (its sizes are
    a solution of the MILP there), in half the steps: the MILP only has to beat the greedy.
    HiGHS's own limit: time_limit_s over all the solves."""
    greedy = greedy_search(prob, steps)
    milp_steps = max(1, (steps + 1) // 2)
    milp = MilpSolver(prob, node_limit, time_limit_s / milp_steps)
    return greedy[:-1] + bisect_targets(prob, milp.solve, milp_steps, start=greedy[-1])


def greedy_search(prob: Problem, steps: int) -> List[Tuple[float, List[int]]]:
    """bisect_targets with greedy_sizes: no solver, the fallback when the MILP cannot be used."""
    return bisect_targets(prob, lambda c: greedy_sizes(prob, c), steps)
