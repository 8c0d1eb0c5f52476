"""Ulysses x ring (USP): each distributed group takes the u x r factorisation the cost model
predicts fastest (toolkit/usp_layout.py)."""

from __future__ import annotations

from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.relayout import RelayoutBalancer


@register_balancer("usp", auto_member=True)
class UspBalancer(RelayoutBalancer):
    """Every group takes the (u, r) Ulysses x ring factorisation (or ring, or Ulysses) the cost
    model predicts fastest (base: `dynamic_cp`'s groups)."""

    name = "usp"
    families = ("ring", "ulysses", "usp")
