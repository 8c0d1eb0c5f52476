"""GRPO's planned step as the executor sees it: the per-row tables one step looks up (advantages,
TRL's old and reference log-probs, each row's normaliser) and the objective of a micro-batch
over them (TRL's per-token loss, grpo_loss.token_losses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from hf_cp.planning.worker import PlannedStep
from hf_cp.train.data.collator import MicroBatch, RankStep
from hf_cp.train.objectives.grpo_loss import GRPOSettings, token_losses


@dataclass
class StepTables:
    """One planned step and, on this rank's device, what the objective looks up per target."""

    step: RankStep
    planned: Optional[PlannedStep]
    slot_row: torch.Tensor  # [slots] answer slot -> row of the rollout
    slot_prompt: torch.Tensor  # [slots] prompt length of the slot's group
    weight: torch.Tensor  # [rows] the row's normaliser (grpo_loss.row_weights)
    advantages: torch.Tensor  # [rows, C]
    old: Optional[torch.Tensor]  # [rows, C]
    ref: Optional[torch.Tensor]  # [rows, C]
    groups: List[int]  # sample id -> group of the generation batch
    skipped: List[int]  # groups not run (no row that can move the policy)
    sums: Dict[str, torch.Tensor] = field(default_factory=dict)  # per-row sums of logged statistics
    loss: float = 0.0


def step_targets(mb: MicroBatch, own: torch.Tensor, extra: torch.Tensor, t: StepTables):
    """(row, token index in its completion, log-prob) of every target of the micro-batch: an
    ordinary target at rotary position p of a group with prompt length P is completion token
    p - P + 1; an extra target (the prompt's last token predicting another completion's
    first token) is token 0."""
    dev = own.device
    slots = mb.target_slots[0].to(dev)
    keep = slots >= 0
    s = slots[keep]
    rows = t.slot_row[s]
    tok = mb.position_ids[0].to(dev)[keep] - t.slot_prompt[s] + 1
    logp = own[keep]
    if extra.numel():
        xs = mb.extra_slots.to(dev)
        xk = xs >= 0
        rows = torch.cat([rows, t.slot_row[xs[xk]]])
        tok = torch.cat([tok, torch.zeros_like(xs[xk])])
        logp = torch.cat([logp, extra[xk]])
    return rows, tok, logp


def step_objective(s: GRPOSettings, t: StepTables) -> Callable[[MicroBatch, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The executor's objective of one micro-batch: TRL's loss of each target token, weighted by
    its row's normaliser; the logged statistics summed per row into `t.sums`."""

    def objective(mb, own, extra):
        rows, tok, logp = step_targets(mb, own, extra, t)
        adv = t.advantages[rows, tok if t.advantages.shape[1] > 1 else 0]
        old = None if t.old is None else t.old[rows, tok]
        ref = None if t.ref is None else t.ref[rows, tok]
        got = token_losses(s, logp, adv.to(logp.dtype), old, ref)
        value = (got.pop("loss") * t.weight[rows].to(logp.dtype)).sum()
        for key, v in got.items():
            acc = t.sums.setdefault(key, torch.zeros(len(t.weight), dtype=torch.float64, device=v.device))
            acc.index_add_(0, rows, v.double())
        t.loss += float(value.detach())
        return value

    return objective
