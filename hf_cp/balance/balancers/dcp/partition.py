"""Partitioning a wave's hypergraph over an aligned block of ranks: the greedy fill that balances
time and memory, Mt-KaHyPar's refinement of it (hypergraph.py), and the hierarchical placement
(the block's nodes, then the GPUs of each node). Vertices are numpy arrays: a part's vertices
are split off by one stable sort, rows are summed by bincount, and only the rows' zigzag pairs
(at most two per rank of the block) are walked in Python."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np

from hf_cp.balance.balancers.dcp import hypergraph
from hf_cp.balance.balancers.dcp.graph import WaveGraph
from hf_cp.balance.balancers.dcp.options import DcpOptions
from hf_cp.balance.balancers.dcp.placement import Rows, WaveMemory, placement_rows
from hf_cp.balance.balancers.dcp.weights import Weights


def greedy_rows(
    graph: WaveGraph,
    vertices: Sequence[int],
    loads: Sequence[float],
    caps: Sequence[float],
    token_caps: Optional[Sequence[float]] = None,
) -> np.ndarray:
    """Part of each vertex (aligned with `vertices`): rows (a data block and the compute blocks
    that read its queries) paired zigzag-fashion within a sample, each pair onto the current
    part while its time stays under `caps` and its owned tokens under `token_caps`, else onto
    the part with the most time left (that has the tokens' room, if any has). Samples
    heaviest first, starting from each part's time `loads`."""
    verts = np.asarray(vertices, dtype=np.int64)
    k = len(loads)
    if len(verts) == 0:
        return np.zeros(0, dtype=np.int64)
    sp, qi = graph.sp[verts], graph.qi[verts]
    width = int(qi.max()) + 1
    rows, inv = np.unique(sp * width + qi, return_inverse=True)  # by sample, then query block
    inv = inv.reshape(-1)
    row_w = np.bincount(inv, weights=graph.weight[verts], minlength=len(rows))
    row_t = np.bincount(inv, weights=graph.tokens[verts].astype(np.float64), minlength=len(rows))
    row_sp = rows // width
    starts = np.flatnonzero(np.concatenate([[True], row_sp[1:] != row_sp[:-1]]))
    ends = np.append(starts[1:], len(rows))
    sample_w = np.add.reduceat(row_w, starts)
    load = np.asarray(loads, dtype=np.float64).copy()
    cap = np.asarray(caps, dtype=np.float64)
    tcap = np.asarray(token_caps, dtype=np.float64) if token_caps is not None else np.full(k, np.inf)
    tok = np.zeros(k)
    part = np.zeros(len(rows), dtype=np.int64)
    rw, rt = row_w.tolist(), row_t.tolist()
    for j in sorted(range(len(starts)), key=lambda j: (-sample_w[j], int(row_sp[starts[j]]))):
        a, b = int(starts[j]), int(ends[j]) - 1
        cur = int(np.argmin(load - cap))
        while a <= b:  # row a with row b: a zigzag pair (the middle row alone)
            uw = rw[a] + (rw[b] if b != a else 0.0)
            ut = rt[a] + (rt[b] if b != a else 0.0)
            if load[cur] + uw > cap[cur] or tok[cur] + ut > tcap[cur]:
                roomy = tok + ut <= tcap
                slack = np.where(roomy, load - cap, np.inf) if roomy.any() else load - cap
                cur = int(np.argmin(slack))
            part[a] = part[b] = cur
            load[cur] += uw
            tok[cur] += ut
            a, b = a + 1, b - 1
    return part[inv]


def refine_parts(
    graph: WaveGraph,
    vertices: Sequence[int],
    caps: Sequence[float],
    initial: Sequence[int],
    token_room: Union[int, Sequence[float]],
) -> np.ndarray:
    """Mt-KaHyPar's refinement of a level's partition (hypergraph.refine; `initial` aligned with
    `vertices`): fewer bytes moved, each part's time under its cap. Data vertices may move as
    long as every part's owned tokens stay within `token_room` (one number, or one per part);
    if they would not, data stays where `initial` put it (memory hard-balanced) and only compute
    blocks move."""
    verts = [int(v) for v in vertices]
    nets, nb = graph.nets(verts)
    weights = graph.weight[verts].tolist()
    init = [int(p) for p in initial]
    parts = hypergraph.refine(weights, nets, nb, caps, init)
    room = np.broadcast_to(np.asarray(token_room, dtype=np.float64), (len(caps),))
    tok = np.bincount(parts, weights=graph.tokens[verts].astype(np.float64), minlength=len(caps))
    if (tok > room).any():
        tokens = graph.tokens[verts]
        fixed = [init[i] if tokens[i] else -1 for i in range(len(verts))]
        parts = hypergraph.refine(weights, nets, nb, caps, init, fixed=fixed)
    return np.asarray(parts, dtype=np.int64)


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
    held: Optional[WaveMemory] = None,
    check: Optional[Callable[[], None]] = None,
) -> Optional[np.ndarray]:
    """Rank of every vertex of `graph` (place_block_rows without the rows)."""
    placed = place_block_rows(graph, first_rank, size, gpus_per_node, cap, world, w, opt, backend, held, check)
    return None if placed is None else placed[0]


