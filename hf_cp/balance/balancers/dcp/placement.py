"""A wave's placement (every block vertex's rank) and what follows from it: each rank's memory,
the groups (ranks that exchange data, in their covering registered block), each group's block
placement, and the atoms' micro-batches.

Memory is StepPlan.validate's count, from the same function (block_layout.held_tokens): a
rank's owned rows plus the K/V and Q rows it receives, summed over every long sample of the
wave that touches it (a rank is in one group per wave, and that group holds all of them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.balance.balancers.dcp.graph import WaveGraph
from hf_cp.balance.toolkit.placement import Chunk, ComputeBlock
from hf_cp.plan.block_layout import BlockLayout, held_tokens

Rows = Tuple[np.ndarray, np.ndarray, np.ndarray]  # per rank: owned, received K/V, received Q rows


def distinct(a: np.ndarray) -> np.ndarray:
    """The distinct values of an integer array, sorted (np.unique by sorting: numpy 2's hashed
    unique takes seconds on the 2M keys of a sample over 1024 ranks)."""
    s = np.sort(a)
    return s[np.concatenate([[True], s[1:] != s[:-1]])] if len(s) else s


def placement_rows(graph: WaveGraph, rank_of: np.ndarray, world: int) -> Rows:
    """Per rank: the rows of the graph's data blocks it owns, and the K/V and Q rows it receives
    (a data block used by a compute block on another rank, once per (block, rank))."""
    rank_of = np.asarray(rank_of, dtype=np.int64)
    data = np.flatnonzero(graph.ki < 0)
    owned = np.bincount(rank_of[data], weights=graph.tokens[data], minlength=world).astype(np.int64)
    comp = graph.compute_vertices()
    ex = rank_of[comp]
    got = []
    for dv in (graph.k_data(comp), graph.q_data(comp)):
        remote = rank_of[dv] != ex
        keys = distinct(dv[remote] * world + ex[remote])
        got.append(np.bincount(keys % world, weights=graph.tokens[keys // world], minlength=world).astype(np.int64))
    return owned, got[0], got[1]


class WaveMemory:
    """What a wave's long samples hold on every rank so far (owned, received K/V, received Q rows)."""

    def __init__(self, world: int):
        self.owned = np.zeros(world, dtype=np.int64)
        self.kv = np.zeros(world, dtype=np.int64)
        self.q = np.zeros(world, dtype=np.int64)

    def copy(self) -> WaveMemory:
        out = WaveMemory(0)
        out.owned, out.kv, out.q = self.owned.copy(), self.kv.copy(), self.q.copy()
        return out

    def add(self, rows: Rows) -> None:
        self.owned += rows[0]
        self.kv += rows[1]
        self.q += rows[2]

    def held(self, cost) -> np.ndarray:
        """Tokens each rank holds (block_layout.held_tokens: what StepPlan.validate bounds)."""
        return held_tokens(self.owned, self.kv, self.q, cost)

    def busy(self, first: int, size: int) -> bool:
        """Whether anything is placed on ranks first .. first + size - 1."""
        s = slice(first, first + size)
        return bool(self.owned[s].any() or self.kv[s].any() or self.q[s].any())


@dataclass
class WavePlacement:
    """Where one wave runs: every block vertex's rank, and the atoms each rank runs whole."""

    graph: WaveGraph
    rank_of: np.ndarray  # vertex -> rank
    atoms: Dict[int, int] = field(default_factory=dict)  # sample index -> rank

    def __post_init__(self):
        self.rank_of = np.asarray(self.rank_of, dtype=np.int64)

    def held_tokens(self, world: int, cost) -> np.ndarray:
        """Tokens every rank holds in this wave, as StepPlan.validate counts them."""
        return held_tokens(*placement_rows(self.graph, self.rank_of, world), cost)

    def sample_ranks(self, sp: int) -> np.ndarray:
        return distinct(self.rank_of[self.graph.vertices(sp)])


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
        rs = wp.sample_ranks(sp).tolist()
        if len(rs) > 1:
            spread.append(sp)
            for r in rs[1:]:
                parent[find(r)] = find(rs[0])
    comps: Dict[int, List[int]] = {}
    for sp in spread:
        r0 = find(int(wp.rank_of[g.first[sp]]))
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
            local.setdefault(int(wp.rank_of[g.first[sp]]), []).append(s.index)
    out = []
    covered = set()
    for ranks, sps in sorted(blocks):
        covered |= set(ranks)
        out.append((ranks, sorted(sps), {r: sorted(local[r]) for r in ranks if local.get(r)}))
    for r in sorted(local):
        if r not in covered:
            out.append(((r,), [], {r: sorted(local[r])}))
    return out


