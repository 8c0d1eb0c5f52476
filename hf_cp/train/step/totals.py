"""What one rank did in one step (or one evaluation batch), as the executor's passes add it up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import torch


@dataclass
class WaveTotals:
    """What this rank did in one step (or one evaluation batch)."""

    loss: torch.Tensor  # the scaled loss handed to backward, summed over waves (training)
    loss_sum: float = 0.0  # unscaled sum of token losses
    valid: int = 0  # valid targets in this rank's rows
    tokens: int = 0
    compute_ms: float = 0.0  # forward+backward time of the waves with work, up to the embedding's gradient
    router_loss: float = 0.0  # the step's MoE router term (coef x aux), the same on every rank (training)
    # wall time of the step's forward-only passes before its training pass (a sequence objective's
    # log-prob and reference passes, the router census): StepExecutor.forward_only_ms taken (training)
    forward_only_ms: float = 0.0
    # per wave, wall-clock seconds since the epoch: (start, end of this rank's compute, end of its backward
    # call, which includes the gradient reduction that follows); dummy waves included (training)
    wave_timeline: List[Tuple[float, float, float]] = field(default_factory=list)
