"""Ring attention's two layouts: the whole packed sequence zigzag-split, or every document
zigzag-split on its own.

Geometry: cut into 2g chunks, member r holds chunks r and 2g-1-r (causal work balances: an
early chunk with few keys pairs with a late one with many). RING_ZIGZAG cuts the packed
sequence (chunks stay long, balance is only in bulk); RING_PER_DOC cuts every document
(balanced exactly, but short documents become tiny, inefficient query chunks; remainders go to
the first parts, so nothing is padded).

Exchange: K/V blocks travel round the ring, overlapping the attention of the previous block.
Execution: hf_cp.attention.ring.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hf_cp.modes.registry import SegmentsOf, ShardModeSpec, register_mode
from hf_cp.modes.segments import Segment, chunk_bounds, cut, doc_starts, segment_tokens, split_sizes

# Every question of which tokens a ring member holds is answered here: the cost model and the
# simulator (through the mode specs below), and the planners' closed forms (CostMemo,
# ring_layout.group_fits, the vectorised pricer, the balancers that place ring pieces).


# ---- the 2g parts and their members
def part_sizes(n: int, group_size: int) -> List[int]:
    """Sizes of the 2g parts `n` tokens are cut into (the first n % 2g parts one longer)."""
    return split_sizes(n, 2 * group_size)


def part_arrays(n: int, group_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(start, size) of each of the 2g parts of `n` tokens, as int64 arrays (part_sizes)."""
    parts = 2 * group_size
    q, r = divmod(n, parts)
    p = np.arange(parts, dtype=np.int64)
    return p * q + np.minimum(p, r), q + (p < r)


def part_member(part: int, group_size: int) -> int:
    """The member holding part `part` of 2g: member m holds parts m and 2g-1-m."""
    return part if part < group_size else 2 * group_size - 1 - part


def member_parts(member: int, group_size: int) -> Tuple[int, int]:
    """The two parts member `member` holds (part_member's inverse)."""
    return member, 2 * group_size - 1 - member


def member_sums(per_part: np.ndarray) -> np.ndarray:
    """Per member, the sum of a per-part quantity (2g entries) over the two parts it holds."""
    g = len(per_part) // 2
    return per_part[:g] + per_part[2 * g - 1 - np.arange(g)]


# ---- tokens per member (closed forms of the segments' token counts)
def split_member_tokens(n: int, group_size: int) -> List[int]:
    """Tokens each member holds of `n` tokens cut in 2g parts: one document per-document
    sharded, or a packed sequence of n tokens zigzag-split."""
    parts = 2 * group_size
    q, r = divmod(n, parts)
    return [2 * q + (m < r) + (parts - 1 - m < r) for m in range(group_size)]


def per_doc_max_member_tokens(length: int, group_size: int) -> int:
    """Tokens of the fullest member when one document is split in 2g parts, member m holding
    parts m and 2g-1-m (per_doc_segments): 2q, plus one per remainder token it holds."""
    q, r = divmod(length, 2 * group_size)
    return 2 * q + (0 if r == 0 else 1 if r <= group_size else 2)


def zigzag_member_tokens(doc_lengths: Sequence[int], group_size: int) -> np.ndarray:
    """Tokens every member holds when the packed documents are zigzag-split (int64 array)."""
    return np.asarray(split_member_tokens(int(sum(doc_lengths)), group_size), dtype=np.int64)


def per_doc_member_tokens(doc_lengths: Sequence[int], group_size: int) -> np.ndarray:
    """Tokens every member holds when every document is split on its own (int64 array):
    2 x the documents' quotients, plus one per document whose remainder covers each part."""
    g = group_size
    lens = np.asarray(doc_lengths, dtype=np.int64)
    q, r = np.divmod(lens, 2 * g)
    r = np.sort(r)
    m = np.arange(g, dtype=np.int64)
    n = len(r)
    covered = (n - np.searchsorted(r, m, side="right")) + (n - np.searchsorted(r, 2 * g - 1 - m, side="right"))
    return 2 * int(q.sum()) + covered.astype(np.int64)


def member_tokens(mode, doc_lengths: Sequence[int], group_size: int) -> np.ndarray:
    """Tokens every member holds of the distributed documents under a ring mode (a name or a
    ShardMode member), as an int64 array."""
    name = getattr(mode, "value", mode)
    if not len(doc_lengths):
        return np.zeros(group_size, dtype=np.int64)
    if name == RING_ZIGZAG.name:
        return zigzag_member_tokens(doc_lengths, group_size)
    if name == RING_PER_DOC.name:
        return per_doc_member_tokens(doc_lengths, group_size)
    raise ValueError(f"ring.member_tokens: {name!r} is not a ring mode")


