"""Block plans priced: compute from masked areas, exchange bytes from the placement.

Per layer and member of a "blocks" group (plan/block_layout.py):
    compute = c1 * tokens it owns
              + sum over the blocks it executes of
                c2 * area * heads/H * head_split_factor(H/heads) / efficiency(query chunk length)
    bytes   = what the engine sends (block_layout.layer_exchange, attention/engine.py):
        forward  dispatch: K/V of its chunks to the executors needing them (their kv-head hull)
                           and Q rows of its chunks run elsewhere;
                 return:   partial outputs and log-sum-exp of the Q rows it ran for others (fp32);
        backward dispatch: the same K/V and Q again, with dO, O and the log-sum-exp;
                 return:   dQ of the Q rows it ran for others, dK/dV of the K/V it received.
    comm    = transfer time of each phase (bytes / link bandwidth + latency per peer; in a group
              spanning nodes, the bytes to the member's own node and to other nodes travel on
              their own links at once, the slower deciding); a dispatch
              overlaps the member's blocks that need nothing received (its own Q against its own K/V).
`area` is masks.rect_pairs of the sample's mask over the (query chunk, key chunk) rectangle: the
same count the executor's kernels compute.

Whole-document modes price masked samples by their masked area too (modes/segments.py:
masked_doc_pairs, masked_segment_pairs). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hf_cp.cost.hardware import transfer_ms
from hf_cp.cost.model import CostModel, RankCost
from hf_cp.modes.segments import masked_doc_pairs
from hf_cp.plan.block_layout import (
    PARTIAL_BYTES,
    BlockLayout,
    LayerExchange,
    block_area,
    doc_slices,
    layer_exchange,
    per_doc_layout,
    zigzag_layout,
)
from hf_cp.samples.masks import SampleMask

FORWARD_SHARE = 4.0 / 14.0  # of a block's fwd+bwd time (ModelDims.attention_flops_per_pair: 4 fwd, 10 bwd)
# default_layout keeps the first layout unless another is faster by more than this (ms): two
# layouts that tie up to rounding keep the order they were tried in, so the choice is stable
LAYOUT_TIE_MS = 1e-12


# --------------------------------------------------------------------------- exchange volumes
@dataclass(frozen=True)
class ExchangeBytes:
    """Bytes one member sends in one layer, per phase of the engine's exchange."""

    fwd_dispatch: int = 0
    fwd_return: int = 0
    bwd_dispatch: int = 0
    bwd_return: int = 0

    @property
    def total(self) -> int:
        return self.fwd_dispatch + self.fwd_return + self.bwd_dispatch + self.bwd_return


def exchange_bytes(
    layout: BlockLayout,
    ex: LayerExchange,
    member: int,
    head_dim: int,
    bytes_per_element: int,
    peers: Optional[Callable[[int], bool]] = None,
) -> ExchangeBytes:
    """Bytes `member` sends in one layer (fwd+bwd) under the exchange `ex` (block_layout.layer_exchange);
    with `peers`, only the bytes sent to members for which peers(member) is true."""
    d, e = head_dim, bytes_per_element
    fd = fr = bd = br = 0
    for c, ex_member, a, b in ex.kv:
        rows = layout.chunks[c].length * (b - a)
        owner = layout.chunks[c].owner
        if owner == member and (peers is None or peers(ex_member)):
            fd += rows * 2 * d * e
            bd += rows * 2 * d * e
        if ex_member == member and (peers is None or peers(owner)):
            br += rows * 2 * d * e  # dK, dV partials home
    for c, ex_member, a, b in ex.q:
        rows = layout.chunks[c].length * (b - a)
        owner = layout.chunks[c].owner
        if owner == member and (peers is None or peers(ex_member)):
            fd += rows * d * e
            bd += rows * (3 * d * e + PARTIAL_BYTES)  # Q, dO, O and the log-sum-exp
        if ex_member == member and (peers is None or peers(owner)):
            fr += rows * (d + 1) * PARTIAL_BYTES  # partial O and its log-sum-exp
            br += rows * d * e  # dQ
    return ExchangeBytes(fd, fr, bd, br)


