"""Shard geometry primitives: segments of documents, their token and causal-pair counts.

Pure functions on lengths. Which tokens each member of a CP group holds is a shard *mode*'s
business (hf_cp/modes/, one module per mode, looked up by name); `registry.rank_segments`
asks the mode. The cost model, the simulator, the collator and the attention functions all take their
layouts from there, so predicted and executed work agree.

A *segment* is a contiguous run of query tokens of one document held by one rank:
(doc index in the packed sequence, start position inside the document, length).
A query at position p of a document attends causally to p + 1 keys of that document.
"""

from __future__ import annotations

from bisect import bisect_right
from enum import Enum
from functools import lru_cache
from itertools import accumulate
from typing import List, NamedTuple, Optional, Sequence

from hf_cp.samples.masks import SampleMask, Slices, rect_pairs


class ShardMode(str, Enum):
    """Names of the built-in shard modes (hf_cp/modes/). Plans store a mode by its name, and a
    registered mode needs no member here: this is a convenience for code and tests."""

    ULYSSES = "ulysses"  # contiguous token split; all-to-all over heads
    RING_ZIGZAG = "ring_zigzag"  # whole packed sequence in 2g chunks, rank r: chunks r, 2g-1-r
    RING_PER_DOC = "ring_per_doc"  # every document in 2g parts, rank r: parts r, 2g-1-r
    BLOCKS = "blocks"  # placed chunks and compute blocks (block_layout.BlockLayout); all-to-all-v


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


def cut(doc_lengths: Sequence[int], begin: int, end: int, starts: Optional[Sequence[int]] = None) -> List[Segment]:
    """Segments covering packed-token range [begin, end). `starts`: the documents' packed
    offsets with the total last (doc_starts), when the caller cuts the same pack many times.

    The first document is found by bisection: scanning from the first document made the
    simulator of a 4096-rank step of zigzag packs (1,400 documents over 64 ranks, each member
    cut twice for itself and its ring successor) spend 14 s here."""
    if starts is None:
        starts = doc_starts(doc_lengths)
    out: List[Segment] = []
    d = max(0, bisect_right(starts, begin) - 1)
    n = len(doc_lengths)
    while d < n:
        offset = starts[d]
        if offset >= end:
            break
        lo, hi = max(begin, offset), min(end, starts[d + 1])
        if lo < hi:
            out.append(Segment(d, lo - offset, hi - lo))
        d += 1
    return out


def doc_starts(doc_lengths: Sequence[int]) -> List[int]:
    """Each document's first packed position, and the pack's length last."""
    return list(accumulate(doc_lengths, initial=0))


def chunk_bounds(n: int, parts: int) -> List[int]:
    bounds = [0]
    for s in split_sizes(n, parts):
        bounds.append(bounds[-1] + s)
    return bounds


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


# masked pair counts: the one count of a masked sample's (or segment's) attended pairs that the
# cost model, the simulator and the block engine's pricing share
@lru_cache(maxsize=65536)
def mask_slices(mask: SampleMask) -> Slices:
    return tuple(mask.slices())


@lru_cache(maxsize=65536)  # every bound, member and pricer of a step asks for its samples' areas
def masked_doc_pairs(length: int, mask: Optional[SampleMask]) -> int:
    """Attended pairs of a whole sample (causal without a mask)."""
    return doc_pairs(length) if mask is None else rect_pairs(mask_slices(mask), 0, length, 0, length)


def masked_segment_pairs(segment: Segment, length: int, mask: Optional[SampleMask]) -> int:
    """Attended pairs of a segment's queries over all keys of its sample."""
    if mask is None:
        return causal_pairs(segment.start, segment.length)
    return rect_pairs(mask_slices(mask), segment.start, segment.start + segment.length, 0, length)
