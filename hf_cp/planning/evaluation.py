"""Evaluation batches, planned: the eval set cut into global batches in dataset order (no
shuffling) and every batch planned by the training balancer on the same cluster, so samples
longer than one rank's cap are evaluated over a CP group exactly as they are trained. Planned
once, the same on every rank and at every evaluation of the run."""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import StepPlan
from hf_cp.planning.sampler import GlobalBatchSampler
from hf_cp.planning.worker import Planner
from hf_cp.samples.masks import SampleMask


def plan_evaluation(
    lengths: Sequence[int],
    valid_counts: Sequence[int],
    tokens_per_step: int,
    balancer,
    cluster: ClusterSpec,
    cost: CostModel,
    seed: int = 0,
    name: str = "eval_dataset",
    masks: Optional[Mapping[int, SampleMask]] = None,
) -> List[Tuple[StepPlan, int]]:
    """(plan, valid targets of the batch) for every evaluation batch, in dataset order.
    `balancer`: a registered name or a balancer object; `masks`: sample id -> non-causal mask."""
    sampler = GlobalBatchSampler(lengths, tokens_per_step, seed=seed, num_epochs=1, shuffle=False)
    try:
        planner = Planner(sampler, balancer, cluster, cost, seed=seed, lookahead=0, masks=masks)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    valid = np.asarray(valid_counts, dtype=np.int64)
    plans = []
    for k in range(len(sampler)):
        ps = planner.get(k)
        plans.append((ps.plan, int(valid[list(ps.batch.sample_ids)].sum())))
    return plans
