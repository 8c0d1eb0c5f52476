"""Ulysses: a contiguous token split, then an all-to-all from tokens to heads and back.

Geometry: member r holds the r-th of g contiguous pieces of the packed sequence. After the
exchange every member runs whole documents on H/g query heads (kv heads replicated only as far
as needed when there are fewer than g). Cost: the attention of whole documents on a share of
the heads, times the measured head-split factor; the all-to-alls do not overlap compute.
Execution: hf_cp.attention.ulysses.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence

from hf_cp.modes.registry import SegmentsOf, ShardModeSpec, register_mode
from hf_cp.modes.segments import Segment, check_ulysses_heads, chunk_bounds, cut, split_sizes


def contiguous_segments(doc_lengths: Sequence[int], group_size: int, rank: int) -> List[Segment]:
    """Member `rank`'s token segments under Ulysses (contiguous split of the packed sequence)."""
    b = chunk_bounds(sum(doc_lengths), group_size)
    return cut(doc_lengths, b[rank], b[rank + 1])


def kv_heads_after_replication(num_kv_heads: int, group_size: int) -> int:
    """KV heads the all-to-all moves: replicated up to the group size when fewer."""
    return num_kv_heads if num_kv_heads >= group_size else group_size


def ulysses_bytes_per_layer(cost, rank_tokens: int, total_tokens: int, group_size: int) -> int:
    """Bytes one member sends per layer (fwd+bwd) in Ulysses all-to-alls.

    fwd: q,k,v of this member's tokens for the other members' heads, then the output of this
    member's heads for the other members' tokens; bwd mirrors it (dO like q, dq/dk/dv like out).
    """
    g = group_size
    if g == 1:
        return 0
    d = cost.dims
    check_ulysses_heads(d.num_heads, d.num_kv_heads, g)
    q_heads, kv_heads = d.num_heads // g, kv_heads_after_replication(d.num_kv_heads, g) // g  # per member
    others_tokens = total_tokens - rank_tokens
    send_qkv = rank_tokens * (q_heads + 2 * kv_heads) * (g - 1)
    send_out = others_tokens * q_heads
    send_dout = rank_tokens * q_heads * (g - 1)
    send_dqkv = others_tokens * (q_heads + 2 * kv_heads)
    elems = (send_qkv + send_out + send_dout + send_dqkv) * d.head_dim
    return d.exchanged(elems * cost.profile.bytes_per_element)


class Ulysses(ShardModeSpec):
    name = "ulysses"
    description = "contiguous token split; all-to-all over heads, whole documents on H/g heads per member"
    splits_heads = True
    attention = "hf_cp.attention.ulysses:ulysses_mode_attention"

    def segments(self, doc_lengths, group_size, member, params: Optional[Mapping] = None):
        return contiguous_segments(doc_lengths, group_size, member)

    def member_tokens(self, doc_lengths, group_size, params=None):
        return split_sizes(sum(doc_lengths), group_size)

    def check_group(self, dims, group_size: int) -> None:
        check_ulysses_heads(dims.num_heads, dims.num_kv_heads, group_size)

    def attention_ms(self, cost, doc_lengths, group_size, segments, masks=None) -> float:
        # after the all-to-all each member runs whole documents on H/g heads
        return cost.head_split_factor(group_size) * cost.docs_attention_ms(doc_lengths, masks) / group_size

    def comm_bytes_per_layer(self, cost, doc_lengths, group_size, member, segments_of: SegmentsOf) -> int:
        mine = sum(s.length for s in segments_of(member))
        return ulysses_bytes_per_layer(cost, mine, sum(doc_lengths), group_size)

    def comm_messages(self, group_size: int) -> int:
        return 4 * (group_size - 1)  # q/k/v and out forward, dout and dq/dk/dv backward


ULYSSES = register_mode(Ulysses())