# ---- segments
def zigzag_segments(doc_lengths: Sequence[int], group_size: int, rank: int) -> List[Segment]:
    """Member `rank`'s query segments when the whole packed sequence is zigzag-split."""
    starts = doc_starts(doc_lengths)
    b = chunk_bounds(starts[-1], 2 * group_size)
    return [s for p in member_parts(rank, group_size) for s in cut(doc_lengths, b[p], b[p + 1], starts)]


def zigzag_pieces(doc_lengths: Sequence[int], group_size: int) -> List[Tuple[int, Segment]]:
    """Every member's pieces at once when the whole packed sequence is zigzag-split, as
    (member, segment) in packed order: part by part, each part cut at document ends (empty
    parts give none). Member m's segments are zigzag_segments(doc_lengths, group_size, m)."""
    starts = doc_starts(doc_lengths)
    b = chunk_bounds(starts[-1], 2 * group_size)
    return [
        (part_member(p, group_size), s) for p in range(2 * group_size) for s in cut(doc_lengths, b[p], b[p + 1], starts)
    ]


def per_doc_pieces(doc_lengths: Sequence[int], group_size: int) -> List[Tuple[int, Segment]]:
    """Every member's pieces at once when each document is split in 2g parts, as (member,
    segment) document by document, parts in order (empty parts give none). Member m's
    segments are per_doc_segments(doc_lengths, group_size, m)."""
    out: List[Tuple[int, Segment]] = []
    for d, ln in enumerate(doc_lengths):
        start = 0
        for p, size in enumerate(part_sizes(ln, group_size)):
            if size:
                out.append((part_member(p, group_size), Segment(d, start, size)))
            start += size
    return out


def per_doc_segments(doc_lengths: Sequence[int], group_size: int, rank: int) -> List[Segment]:
    """Member `rank`'s segments when each document is split in 2g parts (r and 2g-1-r).

    Remainder tokens go to the first parts, so no padding is ever needed; a document shorter
    than 2g leaves some parts empty.
    """
    parts = 2 * group_size
    out: List[Segment] = []
    for d, ln in enumerate(doc_lengths):
        # part p of split_sizes(ln, parts) starts at p*q + min(p, r): O(1) per part, since
        # planners cost every document of a pack on several members (their inner loop)
        q, r = divmod(ln, parts)
        for part in member_parts(rank, group_size):
            size = q + 1 if part < r else q
            if size:
                out.append(Segment(d, part * q + min(part, r), size))
    return out


def ring_bytes_per_layer(cost, next_rank_tokens: int, total_tokens: int, group_size: int) -> int:
    """Bytes one member sends per layer (fwd+bwd) in ring attention.

    fwd: the K,V blocks travel g-1 hops (a member forwards every block but its successor's);
    bwd: K,V travel again and the dK,dV accumulators travel g hops to come home.
    """
    g = group_size
    if g == 1:
        return 0
    d = cost.dims
    kv_elems_per_token = 2 * d.num_kv_heads * d.head_dim
    tokens_sent = 2 * (total_tokens - next_rank_tokens) + total_tokens
    return d.exchanged(tokens_sent * kv_elems_per_token * cost.profile.bytes_per_element)


class _RingSpec(ShardModeSpec):
    overlaps_compute = True
    attention = "hf_cp.attention.ring:ring_mode_attention"

    def comm_bytes_per_layer(
        self, cost, doc_lengths: Sequence[int], group_size: int, member: int, segments_of: SegmentsOf
    ) -> int:
        nxt = segment_tokens(segments_of((member + 1) % group_size))
        return ring_bytes_per_layer(cost, nxt, sum(doc_lengths), group_size)

    def comm_messages(self, group_size: int) -> int:
        return 3 * (group_size - 1)  # K/V forward, K/V again and dK/dV home in backward


class RingZigzag(_RingSpec):
    name = "ring_zigzag"
    description = "whole packed sequence in 2g chunks, member r holds r and 2g-1-r; K/V round the ring"
    ring_split = "zigzag"

    def segments(self, doc_lengths, group_size, member, params: Optional[Mapping] = None):
        return zigzag_segments(doc_lengths, group_size, member)

    def member_tokens(self, doc_lengths, group_size, params=None):
        return split_member_tokens(sum(doc_lengths), group_size)


class RingPerDoc(_RingSpec):
    name = "ring_per_doc"
    description = "every document in 2g parts, member r holds r and 2g-1-r; K/V round the ring"
    ring_split = "per_doc"

    def segments(self, doc_lengths, group_size, member, params: Optional[Mapping] = None):
        return per_doc_segments(doc_lengths, group_size, member)

    def member_tokens(self, doc_lengths, group_size, params=None):
        if len(doc_lengths) == 1:  # most groups of a step hold one document: no numpy
            return split_member_tokens(doc_lengths[0], group_size)
        return per_doc_member_tokens(doc_lengths, group_size).tolist()


RING_ZIGZAG = register_mode(RingZigzag())
RING_PER_DOC = register_mode(RingPerDoc())
