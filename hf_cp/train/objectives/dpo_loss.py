"""DPO losses as functions of each answer's summed log-prob and token count.

A preference pair's loss in TRL's DPOTrainer depends on the sequence only through four sums
(policy and reference log-probs of the chosen and the rejected answer) and, for the
length-normalised types, the answers' token counts. hf_cp places an answer's tokens anywhere in
a planned step, so it sums the per-token log-probs over ranks first (train/objectives/dpo.py) and then
computes the loss here, on whole-step vectors: the same formulas as TRL 1.16's
`DPOTrainer._compute_loss`, term by term, so the two agree to fp32 noise.

Loss types that need more than the sums (per-token WPO weights: `use_weighting`; LD-DPO's
split of an answer at the shorter one's length: `ld_alpha`) are refused by name
(`check_supported`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import torch
import torch.nn.functional as F

LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass(frozen=True)
class DPOSettings:
    """What the loss reads from a DPOConfig."""

    beta: float = 0.1
    loss_types: Tuple[str, ...] = ("sigmoid",)
    loss_weights: Tuple[float, ...] = (1.0,)
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 1.0
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05

    @classmethod
    def from_config(cls, args) -> DPOSettings:
        check_supported(args)
        types = tuple(args.loss_type) if not isinstance(args.loss_type, str) else (args.loss_type,)
        weights = tuple(float(w) for w in (args.loss_weights or [1.0] * len(types)))
        if len(weights) != len(types):
            raise ValueError(f"loss_weights has {len(weights)} entries but loss_type has {len(types)}: {list(types)}")
        return cls(
            beta=float(args.beta),
            loss_types=types,
            loss_weights=weights,
            f_divergence_type=str(getattr(args, "f_divergence_type", "reverse_kl")),
            f_alpha_divergence_coef=float(getattr(args, "f_alpha_divergence_coef", 1.0)),
            label_smoothing=float(getattr(args, "label_smoothing", 0.0)),
            discopop_tau=float(getattr(args, "discopop_tau", 0.05)),
        )


def check_supported(args) -> None:
    """Refuse, by name, DPOConfig settings the per-answer sums cannot honour."""
    types = [args.loss_type] if isinstance(args.loss_type, str) else list(args.loss_type)
    unknown = [t for t in types if t not in LOSS_TYPES]
    if unknown:
        raise ValueError(f"CPDPOTrainer: loss_type {unknown} is not supported; supported: {list(LOSS_TYPES)}")
    if str(getattr(args, "f_divergence_type", "reverse_kl")) not in F_DIVERGENCES:
        raise ValueError(
            f"CPDPOTrainer: f_divergence_type {args.f_divergence_type!r} is not one of {list(F_DIVERGENCES)}"
        )
    if getattr(args, "use_weighting", False):
        raise ValueError(
            "CPDPOTrainer: use_weighting=True (WPO) weights each pair by per-token probabilities of the whole "
            "vocabulary, which the per-answer log-prob sums do not carry; set use_weighting=False"
        )
    if getattr(args, "ld_alpha", None) is not None:
        raise ValueError(
            "CPDPOTrainer: ld_alpha (LD-DPO) splits each answer at the shorter answer's length, which the per-answer "
            "sums do not carry; set ld_alpha=None"
        )


def _scores(s: DPOSettings, logratios: torch.Tensor) -> torch.Tensor:
    """f'(policy/reference ratio) of TRL's f-divergence DPO (identity for reverse KL)."""
    kind = s.f_divergence_type
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    alpha = s.f_alpha_divergence_coef
    if abs(alpha - 1.0) < 1e-6:
        return logratios
    t = torch.clamp((alpha - 1.0) * logratios, max=80.0)
    return (torch.exp(t) - 1.0) / (alpha - 1.0)


def dpo_loss(
    s: DPOSettings,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The step's loss (mean over its pairs, weighted sum over loss types) and TRL's metrics.

    All arguments are [pairs] tensors: summed log-probs of each pair's answers under the policy
    (differentiable) and the reference, and the answers' token counts."""
    beta = s.beta
    chosen_lr, rejected_lr = chosen - ref_chosen, rejected - ref_rejected
    chosen_sc, rejected_sc = _scores(s, chosen_lr), _scores(s, rejected_lr)
    delta = chosen_sc - rejected_sc
    eps = s.label_smoothing
    loss = chosen.new_zeros(())
    for kind, weight in zip(s.loss_types, s.loss_weights):
        if kind == "sigmoid":
            per = -F.logsigmoid(beta * delta)
        elif kind == "hinge":
            per = torch.relu(1 - beta * delta)
        elif kind == "ipo":
            avg = chosen_sc / chosen_tokens.clamp(min=1.0) - rejected_sc / rejected_tokens.clamp(min=1.0)
            per = (avg - 1 / (2 * beta)) ** 2
        elif kind == "exo_pair":
            e = torch.tensor(eps, dtype=delta.dtype, device=delta.device)
            per = torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-e)) + torch.sigmoid(
                -beta * delta
            ) * (F.logsigmoid(-beta * delta) - torch.log(e))
        elif kind == "nca_pair":
            cr, rr = beta * chosen_lr, beta * rejected_lr
            per = -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rr)
        elif kind == "robust":
            per = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        elif kind == "bco_pair":
            per = -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
        elif kind == "sppo_hard":
            per = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
        elif kind in ("aot", "aot_unpaired"):
            if kind == "aot":
                d = torch.sort(chosen - rejected).values - torch.sort(ref_chosen - ref_rejected).values
            else:
                d = torch.sort(chosen_lr).values - torch.sort(rejected_lr).values
            per = -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps
        elif kind == "apo_zero":
            per = 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
        elif kind == "apo_down":
            per = torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
        elif kind == "discopop":
            logits = delta * beta
            mix = torch.sigmoid(logits / s.discopop_tau)
            per = -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
        elif kind == "sft":
            # TRL: minus the mean per-token log-prob over every chosen token of the batch
            per = (-chosen.sum() / chosen_tokens.sum().clamp(min=1.0)).expand(chosen.shape[0])
        elif kind == "sigmoid_norm":
            avg = chosen_sc / chosen_tokens.clamp(min=1.0) - rejected_sc / rejected_tokens.clamp(min=1.0)
            per = -F.logsigmoid(beta * avg)
        else:  # check_supported refuses it first
            raise ValueError(f"unknown DPO loss type {kind!r}")
        loss = loss + per.mean() * weight
    with torch.no_grad():
        cr, rr = beta * chosen_lr.detach(), beta * rejected_lr.detach()
        metrics = {
            "rewards/chosen": float(cr.mean()),
            "rewards/rejected": float(rr.mean()),
            "rewards/accuracies": float((cr > rr).float().mean()),
            "rewards/margins": float((cr - rr).mean()),
            "logps/chosen": float(chosen.detach().mean()),
            "logps/rejected": float(rejected.detach().mean()),
        }
    return loss, metrics


def pair_slots(answer_slots: Sequence[Tuple[int, int]]) -> Tuple[list, list, list]:
    """(sample ids, chosen slots, rejected slots) of a step of DPO samples (answer 0 chosen,
    answer 1 rejected). Every sample must have exactly these two answers."""
    per: Dict[int, list] = {}
    for k, (sid, a) in enumerate(answer_slots):
        per.setdefault(sid, []).append((a, k))
    samples, chosen, rejected = [], [], []
    for sid, answers in per.items():
        if [a for a, _ in answers] != [0, 1]:
            raise ValueError(
                f"sample {sid} has {len(answers)} answers; a DPO sample is one prompt with a chosen and a rejected "
                f"answer (shared-prompt mask with two answers)"
            )
        samples.append(sid)
        chosen.append(answers[0][1])
        rejected.append(answers[1][1])
    return samples, chosen, rejected
