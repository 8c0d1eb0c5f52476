"""`dynamic_cp` (Megatron-LM Dynamic CP, survey 2.4 / 3.1): a CP size per micro-batch.

The DP x CP grid is one pool of ranks; every sample gets its own CP size from the registered
power-of-two groups. Two passes, as in the survey's algorithm:

1. workload balancing: every rank's quota is the step's mean work (total single-rank time /
   world); a sample whose time per rank exceeds `theta` x quota at its memory-minimal CP size
   moves to larger groups (heavy samples cut finer) until it fits the quota or stops
   getting faster;
2. memory filling: distributed samples are placed on the aligned block whose busiest member
   is least loaded, then the remaining (local) samples fill the ranks lightest-first by LPT,
   packed into micro-batches under the per-rank token cap.

One candidate plan per `theta` (and the memory-only one); the fastest predicted candidate
is kept (the closest ones priced by the simulator's timing rule, pricing.PlanPricer). The
candidate machinery is toolkit/cp_candidates.py, which flexsp shares.

Execution order makes groups never wait for each other: every rank runs its distributed
micro-batches from the largest group size to the smallest, then its local ones. Aligned
blocks nest, so the members of a block of size g have done exactly the same larger-group
work before it and reach it at the same moment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

import numpy as np

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.balance.toolkit.cp_candidates import Candidate, balance_sizes, memory_min_sizes, pick_fastest, refine_best
from hf_cp.plan.step_plan import StepPlan

DEFAULT_THETAS: Tuple[Optional[float], ...] = (None, 1.0, 0.5, 0.25, 0.125)


@dataclass(frozen=True)
class DynamicCPOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "dynamic_cp"

    thetas: Tuple[Optional[float], ...] = option(
        DEFAULT_THETAS,
        "quota fractions tried in the workload pass, one candidate plan each (null: memory-minimal CP sizes only)",
    )
    simulate_within: float = option(
        0.003, "candidates predicted within this fraction of the best are simulated (at most two)"
    )
    simulate_samples_per_rank: float = option(
        16.0, "steps of more than this many samples per rank skip the simulation and keep the best prediction"
    )
    refine_candidates: int = option(
        1,
        "candidates (lowest estimates first) whose local samples are evened out by moves and swaps afterwards "
        "(a second one gains ~0.2% on coarse steps such as long documents at 64 ranks, for ~60% more time)",
    )

    def check(self) -> None:
        if not self.thetas:
            raise BalancerOptionError("dynamic_cp: thetas must name at least one candidate")
        if self.refine_candidates < 0:
            raise BalancerOptionError(f"dynamic_cp: refine_candidates {self.refine_candidates} must be >= 0")
        for t in self.thetas:
            if t is not None and not t > 0:
                raise BalancerOptionError(f"dynamic_cp: theta {t!r} must be positive (or null for memory-only)")


@register_balancer("dynamic_cp", auto_member=True)
class DynamicCPBalancer:
    """Per-sample CP size (workload first, then memory filling); best simulated candidate."""

    name = "dynamic_cp"
    options_class = DynamicCPOptions

    last_predicted_ms: Optional[float] = None  # set by every plan(): the kept candidate's predicted makespan

    def __init__(self, **options):
        self.options = o = DynamicCPOptions.from_dict(options)
        self.thetas = o.thetas
        self.simulate_within = o.simulate_within
        self.simulate_samples_per_rank = o.simulate_samples_per_rank
        self.refine_candidates = o.refine_candidates

    def plan(self, req: PlanRequest) -> StepPlan:
        memo = cost_memo(req.cost)
        cl = req.cluster
        lengths = np.asarray(req.lengths, dtype=np.int64)
        local_ms = memo.step_local_ms(req.lengths)
        min_sizes = memory_min_sizes(memo, lengths, req)
        quota = float(local_ms.sum()) / cl.world_size
        seen = set()
        candidates: List[Candidate] = []
        for theta in self.thetas:
            sizes = balance_sizes(memo, lengths, min_sizes, local_ms, cl.group_sizes[-1], quota, theta)
            key = sizes.tobytes()
            if key in seen:
                continue
            seen.add(key)
            candidates.append(Candidate(req, memo, lengths, local_ms, sizes))
        refine_best(req, memo, candidates, lengths, local_ms, self.refine_candidates)
        plan, self.last_predicted_ms = pick_fastest(
            req,
            memo,
            candidates,
            self.name,
            self.simulate_within,
            simulate_up_to_samples=int(self.simulate_samples_per_rank * cl.world_size),
        )
        return plan
