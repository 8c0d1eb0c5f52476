"""Ring attention over a CP group, exact on packed documents, for both ring layouts.

Each member holds query/key/value rows of its shard segments (context.py's layout, the
distributed part only). K/V blocks travel around the ring: at step s a member holds the K/V
of member (me - s) mod g. Which of its query rows attend to which of those key rows, and how
(full or causal), follows from the two members' registry.rank_segments alone (blocks.py), so
the same code serves RING_ZIGZAG (whole packed sequence in 2g chunks) and RING_PER_DOC (each
document in 2g parts) and needs no padding. Partial results merge by log-sum-exp.

Backward passes K/V around again; the dK/dV accumulator of a block travels with it, every
member adds its share, and one last hop brings it home. Bytes per rank and layer:
forward (total - next) K/V tokens, backward the same again plus total dK/dV tokens, which is
hf_cp.modes.ring.ring_bytes_per_layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from hf_cp.attention.blocks import Slices, segment_blocks
from hf_cp.attention.comm import ring_exchange
from hf_cp.attention.kernels import AttentionKernel, kernel_for
from hf_cp.attention.local import BlockPlan, apply_sinks, block_attention, merge_lse, sinks_grad
from hf_cp.modes.segments import Segment

Tensor = torch.Tensor

_TAG_KV, _TAG_DKV = 11, 12


@dataclass(frozen=True)
class RingSpec:
    group: object
    group_ranks: Tuple[int, ...]
    member: int
    segments: Tuple[Tuple[Segment, ...], ...]  # every member's segments, in member order
    slices: Optional[Tuple[Optional[Slices], ...]] = None  # per document: its mask under this layer (None: causal)

    @property
    def size(self) -> int:
        return len(self.group_ranks)

    def tokens(self, member: int) -> int:
        return sum(s.length for s in self.segments[member])

    def source(self, step: int) -> int:
        """The member whose K/V this member holds at ring step `step`."""
        return (self.member - step) % self.size

    def plan(self, step: int, device) -> BlockPlan:
        blocks = segment_blocks(self.segments[self.member], self.segments[self.source(step)], self.slices)
        return BlockPlan(blocks, self.tokens(self.member), device)

    @property
    def next_rank(self) -> int:
        return self.group_ranks[(self.member + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.group_ranks[(self.member - 1) % self.size]


def _pass_on(spec: RingSpec, step: int, buf: Tensor, tag: int) -> Tuple[Tensor, object]:
    """Send `buf` (belonging to the member held at `step`) to the next member and receive the
    one held at step + 1 from the previous member."""
    incoming = (spec.member - step - 1) % spec.size
    recv = buf.new_empty((buf.shape[0], spec.tokens(incoming)) + tuple(buf.shape[2:]))
    pending = ring_exchange(buf, spec.next_rank, recv, spec.prev_rank, spec.group, tag)
    return recv, pending


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, spec: RingSpec, kernel: AttentionKernel, scale: float):
        g = spec.size
        kv = torch.stack([k, v]).contiguous()
        plans = [spec.plan(s, q.device) for s in range(g)]
        out = lse = None
        for s in range(g):
            recv = pending = None
            if s < g - 1:
                recv, pending = _pass_on(spec, s, kv, _TAG_KV)  # overlaps with this step's compute
            if plans[s]:
                o, l = plans[s].forward(kernel, q, kv[0], kv[1], scale)
                out, lse = merge_lse(out, lse, o, l)
            if pending is not None:
                pending.wait()
                kv = recv
        if out is None:  # a member with no rows
            out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32)
            lse = q.new_full((q.shape[0], q.shape[1]), -float("inf"), dtype=torch.float32)
        out, lse = apply_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.spec, ctx.kernel, ctx.scale, ctx.plans = spec, kernel, scale, plans
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        spec, kernel, scale, plans = ctx.spec, ctx.kernel, ctx.scale, ctx.plans
        g = spec.size
        dout = dout.contiguous()
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv_recv = dkv_pending = None
        for s in range(g):
            recv = pending = None
            if s < g - 1:
                recv, pending = _pass_on(spec, s, kv, _TAG_KV)
            contrib = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            if plans[s]:
                dq_s, dk_s, dv_s = plans[s].backward(kernel, dout, q, kv[0], kv[1], out, lse, scale)
                dq += dq_s
                contrib[0] += dk_s
                contrib[1] += dv_s
            if dkv_pending is not None:  # the accumulator of this step's block, from upstream
                dkv_pending.wait()
                contrib += dkv_recv.float()
            # hand the accumulator downstream; after g hops it is back with the block's owner
            dkv_recv, dkv_pending = _pass_on(spec, s, contrib.to(kv.dtype), _TAG_DKV)
            if pending is not None:
                pending.wait()
                kv = recv
        dkv_pending.wait()
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq.to(q.dtype), dkv_recv[0].to(k.dtype), dkv_recv[1].to(v.dtype), dsinks, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: RingSpec,
    scale: float,
    kernel: Optional[AttentionKernel] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Differentiable ring attention of this member's rows (q [n, H, D], k/v [n, H_kv, D])."""
    n = spec.tokens(spec.member)
    if q.shape[0] != n or k.shape[0] != n:
        raise ValueError(
            f"member {spec.member} holds {n} tokens of distributed documents by its segments, "
            f"got q with {q.shape[0]} and k with {k.shape[0]} rows"
        )
    kernel = kernel or kernel_for(q.device, dtype=q.dtype)
    if spec.size == 1:  # nothing to pass: the member's own segments against themselves
        blocks = segment_blocks(spec.segments[0], spec.segments[0], spec.slices)
        return block_attention(q, k, v, blocks, scale, kernel, sinks)
    return _RingAttention.apply(q, k, v, sinks, spec, kernel, scale)


def ring_mode_attention(
    q: Tensor, k: Tensor, v: Tensor, ctx, segments, slices, scale: float, kernel: AttentionKernel, sinks=None
) -> Tensor:
    """The ring modes' entry for dispatch.cp_attention (hf_cp/modes/ring.py): this member's
    distributed rows, every member's segments."""
    spec = RingSpec(ctx.group, tuple(ctx.group_ranks), ctx.member, segments, slices)
    return ring_attention(q, k, v, spec, scale, kernel, sinks)
