"""The CP context: what the attention function needs to know about the current micro-batch.

The trainer (or any caller) sets it around a forward/backward; the attention function reads
it. With no context set, attention is plain local attention over packed documents.

Token layout of one rank's micro-batch (the collator builds it, attention relies on it):
    [ this rank's local documents, whole, in order ]
    [ this rank's shards of the distributed documents: registry.rank_segments(mode,
      distributed_lengths, group_size, member), in that order; in mode "blocks" the chunks
      it owns, in the order of the layout's `chunks` (block_layout.BlockLayout.member_segments) ]
position_ids keep each token's rotary position inside its own document (a shared-prompt
sample's answers continue from the end of its prompt: masks.SampleMask.position_ids).
Masks: a document without one is causal; `masks` / `local_masks` carry the others.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Generic, Iterator, List, Optional, Tuple, TypeVar

from hf_cp.modes.registry import rank_segments
from hf_cp.modes.segments import Segment, ShardMode
from hf_cp.plan.block_layout import BlockLayout
from hf_cp.samples.masks import SampleMask

T = TypeVar("T")


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
        # a placement mode (blocks) takes its geometry from the layout: rank_segments names what is missing
        return rank_segments(self.mode, self.distributed_lengths, self.group_size, m, self.blocks)

    @property
    def local_tokens(self) -> int:
        return sum(self.local_lengths)


class ContextSlot(Generic[T]):
    """The context the attention function reads while a block runs (the CP context, ChunkFlow's
    chunk context). A module global, not thread-local: autograd may run backward on another
    thread; autograd functions capture what they need from the context in forward anyway."""

    def __init__(self):
        self.value: Optional[T] = None

    @contextlib.contextmanager
    def holding(self, ctx: Optional[T]) -> Iterator[Optional[T]]:
        prev = self.value
        self.value = ctx
        try:
            yield ctx
        finally:
            self.value = prev


_CURRENT: ContextSlot[CPContext] = ContextSlot()


def current_cp_context() -> Optional[CPContext]:
    return _CURRENT.value


def cp_context(ctx: Optional[CPContext]):
    """Set the CP context for the forward and backward run inside the block."""
    return _CURRENT.holding(ctx)
