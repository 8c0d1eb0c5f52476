"""The block engine: attention of a CP group under any block placement (plan/block_layout.py).

Each member holds the Q, K, V rows of the chunks it owns (its distributed rows, in `chunks`
order). Per layer, what moves follows from the layout and the layer's masks alone
(block_layout.layer_exchange, the same function the cost model prices):

forward
  1. dispatch, one all-to-all-v: each K/V chunk goes only to the members that execute a block
     needing it (the kv heads those blocks use), and the Q rows of every block run away from
     its query's owner go to that block's executor. While it travels, each member runs the
     blocks whose query and key chunks it owns itself.
  2. the member runs its other blocks; partial outputs of queries it owns merge by
     log-sum-exp at once, those of other members' queries are kept apart.
  3. return, one all-to-all-v (only when some Q travelled): partial outputs and their
     log-sum-exp go back to the queries' owners, which merge them (and the sinks, if any).
backward
  1. dispatch: the same K/V and Q again (nothing received is kept across the layer, as in ring
     attention), with dO, the final O and log-sum-exp of each travelling query row.
  2. every block's gradient from the final O and log-sum-exp of its rows (which is what makes
     per-block gradients add up exactly), own-only blocks while the dispatch travels.
  3. return: dQ of travelling queries and dK/dV partials of received chunks go home and are
     summed by their owners.
The maths (blocks, kernels, merges) is in local.py / blocks.py; the exchange in comm.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hf_cp.attention.blocks import Block, _masked_cached
from hf_cp.attention.comm import COUNTER, exchange_bytes
from hf_cp.attention.kernels import AttentionKernel, kernel_for
from hf_cp.attention.local import BlockPlan, apply_sinks, merge_lse, sinks_grad
from hf_cp.plan.block_layout import BlockLayout, LayerExchange, causal_slices, layer_exchange
from hf_cp.samples.masks import Slices

Tensor = torch.Tensor

PARTIAL_DTYPE = torch.float32  # partial outputs and log-sum-exp travel in float32 (cost.blocks.PARTIAL_BYTES)


@dataclass(frozen=True)
class EngineSpec:
    group: object  # torch.distributed process group of the members (None for one member)
    group_ranks: Tuple[int, ...]
    member: int
    layout: BlockLayout
    doc_lengths: Tuple[int, ...]  # the group's distributed samples
    slices: Tuple[Slices, ...]  # each sample's mask under this layer (window applied)

    @property
    def size(self) -> int:
        return len(self.group_ranks)


# --------------------------------------------------------------------------- the static plan of one member
@dataclass(frozen=True)
class _HeadGroup:
    """Blocks of one head range run by this member: the chunks they read, in gather order,
    and their kernel blocks with rows relative to the gathered tensors."""

    heads: Tuple[int, int]
    kv_heads: Tuple[int, int]  # the kv heads they read
    kv_expand: Optional[Tuple[int, ...]]  # per query head, its kv head (relative): head ranges not kv-aligned
    q_chunks: Tuple[int, ...]
    k_chunks: Tuple[int, ...]
    blocks: Tuple[Block, ...]


@dataclass(frozen=True)
class _MemberPlan:
    ex: LayerExchange
    own_rows: Dict[int, Tuple[int, int]]  # chunk -> (first row, length) in this member's tensors
    n_rows: int
    # per peer: the pieces that travel, in the order both sides agree on (ex.kv then ex.q)
    send_kv: Tuple[Tuple[Tuple[int, int, int], ...], ...]  # peer -> ((chunk, head_lo, head_hi), ...)
    send_q: Tuple[Tuple[Tuple[int, int, int], ...], ...]
    recv_kv: Tuple[Tuple[Tuple[int, int, int], ...], ...]
    recv_q: Tuple[Tuple[Tuple[int, int, int], ...], ...]
    local_groups: Tuple[_HeadGroup, ...]  # blocks reading only this member's own chunks
    remote_groups: Tuple[_HeadGroup, ...]  # blocks reading something received
    kernel_plans: Dict = field(default_factory=dict)  # (head group, device) -> BlockPlan, built once

    def kernel_plan(self, hg: _HeadGroup, n_q: int, device) -> BlockPlan:
        key = (id(hg), str(device))
        plan = self.kernel_plans.get(key)
        if plan is None:
            plan = self.kernel_plans[key] = BlockPlan(hg.blocks, n_q, device)
        return plan


def _head_groups(
    layout: BlockLayout, slices: Sequence[Slices], block_ids: Sequence[int], rep: int
) -> Tuple[_HeadGroup, ...]:
    by_heads: Dict[Tuple[int, int], List[int]] = {}
    for j in block_ids:
        b = layout.compute[j]
        by_heads.setdefault((b.head_start, b.head_end), []).append(j)
    out = []
    for (hs, he), ids in sorted(by_heads.items()):
        q_chunks, k_chunks = [], []
        for j in ids:
            b = layout.compute[j]
            if b.q_chunk not in q_chunks:
                q_chunks.append(b.q_chunk)
            if b.k_chunk not in k_chunks:
                k_chunks.append(b.k_chunk)
        q_row, row = {}, 0
        for c in q_chunks:
            q_row[c], row = row, row + layout.chunks[c].length
        k_row, row = {}, 0
        for c in k_chunks:
            k_row[c], row = row, row + layout.chunks[c].length
        blocks: List[Block] = []
        for j in ids:
            b = layout.compute[j]
            cq, ck = layout.chunks[b.q_chunk], layout.chunks[b.k_chunk]
            blocks.extend(
                _masked_cached(
                    slices[cq.doc], cq.start, cq.length, q_row[b.q_chunk], ck.start, ck.length, k_row[b.k_chunk]
                )
            )
        kv_lo, kv_hi = hs // rep, (he - 1) // rep + 1
        aligned = hs % rep == 0 and he % rep == 0
        expand = None if aligned else tuple(h // rep - kv_lo for h in range(hs, he))
        out.append(_HeadGroup((hs, he), (kv_lo, kv_hi), expand, tuple(q_chunks), tuple(k_chunks), tuple(blocks)))
    return tuple(out)


@lru_cache(maxsize=256)
def member_plan(
    layout: BlockLayout, slices: Tuple[Slices, ...], group_size: int, member: int, num_heads: int, num_kv_heads: int
) -> _MemberPlan:
    """Everything one member needs to run one layer: a pure function of the layout, the
    layer's masks, the member and the head counts (cached: layers with equal masks share it)."""
    ex = layer_exchange(layout, slices, num_heads, num_kv_heads)
    chunks, me, g = layout.chunks, member, group_size
    own_rows, row = {}, 0
    for c in layout.member_chunks(me):
        own_rows[c], row = (row, chunks[c].length), row + chunks[c].length
    send_kv = [[] for _ in range(g)]
    recv_kv = [[] for _ in range(g)]
    send_q = [[] for _ in range(g)]
    recv_q = [[] for _ in range(g)]
    for c, e, a, b in ex.kv:
        if chunks[c].owner == me:
            send_kv[e].append((c, a, b))
        if e == me:
            recv_kv[chunks[c].owner].append((c, a, b))
    for c, e, a, b in ex.q:
        if chunks[c].owner == me:
            send_q[e].append((c, a, b))
        if e == me:
            recv_q[chunks[c].owner].append((c, a, b))
    mine = [j for j in ex.blocks if layout.compute[j].executor == me]
    local = [
        j
        for j in mine
        if chunks[layout.compute[j].q_chunk].owner == me and chunks[layout.compute[j].k_chunk].owner == me
    ]
    local_set = set(local)
    remote = [j for j in mine if j not in local_set]
    rep = num_heads // num_kv_heads
    return _MemberPlan(
        ex,
        own_rows,
        row,
        tuple(map(tuple, send_kv)),
        tuple(map(tuple, send_q)),
        tuple(map(tuple, recv_kv)),
        tuple(map(tuple, recv_q)),
        _head_groups(layout, slices, local, rep),
        _head_groups(layout, slices, remote, rep),
    )


