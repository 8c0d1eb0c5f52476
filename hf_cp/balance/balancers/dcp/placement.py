"""A wave's placement (every block vertex's rank) and what follows from it: each rank's memory,
the groups (ranks that exchange data, in their covering registered block), each group's block
placement, and the atoms' micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from hf_cp.balance.balancers.dcp.graph import WaveGraph
from hf_cp.balance.balancers.dcp.weights import Weights
from hf_cp.balance.toolkit.placement import BlockPlacement, Chunk, ComputeBlock


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
