"""`dcp`: DCP's planner (Jiang et al., SOSP 2025; survey section 3.2) over the whole world.

No CP group is fixed in advance. Per step:

1. Blocks. A sample longer than the block size is cut into data blocks (token chunks: the
   Q, K, V, O and labels of a chunk stay together on its owner) and compute blocks (one per
   (query block, key block) pair with masked pairs, masks.rect_pairs). Shorter samples are
   atoms: one rank computes each whole. Block size heuristic: the largest power of two at
   most cap/4 tokens, but at least two blocks per rank the sample spreads over, in a
   multiple of that, and at most max(`max_blocks`, 2 x those ranks) blocks: the hypergraph
   stays small, so planner time is bounded by construction.
2. Where a long sample runs. hf_cp's collectives run on pre-built groups (aligned
   power-of-two blocks of ranks), and every member of a group meets the others at every
   layer's exchange, so a sample's placement spans one such block and spreads over all of
   it: as many ranks as its predicted time (against a rank's share of the step) and its
   memory need, rounded up to a power of two, on the block with the least work so far,
   heaviest samples first; samples share a wave while their ranks' memory allows (`fill`).
   Within the block the placement is DCP's: the ranks talk only as the placement needs.
3. Placement within the block: a hypergraph whose vertices are the compute blocks (weight:
   predicted time) and data blocks (weight: their linear work), with one net per data block
   joining its users (a K/V net: the blocks that read its keys; a Q net: the blocks that read
   its queries), weighted by the bytes a copy of it moves (fwd + bwd). The partition
   minimises the bytes moved (connectivity - 1) with every part's time within (1 + epsilon)
   of its share. Hierarchical: first across the block's nodes (inter-node bytes are the
   expensive ones), then across the GPUs of each node. Memory is the hard constraint: every
   rank's owned tokens plus received rows (priced by their bytes against a token's activation
   memory, as StepPlan.validate counts them) must fit its cap.
   KaHyPar-family partitioners balance one weight, and DCP needs two (memory hard, time
   within epsilon). So the initial partition is a greedy fill that balances both: each long
   sample's query rows (a data block and the compute blocks reading its queries), paired
   zigzag-fashion (row i with row n-1-i), go onto the current part while its time and memory
   have room, else onto the part with the most time left. With Mt-KaHyPar installed (extra
   `dcp`, deterministic preset) its V-cycles then refine that partition for fewer bytes
   under the time caps; data blocks may move only while every part's memory still fits,
   else they stay and only compute blocks move. Only a block's top level (its nodes, or its
   GPUs within one node) is refined, and only up to `refine_max_vertices` vertices: the
   rest keeps the greedy partition (the planner-time bound). Without Mt-KaHyPar, or with
   `partitioner="greedy"`, the greedy partition is the placement (every compute block on its
   query block's owner).
4. Atoms: heaviest first onto the rank with the least time in the step (LPT: they fill what
   the long samples leave), then each rank's atoms in micro-batches of its own after the
   long samples' waves (first fit decreasing to the cap).
5. Groups of a wave: ranks that exchange data form a component, each runs in the smallest
   registered block covering it (overlapping covers merge); a rank with only atoms runs alone.
6. Divisions. Each group's compute blocks are scheduled in `divisions` divisions so that the
   communication of division i+1 overlaps the computation of division i (the seed's
   algorithm: division 0 holds the blocks whose inputs are all local; the middle divisions
   take, device by device in order of least computation, the next block unless it would push
   a device pair over its per-division share of the traffic; the last division takes the
   rest). `division_overlap_ms` prices that pipeline, and block_cost prices layouts that carry
   divisions the same way. Off by default (`divisions=1`): the engine's executor does not
   pipeline divisions yet, and a plan's prediction must be what runs.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..block_cost import received_row_bytes
from ..cost import CostModel
from ..masks import AttnSlice, SampleMask, SliceKind, rect_pairs
from ..plan import Group, StepPlan, Wave
from ..shard import ShardMode, split_sizes
from . import hypergraph, register_balancer
from .base import PlanRequest
from .placement import BlockPlacement, Chunk, ComputeBlock, blocks_group, request_masks

PARTITIONERS = ("auto", "mtkahypar", "greedy")


class DcpError(ValueError):
    """The step cannot be placed (it names the wave and the rank)."""


@dataclass(frozen=True)
class DcpOptions:
    block_size: int = 0  # tokens per data block; 0: the largest power of two <= cap / 4
    max_blocks: int = 64  # data blocks per sample at most, unless it spreads over more than half as many parts
    epsilon: float = 0.05  # a part's time may exceed its share of the wave by this fraction
    fill: float = 0.8  # a wave's owned tokens at most this share of world x cap
    partitioner: str = "auto"  # "mtkahypar", "greedy", or "auto" (Mt-KaHyPar when installed)
    # computation/communication divisions per group (the seed uses several). The engine's
    # executor runs a layout's exchange before its blocks and does not pipeline divisions yet,
    # so the default, 1, predicts what runs; more divisions are scheduled, carried in the
    # layouts and priced as the pipeline (block_cost.division_comm_ms) for an executor that does
    divisions: int = 1
    refine_max_vertices: int = 2000  # Mt-KaHyPar refines a block's top level up to this many vertices

    def __post_init__(self):
        if self.partitioner not in PARTITIONERS:
            raise ValueError(f"dcp: partitioner {self.partitioner!r} must be one of {PARTITIONERS}")
        if not 0 < self.fill <= 1:
            raise ValueError(f"dcp: fill {self.fill} must be in (0, 1]")
        if self.epsilon < 0:
            raise ValueError(f"dcp: epsilon {self.epsilon} must be >= 0")
        if self.block_size < 0 or self.max_blocks < 1 or self.divisions < 1:
            raise ValueError("dcp: block_size >= 0, max_blocks >= 1 and divisions >= 1 are required")

    def backend(self) -> str:
        if self.partitioner == "auto":
            return "mtkahypar" if hypergraph.available() else "greedy"
        if self.partitioner == "mtkahypar" and not hypergraph.available():
            raise ImportError(
                "dcp: partitioner 'mtkahypar' needs Mt-KaHyPar: pip install mtkahypar (or hf_cp[dcp]); "
                "partitioner='greedy' or 'auto' plans without it"
            )
        return self.partitioner


# --------------------------------------------------------------------------- weights
class Weights:
    """The cost model's numbers for blocks: time in ms (all layers), bytes per layer x layers."""

    def __init__(self, cost: CostModel):
        d = cost.dims
        self.cost = cost
        self.L = d.num_layers
        bpe = cost.profile.bytes_per_element
        # a copy of a data block's keys: K and V forward, dK and dV back (per token, all layers)
        self.kv_bytes_per_token = self.L * 2 * 2 * d.num_kv_heads * d.head_dim * bpe
        # a copy of its queries: Q out, O back (+ log-sum-exp), dO out, dQ back
        self.q_bytes_per_token = self.L * 4 * d.num_heads * d.head_dim * bpe
        self._lin = cost.c1 * self.L + cost.head_ms_per_token
        self._per_pair: Dict[int, float] = {}
        # memory of a received row against an owned token's, as StepPlan.validate counts it
        # (block_cost.received_token_equivalent: one layer's buffers, in activation tokens)
        self.kv_row_bytes, self.q_row_bytes = received_row_bytes(cost)
        self.token_bytes = int(cost.profile.activation_bytes_per_token)

    def linear_ms(self, tokens: int) -> float:
        return self._lin * tokens

    def attention_ms(self, pairs: int, q_len: int) -> float:
        f = self._per_pair.get(q_len)
        if f is None:  # blocks of a step come in few lengths
            f = self._per_pair[q_len] = self.L * self.cost.c2 / self.cost.chunk_efficiency(q_len)
        return f * pairs

    def sample_ms(self, length: int, slices: Sequence[AttnSlice]) -> float:
        return self.linear_ms(length) + self.attention_ms(rect_pairs(slices, 0, length, 0, length), length)


