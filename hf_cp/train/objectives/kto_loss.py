"""KTO losses as functions of each completion's summed log-prob.

An example of TRL's KTOTrainer is a prompt, one completion and a label (desirable or not). Its
loss depends on the sequence only through the completion's summed log-prob under the policy and
the reference, and on the batch through one number, the KL estimate z0: the mean over the batch's
mismatched pairs (each prompt with a neighbour's completion, TRL's rotation) of the policy's minus
the reference's summed log-prob, clamped at 0 and without gradient. hf_cp sums the per-token
log-probs over the ranks that hold them (train/objectives/kto.py) and then computes the loss here,
on whole-step vectors: the formulas of TRL 1.16's `KTOTrainer._compute_loss`, term by term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

LOSS_TYPES = ("kto", "apo_zero_unpaired")
KL_LOSS_TYPES = ("kto",)  # the loss types that estimate the KL term (TRL's calculate_KL)


@dataclass(frozen=True)
class KTOSettings:
    """What the loss reads from a KTOConfig."""

    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @classmethod
    def from_config(cls, args) -> KTOSettings:
        if args.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"CPKTOTrainer: loss_type {args.loss_type!r} is not supported; supported: {list(LOSS_TYPES)}"
            )
        return cls(
            beta=float(args.beta),
            loss_type=str(args.loss_type),
            desirable_weight=float(args.desirable_weight),
            undesirable_weight=float(args.undesirable_weight),
        )

    @property
    def uses_kl(self) -> bool:
        return self.loss_type in KL_LOSS_TYPES


def kl_estimate(kl_policy: Optional[torch.Tensor], kl_reference: Optional[torch.Tensor]) -> torch.Tensor:
    """TRL's z0: the mean over the batch's mismatched pairs of policy minus reference summed
    log-prob, clamped at 0, without gradient (0 for a loss type without the KL term)."""
    if kl_policy is None:
        return torch.zeros((), dtype=torch.float64)
    return (kl_policy.detach() - kl_reference).mean().clamp(min=0)


def kto_loss(
    s: KTOSettings,
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The batch's loss (mean over its examples) and TRL's metrics.

    `logps`, `ref_logps`: [examples] summed completion log-probs under the policy
    (differentiable) and the reference; `desirable`: [examples] bool labels; `kl`: kl_estimate."""
    kl = kl.to(logps.dtype)
    chosen, rejected = logps[desirable], logps[~desirable]
    chosen_lr = chosen - ref_logps[desirable]
    rejected_lr = rejected - ref_logps[~desirable]
    if s.loss_type == "kto":  # Eqn (7) of the KTO paper
        chosen_losses = 1 - torch.sigmoid(s.beta * (chosen_lr - kl))
        rejected_losses = 1 - torch.sigmoid(s.beta * (kl - rejected_lr))
    else:  # apo_zero_unpaired: the unpaired variant of APO-zero
        chosen_losses = 1 - torch.sigmoid(s.beta * chosen_lr)
        rejected_losses = F.sigmoid(s.beta * rejected_lr)
    losses = torch.cat((s.desirable_weight * chosen_losses, s.undesirable_weight * rejected_losses))
    loss = losses.nanmean()
    metrics = {"kl": float(kl)}
    with torch.no_grad():
        if chosen.numel():
            metrics["rewards/chosen"] = float((s.beta * chosen_lr).sum()) / chosen.numel()
            metrics["logps/chosen"] = float(chosen.sum()) / chosen.numel()
        if rejected.numel():
            metrics["rewards/rejected"] = float((s.beta * rejected_lr).sum()) / rejected.numel()
            metrics["logps/rejected"] = float(rejected.sum()) / rejected.numel()
        if chosen.numel() and rejected.numel():
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return loss, metrics