# --------------------------------------------------------------------------- packing pieces into one byte buffer
def _bytes_of(tensors: Sequence[Tensor]) -> Tensor:
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _dispatch_sends(plan, size: int, k: Tensor, v: Tensor, travelling: Sequence[Tensor]) -> List[Tensor]:
    """Per member, the bytes of the K/V pieces it needs from this one and of the query pieces
    that travel to it (`travelling`: Q in forward; Q, dO, O and lse in backward), in the order
    _unpack_dispatch reads them."""
    send = []
    for p in range(size):
        ts = []
        for c, a, b in plan.send_kv[p]:
            r, ln = plan.own_rows[c]
            ts += [k[r : r + ln, a:b], v[r : r + ln, a:b]]
        for c, a, b in plan.send_q[p]:
            r, ln = plan.own_rows[c]
            ts += [t[r : r + ln, a:b] for t in travelling]
        send.append(_bytes_of(ts))
    return send


def _dispatch_recv_bytes(plan, size: int, lengths, kv_row_bytes: int, q_row_bytes: int) -> List[int]:
    """Per member, the bytes this one receives in the dispatch: its K/V pieces at `kv_row_bytes`
    per row and head, its travelling query pieces at `q_row_bytes`."""
    return [
        _piece_bytes(plan.recv_kv[p], lengths, kv_row_bytes) + _piece_bytes(plan.recv_q[p], lengths, q_row_bytes)
        for p in range(size)
    ]


