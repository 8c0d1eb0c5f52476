"""Which query rows attend to which key rows: attention work as a list of rectangular blocks.

Every attention pattern here (local packed documents, a ring step between two members'
shards, whole documents after a Ulysses exchange) is a set of blocks. A block pairs a run of
query rows with a run of key rows of the same document and is either *full* (every query
sees every key) or *causal*: a square whose query i sees keys 0..i. Any pair of position
ranges of one document under the causal rule "key position <= query position" splits into
at most three such blocks, so kernels only ever need two masks, and the top-left versus
bottom-right alignment of non-square causal kernels never matters.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from typing import List, NamedTuple, Sequence, Tuple

from ..shard import Segment


class Block(NamedTuple):
    q_row: int  # first query row in the query tensor
    k_row: int  # first key row in the key tensor
    q_len: int
    k_len: int
    causal: bool  # square, query i sees keys 0..i; otherwise full


def range_pair_blocks(q_start: int, q_len: int, q_row: int, k_start: int, k_len: int, k_row: int) -> List[Block]:
    """Blocks for queries at document positions [q_start, q_start+q_len) stored from row q_row,
    against keys at positions [k_start, k_start+k_len) stored from row k_row."""
    qs, qe, ks, ke = q_start, q_start + q_len, k_start, k_start + k_len
    if q_len <= 0 or k_len <= 0:
        return []
    lo, hi = max(qs, ks), min(qe, ke)
    if lo < hi:  # the position ranges overlap on [lo, hi)
        out = [Block(q_row + lo - qs, k_row + lo - ks, hi - lo, hi - lo, True)]
        if ks < lo:  # keys before the overlap: seen in full by every query from lo on
            out.append(Block(q_row + lo - qs, k_row, qe - lo, lo - ks, False))
        if hi < qe:  # queries past the last key: see all overlapping keys in full
            out.append(Block(q_row + hi - qs, k_row + lo - ks, qe - hi, hi - lo, False))
        return out
    if ke <= qs:  # every key precedes every query
        return [Block(q_row, k_row, q_len, k_len, False)]
    return []  # every key follows every query


def document_blocks(doc_lengths: Sequence[int], row: int = 0) -> List[Block]:
    """Causal blocks of whole documents packed one after the other from `row`."""
    out = []
    for n in doc_lengths:
        if n > 0:
            out.append(Block(row, row, n, n, True))
        row += n
    return out


def _rows(segments: Sequence[Segment]) -> List[Tuple[Segment, int]]:
    row, out = 0, []
    for s in segments:
        out.append((s, row))
        row += s.length
    return out


@lru_cache(maxsize=4096)
def _segment_blocks_cached(q_segments: Tuple[Segment, ...], k_segments: Tuple[Segment, ...]) -> Tuple[Block, ...]:
    by_doc = defaultdict(list)
    for s, row in _rows(k_segments):
        by_doc[s.doc].append((s, row))
    out: List[Block] = []
    for q, q_row in _rows(q_segments):
        for k, k_row in by_doc.get(q.doc, ()):
            out.extend(range_pair_blocks(q.start, q.length, q_row, k.start, k.length, k_row))
    return tuple(out)


def segment_blocks(q_segments: Sequence[Segment], k_segments: Sequence[Segment]) -> List[Block]:
    """Blocks between a member's query segments and a (possibly other) member's key segments,
    each stored as its segments' tokens back to back in segment order (context.py's layout)."""
    return list(_segment_blocks_cached(tuple(Segment(*s) for s in q_segments), tuple(Segment(*s) for s in k_segments)))


def block_pairs(blocks: Sequence[Block]) -> int:
    """Query-key pairs the blocks compute (for checks against shard.causal_pairs)."""
    return sum(b.q_len * (b.q_len + 1) // 2 if b.causal else b.q_len * b.k_len for b in blocks)
