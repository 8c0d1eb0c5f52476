"""State passing for Gated DeltaNet layers across a CP group: each member runs only its own rows.

A gated delta rule layer carries a state S (per value head, key dim x value dim) through a
document: S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, so over a run of
tokens the state maps affinely, S_end = P S_start + B, with P (key dim x key dim) the run's
transition and B the state it leaves from zero. The value columns of S evolve independently, so
one kernel run with the values widened by zeros and the initial state [0 | I] returns [B | P].
For a document spread over a CP group (any shard mode: its pieces may be anywhere):
1. every piece's rows get the k-1 rows before it (the causal convolution's window, the *halo*),
   from whichever members hold them: one differentiable all-to-all;
2. the layer runs its own forward once on this member's pieces (a batch, one piece a row, the
   halo in front); the gated delta rule kernel it calls is intercepted:
   - each piece that is not its document's last runs once from [0 | I] for [B | P];
   - [B | P] of every piece go to every member (one all-to-all, its gradient comes back);
   - every member chains them in token order, S_in(j+1) = P_j S_in(j) + B_j, and each piece
     runs again from its own S_in (a document's first piece from zero: its first run's outputs
     are already those), its halo rows dropped;
3. this member keeps its pieces' outputs.
Exact (the same arithmetic as one long run, up to float rounding of the chained states), with no
head divisibility, and each member's mixer work is its own rows (about twice the kernel's), where
gathering would run every whole document on every member.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from hf_cp.attention.comm import all_to_all
from hf_cp.attention.context import CPContext
from hf_cp.modes.segments import Segment

Tensor = torch.Tensor

# Gated DeltaNet layer classes whose module calls `torch_chunk_gated_delta_rule` (transformers'
# torch kernel, or the hub kernel it is swapped for) with a batch of sequences and no cache.
STATE_PASSING_MIXERS = frozenset({"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})
KERNEL_NAME = "torch_chunk_gated_delta_rule"

# (source member, row offset in the source's rows, count): a run of rows of one member
Run = Tuple[int, int, int]


def halo_routes(segments_of: Sequence[Sequence[Segment]], width: int) -> List[List[List[Run]]]:
    """For each member and each of its segments, where the `width` rows before the segment's first
    token live (fewer at a document's start), in token order: a pure function of the layout."""
    owners: Dict[int, List[Tuple[int, int, int, int]]] = {}  # doc -> (start, length, member, row offset)
    for m, segs in enumerate(segments_of):
        row = 0
        for s in segs:
            owners.setdefault(s.doc, []).append((s.start, s.length, m, row))
            row += s.length
    for runs in owners.values():
        runs.sort()
    routes: List[List[List[Run]]] = []
    for segs in segments_of:
        mine: List[List[Run]] = []
        for s in segs:
            lo, hi = max(0, s.start - width), s.start
            need: List[Run] = []
            for start, length, m, row in owners[s.doc]:
                a, b = max(lo, start), min(hi, start + length)
                if a < b:
                    need.append((m, row + a - start, b - a))
            if sum(n for _, _, n in need) != hi - lo:
                raise ValueError(f"hf_cp state passing: document {s.doc}'s tokens {lo}..{hi} are held by no member")
            mine.append(need)
        routes.append(mine)
    return routes


def gather_halos(x: Tensor, ctx: CPContext, routes: List[List[List[Run]]]) -> Tuple[List[Tensor], Tensor]:
    """This member's halo rows, one tensor per segment, from the members holding them (one
    differentiable all-to-all: each member sends what each other member's segments need), and a
    zero that depends on what arrived (added to the outputs, so that every member's backward runs
    the exchange's reverse, also one that received nothing)."""
    me, g = ctx.member, ctx.group_size
    send_index: List[List[int]] = [[] for _ in range(g)]
    recv_counts = [0] * g
    for dst in range(g):
        for runs in routes[dst]:
            for src, row, n in runs:
                if src == me:
                    send_index[dst].extend(range(row, row + n))
                if dst == me:
                    recv_counts[src] += n
    flat = [i for idx in send_index for i in idx]
    send = x.index_select(0, torch.tensor(flat, dtype=torch.long, device=x.device)) if flat else x[:0]
    received = all_to_all(send, [len(i) for i in send_index], recv_counts, ctx.group, me)
    # the buffer holds each source's rows in the order of this member's segments and tokens
    base = [sum(recv_counts[:src]) for src in range(g)]
    taken = [0] * g
    halos = []
    for runs in routes[me]:
        picks: List[int] = []
        for src, _, n in runs:
            picks.extend(range(base[src] + taken[src], base[src] + taken[src] + n))
            taken[src] += n
        halos.append(received.index_select(0, torch.tensor(picks, dtype=torch.long, device=x.device)))
    return halos, received.sum() * 0


def _exchange(states: Tensor, counts: Sequence[int], ctx: CPContext) -> Tensor:
    """Every member's piece states, in member order, on every member (the backward sums). Every
    member's backward must run the exchange's reverse, also one whose states need no gradient (a
    member holding only documents' last pieces sends zeros): else the collectives pair wrongly."""
    me = ctx.member
    if torch.is_grad_enabled() and not states.requires_grad:
        states = states.detach().requires_grad_()
    send = torch.cat([states] * ctx.group_size, dim=0)
    return all_to_all(send, [counts[me]] * ctx.group_size, list(counts), ctx.group, me)


def chain_states(every: Tensor, segments_of: Sequence[Sequence[Segment]], dv: int) -> List[Optional[Tensor]]:
    """Each piece's incoming state (None: a document's first piece, from zero), pieces numbered in
    member order as in `every` ([pieces, heads, key dim, value dim + key dim]: [B | P] each):
    S_in(j+1) = P_j S_in(j) + B_j in each document's token order."""
    order: Dict[int, List[Tuple[int, int]]] = {}  # doc -> (start, piece index)
    j = 0
    for segs in segments_of:
        for s in segs:
            order.setdefault(s.doc, []).append((s.start, j))
            j += 1
    incoming: List[Optional[Tensor]] = [None] * j
    for runs in order.values():
        state = None
        for _, i in sorted(runs):
            incoming[i] = state
            leaves, transition = every[i][..., :dv], every[i][..., dv:]
            state = leaves if state is None else transition @ state + leaves
    return incoming


class _PassedStateKernel:
    """Stands in for the layer's gated delta rule kernel during one forward over this member's
    pieces (module docstring, step 2). `pieces[i]` = (halo rows, own rows) of batch row i."""

    def __init__(self, kernel: Callable, ctx: CPContext, segments_of: Sequence[Sequence[Segment]], pieces):
        self.kernel, self.ctx, self.segments_of, self.pieces = kernel, ctx, segments_of, pieces
        self.called = False
        self.anchor = None

    def exchange(self, states: List[Tensor], heads: int, dk: int, dv: int, device) -> Tensor:
        """[B | P] of every piece of the group, in member order, on every member."""
        counts = [len(segs) for segs in self.segments_of]
        width = heads * dk * (dv + dk)
        flat = torch.cat(states, dim=0).flatten(1) if states else torch.zeros((0, width), device=device)
        every = _exchange(flat.float(), counts, self.ctx).view(-1, heads, dk, dv + dk)
        # every member's output depends on the exchange, so that every member's backward runs it
        # (a member holding only first pieces reads no incoming state)
        self.anchor = every.sum() * 0
        return every

    def __call__(self, query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
        if self.called or initial_state is not None or query.shape[0] != len(self.pieces):
            raise RuntimeError("hf_cp state passing: the layer called its kernel other than once over its pieces")
        self.called = True
        kwargs.pop("cu_seqlens", None)
        me = self.ctx.member
        heads, dk, dv = value.shape[2], key.shape[3], value.shape[3]
        last = {}  # doc -> start of its last piece
        for segs in self.segments_of:
            for s in segs:
                last[s.doc] = max(last.get(s.doc, -1), s.start)
        mine = self.segments_of[me]
        rows = [
            tuple(t[i : i + 1, h : h + n] for t in (query, key, value, g, beta)) for i, (h, n) in enumerate(self.pieces)
        ]

        # 1. [B | P] of each piece that is not its document's last (zeros for a last one: unused)
        states, first_out = [], {}
        eye = torch.eye(dk, dtype=torch.float32, device=query.device).expand(1, heads, dk, dk)
        for i, (s, (q, k, v, gi, b)) in enumerate(zip(mine, rows)):
            if s.start == last[s.doc]:
                states.append(query.new_zeros((1, heads, dk, dv + dk), dtype=torch.float32))
                continue
            wide_v = torch.cat([v, v.new_zeros(v.shape[:-1] + (dk,))], dim=-1)
            start = torch.cat([eye.new_zeros(1, heads, dk, dv), eye], dim=-1)
            out, end = self.kernel(q, k, wide_v, gi, b, initial_state=start, output_final_state=True, **kwargs)
            if s.start == 0:
                first_out[i] = out[..., :dv]  # from a zero state: the piece's outputs
            states.append(end.float())
        every = self.exchange(states, heads, dk, dv, query.device)
        if not mine:
            return None, None

        # 2. each piece's incoming state, chained in token order over the whole group
        incoming = chain_states(every, self.segments_of, dv)
        base = sum(len(segs) for segs in self.segments_of[:me])

        # 3. each piece from its own incoming state; halo and padding rows give zeros
        outs = []
        length = query.shape[1]
        for i, (q, k, v, gi, b) in enumerate(rows):
            if i in first_out:
                out = first_out[i]
            else:
                state = incoming[base + i]
                init = None if state is None else state.unsqueeze(0)
                out, _ = self.kernel(q, k, v, gi, b, initial_state=init, output_final_state=False, **kwargs)
            h, n = self.pieces[i]
            outs.append(torch.nn.functional.pad(out, (0, 0, 0, 0, h, length - h - n)))
        return torch.cat(outs, dim=0), None


@contextlib.contextmanager
def kernel_replaced(module: torch.nn.Module, replacement: Callable) -> Iterator[Callable]:
    """`module`'s layer calls `replacement` for its gated delta rule kernel inside the block (the
    name is a global of the layer's transformers module, looked up at each call)."""
    namespace = sys.modules[type(module).__module__]
    original = getattr(namespace, KERNEL_NAME)
    setattr(namespace, KERNEL_NAME, replacement)
    try:
        yield original
    finally:
        setattr(namespace, KERNEL_NAME, original)


def state_passing_outputs(
    module: torch.nn.Module, forward: Callable, x: Tensor, ctx: CPContext, kwargs: Dict
) -> Tensor:
    """This member's output rows of the distributed documents (its segments, in its order), each
    member running the layer on its own rows only (module docstring)."""
    segments_of = [ctx.segments(m) for m in range(ctx.group_size)]
    width = int(module.conv_kernel_size) - 1
    halos, halo_anchor = gather_halos(x, ctx, halo_routes(segments_of, width))
    mine = segments_of[ctx.member]
    namespace = sys.modules[type(module).__module__]
    kernel = _PassedStateKernel(getattr(namespace, KERNEL_NAME), ctx, segments_of, [])
    if not mine:  # nothing to run, but the group's state exchange still needs this member
        kernel.exchange([], module.num_v_heads, module.head_k_dim, module.head_v_dim, x.device)
        return x[:0] + (kernel.anchor + halo_anchor).to(x.dtype)
    rows, off = [], 0
    for s, halo in zip(mine, halos):
        rows.append(torch.cat([halo, x[off : off + s.length]], dim=0))
        off += s.length
    kernel.pieces = [(h.shape[0], s.length) for s, h in zip(mine, halos)]
    longest = max(r.shape[0] for r in rows)
    batch = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, longest - r.shape[0])) for r in rows])
    with kernel_replaced(module, kernel):
        out = forward(hidden_states=batch, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    if not kernel.called:
        raise RuntimeError(f"hf_cp state passing: {type(module).__name__} never called {KERNEL_NAME}")
    mine_out = torch.cat([out[i, h : h + n] for i, (h, n) in enumerate(kernel.pieces)], dim=0)
    return mine_out + (kernel.anchor + halo_anchor).to(mine_out.dtype)
