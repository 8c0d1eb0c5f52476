"""USP (Ulysses x ring) as a block placement of a CP group of u x r members.

The group's members form r ring positions of u consecutive members each (member = position x
u + i: the u members of a position are neighbours, so the head exchange stays on the fastest
links). The packed sequence is cut as ring zigzag over the r positions (2r pieces, position j
holding pieces j and 2r-1-j) or per document (every sample in 2r parts, the same pairing), and
each position's pieces are cut in u contiguous chunks owned by its members.

Attention then runs as USP does: member i of position j computes query heads
[i H/u, (i+1) H/u) of all of its position's queries. In block terms, every (query chunk, key
chunk) pair with masked pairs is split in u equal head ranges, range i executed by member i of
the query chunk's position: within a position that is Ulysses' all-to-all (Q of the other
heads out, partial outputs back), across positions it is the ring's K/V exchange, each
executor receiving only the K/V heads its query heads use (GQA: the same KV head goes to
several executors only when u exceeds the KV heads, i.e. replicated as far as needed). The
engine executes and prices it as what it is: every byte and the head-split overhead
(CostModel.head_split_factor) come from the placement (cost/blocks.py).

u = g, r = 1 is Ulysses; u = 1 is a ring placement with K/V sent only where needed.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from hf_cp.balance.toolkit.placement import BlockPlacement, Chunk, add_compute_blocks, sample_slices
from hf_cp.modes.ring import per_doc_pieces, zigzag_pieces
from hf_cp.modes.segments import split_sizes
from hf_cp.samples.masks import AttnSlice, SampleMask, rect_pairs

RING_LAYOUTS = ("zigzag", "per_doc")


def usp_factorisations(group_size: int, num_heads: int, max_ulysses: Optional[int] = None) -> List[Tuple[int, int]]:
    """Every (u, r) with u * r = group_size, u a power of two dividing the query heads."""
    out = []
    u = 1
    while u <= group_size:
        if group_size % u == 0 and num_heads % u == 0 and (max_ulysses is None or u <= max_ulysses):
            out.append((u, group_size // u))
        u *= 2
    return out


def _pieces(doc_lengths: Sequence[int], r: int, ring: str) -> List[List[Tuple[int, int, int]]]:
    """Per ring position: its (doc, start, length) pieces in order (ring.zigzag_pieces or
    ring.per_doc_pieces over the r positions)."""
    out: List[List[Tuple[int, int, int]]] = [[] for _ in range(r)]
    pieces = per_doc_pieces(doc_lengths, r) if ring == "per_doc" else zigzag_pieces(doc_lengths, r)
    for position, s in pieces:
        out[position].append((s.doc, s.start, s.length))
    return out


def _check(ulysses: int, ring: int, num_heads: int, ring_layout: str) -> None:
    if ulysses < 1 or ring < 1:
        raise ValueError(f"usp: ulysses {ulysses} and ring {ring} must be positive")
    if num_heads % ulysses:
        raise ValueError(
            f"usp: Ulysses over {ulysses} members splits {num_heads} query heads unevenly; pick u dividing the heads"
        )
    if ring_layout not in RING_LAYOUTS:
        raise ValueError(f"usp: ring_layout {ring_layout!r} must be one of {RING_LAYOUTS}")


def usp_chunks(doc_lengths: Sequence[int], ulysses: int, ring: int, ring_layout: str = "zigzag") -> List[Chunk]:
    """The chunks of the USP placement of a group of ulysses x ring members: each ring
    position's pieces, its tokens in u contiguous runs cut at sample ends (module docstring)."""
    u, r = ulysses, ring
    chunks: List[Chunk] = []
    for j, pieces in enumerate(_pieces(doc_lengths, r, ring_layout)):
        sizes = split_sizes(sum(ln for _, _, ln in pieces), u)
        i, room = 0, sizes[0]
        for d, start, ln in pieces:
            while ln:
                while room == 0:
                    i += 1
                    room = sizes[i]
                take = min(room, ln)
                chunks.append(Chunk(d, start, take, j * u + i))
                start, ln, room = start + take, ln - take, room - take
    return chunks


def usp_chunk_pairs(chunks: Sequence[Chunk], doc_lengths: Sequence[int], slices) -> List[int]:
    """Each chunk's masked pairs against all the keys of its sample (placement.executed_attention_ms)."""
    return [rect_pairs(slices[c.doc], c.start, c.end, 0, doc_lengths[c.doc]) for c in chunks]


def usp_placement(
    doc_lengths: Sequence[int],
    ulysses: int,
    ring: int,
    num_heads: int,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
    ring_layout: str = "zigzag",
    doc_slices: Optional[Sequence[Sequence[AttnSlice]]] = None,
    chunks: Optional[Sequence[Chunk]] = None,
) -> BlockPlacement:
    """The USP placement of a group of ulysses x ring members (module docstring); `chunks`:
    usp_chunks of the same arguments, when already made."""
    u, r = ulysses, ring
    _check(u, r, num_heads, ring_layout)
    slices = doc_slices if doc_slices is not None else sample_slices(doc_lengths, masks)
    pl = BlockPlacement(u * r, num_heads)
    pl.chunks = list(chunks) if chunks is not None else usp_chunks(doc_lengths, u, r, ring_layout)
    h = num_heads // u
    ranges = [(i * h, (i + 1) * h) for i in range(u)]
    owners = [c.owner for c in pl.chunks]

    def executor(q_chunk: int, k_chunk: int, head_start: int, head_end: int) -> int:
        return (owners[q_chunk] // u) * u + head_start // h

    return add_compute_blocks(pl, slices, executor, ranges)
