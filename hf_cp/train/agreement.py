"""Plan agreement, the exchange that opens every training step (before any of its collectives).

Every rank compares its plan's digest with the others' (consistency.py); the same exchange
carries each rank's stop flag (a SIGTERM seen by any rank stops every rank after this step,
stop_signal.py) and a payload, the online calibration's new coefficients, of which every rank
adopts rank 0's (online_calibration.py). A balancer whose plans may depend on timing
(balancer.timing_dependent: a solver's time limit or deadline) makes ranks that disagree run
the first rank's plan instead of failing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Sequence

from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import StepPlan
from hf_cp.train.collator import PlanCollator, RankStep
from hf_cp.train.consistency import agree_on_plan_and_payload

logger = logging.getLogger(__name__)


@dataclass
class Agreed:
    """What every rank agreed on for one step."""

    step: RankStep  # the step to run: this rank's, or rank 0's plan where this rank planned otherwise
    flagged: List[int]  # the ranks that raised the stop flag
    payload: List[float]  # rank 0's payload


class PlanAgreement:
    """Agreement over `group` (the control group of every rank). `collator` builds this rank's
    share of rank 0's plan when it is adopted; `cluster` and `cost` validate that plan."""

    def __init__(self, group, cluster: ClusterSpec, cost: CostModel, rank: int, collator: PlanCollator):
        self.group, self.cluster, self.cost, self.rank, self.collator = group, cluster, cost, rank, collator

    def agree(self, step: RankStep, balancer, flag: bool, payload: Sequence[float]) -> Agreed:
        """Agree on `step` (errors count steps as the Trainer does, from 1); `balancer`: the
        planner's (its `timing_dependent` decides whether disagreeing ranks adopt rank 0's plan)."""
        adopt = bool(getattr(balancer, "timing_dependent", False))
        plan_json = step.plan.to_json() if adopt else ""
        theirs, flagged, adopted = agree_on_plan_and_payload(
            plan_json,
            step.plan.digest(),
            step.index + 1,
            group=self.group,
            flag=flag,
            adopt_first=adopt,
            payload=payload,
        )
        if theirs is not None:  # this rank planned otherwise (a solver's time limit): run rank 0's plan
            plan = StepPlan.from_json(theirs, f"step {step.index + 1}: rank 0's plan")
            plan.validate(self.cluster, self.cost)
            logger.warning(
                "hf_cp: step %d: rank %d planned this step otherwise (%s depends on timing); running rank 0's plan",
                step.index + 1,
                self.rank,
                step.plan.balancer,
            )
            step = self.collator.rank_step(plan, self.rank, step.global_valid_tokens, step.epoch, step.planned)
        return Agreed(step, flagged, adopted)