def place_block_rows(
    graph: WaveGraph,
    first_rank: int,
    size: int,
    gpus_per_node: int,
    cap: int,
    world: int,
    w: Weights,
    opt: DcpOptions,
    backend: str,
    held: Optional[WaveMemory] = None,
    check: Optional[Callable[[], None]] = None,
) -> Optional[Tuple[np.ndarray, Rows]]:
    """(rank of every vertex of `graph` (in first_rank .. first_rank + size - 1, an aligned block),
    hierarchically (the block's nodes, then the GPUs of each node), every part's time under
    (1 + epsilon) x its share of the graph's time; and the rows each rank owns and receives
    (placement_rows)). `held`: what the wave already holds on each rank (its owned tokens leave
    less room to fill). None if a rank would hold more than
    the cap, owned plus received rows on top of `held` (block_layout.held_tokens, as
    StepPlan.validate counts). `check` is called between steps (the planner's deadline)."""
    eps = 1.0 + opt.epsilon
    total = float(graph.weight.sum())
    room = np.full(world, cap * opt.fill)
    if held is not None:
        room = np.maximum(room - held.owned, 0.0)
    levels = [size // gpus_per_node, gpus_per_node] if size > gpus_per_node else [size]
    rank_of = np.zeros(len(graph), dtype=np.int64)
    todo = [(np.arange(len(graph), dtype=np.int64), first_rank)]  # (vertices, first rank of the part)
    span = size
    for k in levels:
        span //= k
        nxt = []
        for verts, first in todo:
            if check is not None:
                check()
            if k == 1:
                parts = np.zeros(len(verts), dtype=np.int64)
            else:
                caps = [eps * total * span / size] * k
                tcap = room[first : first + k * span].reshape(k, span).sum(axis=1)
                parts = greedy_rows(graph, verts, [0.0] * k, caps, tcap)
                if backend == "mtkahypar" and span * k == size and 1 < len(verts) <= opt.refine_max_vertices:
                    parts = refine_parts(graph, verts, caps, parts, tcap)
            rank_of[verts] = first + parts * span
            order = np.argsort(parts, kind="stable")
            counts = np.bincount(parts, minlength=k)
            bounds = np.concatenate([[0], np.cumsum(counts)])
            for p in range(k):
                if counts[p]:
                    nxt.append((verts[order[bounds[p] : bounds[p + 1]]], first + p * span))
        todo = nxt
    rows = placement_rows(graph, rank_of, world)
    memory = WaveMemory(world) if held is None else held.copy()
    memory.add(rows)
    if memory.held(w.cost)[first_rank : first_rank + size].max(initial=0) > cap:
        return None
    return rank_of, rows
