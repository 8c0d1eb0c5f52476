"""Where CP attention puts a group's documents (context.py's layout) and what it sends, for the
tests that compare CP attention and CP models with a single-process reference."""

from __future__ import annotations

import torch

from hf_cp.modes.registry import rank_segments
from hf_cp.modes.ring import ring_bytes_per_layer
from hf_cp.modes.segments import ShardMode
from hf_cp.modes.ulysses import ulysses_bytes_per_layer


# ----------------------------------------------------------------------------- layout helpers
def group_documents(distributed, locals_per_member):
    """The group's documents as one reference sequence: distributed ones, then each member's locals."""
    return list(distributed) + [n for member in locals_per_member for n in member]


def member_rows(mode, distributed, locals_per_member, member):
    """Rows of the reference sequence that `member` holds, in context.py's layout order:
    its local documents whole, then its shard segments of the distributed documents."""
    lengths = group_documents(distributed, locals_per_member)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    rows = []
    first_local = len(distributed) + sum(len(m) for m in locals_per_member[:member])
    for i in range(len(locals_per_member[member])):
        d = first_local + i
        rows.extend(range(starts[d], starts[d + 1]))
    if distributed:
        for s in rank_segments(mode, distributed, len(locals_per_member), member):
            rows.extend(range(starts[s.doc] + s.start, starts[s.doc] + s.start + s.length))
    return torch.tensor(rows, dtype=torch.long)


def expected_bytes(cost, mode, distributed, group_size, member):
    """Bytes `member` sends per layer in `mode` (the cost model's formula)."""
    if not distributed or group_size == 1:
        return 0
    total = sum(distributed)
    tokens = [sum(s.length for s in rank_segments(mode, distributed, group_size, m)) for m in range(group_size)]
    if mode == ShardMode.ULYSSES:
        return ulysses_bytes_per_layer(cost, tokens[member], total, group_size)
    return ring_bytes_per_layer(cost, tokens[(member + 1) % group_size], total, group_size)
