"""Planned evaluation: the eval set's loss, batched and planned like training steps, forward only.

The eval set is cut into global batches in dataset order (no shuffling) and every batch is
planned by the training balancer on the same cluster, so samples longer than one rank's cap are
evaluated over a CP group exactly as they are trained. Forward only means no gradient
reduction: a rank without work in a wave simply skips it (only CP groups communicate). Each
rank sums the token losses and valid targets of its shards; one all-reduce at the end gives
eval loss = total token loss / total valid targets, the single-device number.
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

from ..cluster import ClusterSpec
from ..cost import CostModel
from ..plan import StepPlan
from .collator import PlanCollator, RankStep
from .columns import TokenColumns
from .planner import Planner
from .sampler import GlobalBatchSampler


def plan_evaluation(
    data: TokenColumns,
    tokens_per_step: int,
    balancer,
    cluster: ClusterSpec,
    cost: CostModel,
    seed: int = 0,
    name: str = "eval_dataset",
) -> List[Tuple[StepPlan, int]]:
    """(plan, valid targets of the batch) for every evaluation batch, in dataset order: the same
    on every rank, and the same at every evaluation of the run (plan once, reuse)."""
    sampler = GlobalBatchSampler(data.lengths, tokens_per_step, seed=seed, num_epochs=1, shuffle=False)
    try:
        planner = Planner(sampler, balancer, cluster, cost, seed=seed, lookahead=0, masks=data.masks)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    plans = []
    for k in range(len(sampler)):
        ps = planner.get(k)
        plans.append((ps.plan, int(data.valid_counts[list(ps.batch.sample_ids)].sum())))
    return plans


def evaluation_rank_steps(plans: List[Tuple[StepPlan, int]], data: TokenColumns, rank: int) -> Iterator[RankStep]:
    """This rank's share of every evaluation batch, collated one batch at a time."""
    collate = PlanCollator(data.fetch, data.masks)
    for plan, valid in plans:
        yield collate.rank_step(plan, rank, valid)
