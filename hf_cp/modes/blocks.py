"""The block engine's mode: a placement of chunks and compute blocks (hf_cp/block_layout.py).

Geometry: each member owns the chunks the group's layout gives it (any permutation, any
sizes), so segments come from the layout (`params`), not from the lengths alone. Cost: every
compute block is charged at its executor by its masked area, and the exchange is what the
placement moves (hf_cp/cost.blocks.py prices a whole group at once: the simulator calls it for
this mode). Exchange: all-to-all-v of K/V (and Q, partial O with LSE for blocks executed away
from their query's owner). Execution: hf_cp.attention.engine.
"""

from __future__ import annotations

from typing import Mapping, Optional

from hf_cp.modes.registry import ShardModeSpec, register_mode


def _layout(params, what: str):
    # the layout is plan data (plan/block_layout.py, a layer above this one): it is passed in
    # as an object, never built here
    if params is None or not hasattr(params, "member_segments"):
        raise ValueError(
            f"shard mode 'blocks' places chunks explicitly: {what} come from the group's block layout "
            "(plan.Group.member_segments / plan.block_layout.BlockLayout), not from the lengths alone"
            + ("" if params is None else f"; got {type(params).__name__}, not a BlockLayout")
        )
    return params


class Blocks(ShardModeSpec):
    name = "blocks"
    description = "placed chunks with owners and compute blocks with executors; K/V by all-to-all-v"
    attention = "hf_cp.attention.engine:engine_mode_attention"
    priced_per_group = True  # cost.blocks.block_group_costs prices the whole group
    carries_layout = True  # the group's BlockLayout places its chunks and compute blocks

    def segments(self, doc_lengths, group_size, member, params: Optional[Mapping] = None):
        return _layout(params, "a member's segments").member_segments(member)

    def member_tokens(self, doc_lengths, group_size, params=None):
        layout = _layout(params, "a member's tokens")
        return [layout.member_tokens(m) for m in range(group_size)]


BLOCKS = register_mode(Blocks())
