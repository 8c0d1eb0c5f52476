"""MagiAttention: its dispatch solver (toolkit/magi_dispatch.py) lays out each distributed group
wherever the cost model prefers it to the ring geometries."""

from __future__ import annotations

from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.relayout import RelayoutBalancer


@register_balancer("magi", auto_member=True)
class MagiBalancer(RelayoutBalancer):
    """MagiAttention's dispatch as the in-group layout wherever the cost model prefers it to the
    ring geometries (base: `dynamic_cp`'s groups)."""

    name = "magi"
    families = ("ring", "magi")
