"""Attention of query segments over the keys of their own documents: one rank's shard work.

A segment (start, length) is a run of queries at positions start..start+length-1 of one
document; causally they see that document's keys 0..start+length-1. Keys before `start` live
on other ranks in a real CP run (ring attention brings them over); for measuring compute they
come from a `prefix` tensor the caller provides (placeholders in replay). Local documents are
segments with start 0.

The work runs on the attention package's block kernels (hf_cp.attention.local.block_attention:
torch's CPU flash kernel, torch varlen_attn or flash-attn on CUDA), so replay and profiling
time the same kernels training uses: per segment a square causal block over its own keys and,
when it has a prefix, a full block over the prefix keys, merged by log-sum-exp as a ring step
does (in one kernel call per block shape rather than one per ring step). Tensors are token-major: [tokens, heads, head_dim].
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from hf_cp.attention.blocks import Block
from hf_cp.attention.local import block_attention


class SegmentLayout:
    """The blocks of `segments` (start, length) laid out back to back, with prefix keys stored after
    the segments' own keys. Built once per micro-batch, outside the timed region, like a
    collator's metadata."""

    def __init__(self, segments: Sequence[Tuple[int, int]], device: torch.device):
        self.segments: List[Tuple[int, int]] = [(int(s), int(n)) for s, n in segments]
        for i, (s, n) in enumerate(self.segments):
            if s < 0 or n <= 0:
                raise ValueError(f"segment {i}: start {s} must be >= 0 and length {n} > 0")
        self.device = torch.device(device)
        self.tokens = sum(n for _, n in self.segments)
        self.max_start = max((s for s, _ in self.segments), default=0)
        blocks, row = [], 0
        for s, n in self.segments:
            blocks.append(Block(row, row, n, n, True))  # own keys, causal
            if s:
                blocks.append(Block(row, self.tokens, n, s, False))  # prefix keys 0..s-1, all seen
            row += n
        self.blocks = blocks

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefix_k: Optional[torch.Tensor] = None,
        prefix_v: Optional[torch.Tensor] = None,
        scale: Optional[float] = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, H_kv, D] of the segments' own tokens; prefix_k/v [P >= max start, H_kv, D]."""
        if q.shape[0] != self.tokens:
            raise ValueError(f"q has {q.shape[0]} tokens, the layout {self.tokens}")
        if self.max_start:
            if prefix_k is None or prefix_k.shape[0] < self.max_start:
                have = None if prefix_k is None else prefix_k.shape[0]
                raise ValueError(f"segments start up to position {self.max_start}; the prefix keys hold {have}")
            k, v = torch.cat([k, prefix_k]), torch.cat([v, prefix_v])
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # block_attention plans its gathers on every call, as the training path does per layer
        return block_attention(q, k, v, self.blocks, scale)
