"""`magi`: MagiAttention's dispatch solver (survey section 4.4) as a CP group's layout.

Inside a group that distributes documents, the packed sequence is cut into equal windows of
`chunk_size` tokens (equal, so the linear work per member stays balanced), each window's
exact masked area is counted (masks.rect_pairs: the attention work, any mask), and the
windows go to the group's members in equal numbers so that the largest summed area is as
small as possible:

    min over assignments f of max_j SumArea(B_j)   s.t. |B_j| = n / g

MagiAttention solves it with a min-heap greedy (windows by decreasing area, each onto the
least-loaded member that is not yet full, O(n log n)); `solve_dispatch` also runs an exact
branch-and-bound search on small instances. Zigzag is one point of this solution space; for
non-causal masks (shared prompts, sliding windows, block-causal) it is usually far from the
best one.

A window never spans samples in the block-plan contract, so a window that holds the end of
one sample and the start of the next becomes several chunks with the same owner. Every
(query chunk, key chunk) pair of one sample with masked pairs is a compute block run by the
query's owner: K/V move only to the members that need them (the engine's all-to-all-v),
never round a ring.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from hf_cp.balance.toolkit.placement import BlockPlacement, Chunk, add_compute_blocks, sample_slices
from hf_cp.modes.ring import zigzag_pieces
from hf_cp.samples.masks import AttnSlice, SampleMask, rect_pairs

# Exact search on instances up to this many windows (branch and bound, node-limited).
EXACT_MAX_ITEMS = 12
EXACT_NODE_LIMIT = 20_000


@dataclass(frozen=True)
class Dispatch:
    """Items (windows) in buckets (members): bucket_of[i] is item i's bucket."""

    bucket_of: Tuple[int, ...]
    loads: Tuple[float, ...]
    optimal: bool  # proven optimal (exact search finished), else a heuristic's answer

    @property
    def max_load(self) -> float:
        return max(self.loads) if self.loads else 0.0


def area_bound(areas: Sequence[float], n_buckets: int) -> float:
    """The mean bucket area: no assignment's largest bucket is below it."""
    return sum(areas) / n_buckets


def _check(areas: Sequence[float], n_buckets: int, per_bucket: Optional[int]) -> None:
    if n_buckets <= 0:
        raise ValueError(f"dispatch needs at least one bucket, got {n_buckets}")
    if per_bucket is not None and per_bucket * n_buckets < len(areas):
        raise ValueError(f"{len(areas)} items do not fit {n_buckets} buckets of {per_bucket}")
    if any(a < 0 for a in areas):
        raise ValueError("areas must be non-negative")


def equal_count(n_items: int, n_buckets: int) -> int:
    """Items per bucket under MagiAttention's equal-count rule (the last may hold fewer)."""
    return -(-n_items // n_buckets)


def min_heap_dispatch(areas: Sequence[float], n_buckets: int, per_bucket: Optional[int] = None) -> Dispatch:
    """MagiAttention's greedy: items by decreasing area (ties: lower index first), each onto
    the least-loaded bucket holding fewer than `per_bucket` items (ties: lower bucket).
    per_bucket None: no count limit."""
    _check(areas, n_buckets, per_bucket)
    order = sorted(range(len(areas)), key=lambda i: (-areas[i], i))
    heap = [(0.0, b) for b in range(n_buckets)]
    count = [0] * n_buckets
    loads = [0.0] * n_buckets
    bucket_of = [0] * len(areas)
    for i in order:
        load, b = heapq.heappop(heap)
        bucket_of[i] = b
        loads[b] = load + areas[i]
        count[b] += 1
        if per_bucket is None or count[b] < per_bucket:
            heapq.heappush(heap, (loads[b], b))
    return Dispatch(tuple(bucket_of), tuple(loads), optimal=False)


def exact_dispatch(
    areas: Sequence[float], n_buckets: int, per_bucket: Optional[int] = None, node_limit: int = EXACT_NODE_LIMIT
) -> Dispatch:
    """The assignment with the smallest largest bucket (branch and bound from the greedy's
    answer). Items go in decreasing order; a branch is cut when its bucket would reach the
    best known maximum or when the mean of what is left cannot fit under it; buckets in the
    same state (load, count) are tried once. `optimal` is False if `node_limit` search nodes
    ran out first (the best assignment found is returned)."""
    _check(areas, n_buckets, per_bucket)
    greedy = min_heap_dispatch(areas, n_buckets, per_bucket)
    n = len(areas)
    order = sorted(range(n), key=lambda i: (-areas[i], i))
    a = [areas[i] for i in order]
    suffix = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + a[i]
    cap = n if per_bucket is None else per_bucket
    best = [greedy.max_load]
    best_assign: List[Optional[List[int]]] = [None]
    loads = [0.0] * n_buckets
    counts = [0] * n_buckets
    assign = [0] * n
    nodes = [0]
    exhausted = [False]

    def dfs(i: int, cur_max: float) -> None:
        if exhausted[0]:
            return
        nodes[0] += 1
        if nodes[0] > node_limit:
            exhausted[0] = True
            return
        if i == n:
            if cur_max < best[0]:
                best[0] = cur_max
                best_assign[0] = list(assign)
            return
        # the rest must fit somewhere: the fullest bucket is at least the mean of everything
        if max(cur_max, (sum(loads) + suffix[i]) / n_buckets) >= best[0]:
            return
        seen = set()
        for b in sorted(range(n_buckets), key=lambda b: (loads[b], b)):
            if counts[b] >= cap:
                continue
            state = (loads[b], counts[b])
            if state in seen:
                continue
            seen.add(state)
            nl = loads[b] + a[i]
            if nl >= best[0]:
                continue
            loads[b], counts[b], assign[i] = nl, counts[b] + 1, b
            dfs(i + 1, max(cur_max, nl))
            loads[b], counts[b] = nl - a[i], counts[b] - 1

    dfs(0, 0.0)
    if best_assign[0] is None:  # the greedy's answer was already optimal (or the search ran out)
        return Dispatch(greedy.bucket_of, greedy.loads, optimal=not exhausted[0])
    bucket_of = [0] * n
    out_loads = [0.0] * n_buckets
    for pos, b in enumerate(best_assign[0]):
        bucket_of[order[pos]] = b
        out_loads[b] += a[pos]
    return Dispatch(tuple(bucket_of), tuple(out_loads), optimal=not exhausted[0])


def solve_dispatch(
    areas: Sequence[float], n_buckets: int, per_bucket: Optional[int] = None, exact_max_items: int = EXACT_MAX_ITEMS
) -> Dispatch:
    """The min-heap greedy, improved by the exact search on instances of at most
    `exact_max_items` items when the greedy is above the area bound."""
    greedy = min_heap_dispatch(areas, n_buckets, per_bucket)
    if len(areas) > exact_max_items or greedy.max_load <= area_bound(areas, n_buckets):
        return greedy
    return exact_dispatch(areas, n_buckets, per_bucket)


# --------------------------------------------------------------------------- group layout
def windows(doc_lengths: Sequence[int], chunk_size: int) -> List[List[Tuple[int, int, int]]]:
    """The packed sequence cut into windows of `chunk_size` tokens (the last may be shorter);
    each window as its pieces (doc, start, length), one per sample it touches."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    out: List[List[Tuple[int, int, int]]] = []
    cur: List[Tuple[int, int, int]] = []
    room = chunk_size
    for d, n in enumerate(doc_lengths):
        pos = 0
        while pos < n:
            take = min(room, n - pos)
            cur.append((d, pos, take))
            pos += take
            room -= take
            if room == 0:
                out.append(cur)
                cur, room = [], chunk_size
    if cur:
        out.append(cur)
    return out


def window_piece_pairs(wins: Sequence[Sequence[Tuple[int, int, int]]], doc_lengths, doc_slices) -> List[List[int]]:
    """Per window, the masked query-key pairs of each of its pieces' queries (against all keys of
    their sample)."""
    return [[rect_pairs(doc_slices[d], s, s + ln, 0, doc_lengths[d]) for d, s, ln in w] for w in wins]


def window_areas(wins: Sequence[Sequence[Tuple[int, int, int]]], doc_lengths, doc_slices) -> List[int]:
    """Masked query-key pairs of each window's queries (against all keys of their samples)."""
    return [sum(p) for p in window_piece_pairs(wins, doc_lengths, doc_slices)]


