"""What a plan's distributed groups move, beside what ring zigzag of the same samples would move
(`hf-cp plan` prints both). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import group_costs
from hf_cp.modes.registry import mode_spec
from hf_cp.modes.ring import ring_bytes_per_layer, split_member_tokens
from hf_cp.plan.block_layout import ring_kv_transfers


@dataclass(frozen=True)
class GroupExchange:
    """Bytes one group's micro-batch moves in a step (all layers, all members, fwd+bwd), beside
    what ring zigzag of the same distributed samples would move."""

    wave: int
    ranks: Tuple[int, ...]
    mode: str
    bytes: int
    ring_zigzag_bytes: int
    kv_transfers: Optional[int] = None  # blocks mode: K/V chunk sends per layer and forward pass
    ring_kv_transfers: Optional[int] = None  # the same chunks sent round a ring (g-1 hops each)


def ring_zigzag_group_bytes(doc_lengths: Sequence[int], ranks: Sequence[int], cost: CostModel) -> int:
    g = len(ranks)
    if g == 1 or not doc_lengths:
        return 0
    total = sum(doc_lengths)
    tokens = split_member_tokens(total, g)  # ring zigzag's members (modes/ring.py)
    return cost.dims.num_layers * sum(ring_bytes_per_layer(cost, tokens[(m + 1) % g], total, g) for m in range(g))


def plan_exchange(plan, cost: CostModel) -> List[GroupExchange]:
    """Per group with distributed samples: the bytes its mode moves and ring zigzag's bytes for
    the same samples on the same group (for `hf-cp plan` to print)."""
    lens = plan.length_of()
    out = []
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            if not g.distributed or g.size == 1:
                continue
            dist = [lens[s] for s in g.distributed]
            moved = sum(c.comm_bytes for c in group_costs(lens, g, cost, plan.masks))
            kvt = rkvt = None
            if mode_spec(g.mode).carries_layout:
                kvt = g.blocks.kv_transfers()
                rkvt = ring_kv_transfers(g.blocks, g.size)
            out.append(
                GroupExchange(w, tuple(g.ranks), g.mode, moved, ring_zigzag_group_bytes(dist, g.ranks, cost), kvt, rkvt)
            )
    return out
