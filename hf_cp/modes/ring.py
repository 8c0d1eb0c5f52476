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

from typing import List, Mapping, Optional, Sequence

from hf_cp.modes.registry import SegmentsOf, ShardModeSpec, register_mode
from hf_cp.modes.segments import Segment, chunk_bounds, cut, segment_tokens, split_sizes


def zigzag_segments(doc_lengths: Sequence[int], group_size: int, rank: int) -> List[Segment]:
    """Member `rank`'s query segments when the whole packed sequence is zigzag-split."""
    g = group_size
    b = chunk_bounds(sum(doc_lengths), 2 * g)
    return cut(doc_lengths, b[rank], b[rank + 1]) + cut(doc_lengths, b[2 * g - 1 - rank], b[2 * g - rank])


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
        for part in (rank, parts - 1 - rank):
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
    return tokens_sent * kv_elems_per_token * cost.profile.bytes_per_element


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

    def segments(self, doc_lengths, group_size, member, params: Optional[Mapping] = None):
        return zigzag_segments(doc_lengths, group_size, member)

    def member_tokens(self, doc_lengths, group_size, params=None):
        parts = split_sizes(sum(doc_lengths), 2 * group_size)
        return [parts[m] + parts[2 * group_size - 1 - m] for m in range(group_size)]


class RingPerDoc(_RingSpec):
    name = "ring_per_doc"
    description = "every document in 2g parts, member r holds r and 2g-1-r; K/V round the ring"

    def segments(self, doc_lengths, group_size, member, params: Optional[Mapping] = None):
        return per_doc_segments(doc_lengths, group_size, member)

    def member_tokens(self, doc_lengths, group_size, params=None):
        out = [0] * group_size
        for n in doc_lengths:
            parts = split_sizes(n, 2 * group_size)
            for m in range(group_size):
                out[m] += parts[m] + parts[2 * group_size - 1 - m]
        return out


RING_ZIGZAG = register_mode(RingZigzag())
RING_PER_DOC = register_mode(RingPerDoc())
