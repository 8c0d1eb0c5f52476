"""Libra's TAP (tiled attention pooling, survey section 3.2) inside VRSP's bounded pools.

VRSP (libra.py) decides which replica runs each packed sequence and in which wave; it never
splits a sequence, so what a pool's replicas hold in one wave can still differ in attention
work. TAP moves that work, not the data: in each wave every pool's ranks form one "blocks"
group, the data stays with its VRSP owner, and attention is cut into SH-tiles (a head range x
a query chunk of one sample, against all the keys it attends), each priced by its exact
masked pairs (masks.rect_pairs) at the kernel efficiency of its query length, with the head
split overhead when it covers part of the heads (CostModel.head_split_factor).

Placement (Libra's communication-aware greedy): tiles heaviest first; a tile goes to a worker
whose load stays under the soft cap ((1 + slack) x the pool's mean load, linear work
included), preferring, in order: the owner of its queries (nothing moves), a worker that
already receives the tile's keys and values for another tile (only Q moves), then the least
loaded worker. A tile that fits nowhere is split along heads first (Libra: equal head
ranges run at equal cost and keep the kernel's sequence length, where sequence splits make
short, slow chunks), down to one KV-head group; past that it goes to the least loaded
worker. Sequence chunks are `tile_tokens` long (the last of a sample shorter).

Samples none of whose tiles leave their owner stay local documents of the owner.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..cost import CostModel
from ..masks import AttnSlice, SampleMask, SliceKind, rect_pairs
from ..shard import split_sizes
from .placement import BlockPlacement, Chunk, ComputeBlock


@dataclass(frozen=True)
class TapOptions:
    tile_tokens: int = 4096  # query tokens per sequence tile
    slack: float = 0.02  # soft cap: (1 + slack) x the pool's mean load

    def __post_init__(self):
        if self.tile_tokens < 1:
            raise ValueError(f"tap: tile_tokens {self.tile_tokens} must be positive")
        if self.slack < 0:
            raise ValueError(f"tap: slack {self.slack} must be >= 0")


@dataclass
class Tile:
    doc: int  # position in the pool's documents
    chunk: int  # query chunk (index into the placement's chunks)
    head_start: int
    head_end: int
    keys: Tuple[int, ...]  # key chunks it reads
    pairs: Tuple[int, ...]  # masked pairs per key chunk (all heads)
    ms: float


def _causal(n: int) -> List[AttnSlice]:
    return [AttnSlice(0, n, 0, n, SliceKind.CAUSAL)]


def tile_ms(cost: CostModel, pairs: int, q_len: int, heads: int) -> float:
    """Predicted time (all layers) of a tile: its share of the heads, the head-split overhead."""
    H = cost.dims.num_heads
    t = cost.dims.num_layers * cost.c2 * pairs / cost.chunk_efficiency(q_len) * heads / H
    return t * (cost.head_split_factor(H // heads) if heads < H else 1.0)


def pool_chunks(
    doc_lengths: Sequence[int], doc_owner_members: Sequence[Sequence[int]], tile_tokens: int
) -> List[Chunk]:
    """Chunks of every document: split in 2n parts over its n owning members (zigzag pairs,
    as per-document sharding; n = 1: the whole document), each part cut to `tile_tokens`."""
    out: List[Chunk] = []
    for d, (n, members) in enumerate(zip(doc_lengths, doc_owner_members)):
        g = len(members)
        parts = split_sizes(n, 2 * g) if g > 1 else [n]
        start = 0
        for p, size in enumerate(parts):
            owner = members[p if p < g else 2 * g - 1 - p] if g > 1 else members[0]
            for piece in split_sizes(size, -(-size // tile_tokens)) if size else []:
                out.append(Chunk(d, start, piece, owner))
                start += piece
    return out


def place_tiles(
    cost: CostModel,
    doc_lengths: Sequence[int],
    doc_slices: Sequence[Sequence[AttnSlice]],
    chunks: Sequence[Chunk],
    base_load: Sequence[float],
    opt: TapOptions,
) -> Tuple[BlockPlacement, List[float]]:
    """TAP's greedy over one pool's members (see the module docstring). `base_load`: each
    member's work that stays put (its linear work, and anything else it runs). Returns the
    placement (every block of a tile on the tile's worker) and the members' loads."""
    H = cost.dims.num_heads
    group = max(1, H // cost.dims.num_kv_heads)  # query heads per KV head: the finest head split
    g = len(base_load)
    by_doc: Dict[int, List[int]] = {}
    for i, c in enumerate(chunks):
        by_doc.setdefault(c.doc, []).append(i)
    tiles: List[Tile] = []
    for d, idx in by_doc.items():
        sl = doc_slices[d]
        for qi in idx:
            q = chunks[qi]
            keys, pairs = [], []
            for ki in idx:
                k = chunks[ki]
                p = rect_pairs(sl, q.start, q.end, k.start, k.end)
                if p:
                    keys.append(ki)
                    pairs.append(p)
            tiles.append(Tile(d, qi, 0, H, tuple(keys), tuple(pairs), tile_ms(cost, sum(pairs), q.length, H)))
    load = list(base_load)
    cap = (1.0 + opt.slack) * (sum(load) + sum(t.ms for t in tiles)) / g
    receives: Dict[int, set] = {m: set() for m in range(g)}  # member -> key chunks it already gets
    placed: List[Tuple[Tile, int]] = []
    heap = [(-t.ms, n, t) for n, t in enumerate(tiles)]
    heapq.heapify(heap)
    serial = len(tiles)
    while heap:
        _, _, t = heapq.heappop(heap)
        owner = chunks[t.chunk].owner
        fits = [m for m in range(g) if load[m] + t.ms <= cap + 1e-12]
        if owner in fits:
            m = owner
        else:
            holders = [m for m in fits if set(t.keys) <= receives[m] | {k for k in t.keys if chunks[k].owner == m}]
            if holders:
                m = min(holders, key=lambda x: (load[x], x))
            elif fits:
                m = min(fits, key=lambda x: (len(set(t.keys) - receives[x]), load[x], x))
            else:
                h = t.head_end - t.head_start
                if h >= 2 * group:  # split along heads first, at KV-head-group boundaries
                    mid = t.head_start + (h // group // 2) * group
                    q_len = chunks[t.chunk].length
                    for a, b in ((t.head_start, mid), (mid, t.head_end)):
                        part = Tile(t.doc, t.chunk, a, b, t.keys, t.pairs, tile_ms(cost, sum(t.pairs), q_len, b - a))
                        heapq.heappush(heap, (-part.ms, serial, part))
                        serial += 1
                    continue
                m = min(range(g), key=lambda x: (load[x], x != owner, x))  # least loaded; the owner on ties
        load[m] += t.ms
        for k in t.keys:
            if chunks[k].owner != m:
                receives[m].add(k)
        placed.append((t, m))
    pl = BlockPlacement(g, H, list(chunks))
    for t, m in sorted(placed, key=lambda x: (x[0].chunk, x[0].head_start)):
        for k, p in zip(t.keys, t.pairs):
            pl.compute.append(ComputeBlock(t.chunk, k, t.head_start, t.head_end, m, p))
    pl.compute.sort(key=lambda b: (b.q_chunk, b.k_chunk, b.head_start))
    return pl, load


def linear_ms(cost: CostModel, tokens: int) -> float:
    return (cost.dims.num_layers * cost.c1 + cost.head_ms_per_token) * tokens


@dataclass
class TapGroup:
    """One pool in one wave: its ranks, the samples TAP distributes (with their placement),
    and the samples that stay local to one rank."""

    ranks: Tuple[int, ...]
    distributed: List[int]  # request indices
    placement: Optional[BlockPlacement]
    local: Dict[int, List[int]]  # rank -> request indices
    loads: List[float]


def tap_pool(
    cost: CostModel,
    ranks: Sequence[int],
    docs: Sequence[Tuple[int, Sequence[int]]],
    lengths: Sequence[int],
    masks: Optional[Mapping[int, SampleMask]] = None,
    options: Optional[TapOptions] = None,
) -> TapGroup:
    """TAP over one pool: `docs` are (request index, owning members) of its samples in this
    wave (one member: the sample is that member's local document before TAP; several: the
    sample is spread over them, per-document style)."""
    opt = options or TapOptions()
    masks = masks or {}
    g = len(ranks)
    doc_ids = [i for i, _ in docs]
    doc_len = [lengths[i] for i in doc_ids]
    slices = [masks[i].slices() if i in masks else _causal(lengths[i]) for i in doc_ids]
    chunks = pool_chunks(doc_len, [list(m) for _, m in docs], opt.tile_tokens)
    base = [0.0] * g
    for c in chunks:
        base[c.owner] += linear_ms(cost, c.length)
    pl, loads = place_tiles(cost, doc_len, slices, chunks, base, opt)
    # a document none of whose blocks left a single owner is a local document of that owner
    spread = set()
    for b in pl.compute:
        q = pl.chunks[b.q_chunk]
        if b.executor != q.owner or pl.chunks[b.k_chunk].owner != q.owner:
            spread.add(q.doc)
    owners: Dict[int, set] = {}
    for c in pl.chunks:
        owners.setdefault(c.doc, set()).add(c.owner)
    spread |= {d for d, o in owners.items() if len(o) > 1}
    local: Dict[int, List[int]] = {}
    for d in range(len(doc_ids)):
        if d not in spread:
            local.setdefault(ranks[next(iter(owners[d]))], []).append(doc_ids[d])
    keep = sorted(spread)
    if not keep:
        return TapGroup(tuple(ranks), [], None, local, loads)
    renum = {d: n for n, d in enumerate(keep)}
    sub = BlockPlacement(g, pl.num_heads)
    index = {}
    for i, c in enumerate(pl.chunks):
        if c.doc in renum:
            index[i] = len(sub.chunks)
            sub.chunks.append(Chunk(renum[c.doc], c.start, c.length, c.owner))
    for b in pl.compute:
        if b.q_chunk in index:
            sub.compute.append(
                ComputeBlock(index[b.q_chunk], index[b.k_chunk], b.head_start, b.head_end, b.executor, b.pairs)
            )
    return TapGroup(tuple(ranks), [doc_ids[d] for d in keep], sub, local, loads)
