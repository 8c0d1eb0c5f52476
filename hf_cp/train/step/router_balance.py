"""The MoE router's load-balancing loss over the whole step, as one process computes it.

transformers' MoE families add `router_aux_loss_coef x load_balancing_loss_func(router logits)`
to the loss (Switch Transformer's term). Over R router rows (every token of the batch, at every
MoE layer) with C_e the number of top-k selections of expert e and S_e the sum of its routing
probabilities,

    aux = E * sum_e (C_e / R) * (S_e / R).

It couples every token of the batch: a rank holding a shard of the step, one wave at a time,
cannot compute it from its own tokens. The counts carry no gradient, so the term is linear in
the probability sums given the step's counts: a forward pass without gradient over every wave
(`RouterCensus`, one all-reduce) gives C and R of the whole step; then each wave's training
pass adds `coef * E * sum_e C_e * S_e(wave) / R^2`, whose sum over waves and ranks is the term
and whose gradient is the term's. The census costs one more forward of the step (no LM head).

A family is honoured when its own `load_balancing_loss_func` equals this formula on random
router logits (checked when the trainer is built); otherwise, and for the router z-loss and
router jitter noise (random: the census would route otherwise than the training pass), the
trainer is refused by name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hf_cp.train.checks.setup import SetupError

FORMULA_RTOL = 1e-5  # the family's function against ours on random logits (fp32)


@dataclass(frozen=True)
class RouterBalance:
    """The router term of a model: its weight, the number of experts and the top-k routed to."""

    coef: float
    num_experts: int
    top_k: int
    family: str


def router_tallies(
    router_logits: Sequence[torch.Tensor], balance: RouterBalance, rows: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(C [E] float64 selections, S [E] float32 probability sums (differentiable), R rows) of the
    router logits of a forward, every layer's first `rows` rows (None: all; the rest is padding)."""
    e = balance.num_experts
    device = router_logits[0].device
    counts = torch.zeros(e, dtype=torch.float64, device=device)
    sums = torch.zeros(e, dtype=torch.float32, device=device)
    total = 0
    for logits in router_logits:
        logits = logits if rows is None else logits[:rows]
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, balance.top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.bincount(chosen, minlength=e).to(torch.float64)
        sums = sums + probs.float().sum(dim=0)
        total += int(logits.shape[0])
    return counts, sums, total


@dataclass
class RouterCensus:
    """The step's router selections over every rank and wave (the same on every rank), and the
    ones this rank's waves made (checked against the training pass's)."""

    counts: torch.Tensor  # [E] float64
    rows: float
    value: float  # the step's router term, coef x aux, from the census's probability sums
    wave_counts: dict  # wave -> this rank's [E] selections in it

    def share(self, balance: RouterBalance, sums: torch.Tensor) -> torch.Tensor:
        """A wave's part of the step's term: coef * E * sum_e C_e S_e(wave) / R^2."""
        if not self.rows:
            return sums.sum() * 0.0
        weights = (self.counts * (balance.coef * balance.num_experts / self.rows**2)).to(sums.dtype)
        return (weights * sums).sum()


def census_of(
    balance: RouterBalance, per_wave: dict, world: int, group=None, device: Optional[torch.device] = None
) -> RouterCensus:
    """The step's census from this rank's tallies per wave ({wave: (C, S, R)}): one all-reduce."""
    e = balance.num_experts
    packed = torch.zeros(2 * e + 1, dtype=torch.float64, device=device)
    for counts, sums, rows in per_wave.values():
        packed[:e] += counts.to(packed.device)
        packed[e : 2 * e] += sums.detach().to(packed.device, torch.float64)
        packed[2 * e] += rows
    if world > 1:
        dist.all_reduce(packed, group=group)
    counts, sums, rows = packed[:e], packed[e : 2 * e], float(packed[2 * e])
    value = balance.coef * balance.num_experts * float((counts * sums).sum()) / rows**2 if rows else 0.0
    return RouterCensus(counts, rows, value, {w: c.detach() for w, (c, _, _) in per_wave.items()})


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    top = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    return getattr(top, "module", top)  # DDP


def router_balance_of(model: torch.nn.Module) -> Optional[RouterBalance]:
    """The model's router term when it is on (output_router_logits and a non-zero
    router_aux_loss_coef), None when off; SetupError naming the family and the setting when hf_cp
    cannot compute it exactly."""
    lm = _causal_lm(model)
    config = getattr(lm, "config", None)
    family = getattr(config, "model_type", type(lm).__name__)
    coef = float(getattr(lm, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", 0.0)) or 0.0)
    if not getattr(config, "output_router_logits", False) or coef == 0.0:
        return None
    for name in ("router_z_loss_coef", "z_loss_coefficient"):
        if float(getattr(config, name, 0.0) or 0.0):
            raise SetupError(
                f"{family}: the router z-loss ({name}={getattr(config, name):g}) is not computed by hf_cp over the "
                f"step; set {name}=0 (the load-balancing term, router_aux_loss_coef, is honoured)"
            )
    jitter = float(getattr(config, "router_jitter_noise", 0.0) or 0.0)
    if jitter:
        raise SetupError(
            f"{family}: router_jitter_noise={jitter:g} routes each forward at random, so the step's expert counts "
            "(a pass before training) would differ from the training pass's; set router_jitter_noise=0 to train "
            "with the router's auxiliary loss"
        )
    experts = getattr(lm, "num_experts", None) or getattr(config, "num_experts", None)
    experts = experts or getattr(config, "num_local_experts", None)
    top_k = getattr(lm, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        raise SetupError(
            f"{family}: output_router_logits=True with router_aux_loss_coef={coef:g}, but hf_cp finds no "
            "num_experts / num_experts_per_tok on the model to compute the term; set output_router_logits=False"
        )
    balance = RouterBalance(coef, int(experts), int(top_k), family)
    reason = formula_mismatch(lm, balance)
    if reason:
        raise SetupError(
            f"{family}: the MoE router's auxiliary loss is on (output_router_logits=True, router_aux_loss_coef="
            f"{coef:g}), and {reason}; set output_router_logits=False (the router then trains on the "
            "language-model loss alone)"
        )
    return balance


def formula_mismatch(lm: torch.nn.Module, balance: RouterBalance) -> Optional[str]:
    """Why the family's own load_balancing_loss_func is not the term hf_cp computes (None: it is)."""
    module = sys.modules.get(type(lm).__module__)
    func = getattr(module, "load_balancing_loss_func", None)
    if func is None:
        return f"{type(lm).__module__} has no load_balancing_loss_func whose term hf_cp could check"
    gen = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(7 + layer, balance.num_experts, generator=gen) for layer in range(3))
    try:
        theirs = float(func(logits, balance.num_experts, balance.top_k, None))
    except Exception as e:  # a signature of another shape: not the term checked here
        return f"its load_balancing_loss_func does not take (router logits, experts, top_k): {e}"
    census = census_of(balance, {0: router_tallies(logits, balance)}, world=1)
    ours = census.value / balance.coef
    if abs(ours - theirs) > FORMULA_RTOL * max(abs(theirs), 1e-12):
        return (
            f"its load_balancing_loss_func is not Switch Transformer's term hf_cp computes ({theirs:.6g} vs {ours:.6g})"
        )
    return None
