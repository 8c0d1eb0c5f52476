"""Which query rows attend to which key rows: attention work as a list of rectangular blocks.

Every attention pattern here (local packed documents, a ring step between two members'
shards, whole documents after a Ulysses exchange, a placed block of the block engine) is a
set of blocks. A block pairs a run of query rows with a run of key rows of the same document
and is one of three kinds:
    FULL        every query sees every key;
    CAUSAL      a square whose query i sees keys 0..i;
    INV_CAUSAL  a square whose query i sees keys i..n-1 (a causal square with rows and keys
                both reversed, which is how the kernels run it).
Any mask slice (masks.py) restricted to a pair of position ranges becomes tight slices
(masks.clip_slices), and each tight slice splits into at most three such blocks (a bi-causal
band into squares and a rectangle per band-width of rows), so every kernel only needs its
full and causal forms and the top-left versus bottom-right alignment of non-square causal
kernels never matters. A document without a mask is causal: the fast path below.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from typing import List, NamedTuple, Optional, Sequence, Tuple

from hf_cp.modes.segments import Segment
from hf_cp.samples.masks import AttnSlice, SliceKind, clip_slices

FULL, CAUSAL, INV_CAUSAL = 0, 1, 2  # Block.kind (a bool True/False reads as CAUSAL/FULL)

Slices = Tuple[AttnSlice, ...]


class Block(NamedTuple):
    q_row: int  # first query row in the query tensor
    k_row: int  # first key row in the key tensor
    q_len: int
    k_len: int
    kind: int  # FULL, CAUSAL or INV_CAUSAL (squares for the last two)

    @property
    def causal(self) -> bool:
        return self.kind == CAUSAL

    @property
    def pairs(self) -> int:
        return self.q_len * self.k_len if self.kind == FULL else self.q_len * (self.q_len + 1) // 2


def range_pair_blocks(q_start: int, q_len: int, q_row: int, k_start: int, k_len: int, k_row: int) -> List[Block]:
    """Blocks for queries at document positions [q_start, q_start+q_len) stored from row q_row,
    against keys at positions [k_start, k_start+k_len) stored from row k_row."""
    qs, qe, ks, ke = q_start, q_start + q_len, k_start, k_start + k_len
    if q_len <= 0 or k_len <= 0:
        return []
    lo, hi = max(qs, ks), min(qe, ke)
    if lo < hi:  # the position ranges overlap on [lo, hi)
        out = [Block(q_row + lo - qs, k_row + lo - ks, hi - lo, hi - lo, CAUSAL)]
        if ks < lo:  # keys before the overlap: seen in full by every query from lo on
            out.append(Block(q_row + lo - qs, k_row, qe - lo, lo - ks, FULL))
        if hi < qe:  # queries past the last key: see all overlapping keys in full
            out.append(Block(q_row + hi - qs, k_row + lo - ks, qe - hi, hi - lo, FULL))
        return out
    if ke <= qs:  # every key precedes every query
        return [Block(q_row, k_row, q_len, k_len, FULL)]
    return []  # every key follows every query


def tight_slice_blocks(s: AttnSlice, q_row: int, k_row: int) -> List[Block]:
    """Kernel blocks of one tight slice (masks.clip_slices) whose query position s.q_start is
    stored at row q_row and key position s.k_start at row k_row."""
    n, m = s.q_len, s.k_len
    if s.kind == SliceKind.FULL:
        return [Block(q_row, k_row, n, m, FULL)]
    if s.kind == SliceKind.CAUSAL:  # row i sees the first m - n + 1 + i keys
        extra = m - n
        out = [Block(q_row, k_row, n, extra, FULL)] if extra else []
        return out + [Block(q_row, k_row + extra, n, n, CAUSAL)]
    if s.kind == SliceKind.INV_CAUSAL:  # row i sees keys i..m-1
        out = [Block(q_row, k_row, n, n, INV_CAUSAL)]
        return out + ([Block(q_row, k_row + n, n, m - n, FULL)] if m > n else [])
    # a band: row i sees w keys starting at key i; in runs of h <= w rows it is an inverse-causal
    # square, a full rectangle and a causal square one row down
    w = m - n + 1
    out = []
    for r in range(0, n, w):
        h = min(w, n - r)
        out.append(Block(q_row + r, k_row + r, h, h, INV_CAUSAL))
        if w > h:
            out.append(Block(q_row + r, k_row + r + h, h, w - h, FULL))
        if h > 1:
            out.append(Block(q_row + r + 1, k_row + r + w, h - 1, h - 1, CAUSAL))
    return out


def masked_range_blocks(
    slices: Slices, q_start: int, q_len: int, q_row: int, k_start: int, k_len: int, k_row: int
) -> List[Block]:
    """Blocks of a masked document for queries at positions [q_start, q_start+q_len) stored
    from row q_row against keys at [k_start, k_start+k_len) stored from row k_row."""
    out: List[Block] = []
    for t in clip_slices(slices, q_start, q_start + q_len, k_start, k_start + k_len):
        out.extend(tight_slice_blocks(t, q_row + t.q_start - q_start, k_row + t.k_start - k_start))
    return out


def document_blocks(
    doc_lengths: Sequence[int], row: int = 0, slices: Optional[Sequence[Optional[Slices]]] = None
) -> List[Block]:
    """Blocks of whole documents packed one after the other from `row`: causal, or under each
    document's slices where given (None entries are causal)."""
    out = []
    for d, n in enumerate(doc_lengths):
        sl = slices[d] if slices is not None and d < len(slices) else None
        if n > 0:
            if sl is None:
                out.append(Block(row, row, n, n, CAUSAL))
            else:
                out.extend(_masked_cached(sl, 0, n, row, 0, n, row))
        row += n
    return out


