"""Shard geometry: which tokens of a packed sequence each member of a CP group holds.

Pure functions on lengths. The cost model, the simulator, the collator and the attention
functions all take their layouts from here, so predicted and executed work agree.

A *segment* is a contiguous run of query tokens of one document held by one rank:
(doc index in the packed sequence, start position inside the document, length).
A query at position p of a document attends causally to p + 1 keys of that document.
"""

from __future__ import annotations

from enum import Enum
from typing import List, NamedTuple, Sequence


class ShardMode(str, Enum):
    """How a distributed (packed) sequence is spread over a CP group."""

    ULYSSES = "ulysses"  # contiguous token split; all-to-all over heads
    RING_ZIGZAG = "ring_zigzag"  # whole packed sequence in 2g chunks, rank r: chunks r, 2g-1-r
    RING_PER_DOC = "ring_per_doc"  # every document in 2g parts, rank r: parts r, 2g-1-r
    BLOCKS = "blocks"  # placed chunks and compute blocks (block_plan.BlockLayout); all-to-all-v


# The modes whose geometry follows from the documents' lengths alone (rank_segments).
WHOLE_DOCUMENT_MODES = (ShardMode.ULYSSES, ShardMode.RING_ZIGZAG, ShardMode.RING_PER_DOC)


class Segment(NamedTuple):
    doc: int
    start: int
    length: int


def split_sizes(n: int, parts: int) -> List[int]:
    """n tokens in `parts` nearly equal pieces; the first n % parts pieces get one more."""
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    q, r = divmod(n, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def causal_pairs(start: int, length: int) -> int:
    """Causal query-key pairs of queries at positions start..start+length-1 of one document."""
    return length * start + length * (length + 1) // 2


def doc_pairs(length: int) -> int:
    return causal_pairs(0, length)


def _cut(doc_lengths: Sequence[int], begin: int, end: int) -> List[Segment]:
    """Segments covering packed-token range [begin, end)."""
    out: List[Segment] = []
    offset = 0
    for d, ln in enumerate(doc_lengths):
        lo, hi = max(begin, offset), min(end, offset + ln)
        if lo < hi:
            out.append(Segment(d, lo - offset, hi - lo))
        offset += ln
        if offset >= end:
            break
    return out


def _chunk_bounds(n: int, parts: int) -> List[int]:
    bounds = [0]
    for s in split_sizes(n, parts):
        bounds.append(bounds[-1] + s)
    return bounds


def zigzag_segments(doc_lengths: Sequence[int], group_size: int, rank: int) -> List[Segment]:
    """Rank `rank`'s query segments when the whole packed sequence is zigzag-split."""
    g = group_size
    b = _chunk_bounds(sum(doc_lengths), 2 * g)
    return _cut(doc_lengths, b[rank], b[rank + 1]) + _cut(doc_lengths, b[2 * g - 1 - rank], b[2 * g - rank])


def per_doc_segments(doc_lengths: Sequence[int], group_size: int, rank: int) -> List[Segment]:
    """Rank `rank`'s segments when each document is split in 2g parts (r and 2g-1-r).

    Remainder tokens go to the first parts, so no padding is ever needed; a document shorter
    than 2g leaves some parts empty.
    """
    parts = 2 * group_size
    out: List[Segment] = []
    for d, ln in enumerate(doc_lengths):
        # part p of split_sizes(ln, parts) starts at p*q + min(p, r): O(1) per part, since
        # planners cost every document of a pack on several members (their inner loop)
        q, r = divmod(ln, parts)
        for part in (rank, parts - 1 - rank):
            size = q + 1 if part < r else q
            if size:
                out.append(Segment(d, part * q + min(part, r), size))
    return out


def contiguous_segments(doc_lengths: Sequence[int], group_size: int, rank: int) -> List[Segment]:
    """Rank `rank`'s token segments under Ulysses (contiguous split of the packed sequence)."""
    b = _chunk_bounds(sum(doc_lengths), group_size)
    return _cut(doc_lengths, b[rank], b[rank + 1])


def rank_segments(mode: ShardMode, doc_lengths: Sequence[int], group_size: int, rank: int) -> List[Segment]:
    mode = ShardMode(mode)
    if mode == ShardMode.BLOCKS:
        raise ValueError(
            "shard mode 'blocks' places chunks explicitly: a member's segments come from the group's block "
            "layout (plan.Group.member_segments / block_plan.BlockLayout.member_segments), not from lengths"
        )
    if not 0 <= rank < group_size:
        raise ValueError(f"rank {rank} outside group of size {group_size}")
    if mode == ShardMode.ULYSSES:
        return contiguous_segments(doc_lengths, group_size, rank)
    if mode == ShardMode.RING_ZIGZAG:
        return zigzag_segments(doc_lengths, group_size, rank)
    return per_doc_segments(doc_lengths, group_size, rank)


def segment_tokens(segments: Sequence[Segment]) -> int:
    return sum(s.length for s in segments)


def segment_pairs(segments: Sequence[Segment]) -> int:
    return sum(causal_pairs(s.start, s.length) for s in segments)


def check_ulysses_heads(num_heads: int, num_kv_heads: int, group_size: int) -> None:
    """Ulysses splits heads: q heads must divide by the group, kv heads divide or replicate evenly."""
    g = group_size
    if num_heads % g:
        raise ValueError(
            f"Ulysses over a CP group of {g} ranks needs the number of query heads to be divisible "
            f"by {g}; the model has {num_heads} query heads. Use a ring mode "
            f"(ShardMode.RING_PER_DOC / RING_ZIGZAG) or a group size that divides {num_heads}."
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if (num_kv_heads >= g and num_kv_heads % g) or (num_kv_heads < g and g % num_kv_heads):
        raise ValueError(
            f"Ulysses over {g} ranks: {num_kv_heads} kv heads neither divide into {g} groups nor "
            f"replicate evenly to {g} ranks; use a ring mode for this group size"
        )
