"""Block placements as the solvers build them: chunks with owners, compute blocks with executors.

A placement is the body of a CP group in shard mode "blocks" (the block-plan contract): every
distributed sample of the group is cut into chunks (doc, start, length, owner) that cover it
exactly once, and every (query chunk, key chunk) pair of one sample with a non-zero masked
area (masks.rect_pairs) is a compute block (q_chunk, k_chunk, head_start, head_end, executor)
over a head range. `to_dict()` is the plan JSON's "blocks" object.

This module is the solvers' side of that contract (plan/block_layout.py holds the format and its
validation): building a placement from a few rules, keeping each block's masked area, and
measuring it (tokens per member, masked area per member, K/V chunk transfers) in the same
terms the solvers optimise. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hf_cp.modes.segments import ShardMode
from hf_cp.plan.block_layout import BlockLayout, attended_chunk_pairs
from hf_cp.plan.block_layout import Chunk as LayoutChunk
from hf_cp.plan.step_plan import Group
from hf_cp.samples.masks import AttnSlice, SampleMask, SliceKind, rect_pairs


@dataclass(frozen=True)
class Chunk:
    doc: int  # index into the group's distributed samples
    start: int  # sample-local token position
    length: int
    owner: int  # member index

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class ComputeBlock:
    q_chunk: int
    k_chunk: int
    head_start: int
    head_end: int
    executor: int
    pairs: int = 0  # masked query-key pairs of the rectangle (all heads); not serialised


@dataclass
class BlockPlacement:
    """Chunks and compute blocks of one group (member indices 0..group_size-1)."""

    group_size: int
    num_heads: int
    chunks: List[Chunk] = field(default_factory=list)
    compute: List[ComputeBlock] = field(default_factory=list)

    # ---- contract JSON
    def to_dict(self) -> dict:
        return {
            "chunks": [[c.doc, c.start, c.length, c.owner] for c in self.chunks],
            "compute": [[b.q_chunk, b.k_chunk, b.head_start, b.head_end, b.executor] for b in self.compute],
        }

    # ---- measures
    def member_tokens(self) -> List[int]:
        """Rows each member owns (its Q, K, V, O and labels)."""
        return owned_tokens(self.chunks, self.group_size)

    def member_pairs(self) -> List[float]:
        """Masked query-key pairs each member computes, in all-head units (a block over h of
        H heads counts h/H of its rectangle)."""
        out = [0.0] * self.group_size
        H = self.num_heads
        for b in self.compute:
            out[b.executor] += b.pairs * (b.head_end - b.head_start) / H
        return out

    def kv_transfers(self) -> int:
        """K/V chunk transfers: (key chunk, member) pairs where a member other than the chunk's
        owner executes a block over that key chunk (each is sent once, whatever its heads)."""
        need = {(b.k_chunk, b.executor) for b in self.compute if self.chunks[b.k_chunk].owner != b.executor}
        return len(need)

    def received_rows(self) -> List[int]:
        """Rows each member receives to execute its blocks: the K/V chunks and the Q chunks it
        does not own (each counted once per member)."""
        out = [0] * self.group_size
        kv = {(b.k_chunk, b.executor) for b in self.compute if self.chunks[b.k_chunk].owner != b.executor}
        q = {(b.q_chunk, b.executor) for b in self.compute if self.chunks[b.q_chunk].owner != b.executor}
        for c, m in kv | q:
            out[m] += self.chunks[c].length
        return out

    def to_layout(self, divisions: Optional[Sequence[int]] = None) -> BlockLayout:
        """The plan format's layout (block_layout.BlockLayout) of this placement, with a division
        per compute block if given (balancers/dcp/divisions.py: schedule_divisions)."""
        return BlockLayout(
            tuple((c.doc, c.start, c.length, c.owner) for c in self.chunks),
            tuple((b.q_chunk, b.k_chunk, b.head_start, b.head_end, b.executor) for b in self.compute),
            tuple(divisions) if divisions else None,
        )

    def check(self, doc_lengths: Sequence[int], doc_slices: Sequence[Sequence[AttnSlice]]) -> BlockPlacement:
        """The block-plan contract (block_layout.BlockLayout.validate: chunks cover every document
        exactly once, every attended chunk pair appears with head ranges partitioning the heads,
        no zero-area block, members in range); raises BlockLayoutError naming what breaks it."""
        self.to_layout().validate(doc_lengths, self.group_size, [tuple(s) for s in doc_slices], self.num_heads)
        return self


def sample_slices(doc_lengths: Sequence[int], masks: Optional[Sequence[Optional[SampleMask]]] = None):
    """The slices of each document: its mask's, or one causal slice when it has none."""
    masks = masks or [None] * len(doc_lengths)
    out = []
    for n, m in zip(doc_lengths, masks):
        out.append(m.slices() if m is not None else [AttnSlice(0, n, 0, n, SliceKind.CAUSAL)])
    return out