@lru_cache(maxsize=8192)
def _masked_cached(slices: Slices, qs: int, ql: int, qr: int, ks: int, kl: int, kr: int) -> Tuple[Block, ...]:
    return tuple(masked_range_blocks(slices, qs, ql, qr, ks, kl, kr))


def _rows(segments: Sequence[Segment]) -> List[Tuple[Segment, int]]:
    row, out = 0, []
    for s in segments:
        out.append((s, row))
        row += s.length
    return out


@lru_cache(maxsize=4096)
def _segment_blocks_cached(
    q_segments: Tuple[Segment, ...], k_segments: Tuple[Segment, ...], slices: Optional[Tuple[Optional[Slices], ...]]
) -> Tuple[Block, ...]:
    by_doc = defaultdict(list)
    for s, row in _rows(k_segments):
        by_doc[s.doc].append((s, row))
    out: List[Block] = []
    for q, q_row in _rows(q_segments):
        sl = slices[q.doc] if slices is not None else None
        for k, k_row in by_doc.get(q.doc, ()):
            if sl is None:
                out.extend(range_pair_blocks(q.start, q.length, q_row, k.start, k.length, k_row))
            else:
                out.extend(masked_range_blocks(sl, q.start, q.length, q_row, k.start, k.length, k_row))
    return tuple(out)


def segment_blocks(
    q_segments: Sequence[Segment],
    k_segments: Sequence[Segment],
    slices: Optional[Sequence[Optional[Slices]]] = None,
) -> List[Block]:
    """Blocks between a member's query segments and a (possibly other) member's key segments,
    each stored as its segments' tokens back to back in segment order (context.py's layout).
    `slices[doc]` is a document's mask (None or absent: causal)."""
    sl = None if slices is None or all(x is None for x in slices) else tuple(slices)
    return list(
        _segment_blocks_cached(tuple(Segment(*s) for s in q_segments), tuple(Segment(*s) for s in k_segments), sl)
    )


def block_pairs(blocks: Sequence[Block]) -> int:
    """Query-key pairs the blocks compute (for checks against masks.rect_pairs / segments.causal_pairs)."""
    return sum(b.pairs for b in blocks)
