"""The CP context: what the attention function needs to know about the current micro-batch.

The trainer (or any caller) sets it around a forward/backward; the attention function reads
it. With no context set, attention is plain local attention over packed documents.

Token layout of one rank's micro-batch (the collator builds it, attention relies on it):
    [ this rank's local documents, whole, in order ]
    [ this rank's shards of the distributed documents: shard.rank_segments(mode,
      distributed_lengths, group_size, member), in that order; in mode "blocks" the chunks
      it owns, in the order of the layout's `chunks` (block_plan.BlockLayout.member_segments) ]
position_ids keep each token's rotary position inside its own document (a shared-prompt
sample's answers continue from the end of its prompt: masks.SampleMask.position_ids).
Masks: a document without one is causal; `masks` / `local_masks` carry the others.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

from ..block_plan import BlockLayout
from ..masks import SampleMask
from ..shard import Segment, ShardMode, rank_segments


@dataclass(frozen=True)
class CPContext:
    group: Any  # torch.distributed ProcessGroup of the members, or None when group_size == 1
    group_ranks: Tuple[int, ...]  # global ranks of the members, in member order
    member: int  # this rank's index in group_ranks
    mode: ShardMode = ShardMode.RING_PER_DOC
    distributed_lengths: Tuple[int, ...] = ()  # full lengths of the distributed documents (same on all members)
    local_lengths: Tuple[int, ...] = ()  # this rank's local documents
    blocks: Optional[BlockLayout] = None  # mode BLOCKS: the group's chunks and compute blocks
    masks: Tuple[Optional[SampleMask], ...] = ()  # per distributed document (empty or None: causal)
    local_masks: Tuple[Optional[SampleMask], ...] = ()  # per local document of this rank

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)

    def segments(self, member: Optional[int] = None) -> List[Segment]:
        """The distributed-document segments a member holds (default: this rank)."""
        if not self.distributed_lengths:
            return []
        m = self.member if member is None else member
        if ShardMode(self.mode) == ShardMode.BLOCKS:
            if self.blocks is None:
                raise ValueError("CPContext in mode 'blocks' needs its block layout (CPContext.blocks)")
            return self.blocks.member_segments(m)
        return rank_segments(self.mode, self.distributed_lengths, self.group_size, m)

    @property
    def local_tokens(self) -> int:
        return sum(self.local_lengths)


# A module global, not thread-local: autograd may run backward on another thread. Autograd
# functions capture what they need from the context in forward anyway.
_CURRENT: List[Optional[CPContext]] = [None]


def current_cp_context() -> Optional[CPContext]:
    return _CURRENT[0]


@contextlib.contextmanager
def cp_context(ctx: Optional[CPContext]) -> Iterator[Optional[CPContext]]:
    """Set the CP context for the forward and backward run inside the block."""
    prev = _CURRENT[0]
    _CURRENT[0] = ctx
    try:
        yield ctx
    finally:
        _CURRENT[0] = prev