def masks_of(doc_ids: Sequence[int], masks: Optional[Mapping[int, SampleMask]]) -> List[Optional[SampleMask]]:
    """Masks aligned with a group's distributed sample ids (None: causal)."""
    masks = masks or {}
    return [masks.get(s) for s in doc_ids]


def _causal_prefix(x: int, a: int, b: int) -> int:
    """Causal pairs of query rows [0, x) with keys [a, b) (row i sees keys 0..i)."""
    if x <= a:
        return 0
    if x <= b:
        return (x - a) * (x - a + 1) // 2
    return (b - a) * (b - a + 1) // 2 + (x - b) * (b - a)


def add_compute_blocks(
    placement: BlockPlacement,
    doc_slices: Sequence[Sequence[AttnSlice]],
    executor_of=None,
    head_ranges: Sequence[Tuple[int, int]] = (),
) -> BlockPlacement:
    """Append a compute block for every (q, k) chunk pair of one document with masked pairs.

    `executor_of(q_chunk, k_chunk, head_start, head_end)` picks the executor (default: the
    query chunk's owner); `head_ranges` cut [0, num_heads) (default: one range, all heads)."""
    H = placement.num_heads
    ranges = list(head_ranges) or [(0, H)]
    chunks = placement.chunks
    slices = [tuple(sl) for sl in doc_slices]
    pairs = sorted(attended_chunk_pairs([LayoutChunk(c.doc, c.start, c.length, c.owner) for c in chunks], slices))
    causal = [len(sl) == 1 and sl[0] == AttnSlice(0, sl[0].q_end, 0, sl[0].q_end, SliceKind.CAUSAL) for sl in slices]
    for qi, ki in pairs:
        qc, kc = chunks[qi], chunks[ki]
        if causal[qc.doc]:  # the common case, in closed form
            p = _causal_prefix(qc.end, kc.start, kc.end) - _causal_prefix(qc.start, kc.start, kc.end)
        else:
            p = rect_pairs(slices[qc.doc], qc.start, qc.end, kc.start, kc.end)
        if p == 0:
            continue
        for hs, he in ranges:
            ex = qc.owner if executor_of is None else executor_of(qi, ki, hs, he)
            placement.compute.append(ComputeBlock(qi, ki, hs, he, ex, p))
    return placement


def owned_tokens(chunks: Sequence[Chunk], group_size: int) -> List[int]:
    """Rows each member owns of these chunks."""
    out = [0] * group_size
    for c in chunks:
        out[c.owner] += c.length
    return out


def executed_attention_ms(
    cost, chunks: Sequence[Chunk], chunk_pairs: Sequence[int], group_size: int, ulysses: int = 1
) -> List[float]:
    """Per member, the attention (per layer) it executes when every query chunk's blocks run on
    the `ulysses` members of its owner's ring position, heads split evenly over them (u = 1: on
    its owner, as add_compute_blocks places them by default; USP for u > 1), from each chunk's
    masked pairs against all the keys it attends (`chunk_pairs`): the sum over the blocks
    add_compute_blocks would build (their pairs, head range and query chunk), without building them."""
    u, H = ulysses, cost.dims.num_heads
    h = H // u
    factor = cost.head_split_factor(max(1, round(H / h))) if h < H else 1.0
    attn = [0.0] * group_size
    for c, pairs in zip(chunks, chunk_pairs):
        t = cost.c2 * pairs * h / H * factor / cost.chunk_efficiency(c.length)
        first = c.owner // u * u
        for m in range(first, first + u):
            attn[m] += t
    return attn


def request_masks(req) -> Dict[int, SampleMask]:
    """The request's masks (sample id -> SampleMask), if it carries any (PlanRequest.masks)."""
    return dict(getattr(req, "masks", None) or {})


def blocks_group(
    ranks: Sequence[int],
    distributed: Sequence[int],
    placement: Optional[BlockPlacement],
    local: Optional[Mapping[int, Sequence[int]]] = None,
    divisions: Optional[Sequence[int]] = None,
):
    """A plan Group: `distributed` sample ids in mode "blocks" with the placement's layout (its
    documents are those ids, in order; `divisions` its schedule), plus local samples per rank."""

    local = {int(r): list(v) for r, v in (local or {}).items() if v}
    if not distributed:
        return Group(ranks=tuple(ranks), local=local)
    return Group(
        ranks=tuple(ranks),
        distributed=list(distributed),
        mode=ShardMode.BLOCKS,
        local=local,
        blocks=placement.to_layout(divisions),
    )