class _Reader:
    """Typed views of consecutive pieces of a received byte buffer."""

    def __init__(self, buf: Tensor):
        self.buf, self.pos = buf, 0

    def take(self, shape: Tuple[int, ...], dtype: torch.dtype) -> Tensor:
        n = 1
        for x in shape:
            n *= x
        size = torch.tensor([], dtype=dtype).element_size()
        raw = self.buf[self.pos : self.pos + n * size]
        self.pos += n * size
        if (raw.storage_offset() % size) != 0:  # dtype views need aligned storage
            raw = raw.clone()
        return raw.view(dtype).view(shape)


def _piece_bytes(pieces, lengths, per_head_row: int) -> int:
    return sum(lengths[c] * (b - a) * per_head_row for c, a, b in pieces)


# --------------------------------------------------------------------------- running head groups
class _Sources:
    """Where a head group reads a chunk's rows: this member's own tensors or a received piece."""

    def __init__(self, own_rows: Dict[int, Tuple[int, int]], own: Dict[str, Tensor]):
        self.own_rows, self.own = own_rows, own
        self.recv: Dict[Tuple[str, int], Tuple[int, Tensor]] = {}  # (name, chunk) -> (first head, tensor)

    def add(self, name: str, chunk: int, head_lo: int, t: Tensor) -> None:
        self.recv[(name, chunk)] = (head_lo, t)

    def rows(self, name: str, chunk: int, lo: int, hi: int) -> Tensor:
        if chunk in self.own_rows:
            r, n = self.own_rows[chunk]
            return self.own[name][r : r + n, lo:hi]
        base, t = self.recv[(name, chunk)]
        return t[:, lo - base : hi - base]

    def gather(self, name: str, chunks: Sequence[int], lo: int, hi: int) -> Tensor:
        parts = [self.rows(name, c, lo, hi) for c in chunks]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _kv_of(src: _Sources, hg: _HeadGroup, name: str) -> Tensor:
    x = src.gather(name, hg.k_chunks, *hg.kv_heads)
    if hg.kv_expand is not None:  # a head range not aligned to kv groups: one kv head per query head
        x = x.index_select(1, torch.tensor(hg.kv_expand, device=x.device))
    return x


def _kv_grad_home(dx: Tensor, hg: _HeadGroup) -> Tensor:
    if hg.kv_expand is None:
        return dx
    out = dx.new_zeros(dx.shape[0], hg.kv_heads[1] - hg.kv_heads[0], dx.shape[2])
    return out.index_add_(1, torch.tensor(hg.kv_expand, device=dx.device), dx)