CHECK_EVERY = 1 << 16


def _checked(items: Iterable, check: Callable[[], None]) -> Iterator:
    """`items`, calling check() before each run of CHECK_EVERY of them."""
    for j, item in enumerate(items):
        if not j % CHECK_EVERY:
            check()
        yield item


class ArrayPlacement:
    """A group's block placement as arrays (chunks in sample then block order; compute blocks
    over all heads): the plan's layout (`to_layout`) is made from them directly. `chunks` and
    `compute` (toolkit.placement's Chunk and ComputeBlock, as BlockPlacement has them) are
    made on first use: the planner needs neither."""

    def __init__(self, group_size, num_heads, doc, start, length, owner, q_chunk, k_chunk, executor, pairs):
        self.group_size, self.num_heads = int(group_size), int(num_heads)
        self.doc, self.start, self.length, self.owner = doc, start, length, owner
        self.q_chunk, self.k_chunk, self.executor, self.pairs = q_chunk, k_chunk, executor, pairs
        self._chunks: Optional[List[Chunk]] = None
        self._compute: Optional[List[ComputeBlock]] = None

    def __len__(self) -> int:
        return len(self.q_chunk)

    @property
    def chunks(self) -> List[Chunk]:
        if self._chunks is None:
            cols = (self.doc, self.start, self.length, self.owner)
            self._chunks = [Chunk(*c) for c in zip(*(a.tolist() for a in cols))]
        return self._chunks

    @property
    def compute(self) -> List[ComputeBlock]:
        if self._compute is None:
            h = self.num_heads
            q, k, e, p = (a.tolist() for a in (self.q_chunk, self.k_chunk, self.executor, self.pairs))
            self._compute = [ComputeBlock(a, b, 0, h, x, n) for a, b, x, n in zip(q, k, e, p)]
        return self._compute

    def member_tokens(self) -> List[int]:
        return np.bincount(self.owner, weights=self.length, minlength=self.group_size).astype(np.int64).tolist()

    def kv_transfers(self) -> int:
        remote = self.owner[self.k_chunk] != self.executor
        return len(distinct(self.k_chunk[remote] * self.group_size + self.executor[remote]))

    def to_dict(self) -> dict:
        return self.to_layout().to_dict()

    def to_layout(
        self, divisions: Optional[Sequence[int]] = None, check: Optional[Callable[[], None]] = None
    ) -> BlockLayout:
        """The plan format's layout. `check` is called every CHECK_EVERY compute blocks while
        the layout takes them (the planner's deadline: 2.1M of them take seconds)."""
        n, h = len(self.q_chunk), self.num_heads
        chunks = tuple(zip(*(a.tolist() for a in (self.doc, self.start, self.length, self.owner))))
        zeros, heads = [0] * n, [h] * n
        compute = zip(self.q_chunk.tolist(), self.k_chunk.tolist(), zeros, heads, self.executor.tolist())
        if check is not None:
            compute = _checked(compute, check)
        return BlockLayout(chunks, compute, tuple(divisions) if divisions else None)  # type: ignore[arg-type]

    def check(self, doc_lengths, doc_slices) -> ArrayPlacement:
        """The block-plan contract (BlockPlacement.check)."""
        self.to_layout().validate(doc_lengths, self.group_size, [tuple(s) for s in doc_slices], self.num_heads)
        return self


def group_placement(
    wp: WavePlacement, ranks: Sequence[int], sample_positions: Sequence[int], num_heads: int
) -> ArrayPlacement:
    """The block placement of one group's long samples (chunks in sample then block order)."""
    g = wp.graph
    ranks = list(ranks)
    member = np.full(max(ranks) + 1, -1, dtype=np.int64)
    member[ranks] = np.arange(len(ranks))
    cols: List[List[np.ndarray]] = [[] for _ in range(8)]
    first = 0
    for doc, sp in enumerate(sample_positions):
        s = g.samples[sp]
        nb = len(s.lens)
        dv = g.data_vertices(sp)
        cols[0].append(np.full(nb, doc, dtype=np.int64))
        cols[1].append(s.starts)
        cols[2].append(s.lens)
        cols[3].append(member[wp.rank_of[dv]])
        cols[4].append(first + s.cq)
        cols[5].append(first + s.ck)
        cols[6].append(member[wp.rank_of[g.first[sp] + nb + np.arange(len(s.cq))]])
        cols[7].append(s.pairs)
        first += nb
    arrays = [np.concatenate(c).astype(np.int64) if c else np.zeros(0, dtype=np.int64) for c in cols]
    return ArrayPlacement(len(ranks), num_heads, *arrays)
