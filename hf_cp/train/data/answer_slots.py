"""Answer slots: a step's answers (a DPO pair's chosen and rejected, a group's completions), each
one slot of the step (RankStep.answer_slots); a micro-batch's targets carry their slot."""

from __future__ import annotations

import torch

from hf_cp.train.data.collator import MicroBatch


def answer_sums(mb: MicroBatch, own: torch.Tensor, extra: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Per-token values of a micro-batch (own [T], extra [k]) summed into the step's answer
    slots [num_slots]; rows without an answer (slot -1) are left out. Differentiable."""
    slots = mb.target_slots[0].to(own.device)
    keep = slots >= 0
    out = own.new_zeros(num_slots).index_add(0, slots[keep], own[keep])
    if extra.numel():
        xs = mb.extra_slots.to(own.device)
        keep = xs >= 0
        out = out.index_add(0, xs[keep], extra[keep])
    return out