class _Accumulator:
    """Per chunk and head range: partial outputs merged by log-sum-exp (forward) or gradient
    sums (backward), for this member's own rows and for the received rows it runs."""

    def __init__(self, own_rows, n_rows: int, heads: int, dim: int, device, lse: bool):
        self.own_rows = own_rows
        self.out = torch.zeros(n_rows, heads, dim, dtype=torch.float32, device=device)
        self.lse = torch.full((n_rows, heads), -float("inf"), device=device) if lse else None
        self.recv: Dict[int, Tuple[int, Tensor, Optional[Tensor]]] = {}

    def add_received(self, chunk: int, length: int, head_lo: int, head_hi: int, dim: int, device) -> None:
        out = torch.zeros(length, head_hi - head_lo, dim, dtype=torch.float32, device=device)
        lse = torch.full((length, head_hi - head_lo), -float("inf"), device=device) if self.lse is not None else None
        self.recv[chunk] = (head_lo, out, lse)

    def _views(self, chunk: int, lo: int, hi: int):
        if chunk in self.own_rows:
            r, n = self.own_rows[chunk]
            return self.out[r : r + n, lo:hi], (self.lse[r : r + n, lo:hi] if self.lse is not None else None)
        base, out, lse = self.recv[chunk]
        return out[:, lo - base : hi - base], (lse[:, lo - base : hi - base] if lse is not None else None)

    def merge(self, chunk: int, lo: int, hi: int, out: Tensor, lse: Tensor) -> None:
        o_view, l_view = self._views(chunk, lo, hi)
        o, l = merge_lse(o_view, l_view, out, lse)
        o_view.copy_(o)
        l_view.copy_(l)

    def add(self, chunk: int, lo: int, hi: int, grad: Tensor) -> None:
        self._views(chunk, lo, hi)[0].add_(grad)


def _split_rows(x: Tensor, chunks: Sequence[int], lengths: Sequence[int]):
    o = 0
    for c in chunks:
        yield c, x[o : o + lengths[c]]
        o += lengths[c]


def _forward_groups(plan: _MemberPlan, groups, src: _Sources, acc: _Accumulator, kernel, scale, lengths) -> None:
    for hg in groups:
        hs, he = hg.heads
        q = src.gather("q", hg.q_chunks, hs, he)
        k, v = _kv_of(src, hg, "k"), _kv_of(src, hg, "v")
        out, lse = plan.kernel_plan(hg, q.shape[0], q.device).forward(kernel, q, k, v, scale)
        for (c, o), (_, l) in zip(_split_rows(out, hg.q_chunks, lengths), _split_rows(lse, hg.q_chunks, lengths)):
            acc.merge(c, hs, he, o, l)


def _backward_groups(plan: _MemberPlan, groups, src: _Sources, dq_acc, dk_acc, dv_acc, kernel, scale, lengths) -> None:
    for hg in groups:
        hs, he = hg.heads
        q, do = src.gather("q", hg.q_chunks, hs, he), src.gather("do", hg.q_chunks, hs, he)
        o, lse = src.gather("o", hg.q_chunks, hs, he), src.gather("lse", hg.q_chunks, hs, he)
        k, v = _kv_of(src, hg, "k"), _kv_of(src, hg, "v")
        dq, dk, dv = plan.kernel_plan(hg, q.shape[0], q.device).backward(kernel, do, q, k, v, o, lse, scale)
        for c, g in _split_rows(dq, hg.q_chunks, lengths):
            dq_acc.add(c, hs, he, g)
        lo, hi = hg.kv_heads
        for c, g in _split_rows(_kv_grad_home(dk, hg), hg.k_chunks, lengths):
            dk_acc.add(c, lo, hi, g)
        for c, g in _split_rows(_kv_grad_home(dv, hg), hg.k_chunks, lengths):
            dv_acc.add(c, lo, hi, g)