def magi_chunks(
    doc_lengths: Sequence[int],
    group_size: int,
    chunk_size: int,
    doc_slices: Sequence[Sequence[AttnSlice]],
    exact_max_items: int = EXACT_MAX_ITEMS,
) -> Tuple[List[Chunk], List[int]]:
    """magi_placement's chunks (each window's pieces, owned by the member the dispatch gives the
    window) and each chunk's masked pairs against all the keys of its sample."""
    wins = windows(doc_lengths, chunk_size)
    piece_pairs = window_piece_pairs(wins, doc_lengths, doc_slices)
    disp = solve_dispatch(
        [sum(p) for p in piece_pairs], group_size, equal_count(len(wins), group_size), exact_max_items
    )
    chunks: List[Chunk] = []
    pairs: List[int] = []
    for w, pieces in enumerate(wins):
        for (d, s, ln), p in zip(pieces, piece_pairs[w]):
            chunks.append(Chunk(d, s, ln, disp.bucket_of[w]))
            pairs.append(p)
    return chunks, pairs


def magi_placement(
    doc_lengths: Sequence[int],
    group_size: int,
    chunk_size: int,
    num_heads: int,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    doc_slices: Optional[Sequence[Sequence[AttnSlice]]] = None,
    exact_max_items: int = EXACT_MAX_ITEMS,
    chunks: Optional[Sequence[Chunk]] = None,
) -> BlockPlacement:
    """MagiAttention's layout of a group's distributed documents: equal windows dispatched by
    area in equal numbers per member (solve_dispatch), each window's pieces owned by its
    member, every block executed by its query chunk's owner. `chunks`: magi_chunks' of the
    same arguments, when already made."""
    slices = doc_slices if doc_slices is not None else sample_slices(doc_lengths, masks)
    pl = BlockPlacement(group_size, num_heads)
    if chunks is None:
        chunks = magi_chunks(doc_lengths, group_size, chunk_size, slices, exact_max_items)[0]
    pl.chunks = list(chunks)
    return add_compute_blocks(pl, slices)


def zigzag_placement(
    doc_lengths: Sequence[int],
    group_size: int,
    num_heads: int,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    doc_slices: Optional[Sequence[Sequence[AttnSlice]]] = None,
) -> BlockPlacement:
    """Ring zigzag as a placement (for comparisons): the packed sequence in 2g windows
    (ring.zigzag_pieces), member r owning windows r and 2g-1-r."""

    slices = doc_slices if doc_slices is not None else sample_slices(doc_lengths, masks)
    pl = BlockPlacement(group_size, num_heads)
    for owner, s in zigzag_pieces(doc_lengths, group_size):
        pl.chunks.append(Chunk(s.doc, s.start, s.length, owner))
    return add_compute_blocks(pl, slices)