def softmax_layers_bytes(xb: ExchangeBytes, dims) -> ExchangeBytes:
    """`xb` averaged over the layers: only a hybrid's softmax layers exchange blocks
    (ModelDims.exchanged; the same bytes for a plain transformer)."""
    if dims.attention_layers is None:
        return xb
    return ExchangeBytes(*(dims.exchanged(x) for x in (xb.fwd_dispatch, xb.fwd_return, xb.bwd_dispatch, xb.bwd_return)))


def exchange_phases(ex: LayerExchange) -> Tuple[bool, bool, bool, bool]:
    """Which of the four all-to-alls run (every member joins a phase in which anyone sends)."""
    moves = bool(ex.kv or ex.q)
    return moves, bool(ex.q), moves, moves


# --------------------------------------------------------------------------- costs
def block_attention_ms(cost: CostModel, area: int, heads: int, q_len: int) -> float:
    """fwd+bwd time of one block, per layer: its masked area on `heads` of the H query heads."""
    h = cost.dims.num_heads
    factor = cost.head_split_factor(max(1, round(h / heads))) if heads < h else 1.0
    return cost.c2 * area * (heads / h) * factor / cost.chunk_efficiency(q_len)


def block_group_costs(
    layout: BlockLayout,
    doc_lengths: Sequence[int],
    ranks: Sequence[int],
    cost: CostModel,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    local: Optional[Mapping[int, Sequence[int]]] = None,
    local_masks: Optional[Mapping[int, Sequence[Optional[SampleMask]]]] = None,
    areas: Optional[Sequence[int]] = None,
) -> List[RankCost]:
    """RankCost of every member of a blocks group's micro-batch (local: member -> lengths of its
    local samples, local_masks alike), all layers included; kept by the cost model per
    arguments (CostModel.kept): relayout prices a chosen layout, the pricer the plan's groups.
    `areas`: each compute block's masked pairs when the caller has them (a placement's own
    ComputeBlock.pairs), else counted here."""
    kept = getattr(cost, "kept", None)
    if kept is None:
        return _block_group_costs(layout, doc_lengths, ranks, cost, masks, local, local_masks, areas)
    key = (
        "block_group_costs",
        layout,
        tuple(doc_lengths),
        tuple(ranks),
        tuple(masks) if masks else None,
        tuple((m, tuple(v)) for m, v in sorted((local or {}).items())),
        tuple((m, tuple(v)) for m, v in sorted((local_masks or {}).items())),
    )
    return list(
        kept(key, lambda: _block_group_costs(layout, doc_lengths, ranks, cost, masks, local, local_masks, areas))
    )


