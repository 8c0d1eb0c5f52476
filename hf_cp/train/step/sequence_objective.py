"""The seam of sequence-level objectives: a loss that is a function of each answer's summed
log-prob (DPO today; KTO, ORPO, SimPO and reward models have the same shape) states only that
function. The rest is here, once:

1. a pass without gradient gives this rank's part of every answer's summed log-prob; one
   all-reduce makes the whole sums, the same on every rank (`answer_logps_everywhere`);
2. the loss is computed on a leaf holding those sums and differentiated: d loss / d sum_a is
   the weight of answer a (`train_sequence_objective`);
3. a token pass with gradient backpropagates sum_a weight_a * (answer a's token log-probs),
   whose gradient is the loss's by the chain rule, with one forward and backward per wave
   (so activations are never held across waves, and dropout may stay on when it is off in 1).
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
import torch.distributed as dist

from hf_cp.train.data.answer_slots import answer_sums
from hf_cp.train.data.collator import RankStep
from hf_cp.train.step.executor import StepExecutor, WaveTotals

# loss of every answer's summed log-prob -> (the step's loss, metrics to log)
SequenceLoss = Callable[[torch.Tensor], Tuple[torch.Tensor, Dict[str, float]]]


def all_reduce_sum(t: torch.Tensor, world: int, group=None) -> torch.Tensor:
    """`t` summed over the ranks of `group` (every rank), in place; as it is on one rank."""
    if world > 1:
        dist.all_reduce(t, group=group)
    return t


def answer_logps_everywhere(executor: StepExecutor, model, step: RankStep, world: int, group=None) -> torch.Tensor:
    """Every answer's summed log-prob [answer slots] of the step under `model` (no gradient),
    the same on every rank."""
    with torch.no_grad():
        own = executor.answer_logps(model, step)
    return all_reduce_sum(own, world, group)


def train_sequence_objective(
    executor: StepExecutor, model, step: RankStep, answer_logps: torch.Tensor, loss_of: SequenceLoss
) -> Tuple[WaveTotals, float, Dict[str, float]]:
    """Train the step on `loss_of(every answer's summed log-prob)`. `answer_logps`: those sums
    under the current policy, on every rank (answer_logps_everywhere). Returns what this rank
    did, the step's loss and the loss's metrics."""
    leaf = answer_logps.detach().clone().requires_grad_(True)
    loss, metrics = loss_of(leaf)
    loss.backward()  # d loss / d (each answer's log-prob): the weights of the token pass
    weights = leaf.grad.detach()

    def objective(mb, own, extra):
        return (answer_sums(mb, own, extra, len(weights)) * weights.to(own.dtype)).sum()

    totals = executor.train(model, step, objective)
    totals.loss = loss.detach().to(totals.loss.device, totals.loss.dtype)
    return totals, loss.item(), metrics


def answer_lengths(step: RankStep, masks) -> torch.Tensor:
    """Token count of every answer slot of the step (every answer token is a target), from the
    samples' masks (`masks`: sample id -> SampleMask with `answers`)."""
    out = torch.zeros(len(step.answer_slots), dtype=torch.float64)
    for k, (sid, a) in enumerate(step.answer_slots):
        out[k] = masks[sid].answers[a]
    return out
