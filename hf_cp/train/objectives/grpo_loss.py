"""GRPO losses token by token, with the normalisation of TRL 1.16 written as one weight per row.

TRL's `GRPOTrainer._compute_loss` computes, on each process p, a per-token loss l over its
padded rows and reduces it with the loss type's normaliser; data-parallel training then averages
the processes' gradients. Every supported type is linear in the per-token losses, so the step's
loss is sum over rows r and their loss tokens t of w_r * l_rt, with (B rows in the generation
batch, P processes, B_p = B / P rows each, n_r the loss tokens of row r, N their sum):

    grpo, sapo      w_r = 1 / (B * max(n_r, 1))          a mean over rows of per-row means
    luspo           w_r = 1 / B                           a mean over rows of per-row sums
    dr_grpo         w_r = 1 / (B * max_completion_length)
    dapo, cispo     w_r = 1 / max(N, 1)                   every loss token of the batch alike
    bnpo            w_r = 1 / (P * max(M_p(r), 1))        M_p: the loss tokens of row r's process

bnpo normalises by the loss tokens of the process that held the row, so its number depends on
the world size; hf_cp reproduces it from each row's original process. Each weight is known
before any forward pass (from the completion masks), so one planned forward and backward per
step computes the exact loss wherever a row's tokens were placed (train/objectives/grpo.py).

The per-token loss itself (`token_losses`) is TRL's: the importance ratio exp(logp - old) with
its clipping (epsilon, epsilon_high, delta), CISPO's clamped detached ratio, SAPO's soft gate,
and beta times the k3 estimator of the KL to the reference (optionally importance-corrected).
Settings that need more than a token's own numbers (a sequence-level ratio, an entropy
quantile over the batch, the off-policy sequence mask, VESPO's sequence weights, the entropy
bonus) are refused by name (`check_supported`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np
import torch

CLIP_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL's clipped surrogate
LOSS_TYPES = CLIP_TYPES + ("cispo", "sapo")
REFUSED_TYPES = {
    "vespo": "its gamma weights are a function of each completion's whole-sequence importance ratio, known only "
    "after every token of the completion has been scored wherever it was placed",
}


@dataclass(frozen=True)
class GRPOSettings:
    """What the loss reads from a GRPOConfig."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: Optional[float] = None
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    max_completion_length: Optional[int] = None

    @classmethod
    def from_config(cls, args) -> GRPOSettings:
        check_supported(args)
        eps = float(args.epsilon)
        return cls(
            loss_type=str(args.loss_type),
            beta=float(args.beta),
            epsilon_low=eps,
            epsilon_high=float(args.epsilon_high) if args.epsilon_high is not None else eps,
            delta=None if args.delta is None else float(args.delta),
            use_bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", False)),
            sapo_temperature_pos=float(getattr(args, "sapo_temperature_pos", 1.0)),
            sapo_temperature_neg=float(getattr(args, "sapo_temperature_neg", 1.05)),
            max_completion_length=args.max_completion_length,
        )


def check_supported(args) -> None:
    """Refuse, by name, GRPOConfig settings whose loss is not a sum of per-token terms known
    from each token's own log-prob (train/objectives/grpo.py explains what a planned step can compute)."""
    who = "CPGRPOTrainer"
    kind = str(args.loss_type)
    if kind in REFUSED_TYPES:
        raise ValueError(
            f"{who}: loss_type={kind!r} is not supported: {REFUSED_TYPES[kind]}; supported: {list(LOSS_TYPES)}"
        )
    if kind not in LOSS_TYPES:
        raise ValueError(f"{who}: loss_type={kind!r} is unknown; supported: {list(LOSS_TYPES)}")
    if args.importance_sampling_level != "token":
        raise ValueError(
            f"{who}: importance_sampling_level={args.importance_sampling_level!r} makes each token's ratio the mean "
            "log-ratio of its whole completion, known only after every token of the completion has run wherever the "
            "plan placed it; set importance_sampling_level='token'"
        )
    if args.top_entropy_quantile < 1.0:
        raise ValueError(
            f"{who}: top_entropy_quantile={args.top_entropy_quantile} trains only tokens above an entropy quantile "
            "of the whole batch, which needs every token's entropy before the loss; set top_entropy_quantile=1.0"
        )
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        raise ValueError(
            f"{who}: the entropy bonus (entropy_coef={args.entropy_coef}, use_adaptive_entropy="
            f"{args.use_adaptive_entropy}) needs the gradient of every token's entropy over the vocabulary, which "
            "hf_cp's chunked LM head does not compute; set entropy_coef=0.0 and use_adaptive_entropy=False"
        )
    if args.off_policy_mask_threshold is not None:
        raise ValueError(
            f"{who}: off_policy_mask_threshold={args.off_policy_mask_threshold} drops whole completions by their mean "
            "KL under the current policy, known only after every token of the completion has run; set it to None"
        )
    if kind == "dr_grpo" and not args.max_completion_length:
        raise ValueError(f"{who}: loss_type='dr_grpo' normalises by max_completion_length, which is not set")


