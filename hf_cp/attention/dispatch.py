"""One rank's micro-batch under a CP context: local documents and distributed documents.

Skrull-style mixing: the rank's local documents are computed with no communication; only
the distributed documents take part in the group's collectives (Ulysses or ring, per
ctx.mode). Every member enters the collective part whenever the group has distributed
documents, even a member whose shard of them is empty, so the members stay in step.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import torch

from ..modes import mode_attention, mode_spec
from ..shard import Segment, rank_segments
from .blocks import segment_blocks
from .context import CPContext
from .kernels import AttentionKernel, kernel_for
from .local import block_attention, packed_attention

Tensor = torch.Tensor


@lru_cache(maxsize=1024)
def group_segments(mode: str, doc_lengths: Tuple[int, ...], group_size: int) -> Tuple[Tuple[Segment, ...], ...]:
    """Every member's segments of the distributed documents, in member order."""
    return tuple(tuple(rank_segments(mode, doc_lengths, group_size, m)) for m in range(group_size))


def expected_tokens(ctx: CPContext) -> int:
    """Rows this rank's micro-batch must have under context.py's layout."""
    segs = (
        group_segments(mode_spec(ctx.mode).name, tuple(ctx.distributed_lengths), ctx.group_size)
        if ctx.distributed_lengths
        else ((),) * ctx.group_size
    )
    return ctx.local_tokens + sum(s.length for s in segs[ctx.member])


def cp_attention(
    q: Tensor, k: Tensor, v: Tensor, ctx: CPContext, scale: float, kernel: Optional[AttentionKernel] = None
) -> Tensor:
    """Attention of one rank's packed rows (q [T, H, D], k/v [T, H_kv, D]) under `ctx`.

    Local documents run here with no communication; the distributed ones go to the shard mode's
    attention function (hf_cp/modes/: `ShardModeSpec.attention`), called as
    fn(q, k, v, ctx, segments of every member, scale, kernel) on the distributed rows."""
    mode = mode_spec(ctx.mode).name
    g, me = ctx.group_size, ctx.member
    if not 0 <= me < g:
        raise ValueError(f"CPContext.member {me} is outside the group of {g} ranks {ctx.group_ranks}")
    if g > 1 and ctx.group is None and ctx.distributed_lengths:
        raise ValueError(f"CPContext has {g} members and distributed documents but no process group")
    segs = group_segments(mode, tuple(ctx.distributed_lengths), g) if ctx.distributed_lengths else ()
    n_local = ctx.local_tokens
    n_dist = sum(s.length for s in segs[me]) if segs else 0
    if q.shape[0] != n_local + n_dist:
        raise ValueError(
            f"rank (member {me} of {g}, mode {mode}) got {q.shape[0]} tokens, but its CP context says "
            f"{n_local} local tokens (local_lengths {list(ctx.local_lengths)}) + {n_dist} tokens of its shards of "
            f"the distributed documents {list(ctx.distributed_lengths)}; see hf_cp/attention/context.py for the layout"
        )
    kernel = kernel or kernel_for(q.device)
    parts = []
    if n_local:
        parts.append(packed_attention(q[:n_local], k[:n_local], v[:n_local], ctx.local_lengths, scale, kernel))
    if segs:
        qd, kd, vd = q[n_local:], k[n_local:], v[n_local:]
        if g == 1:
            parts.append(block_attention(qd, kd, vd, segment_blocks(segs[0], segs[0]), scale, kernel))
        else:
            parts.append(mode_attention(mode)(qd, kd, vd, ctx, segs, scale, kernel))
    if not parts:  # no rows at all; still an autograd node, so backward runs as on every rank
        return block_attention(q, k, v, [], scale, kernel)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