def _block_group_costs(layout, doc_lengths, ranks, cost, masks, local, local_masks, areas=None) -> List[RankCost]:
    g, L = len(ranks), cost.dims.num_layers
    local = local or {}
    local_masks = local_masks or {}
    slices = doc_slices(doc_lengths, masks)
    ex = layer_exchange(layout, slices, cost.dims.num_heads, cost.dims.num_kv_heads)
    attn = [0.0] * g
    own_attn = [0.0] * g  # blocks needing nothing received: they hide the dispatch
    div_attn: Dict[Tuple[int, int], float] = {}  # (member, division) -> its blocks' time
    for j in ex.blocks:
        b = layout.compute[j]
        qc = layout.chunks[b.q_chunk]
        area = areas[j] if areas is not None else block_area(layout.chunks, slices, b.q_chunk, b.k_chunk)
        t = block_attention_ms(cost, area, b.head_end - b.head_start, qc.length)
        attn[b.executor] += t
        if qc.owner == b.executor and layout.chunks[b.k_chunk].owner == b.executor:
            own_attn[b.executor] += t
        if layout.divisions is not None:
            key = (b.executor, layout.divisions[j])
            div_attn[key] = div_attn.get(key, 0.0) + t
    if g > 1:  # attention spread over a group: the profile's factor (CostModel._rank_cost)
        scale = cost.profile.cp_attention_scale
        attn = [a * scale for a in attn]
        own_attn = [a * scale for a in own_attn]
        div_attn = {k: v * scale for k, v in div_attn.items()}
    link = cost.link_for(ranks)
    nodes = {r // cost.profile.gpus_per_node for r in ranks}
    phases = exchange_phases(ex)
    out = []
    for m in range(g):
        lens = list(local.get(m, ()))
        lm = list(local_masks.get(m, ())) + [None] * len(lens)
        local_attn = sum(cost.c2 * masked_doc_pairs(n, lm[i]) / cost.chunk_efficiency(n) for i, n in enumerate(lens))
        tokens = layout.member_tokens(m) + sum(lens)
        comm_ms, nbytes = 0.0, 0
        if g > 1:
            xb = softmax_layers_bytes(
                exchange_bytes(layout, ex, m, cost.dims.head_dim, cost.profile.bytes_per_element), cost.dims
            )
            nbytes = xb.total
            t = [
                transfer_ms(x, link, g - 1) if on else 0.0
                for x, on in zip((xb.fwd_dispatch, xb.fwd_return, xb.bwd_dispatch, xb.bwd_return), phases)
            ]
            if len(nodes) > 1:  # each link level carries its own bytes, both at once
                t = _two_level_phase_ms(layout, ex, m, ranks, cost, phases)
            comm_ms = (
                max(0.0, t[0] - FORWARD_SHARE * own_attn[m])
                + t[1]
                + max(0.0, t[2] - (1 - FORWARD_SHARE) * own_attn[m])
                + t[3]
            )
            if layout.divisions is not None:
                comm_ms = division_comm_ms(layout, ex, m, div_attn, cost, link, g, phases, t)
            comm_ms += cost.exchange_sync_ms(block_exchange_messages(phases, g))
        if g > 1:
            local_attn *= cost.profile.cp_attention_scale
        compute = L * (cost.c1 * tokens + local_attn + attn[m]) + cost.head_ms_per_token * tokens
        own = layout.member_tokens(m)
        mix_ms, mix_comm, mix_bytes = cost.spread_linear_layers(sum(doc_lengths), own, g, link)
        out.append(
            RankCost(
                compute_ms=compute + mix_ms,
                comm_ms=L * comm_ms + mix_comm,
                comm_bytes=L * nbytes + mix_bytes,
                tokens=tokens,
            )
        )
    return out


def block_exchange_messages(phases: Sequence[bool], group_size: int) -> int:
    """Messages per layer and member of a blocks group's exchange: one per peer in every phase
    that moves anything (as the phases' latency counts them)."""
    return sum(bool(p) for p in phases) * (group_size - 1)


def block_group_messages(
    layout: BlockLayout, doc_lengths: Sequence[int], group_size: int, cost: CostModel, masks=None
) -> int:
    """block_exchange_messages of a blocks group's micro-batch (per layer)."""
    ex = layer_exchange(layout, doc_slices(doc_lengths, masks), cost.dims.num_heads, cost.dims.num_kv_heads)
    return block_exchange_messages(exchange_phases(ex), group_size)


def _two_level_phase_ms(layout, ex, member, ranks, cost, phases) -> List[float]:
    """A member's four phase times in a group spanning nodes: the bytes for members of its own
    node go over the intra-node link, the rest over the inter-node link, in parallel (USP keeps
    its head exchange inside a node, its ring across nodes)."""
    gpn = cost.profile.gpus_per_node
    node = [r // gpn for r in ranks]
    mine = node[member]
    same = [x for x in range(len(ranks)) if x != member and node[x] == mine]
    other = [x for x in range(len(ranks)) if node[x] != mine]
    d, e = cost.dims.head_dim, cost.profile.bytes_per_element
    near = softmax_layers_bytes(exchange_bytes(layout, ex, member, d, e, lambda x: node[x] == mine), cost.dims)
    far = softmax_layers_bytes(exchange_bytes(layout, ex, member, d, e, lambda x: node[x] != mine), cost.dims)
    links = cost.profile.links
    out = []
    for i, on in enumerate(phases):
        if not on:
            out.append(0.0)
            continue
        a = (near.fwd_dispatch, near.fwd_return, near.bwd_dispatch, near.bwd_return)[i]
        b = (far.fwd_dispatch, far.fwd_return, far.bwd_dispatch, far.bwd_return)[i]
        out.append(
            max(
                transfer_ms(a, links["intra_node"], len(same)) if same else 0.0,
                transfer_ms(b, links["inter_node"], len(other)) if other else 0.0,
            )
        )
    return out


def division_dispatch_bytes(
    layout: BlockLayout, ex: LayerExchange, member: int, head_dim: int, bytes_per_element: int
) -> Tuple[Dict[int, int], Dict[int, int]]:
    """Per division, the dispatch bytes `member` sends (forward, backward): each transfer of
    `ex` goes in the first division whose blocks need it (BlockLayout.divisions)."""
    first_kv: Dict[Tuple[int, int], int] = {}
    first_q: Dict[Tuple[int, int], int] = {}
    for j in ex.blocks:
        b, d = layout.compute[j], layout.divisions[j]
        for key, first in (((b.k_chunk, b.executor), first_kv), ((b.q_chunk, b.executor), first_q)):
            if d < first.get(key, 1 << 30):
                first[key] = d
    dd, e = head_dim, bytes_per_element
    fwd: Dict[int, int] = {}
    bwd: Dict[int, int] = {}
    for c, x, a, b in ex.kv:
        if layout.chunks[c].owner == member:
            d, rows = first_kv[(c, x)], layout.chunks[c].length * (b - a)
            fwd[d] = fwd.get(d, 0) + rows * 2 * dd * e
            bwd[d] = bwd.get(d, 0) + rows * 2 * dd * e
    for c, x, a, b in ex.q:
        if layout.chunks[c].owner == member:
            d, rows = first_q[(c, x)], layout.chunks[c].length * (b - a)
            fwd[d] = fwd.get(d, 0) + rows * dd * e
            bwd[d] = bwd.get(d, 0) + rows * (3 * dd * e + PARTIAL_BYTES)
    return fwd, bwd


def division_comm_ms(layout, ex, member, div_attn, cost, link, group_size, phases, t) -> float:
    """A member's communication not hidden by computation when its blocks run in divisions
    (DCP's schedule): the dispatch a division needs overlaps the previous division's blocks,
    forward and backward (their shares of each block's time); returns follow the last
    division. `t`: the member's four phase times without divisions (their returns are kept)."""
    fwd, bwd = division_dispatch_bytes(layout, ex, member, cost.dims.head_dim, cost.profile.bytes_per_element)
    fwd, bwd = ({d: cost.dims.exchanged(b) for d, b in x.items()} for x in (fwd, bwd))
    n = max([d for (m, d) in div_attn if m == member] + list(fwd) + list(bwd) + [0]) + 1
    comp = [div_attn.get((member, d), 0.0) for d in range(n)]
    out = t[1] + t[3]
    for share, sent, on in ((FORWARD_SHARE, fwd, phases[0]), (1 - FORWARD_SHARE, bwd, phases[2])):
        if not on:
            continue
        busy = [share * c for c in comp]
        comm = [transfer_ms(sent[d], link, group_size - 1) if d in sent else 0.0 for d in range(n)]
        # comm[0] first, then division i's computation beside division i+1's transfers
        total = comm[0] + sum(max(busy[i], comm[i + 1]) for i in range(n - 1)) + busy[-1]
        out += total - sum(busy)
    return out


# --------------------------------------------------------------------------- beside ring zigzag
def masks_by_member(plan, group) -> Dict[int, List[Optional[SampleMask]]]:
    return {group.ranks.index(r): [plan.masks.get(s) for s in ids] for r, ids in group.local.items()}


def default_layout(
    doc_lengths: Sequence[int],
    ranks: Sequence[int],
    cost: CostModel,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
) -> BlockLayout:
    """The engine's default placement until placement solvers choose one (issue 16): the ring
    geometries expressed as blocks (zigzag of the packed samples, or each sample in 2g parts),
    whichever the cost model finishes first, each block run by its query's owner. Same balance
    as the ring modes; only the K/V that blocks need moves."""
    g, h = len(ranks), cost.dims.num_heads
    slices = doc_slices(doc_lengths, masks)
    best, best_t = None, float("inf")
    for make in (zigzag_layout, per_doc_layout):
        lay = make(doc_lengths, g, h, slices)
        t = max(c.total_ms for c in block_group_costs(lay, doc_lengths, ranks, cost, masks))
        if t < best_t - LAYOUT_TIE_MS:
            best, best_t = lay, t
    return best
