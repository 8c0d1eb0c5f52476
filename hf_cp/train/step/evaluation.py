"""Planned evaluation, the trainer's side: this rank's share of every planned evaluation batch
(hf_cp.planning.evaluation plans them). Forward only means no gradient reduction: a rank without
work in a wave simply skips it (only CP groups communicate). Each rank sums the token losses and
valid targets of its shards; one all-reduce at the end gives eval loss = total token loss /
total valid targets, the single-device number."""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import StepPlan
from hf_cp.planning.evaluation import plan_evaluation
from hf_cp.train.checks.setup import check_step_attention
from hf_cp.train.data.collator import IGNORE_INDEX, PlanCollator, RankStep
from hf_cp.train.data.columns import TokenColumns, read_token_columns
from hf_cp.train.step.agreement import assert_plans_agree
from hf_cp.train.step.executor import StepExecutor


def evaluation_rank_steps(plans: List[Tuple[StepPlan, int]], data: TokenColumns, rank: int) -> Iterator[RankStep]:
    """This rank's share of every evaluation batch, collated one batch at a time."""
    collate = PlanCollator(data.fetch, data.masks, data.vision)
    for plan, valid in plans:
        yield collate.rank_step(plan, rank, valid)


def evaluation_data(
    ds,
    name: str,
    tokens_per_step: int,
    balancer,
    cluster: ClusterSpec,
    cost: CostModel,
    seed: int,
    vocab_size: Optional[int] = None,
) -> Tuple[TokenColumns, List[Tuple[StepPlan, int]]]:
    """An eval dataset's token columns (ids checked against `vocab_size`) and its planned batches
    (evaluation_plans); `name` names it in errors."""
    data = read_token_columns(ds, name, vocab_size=vocab_size, training=False)
    return data, evaluation_plans(data, name, tokens_per_step, balancer, cluster, cost, seed)


def evaluation_plans(
    data: TokenColumns, name: str, tokens_per_step: int, balancer, cluster: ClusterSpec, cost: CostModel, seed: int
) -> List[Tuple[StepPlan, int]]:
    """Planned batches over every sample of `data` once (plan_evaluation). A dataset without a
    single target token is an error."""
    if int(data.valid_counts.sum()) == 0:
        raise ValueError(f"CPTrainer.evaluate: {name} has no target tokens (every label is {IGNORE_INDEX})")
    return plan_evaluation(
        data.lengths, data.valid_counts, tokens_per_step, balancer, cluster, cost, seed, name, masks=data.masks
    )


def evaluation_totals(
    model: torch.nn.Module,
    executor: StepExecutor,
    plans: List[Tuple[StepPlan, int]],
    data: TokenColumns,
    rank: int,
    world: int,
    group=None,
    attn_implementation: Optional[str] = None,
) -> torch.Tensor:
    """[token loss sum, valid targets, tokens] of every rank together (float64; one all-reduce
    over `group` when `world` > 1), the model in eval mode meanwhile."""
    was_training = model.training
    model.eval()
    loss_sum, valid, tokens = 0.0, 0, 0
    try:
        with torch.no_grad():
            for step in evaluation_rank_steps(plans, data, rank):
                # as in training: a rank with another plan would wait in the wrong group
                assert_plans_agree(step.plan.digest(), step.index + 1, group=group, phase="evaluation batch")
                check_step_attention(step.plan, step.has_masks, step.index, attn_implementation, "evaluation batch")
                got = executor.evaluate(model, step)
                loss_sum, valid, tokens = loss_sum + got.loss_sum, valid + got.valid, tokens + got.tokens
    finally:
        model.train(was_training)
    totals = torch.tensor([loss_sum, float(valid), float(tokens)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(totals, group=group)
    return totals
