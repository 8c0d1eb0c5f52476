"""RLOO's loss as a function of each completion's summed log-prob.

TRL 1.16's RLOOTrainer folds the KL to the reference into the reward and computes the
leave-one-out advantages at generation; its policy loss is per sequence: the mean over the
generation batch's rows of -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with r the ratio
of the completion's summed log-prob now to the one at generation (`old_logps`). So the planned
step is a sequence objective (step/sequence_objective.py) and this is its loss, term by term as
`RLOOTrainer._compute_loss`; the clip ratios are TRL's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch


@dataclass(frozen=True)
class RLOOSettings:
    """What the loss reads from an RLOOConfig."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2

    @classmethod
    def from_config(cls, args) -> RLOOSettings:
        if getattr(args, "use_liger_kernel", False):
            raise ValueError(
                "CPRLOOTrainer: use_liger_kernel=True patches the LM head and loss, which hf_cp's planned log-prob "
                "pass bypasses; set use_liger_kernel=False"
            )
        high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        return cls(epsilon_low=float(args.epsilon), epsilon_high=float(high))


def rloo_loss(
    s: RLOOSettings, logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, rows: int, constant: float = 0.0
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The step's loss and TRL's clip metrics. `logps`, `old`, `advantages`: [trained rows] (the
    summed log-prob now, differentiable; at generation; the advantage); `rows`: every row of the
    generation batch (TRL's mean); `constant`: the summed loss of the rows not run (no completion
    token: ratio 1, loss -A; advantage 0: loss 0), which moves no parameter."""
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    per = -torch.min(ratio * advantages, clipped * advantages)
    loss = (per.sum() + constant) / rows
    with torch.no_grad():
        low = ((ratio < 1 - s.epsilon_low) & (advantages < 0)).double()
        high = ((ratio > 1 + s.epsilon_high) & (advantages > 0)).double()
        # rows not run have ratio 1: never clipped, but counted in TRL's means over the batch
        metrics = {
            "clip_ratio/low_mean": float(low.sum()) / rows,
            "clip_ratio/low_min": float(low.min()) if len(low) == rows else 0.0,
            "clip_ratio/high_mean": float(high.sum()) / rows,
            "clip_ratio/high_max": float(high.max()) if len(high) else 0.0,
            "clip_ratio/region_mean": float((low + high).clamp(max=1).sum()) / rows,
        }
    return loss, metrics