def _causal(n: int) -> List[AttnSlice]:
    return [AttnSlice(0, n, 0, n, SliceKind.CAUSAL)]


# --------------------------------------------------------------------------- blocks of a wave
@dataclass
class LongSample:
    """A sample cut into data blocks; its compute blocks pair them (query block, key block)."""

    index: int  # into the request's samples
    length: int
    blocks: List[Tuple[int, int]]  # (start, length) of every data block
    compute: List[Tuple[int, int, int]]  # (q block, k block, masked pairs)


def block_count(length: int, base: int, parts: int, max_blocks: int) -> int:
    """Data blocks of a long sample: blocks of about `base` tokens, in a multiple of 2 x the
    parts it should spread over (zigzag-paired rows then deal evenly), at most
    max(max_blocks, 2 * parts) blocks (rounded down to that multiple)."""
    step = 2 * parts
    n = max(-(-length // base), step)
    n = -(-n // step) * step
    top = max(max_blocks, step) // step * step
    return max(1, min(n, top, length))


def cut_sample(index: int, length: int, slices: Sequence[AttnSlice], n_blocks: int) -> LongSample:
    blocks, pos = [], 0
    for ln in split_sizes(length, n_blocks):
        blocks.append((pos, ln))
        pos += ln
    causal = len(slices) == 1 and slices[0].kind == SliceKind.CAUSAL and slices[0].q_start == 0
    comp = []
    for qi, (qs, ql) in enumerate(blocks):
        if causal:  # the same cuts for queries and keys: full squares below the diagonal
            comp.extend((qi, ki, ql * kl) for ki, (_, kl) in enumerate(blocks[:qi]))
            comp.append((qi, qi, ql * (ql + 1) // 2))
            continue
        for ki, (ks, kl) in enumerate(blocks):
            p = rect_pairs(slices, qs, qs + ql, ks, ks + kl)
            if p:
                comp.append((qi, ki, p))
    return LongSample(index, length, blocks, comp)


@dataclass
class WaveGraph:
    """The vertices of one wave's long samples: data blocks then compute blocks, flat."""

    samples: List[LongSample]
    weight: List[float] = field(default_factory=list)  # ms
    tokens: List[int] = field(default_factory=list)  # owned rows (data blocks only)
    data_vertex: List[List[int]] = field(default_factory=list)  # per sample, per block
    comp_vertex: List[List[int]] = field(default_factory=list)  # per sample, per compute block
    nets: List[List[int]] = field(default_factory=list)
    net_bytes: List[float] = field(default_factory=list)
    row_of: List[Tuple[int, int]] = field(default_factory=list)  # vertex -> (sample pos, query block)

    @classmethod
    def build(cls, samples: List[LongSample], w: Weights) -> WaveGraph:
        g = cls(samples)
        for sp, s in enumerate(samples):
            dv = []
            for bi, (_, ln) in enumerate(s.blocks):
                dv.append(len(g.weight))
                g.weight.append(w.linear_ms(ln))
                g.tokens.append(ln)
                g.row_of.append((sp, bi))
            cv = []
            k_users: Dict[int, List[int]] = {}
            q_users: Dict[int, List[int]] = {}
            for qi, ki, p in s.compute:
                v = len(g.weight)
                cv.append(v)
                g.weight.append(w.attention_ms(p, s.blocks[qi][1]))
                g.tokens.append(0)
                g.row_of.append((sp, qi))
                k_users.setdefault(ki, []).append(v)
                q_users.setdefault(qi, []).append(v)
            for bi, (_, ln) in enumerate(s.blocks):
                g.nets.append([dv[bi]] + k_users.get(bi, []))
                g.net_bytes.append(w.kv_bytes_per_token * ln)
                g.nets.append([dv[bi]] + q_users.get(bi, []))
                g.net_bytes.append(w.q_bytes_per_token * ln)
            g.data_vertex.append(dv)
            g.comp_vertex.append(cv)
        return g

    def __len__(self) -> int:
        return len(self.weight)


# --------------------------------------------------------------------------- partitioning
def greedy_rows(
    graph: WaveGraph,
    vertices: Sequence[int],
    loads: List[float],
    caps: Sequence[float],
    token_caps: Optional[Sequence[float]] = None,
) -> Dict[int, int]:
    """Part of each vertex: rows (a data block and the compute blocks that read its queries)
    paired zigzag-fashion within a sample, each pair onto the current part while its time
    stays under `caps` and its owned tokens under `token_caps`, else onto the part with the
    most time left (that has the tokens' room, if any has). Samples heaviest first; `loads`
    (each part's time so far) is updated."""
    rows: Dict[Tuple[int, int], List[int]] = {}
    for v in vertices:
        rows.setdefault(graph.row_of[v], []).append(v)
    by_sample: Dict[int, List[int]] = {}
    for sp, qi in rows:
        by_sample.setdefault(sp, []).append(qi)
    weight, tokens = graph.weight, graph.tokens
    sample_w = {sp: sum(weight[v] for qi in qis for v in rows[(sp, qi)]) for sp, qis in by_sample.items()}
    out: Dict[int, int] = {}
    k = len(loads)
    tok = [0.0] * k
    tcap = list(token_caps) if token_caps is not None else [float("inf")] * k
    for sp in sorted(by_sample, key=lambda s: (-sample_w[s], s)):
        qis = sorted(by_sample[sp])
        units = []
        for a in range(-(-len(qis) // 2)):
            pair = [qis[a]] + ([qis[-1 - a]] if len(qis) - 1 - a != a else [])
            units.append([v for qi in pair for v in rows[(sp, qi)]])
        cur = min(range(k), key=lambda p: (loads[p] - caps[p], p))
        for unit in units:
            uw = sum(weight[v] for v in unit)
            ut = sum(tokens[v] for v in unit)
            if loads[cur] + uw > caps[cur] or tok[cur] + ut > tcap[cur]:
                roomy = [p for p in range(k) if tok[p] + ut <= tcap[p]] or list(range(k))
                cur = min(roomy, key=lambda p: (loads[p] - caps[p], p))
            for v in unit:
                out[v] = cur
            loads[cur] += uw
            tok[cur] += ut
    return out


def refine_parts(
    graph: WaveGraph, vertices: Sequence[int], caps: Sequence[float], initial: Dict[int, int], token_room: int
) -> Dict[int, int]:
    """Mt-KaHyPar's refinement of a level's partition (hypergraph.refine): fewer bytes moved,
    each part's time under its cap. Data vertices may move as long as every part's owned
    tokens stay within `token_room`; if they would not, data stays where `initial` put it
    (memory hard-balanced) and only compute blocks move."""
    local = {v: i for i, v in enumerate(vertices)}
    nets, nb = [], []
    for e, pins in enumerate(graph.nets):
        sub = [local[v] for v in pins if v in local]
        if len(sub) > 1:
            nets.append(sub)
            nb.append(graph.net_bytes[e])
    weights = [graph.weight[v] for v in vertices]
    init = [initial[v] for v in vertices]
    parts = hypergraph.refine(weights, nets, nb, caps, init)
    tok = [0] * len(caps)
    for i, v in enumerate(vertices):
        tok[parts[i]] += graph.tokens[v]
    if max(tok) > token_room:
        fixed = [init[i] if graph.tokens[v] else -1 for i, v in enumerate(vertices)]
        parts = hypergraph.refine(weights, nets, nb, caps, init, fixed=fixed)
    return {v: parts[i] for i, v in enumerate(vertices)}


def lpt_with_room(
    items: Sequence[int], weight: Sequence[float], tokens: Sequence[int], loads: List[float], room: List[int]
) -> Optional[Dict[int, int]]:
    """Items heaviest first onto the least loaded part with token room; None if one has none."""
    out = {}
    order = sorted(items, key=lambda i: (-weight[i], i))
    heap = [(loads[p], p) for p in range(len(loads))]
    heapq.heapify(heap)
    for i in order:
        skipped = []
        while heap and room[heap[0][1]] < tokens[i]:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        l, p = heapq.heappop(heap)
        out[i] = p
        loads[p] = l + weight[i]
        room[p] -= tokens[i]
        heapq.heappush(heap, (loads[p], p))
        for s in skipped:
            heapq.heappush(heap, s)
    return out


# --------------------------------------------------------------------------- one wave
@dataclass
class WavePlacement:
    """Where one wave runs: every block vertex's rank, and the atoms each rank runs whole."""

    graph: WaveGraph
    rank_of: List[int]  # vertex -> rank
    atoms: Dict[int, int] = field(default_factory=dict)  # sample index -> rank

    def block_tokens(self, world: int, w: Weights) -> List[int]:
        """Owned rows of the long samples plus received rows (remote K/V and Q blocks, once per
        rank) in token equivalents, as StepPlan.validate counts them."""
        owned = [0] * world
        g = self.graph
        for v, r in enumerate(self.rank_of):
            owned[r] += g.tokens[v]
        got = set()
        nbytes = [0] * world
        for sp, s in enumerate(g.samples):
            dv = g.data_vertex[sp]
            for c, (qi, ki, _) in zip(g.comp_vertex[sp], s.compute):
                e = self.rank_of[c]
                for b, row in ((qi, w.q_row_bytes), (ki, w.kv_row_bytes)):
                    if self.rank_of[dv[b]] != e and (sp, b, e, row) not in got:
                        got.add((sp, b, e, row))
                        nbytes[e] += s.blocks[b][1] * row
        return [o + (-(-n // w.token_bytes) if n else 0) for o, n in zip(owned, nbytes)]


def place_block(
    graph: WaveGraph,
    first_rank: int,
    size: int,
    gpus_per_node: int,
    cap: int,
    world: int,
    w: Weights,
    opt: DcpOptions,
    backend: str,
) -> Optional[List[int]]:
    """Ranks (in first_rank .. first_rank + size - 1, an aligned block) of the blocks of the long
    samples in `graph`, hierarchically (the block's nodes, then the GPUs of each node), every
    part's time under (1 + epsilon) x its share of the graph's time. None if a rank's memory
    (owned plus received rows, as StepPlan.validate counts them) would pass the cap."""
    eps = 1.0 + opt.epsilon
    total = sum(graph.weight)
    levels = [size // gpus_per_node, gpus_per_node] if size > gpus_per_node else [size]
    rank_of = [0] * len(graph)
    todo = [(list(range(len(graph))), first_rank)]  # (vertices, first rank of the part)
    span = size
    for k in levels:
        span //= k
        nxt = []
        for verts, first in todo:
            if k == 1:
                parts = {v: 0 for v in verts}
            else:
                caps = [eps * total * span / size] * k
                tcap = [span * cap * opt.fill] * k
                parts = greedy_rows(graph, verts, [0.0] * k, caps, tcap)
                if backend == "mtkahypar" and span * k == size and 1 < len(verts) <= opt.refine_max_vertices:
                    parts = refine_parts(graph, verts, caps, parts, int(span * cap * opt.fill))
            for p in range(k):
                pv = [v for v in verts if parts[v] == p]
                for v in pv:
                    rank_of[v] = first + p * span
                if pv:
                    nxt.append((pv, first + p * span))
        todo = nxt
    if max(WavePlacement(graph, rank_of).block_tokens(world, w), default=0) > cap:
        return None
    return rank_of


def pack_to_rooms(items: Sequence[int], tokens: Sequence[int], rooms: Sequence[int], cap: int) -> List[List[int]]:
    """One rank's atoms in micro-batches: first fit decreasing into bins of the given rooms
    (the waves it already runs blocks in), then into new bins of `cap` tokens."""
    bins: List[List[int]] = [[] for _ in rooms]
    free = list(rooms)
    for i in sorted(items, key=lambda i: (-tokens[i], i)):
        for b in range(len(free)):
            if free[b] >= tokens[i]:
                bins[b].append(i)
                free[b] -= tokens[i]
                break
        else:
            bins.append([i])
            free.append(cap - tokens[i])
    return bins


def covering_block(ranks: Sequence[int], world: int) -> Tuple[int, ...]:
    """The smallest aligned power-of-two block of ranks that holds all of `ranks`."""
    lo, hi = min(ranks), max(ranks)
    size = 1
    while lo // size != hi // size:
        size *= 2
    start = (lo // size) * size
    return tuple(range(start, min(world, start + size)))


def wave_groups(wp: WavePlacement, world: int) -> List[Tuple[Tuple[int, ...], List[int], Dict[int, List[int]]]]:
    """(ranks, long samples (positions in the wave graph), local atoms per rank) of every group:
    each set of ranks that exchange data runs in its covering registered block."""
    g = wp.graph
    parent = list(range(world))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    spread = []
    for sp in range(len(g.samples)):
        ranks = {wp.rank_of[v] for v in g.data_vertex[sp]} | {wp.rank_of[v] for v in g.comp_vertex[sp]}
        if len(ranks) > 1:
            spread.append(sp)
            rs = sorted(ranks)
            for r in rs[1:]:
                parent[find(r)] = find(rs[0])
    comps: Dict[int, List[int]] = {}
    for sp in spread:
        r0 = find(wp.rank_of[g.data_vertex[sp][0]])
        comps.setdefault(r0, []).append(sp)
    members: Dict[int, List[int]] = {}
    for r in range(world):
        members.setdefault(find(r), []).append(r)
    blocks: List[Tuple[Tuple[int, ...], List[int]]] = [
        (covering_block(members[c], world), sps) for c, sps in comps.items()
    ]
    merged = True
    while merged:  # overlapping covers merge into their covering block
        merged = False
        for a in range(len(blocks)):
            for b in range(a + 1, len(blocks)):
                if set(blocks[a][0]) & set(blocks[b][0]):
                    ranks = covering_block(blocks[a][0] + blocks[b][0], world)
                    blocks[a] = (ranks, blocks[a][1] + blocks[b][1])
                    blocks.pop(b)
                    merged = True
                    break
            if merged:
                break
    local: Dict[int, List[int]] = {}
    for i, r in sorted(wp.atoms.items()):
        local.setdefault(r, []).append(i)
    # a long sample all on one rank is a local sample of that rank
    for sp, s in enumerate(g.samples):
        if sp not in spread:
            local.setdefault(wp.rank_of[g.data_vertex[sp][0]], []).append(s.index)
    out = []
    covered = set()
    for ranks, sps in sorted(blocks):
        covered |= set(ranks)
        out.append((ranks, sorted(sps), {r: sorted(local[r]) for r in ranks if local.get(r)}))
    for r in sorted(local):
        if r not in covered:
            out.append(((r,), [], {r: sorted(local[r])}))
    return out


def group_placement(wp: WavePlacement, ranks: Sequence[int], sample_positions: Sequence[int], num_heads: int):
    """The block placement of one group's long samples (chunks in sample then block order)."""
    g = wp.graph
    member = {r: m for m, r in enumerate(ranks)}
    pl = BlockPlacement(len(ranks), num_heads)
    for doc, sp in enumerate(sample_positions):
        s = g.samples[sp]
        first = len(pl.chunks)
        for bi, (st, ln) in enumerate(s.blocks):
            pl.chunks.append(Chunk(doc, st, ln, member[wp.rank_of[g.data_vertex[sp][bi]]]))
        for c, (qi, ki, p) in zip(g.comp_vertex[sp], s.compute):
            pl.compute.append(ComputeBlock(first + qi, first + ki, 0, num_heads, member[wp.rank_of[c]], p))
    return pl


# --------------------------------------------------------------------------- divisions
def schedule_divisions(pl: BlockPlacement, block_ms: Sequence[float], n_div: int) -> List[int]:
    """Division of every compute block (DCP's computation/communication schedule).

    Inputs of a block are its query and key chunks; one not owned by the executor is a
    transfer (owner -> executor), made once, in the first division that needs it. Division
    0: blocks with every input local. Divisions 1..T-2: repeatedly the device with the least
    computation in the division takes its next block, unless the block's new transfers
    would push a (sender, receiver) pair over total / T of that pair's traffic (a pair may
    always send one chunk per division: chunks are the unit of transfer); such a device is
    done for the division. Division T-1: the rest.
    """
    n = len(pl.compute)
    if n_div <= 1 or n == 0:
        return [0] * n
    chunks = pl.chunks
    div = [-1] * n
    pair_total: Dict[Tuple[int, int], int] = {}
    for b in pl.compute:
        for c in {b.q_chunk, b.k_chunk}:
            o = chunks[c].owner
            if o != b.executor:
                pair_total[(o, b.executor)] = pair_total.get((o, b.executor), 0)  # keyed; filled below
    needed = {}
    for b in pl.compute:
        for c in {b.q_chunk, b.k_chunk}:
            o = chunks[c].owner
            if o != b.executor:
                needed[(c, b.executor)] = (o, b.executor, chunks[c].length)
    for o, e, ln in needed.values():
        pair_total[(o, e)] += ln
    limit = {k: v / n_div for k, v in pair_total.items()}
    have = set()  # (chunk, executor) already received
    todo: Dict[int, List[int]] = {}
    for j, b in enumerate(pl.compute):
        local = all(chunks[c].owner == b.executor for c in (b.q_chunk, b.k_chunk))
        if local:
            div[j] = 0
        else:
            todo.setdefault(b.executor, []).append(j)
    for d in range(1, n_div - 1):
        sent: Dict[Tuple[int, int], int] = {}
        load = {e: 0.0 for e in todo}
        active = [e for e in todo if todo[e]]
        heap = [(0.0, e) for e in sorted(active)]
        heapq.heapify(heap)
        while heap:
            l, e = heapq.heappop(heap)
            j = todo[e][0]
            b = pl.compute[j]
            new = [
                (c, chunks[c].owner, chunks[c].length)
                for c in {b.q_chunk, b.k_chunk}
                if chunks[c].owner != e and (c, e) not in have
            ]
            if any(sent.get((o, e), 0) and sent[(o, e)] + ln > limit[(o, e)] + 1e-9 for _, o, ln in new):
                continue  # this device waits for the next division (a pair always takes one chunk)
            for c, o, ln in new:
                sent[(o, e)] = sent.get((o, e), 0) + ln
                have.add((c, e))
            div[j] = d
            todo[e].pop(0)
            load[e] = l + block_ms[j]
            if todo[e]:
                heapq.heappush(heap, (load[e], e))
    for e in todo:
        for j in todo[e]:
            div[j] = n_div - 1
    return div


def division_overlap_ms(compute_ms: Sequence[float], comm_ms: Sequence[float]) -> float:
    """Time of a pipeline where the transfers of division i+1 run during the computation of
    division i: comm[0] + sum_i max(compute[i], comm[i+1]) + compute[last]."""
    n = len(compute_ms)
    if n == 0:
        return 0.0
    t = comm_ms[0]
    for i in range(n - 1):
        t += max(compute_ms[i], comm_ms[i + 1])
    return t + compute_ms[-1]


# --------------------------------------------------------------------------- the planner
@dataclass
class DcpLayout:
    """A step as DCP places it: per wave, its groups (ranks, long samples as a placement with
    per-block divisions, local samples per rank)."""

    waves: List[List[Tuple[Tuple[int, ...], List[int], Optional[BlockPlacement], List[int], Dict[int, List[int]]]]]
    backend: str
    planner_s: float


def plan_layout(
    lengths: Sequence[int],
    world: int,
    gpus_per_node: int,
    cap: int,
    cost: CostModel,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    options: Optional[DcpOptions] = None,
    max_group: Optional[int] = None,
) -> DcpLayout:
    """DCP's placement of one step (indices into `lengths`); see the module docstring.
    `max_group`: the largest group a plan may use (ClusterSpec.max_group_size)."""
    t0 = time.perf_counter()
    opt = options or DcpOptions()
    backend = opt.backend()
    w = Weights(cost)
    masks = masks or [None] * len(lengths)
    slices: Dict[int, List[AttnSlice]] = {}  # built for the samples cut in blocks or masked only

    def slices_of(i: int) -> List[AttnSlice]:
        if i not in slices:
            slices[i] = masks[i].slices() if masks[i] is not None else _causal(lengths[i])
        return slices[i]

    causal_ms: Dict[int, float] = {}  # per length: most samples of a step share a few lengths
    times = []
    for i, n in enumerate(lengths):
        if masks[i] is not None:
            times.append(w.sample_ms(n, slices_of(i)))
        else:
            t = causal_ms.get(n)
            if t is None:
                t = causal_ms[n] = w.linear_ms(n) + w.attention_ms(n * (n + 1) // 2, n)
            times.append(t)
    top = min(world, max_group or world)
    rank_share = sum(times) / world  # a rank's share of the step
    base = opt.block_size or max(1, 1 << int(math.log2(max(1, cap // 4))))
    room_per_rank = cap * opt.fill
    long_idx = sorted((i for i, n in enumerate(lengths) if n > base), key=lambda i: (-times[i], i))
    atoms = [i for i, n in enumerate(lengths) if n <= base]
    loads = [0.0] * world
    # long samples, heaviest first: each on the aligned block of ranks (as many as its time and
    # memory need, rounded up to a power of two) with the least work so far, in the first wave
    # where that block's ranks have the memory
    waves: List[Dict[Tuple[int, ...], List[int]]] = []  # wave -> block -> samples
    wave_tokens: List[List[float]] = []  # wave -> rank -> owned tokens of long samples
    for i in long_idx:
        need = max(math.ceil(times[i] / rank_share), math.ceil(lengths[i] / room_per_rank), 1)
        p = 1
        while p < need and p < top:
            p *= 2
        if lengths[i] > p * cap:
            raise DcpError(f"dcp: sample {i} ({lengths[i]} tokens) does not fit {p} ranks x {cap} tokens")
        blocks = sorted(
            (tuple(range(f, f + p)) for f in range(0, world, p)), key=lambda b: (sum(loads[r] for r in b), b[0])
        )
        per_rank = lengths[i] / p
        placed = False
        for wv in range(len(waves) + 1):
            if wv == len(waves):
                waves.append({})
                wave_tokens.append([0.0] * world)
            for blk in blocks:
                if all(wave_tokens[wv][r] + per_rank <= room_per_rank for r in blk) or (
                    wv == len(waves) - 1 and not waves[wv]
                ):
                    waves[wv].setdefault(blk, []).append(i)
                    for r in blk:
                        wave_tokens[wv][r] += per_rank
                        loads[r] += times[i] / p
                    placed = True
                    break
            if placed:
                break
    placed_waves: List[WavePlacement] = []
    ring_waves: List[Tuple[Tuple[int, ...], List[int]]] = []  # blocks that run ring per-document
    queue = [(blk, ids) for wave in waves for blk, ids in sorted(wave.items())]
    pending: List[Tuple[List[LongSample], List[int]]] = [([], []) for _ in waves]
    wave_index = [w for w, wave in enumerate(waves) for _ in sorted(wave.items())]
    while queue:
        blk, ids = queue.pop(0)
        wv = wave_index.pop(0)
        samples = []
        for i in ids:
            nb = block_count(lengths[i], base, len(blk), opt.max_blocks)
            samples.append(cut_sample(i, lengths[i], slices_of(i), nb))
        graph = WaveGraph.build(samples, w)
        gpn = gpus_per_node if len(blk) % gpus_per_node == 0 else len(blk)
        rank_of = place_block(graph, blk[0], len(blk), gpn, cap, world, w, opt, backend)
        if rank_of is None:
            if len(ids) > 1:  # place the samples of this block apart
                half = len(ids) // 2
                queue[:0] = [(blk, ids[:half]), (blk, ids[half:])]
                wave_index[:0] = [wv, len(waves) + len(ring_waves)]
                waves.append({})
                pending.append(([], []))
                continue
            # the K/V its blocks receive do not fit: ring attention streams them instead
            parts, p2 = split_sizes(lengths[ids[0]], 2 * len(blk)), 2 * len(blk)
            if max(parts[m] + parts[p2 - 1 - m] for m in range(len(blk))) > cap:
                raise DcpError(
                    f"dcp: sample {ids[0]} ({lengths[ids[0]]} tokens) does not fit ranks {blk[0]}..{blk[-1]} x {cap} "
                    f"tokens, neither as blocks with the K/V and Q rows they receive nor per-document on a ring"
                )
            ring_waves.append((blk, ids))
            continue
        pending[wv][0].extend(samples)
        pending[wv][1].extend(rank_of)
    for samples, rank_of in pending:
        if samples:
            placed_waves.append(WavePlacement(WaveGraph.build(samples, w), rank_of))
    # atoms: heaviest first onto the rank with the least time in the step (LPT), then each
    # rank's atoms in micro-batches of its own (first fit decreasing), after the long waves
    heap = [(loads[r], r) for r in range(world)]
    heapq.heapify(heap)
    rank_atoms: Dict[int, List[int]] = {r: [] for r in range(world)}
    for i in sorted(atoms, key=lambda i: (-times[i], i)):
        l, r = heapq.heappop(heap)
        rank_atoms[r].append(i)
        heapq.heappush(heap, (l + times[i], r))
    extra: List[Dict[int, List[int]]] = []
    for r in range(world):
        for b, ids in enumerate(pack_to_rooms(rank_atoms[r], lengths, [], cap)):
            while len(extra) <= b:
                extra.append({})
            extra[b][r] = sorted(ids)
    out = []
    for wp in placed_waves:
        groups = []
        for ranks, sps, local in wave_groups(wp, world):
            pl = group_placement(wp, ranks, sps, cost.dims.num_heads) if sps else None
            docs = [wp.graph.samples[sp].index for sp in sps]
            div = []
            if pl is not None:
                ms = [w.attention_ms(b.pairs, pl.chunks[b.q_chunk].length) for b in pl.compute]
                div = schedule_divisions(pl, ms, opt.divisions)
            groups.append((ranks, docs, pl, div, local))
        out.append(groups)
    for blk, ids in ring_waves:  # mode ring per-document: no placement
        out.append([(blk, list(ids), None, [], {})])
    for wave_atoms in extra:
        out.append([((r,), [], None, [], {r: ids}) for r, ids in sorted(wave_atoms.items())])
    return DcpLayout(out, backend, time.perf_counter() - t0)


# --------------------------------------------------------------------------- the balancer
@register_balancer("dcp", auto_member=True)
class DcpBalancer:
    """DCP's planner as a balancer: options are DcpOptions' fields. The last plan's planner time
    (seconds) and partitioner are kept in `last_planner_s` / `last_backend`."""

    name = "dcp"
    handles_masks = True  # blocks and atoms are priced by their masked pairs

    def __init__(self, **options):
        self.options = DcpOptions(**options)
        self.last_planner_s = 0.0
        self.last_backend = ""

    def warm_up(self) -> None:
        """Initialise the partitioner now (Balancer.warm_up)."""
        if self.options.backend() == "mtkahypar":
            hypergraph.warm_up()

    def plan(self, req: PlanRequest) -> StepPlan:
        masks = request_masks(req)
        cl = req.cluster
        lay = plan_layout(
            req.lengths,
            cl.world_size,
            cl.gpus_per_node,
            cl.max_tokens_per_rank,
            req.cost,
            [masks.get(s) for s in req.sample_ids],
            self.options,
            cl.max_group_size,
        )
        self.last_planner_s, self.last_backend = lay.planner_s, lay.backend
        ids = req.sample_ids
        plan = req.empty_plan(self.name)
        plan.masks = {s: m for s, m in masks.items() if s in set(ids)}
        for groups in lay.waves:
            wave = []
            for ranks, docs, pl, div, local in groups:
                loc = {r: [ids[i] for i in v] for r, v in local.items()}
                if docs and pl is None:  # too large for blocks: ring per-document sharding
                    wave.append(Group(ranks=ranks, distributed=[ids[i] for i in docs], mode=ShardMode.RING_PER_DOC))
                    continue
                wave.append(
                    blocks_group(ranks, [ids[i] for i in docs], pl, loc, div if self.options.divisions > 1 else None)
                )
            plan.waves.append(Wave(sorted(wave, key=lambda g: g.ranks[0])))
        return plan