# --------------------------------------------------------------------------- the autograd function
class _BlockEngine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, spec: EngineSpec, kernel: AttentionKernel, scale: float):
        n, h, d = q.shape
        hkv = k.shape[1]
        plan = member_plan(spec.layout, spec.slices, spec.size, spec.member, h, hkv)
        lengths = [c.length for c in spec.layout.chunks]
        me, dev = spec.member, q.device
        src = _Sources(plan.own_rows, {"q": q, "k": k, "v": v})
        acc = _Accumulator(plan.own_rows, n, h, d, dev, lse=True)
        kv_pieces = sum(len(x) for x in plan.send_kv)
        pending = recv = None
        if plan.ex.kv or plan.ex.q:  # 1. dispatch K/V and travelling Q
            send = _dispatch_sends(plan, spec.size, k, v, (q,))
            es = q.element_size()
            recv_sizes = _dispatch_recv_bytes(plan, spec.size, lengths, 2 * d * es, d * es)
            COUNTER.count("kv_chunks", kv_pieces)
            recv, pending = exchange_bytes(send, recv_sizes, spec.group, me, dev, "blocks_fwd_dispatch")
        _forward_groups(plan, plan.local_groups, src, acc, kernel, scale, lengths)  # overlaps the dispatch
        if pending is not None:
            pending.wait()
            _unpack_dispatch(recv, plan, src, lengths, d, q.dtype, backward=False)
        for p in range(spec.size):
            for c, a, b in plan.recv_q[p]:
                acc.add_received(c, lengths[c], a, b, d, dev)
        _forward_groups(plan, plan.remote_groups, src, acc, kernel, scale, lengths)
        if plan.ex.q:  # 3. partial outputs home
            send = []
            for p in range(spec.size):
                ts = []
                for c, _a, _b in plan.recv_q[p]:
                    _, o, l = acc.recv[c]
                    ts += [o, l]
                send.append(_bytes_of(ts))
            recv_sizes = [_piece_bytes(plan.send_q[p], lengths, (d + 1) * 4) for p in range(spec.size)]
            back, pending = exchange_bytes(send, recv_sizes, spec.group, me, dev, "blocks_fwd_return")
            pending.wait()
            rd = _Reader(back)
            for p in range(spec.size):
                for c, a, b in plan.send_q[p]:
                    o = rd.take((lengths[c], b - a, d), PARTIAL_DTYPE)
                    l = rd.take((lengths[c], b - a), PARTIAL_DTYPE)
                    acc.merge(c, a, b, o, l)
        out, lse = apply_sinks(acc.out, acc.lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.spec, ctx.kernel, ctx.scale = spec, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        spec, kernel, scale = ctx.spec, ctx.kernel, ctx.scale
        n, h, d = q.shape
        hkv = k.shape[1]
        plan = member_plan(spec.layout, spec.slices, spec.size, spec.member, h, hkv)
        lengths = [c.length for c in spec.layout.chunks]
        me, dev = spec.member, q.device
        dout = dout.contiguous()
        src = _Sources(plan.own_rows, {"q": q, "k": k, "v": v, "do": dout, "o": out, "lse": lse})
        dq_acc = _Accumulator(plan.own_rows, n, h, d, dev, lse=False)
        dk_acc = _Accumulator(plan.own_rows, n, hkv, d, dev, lse=False)
        dv_acc = _Accumulator(plan.own_rows, n, hkv, d, dev, lse=False)
        pending = recv = None
        if plan.ex.kv or plan.ex.q:  # 1. dispatch K/V, and Q with dO, O, lse
            send = _dispatch_sends(plan, spec.size, k, v, (q, dout, out, lse))
            es = q.element_size()
            recv_sizes = _dispatch_recv_bytes(plan, spec.size, lengths, 2 * d * es, 3 * d * es + 4)
            recv, pending = exchange_bytes(send, recv_sizes, spec.group, me, dev, "blocks_bwd_dispatch")
        _backward_groups(plan, plan.local_groups, src, dq_acc, dk_acc, dv_acc, kernel, scale, lengths)
        if pending is not None:
            pending.wait()
            _unpack_dispatch(recv, plan, src, lengths, d, q.dtype, backward=True)
            for p in range(spec.size):
                for c, a, b in plan.recv_q[p]:
                    dq_acc.add_received(c, lengths[c], a, b, d, dev)
                for c, a, b in plan.recv_kv[p]:
                    dk_acc.add_received(c, lengths[c], a, b, d, dev)
                    dv_acc.add_received(c, lengths[c], a, b, d, dev)
        _backward_groups(plan, plan.remote_groups, src, dq_acc, dk_acc, dv_acc, kernel, scale, lengths)
        if plan.ex.kv or plan.ex.q:  # 3. dK/dV and dQ home, in the dispatch's piece order
            send = []
            for p in range(spec.size):
                ts = []
                for c, _a, _b in plan.recv_kv[p]:
                    ts += [dk_acc.recv[c][1].to(k.dtype), dv_acc.recv[c][1].to(v.dtype)]
                for c, _a, _b in plan.recv_q[p]:
                    ts.append(dq_acc.recv[c][1].to(q.dtype))
                send.append(_bytes_of(ts))
            es = q.element_size()
            recv_sizes = [
                _piece_bytes(plan.send_kv[p], lengths, 2 * d * es) + _piece_bytes(plan.send_q[p], lengths, d * es)
                for p in range(spec.size)
            ]
            back, pending = exchange_bytes(send, recv_sizes, spec.group, me, dev, "blocks_bwd_return")
            pending.wait()
            rd = _Reader(back)
            for p in range(spec.size):
                for c, a, b in plan.send_kv[p]:
                    dk_acc.add(c, a, b, rd.take((lengths[c], b - a, d), k.dtype).float())
                    dv_acc.add(c, a, b, rd.take((lengths[c], b - a, d), v.dtype).float())
                for c, a, b in plan.send_q[p]:
                    dq_acc.add(c, a, b, rd.take((lengths[c], b - a, d), q.dtype).float())
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq_acc.out.to(q.dtype), dk_acc.out.to(k.dtype), dv_acc.out.to(v.dtype), dsinks, None, None, None


def _unpack_dispatch(recv: Tensor, plan: _MemberPlan, src: _Sources, lengths, d: int, dtype, backward: bool) -> None:
    rd = _Reader(recv)
    for p in range(len(plan.recv_kv)):
        for c, a, b in plan.recv_kv[p]:
            src.add("k", c, a, rd.take((lengths[c], b - a, d), dtype))
            src.add("v", c, a, rd.take((lengths[c], b - a, d), dtype))
        for c, a, b in plan.recv_q[p]:
            src.add("q", c, a, rd.take((lengths[c], b - a, d), dtype))
            if backward:
                src.add("do", c, a, rd.take((lengths[c], b - a, d), dtype))
                src.add("o", c, a, rd.take((lengths[c], b - a, d), dtype))
                src.add("lse", c, a, rd.take((lengths[c], b - a), PARTIAL_DTYPE))


def engine_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: EngineSpec,
    scale: float,
    kernel: Optional[AttentionKernel] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Differentiable block-engine attention of this member's owned rows (q [n, H, D], k/v
    [n, H_kv, D], its chunks in `chunks` order) -> output [n, H, D]."""
    n = spec.layout.member_tokens(spec.member)
    if q.shape[0] != n or k.shape[0] != n:
        raise ValueError(
            f"member {spec.member} owns {n} tokens of chunks in its block layout, got q with {q.shape[0]} and k "
            f"with {k.shape[0]} rows"
        )
    heads = spec.layout.num_heads
    if heads and heads != q.shape[1]:
        raise ValueError(
            f"the block layout's compute entries cover query heads [0, {heads}) but the model has {q.shape[1]}"
        )
    if spec.size > 1 and spec.group is None:
        raise ValueError(f"a block layout over {spec.size} members needs their process group")
    kernel = kernel or kernel_for(q.device, dtype=q.dtype)
    return _BlockEngine.apply(q, k, v, sinks, spec, kernel, scale)


def engine_mode_attention(
    q: Tensor, k: Tensor, v: Tensor, ctx, segments, slices, scale: float, kernel: AttentionKernel, sinks=None
) -> Tensor:
    """The blocks mode's entry for dispatch.cp_attention (hf_cp/modes/blocks.py): the layout comes
    with the context; documents without a mask under this layer are causal."""
    lengths = tuple(ctx.distributed_lengths)
    concrete = tuple(
        s if s is not None else causal_slices(n) for s, n in zip(slices or (None,) * len(lengths), lengths)
    )
    spec = EngineSpec(ctx.group, tuple(ctx.group_ranks), ctx.member, ctx.blocks, lengths, concrete)
    return engine_attention(q, k, v, spec, scale, kernel, sinks)
