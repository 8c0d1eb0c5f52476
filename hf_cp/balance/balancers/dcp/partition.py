"""Partitioning a wave's hypergraph over an aligned block of ranks: the greedy fill that balances
time and memory, Mt-KaHyPar's refinement of it (hypergraph.py), and the hierarchical placement
(the block's nodes, then the GPUs of each node)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from hf_cp.balance.balancers.dcp import hypergraph
from hf_cp.balance.balancers.dcp.graph import WaveGraph
from hf_cp.balance.balancers.dcp.options import DcpOptions
from hf_cp.balance.balancers.dcp.placement import WavePlacement
from hf_cp.balance.balancers.dcp.weights import Weights


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
