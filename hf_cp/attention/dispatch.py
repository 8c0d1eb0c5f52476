"""One rank's micro-batch under a CP context: local documents and distributed documents.

Skrull-style mixing: the rank's local documents are computed with no communication; only
the distributed documents take part in the group's collectives, through the attention function
of ctx.mode's registry entry (hf_cp/modes/), called as
fn(q, k, v, ctx, segments of every member, per-document slices or None, scale, kernel, sinks). Every member enters the collective part whenever the group has
distributed documents, even a member whose shard of them is empty, so the members stay in
step. Every mode honours each document's mask and the layer's sliding window (a layer
window is intersected with the sample's mask in rotary positions: masks.window_slices), and
attention sinks.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence, Tuple

import torch

from hf_cp.attention.blocks import Slices
from hf_cp.attention.context import CPContext
from hf_cp.attention.kernels import AttentionKernel, kernel_for
from hf_cp.attention.local import block_attention, packed_attention
from hf_cp.modes.registry import mode_attention, mode_spec, rank_segments
from hf_cp.modes.segments import Segment
from hf_cp.samples.masks import SampleMask, window_slices

Tensor = torch.Tensor


@lru_cache(maxsize=1024)
def group_segments(mode: str, doc_lengths: Tuple[int, ...], group_size: int) -> Tuple[Tuple[Segment, ...], ...]:
    """Every member's segments of the distributed documents, in member order."""
    return tuple(tuple(rank_segments(mode, doc_lengths, group_size, m)) for m in range(group_size))


def _group_segments(ctx: CPContext) -> Tuple[Tuple[Segment, ...], ...]:
    if not ctx.distributed_lengths:
        return ()
    if ctx.blocks is not None:  # a placement: segments from the layout, not from the lengths alone
        return tuple(tuple(ctx.segments(m)) for m in range(ctx.group_size))
    return group_segments(mode_spec(ctx.mode).name, tuple(ctx.distributed_lengths), ctx.group_size)


def expected_tokens(ctx: CPContext) -> int:
    """Rows this rank's micro-batch must have under context.py's layout."""
    segs = _group_segments(ctx)
    return ctx.local_tokens + (sum(s.length for s in segs[ctx.member]) if segs else 0)


@lru_cache(maxsize=4096)
def _layer_slices(length: int, mask: Optional[SampleMask], window: Optional[int]) -> Optional[Slices]:
    if mask is None and (window is None or window >= length):
        return None  # causal: the kernels' fast path
    return tuple(window_slices(mask if mask is not None else SampleMask.causal(length), window))


def layer_slices(
    lengths: Sequence[int], masks: Sequence[Optional[SampleMask]], window: Optional[int]
) -> Optional[Tuple[Optional[Slices], ...]]:
    """Each document's mask under a layer's sliding window (None entries: causal); None when
    every document is plainly causal."""
    out = tuple(_layer_slices(n, masks[d] if d < len(masks) else None, window) for d, n in enumerate(lengths))
    return None if all(s is None for s in out) else out


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ctx: CPContext,
    scale: float,
    kernel: Optional[AttentionKernel] = None,
    window: Optional[int] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Attention of one rank's packed rows (q [T, H, D], k/v [T, H_kv, D]) under `ctx`;
    `window`: the layer's sliding window (keys within `window` positions, itself included);
    `sinks` [H]: the layer's attention sinks (one extra logit per head)."""
    mode = mode_spec(ctx.mode).name
    g, me = ctx.group_size, ctx.member
    if not 0 <= me < g:
        raise ValueError(f"CPContext.member {me} is outside the group of {g} ranks {ctx.group_ranks}")
    if g > 1 and ctx.group is None and ctx.distributed_lengths:
        raise ValueError(f"CPContext has {g} members and distributed documents but no process group")
    for what, masks, lengths in (
        ("distributed", ctx.masks, ctx.distributed_lengths),
        ("local", ctx.local_masks, ctx.local_lengths),
    ):
        if len(masks) > len(lengths):
            raise ValueError(f"CPContext has {len(masks)} {what} masks for {len(lengths)} {what} documents")
        for d, m in enumerate(masks):
            if m is not None and m.length != lengths[d]:
                raise ValueError(
                    f"CPContext: the mask of {what} document {d} covers {m.length} tokens, the document has {lengths[d]}"
                )
    segs = _group_segments(ctx)
    n_local = ctx.local_tokens
    n_dist = sum(s.length for s in segs[me]) if segs else 0
    if q.shape[0] != n_local + n_dist:
        raise ValueError(
            f"rank (member {me} of {g}, mode {mode}) got {q.shape[0]} tokens, but its CP context says "
            f"{n_local} local tokens (local_lengths {list(ctx.local_lengths)}) + {n_dist} tokens of its shards of "
            f"the distributed documents {list(ctx.distributed_lengths)}; see hf_cp/attention/context.py for the layout"
        )
    kernel = kernel or kernel_for(q.device, dtype=q.dtype)
    parts = []
    if n_local:
        local_slices = layer_slices(ctx.local_lengths, ctx.local_masks, window)
        parts.append(
            packed_attention(
                q[:n_local], k[:n_local], v[:n_local], ctx.local_lengths, scale, kernel, local_slices, sinks
            )
        )
    if segs:
        qd, kd, vd = q[n_local:], k[n_local:], v[n_local:]
        lengths = tuple(ctx.distributed_lengths)
        slices = layer_slices(lengths, ctx.masks, window)
        # the shard mode's attention (hf_cp/modes/: ShardModeSpec.attention), one signature for all
        parts.append(mode_attention(mode)(qd, kd, vd, ctx, segs, slices, scale, kernel, sinks))
    if not parts:  # no rows at all; still an autograd node, so backward runs as on every rank
        return block_attention(q, k, v, [], scale, kernel, sinks)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
