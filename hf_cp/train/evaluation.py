"""Planned evaluation, the trainer's side: this rank's share of every planned evaluation batch
(hf_cp.planning.evaluation plans them). Forward only means no gradient reduction: a rank without
work in a wave simply skips it (only CP groups communicate). Each rank sums the token losses and
valid targets of its shards; one all-reduce at the end gives eval loss = total token loss /
total valid targets, the single-device number."""

from __future__ import annotations

from typing import Iterator, List, Tuple

from hf_cp.plan.step_plan import StepPlan
from hf_cp.train.collator import PlanCollator, RankStep
from hf_cp.train.columns import TokenColumns


def evaluation_rank_steps(plans: List[Tuple[StepPlan, int]], data: TokenColumns, rank: int) -> Iterator[RankStep]:
    """This rank's share of every evaluation batch, collated one batch at a time."""
    collate = PlanCollator(data.fetch, data.masks)
    for plan, valid in plans:
        yield collate.rank_step(plan, rank, valid)