def row_weights(s: GRPOSettings, counts: Sequence[float], processes: Sequence[int], world: int) -> np.ndarray:
    """w_r of every row of a generation batch (module docstring), float64.

    `counts`: each row's loss tokens (its completion mask, times the tool mask if any);
    `processes`: the process that held each row in TRL's layout (rows are split contiguously);
    `world`: the number of processes."""
    n = np.asarray(counts, dtype=np.float64)
    rows = len(n)
    if rows == 0:
        return n
    kind = s.loss_type
    if kind in ("grpo", "sapo"):
        return 1.0 / (rows * np.maximum(n, 1.0))
    if kind == "luspo":
        return np.full(rows, 1.0 / rows)
    if kind == "dr_grpo":
        return np.full(rows, 1.0 / (rows * float(s.max_completion_length)))
    if kind in ("dapo", "cispo"):
        return np.full(rows, 1.0 / max(float(n.sum()), 1.0))
    if kind == "bnpo":
        proc = np.asarray(processes, dtype=np.int64)
        per_process = np.bincount(proc, weights=n, minlength=world)
        return 1.0 / (world * np.maximum(per_process[proc], 1.0))
    raise ValueError(f"unknown GRPO loss type {kind!r}")


def token_losses(
    s: GRPOSettings,
    logps: torch.Tensor,
    advantages: torch.Tensor,
    old: Optional[torch.Tensor] = None,
    ref: Optional[torch.Tensor] = None,
) -> Dict[str, torch.Tensor]:
    """TRL's per-token GRPO loss for tokens with log-probs `logps` (differentiable), their rows'
    advantages, the log-probs at generation (`old`; None: the current ones, detached, as TRL
    when the step is on-policy) and the reference's (`ref`, needed when beta != 0). All [k].

    Returns {"loss"} and, detached, the per-token statistics TRL logs: "low", "high",
    "region" (clipped tokens), "cispo" (CISPO-clipped tokens) and "kl"."""
    old = logps.detach() if old is None else old
    coef_1 = torch.exp(logps - old)
    out: Dict[str, torch.Tensor] = {}
    if s.beta != 0.0:
        if ref is None:
            raise ValueError("beta != 0 needs the reference log-probs")
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if s.use_bias_correction_kl:
            kl = kl * coef_1
        out["kl"] = kl.detach()
    if s.loss_type == "cispo":
        clamped = torch.clamp(coef_1, max=s.epsilon_high).detach()
        loss = -clamped * advantages * logps
        out["cispo"] = ((coef_1 > s.epsilon_high) & (advantages > 0)).float().detach()
    elif s.loss_type in CLIP_TYPES:
        coef_2 = torch.clamp(coef_1, 1 - s.epsilon_low, 1 + s.epsilon_high)
        if s.delta is not None:
            coef_1 = torch.clamp(coef_1, max=s.delta)
        loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        low = (coef_1 < 1 - s.epsilon_low) & (advantages < 0)
        high = (coef_1 > 1 + s.epsilon_high) & (advantages > 0)
        out["low"], out["high"], out["region"] = low.float(), high.float(), (low | high).float()
    elif s.loss_type == "sapo":
        temperatures = torch.where(
            advantages > 0,
            torch.as_tensor(s.sapo_temperature_pos, dtype=logps.dtype, device=logps.device),
            torch.as_tensor(s.sapo_temperature_neg, dtype=logps.dtype, device=logps.device),
        )
        loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    else:  # check_supported refuses it first
        raise ValueError(f"unknown GRPO loss type {s.loss_type!r}")
    if s.beta != 0.0:
        loss = loss + s.beta * kl
    out["loss"] = loss
    return out
