"""Ulysses attention: all-to-all from a token split to a head split and back.

Members hold contiguous token ranges of the packed distributed documents (ShardMode.ULYSSES).
One all-to-all gives every member all tokens for H/g query heads (q, k and v in one message);
each member then runs plain packed attention on whole documents and a second all-to-all
returns its heads' output to the tokens' owners. Autograd mirrors both exchanges.

GQA: with H_kv >= g kv heads they split like q heads (H_kv % g == 0 needed). With fewer kv
heads than members, each kv head is replicated only to the g / H_kv members whose q heads use
it (one kv head per member); autograd sums the replicas' gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from hf_cp.attention.blocks import Slices, document_blocks
from hf_cp.attention.comm import all_to_all
from hf_cp.attention.kernels import AttentionKernel, kernel_for
from hf_cp.attention.local import block_attention
from hf_cp.modes.segments import check_ulysses_heads

Tensor = torch.Tensor


@dataclass(frozen=True)
class UlyssesSpec:
    group: object
    member: int
    rank_tokens: Tuple[int, ...]  # tokens each member holds, in member order
    doc_lengths: Tuple[int, ...]  # the distributed documents, whole
    slices: Optional[Tuple[Optional[Slices], ...]] = None  # per document: its mask under this layer (None: causal)

    @property
    def size(self) -> int:
        return len(self.rank_tokens)


def _kv_for_members(x: Tensor, g: int) -> Tensor:
    """[n, H_kv, D] -> [n, max(H_kv, g), D]: replicate each kv head to the members that need it."""
    hkv = x.shape[1]
    return x if hkv >= g else x.repeat_interleave(g // hkv, dim=1)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: UlyssesSpec,
    scale: float,
    kernel: Optional[AttentionKernel] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """This member's token rows (q [n, H, D], k/v [n, H_kv, D]) -> attention output [n, H, D]."""
    g, me = spec.size, spec.member
    n, h, d = q.shape
    hkv = k.shape[1]
    if n != spec.rank_tokens[me]:
        raise ValueError(f"member {me} should hold {spec.rank_tokens[me]} distributed tokens, got {n}")
    check_ulysses_heads(h, hkv, g)
    kernel = kernel or kernel_for(q.device, dtype=q.dtype)
    blocks = document_blocks(spec.doc_lengths, 0, spec.slices)
    if g == 1:
        return block_attention(q, k, v, blocks, scale, kernel, sinks)
    hq_r = h // g
    k_m, v_m = _kv_for_members(k, g), _kv_for_members(v, g)
    hk_r = k_m.shape[1] // g
    # [n, g, heads of member j, D] -> [g, n, ...]: the rows for member j are contiguous
    packed = torch.cat([q.reshape(n, g, hq_r, d), k_m.reshape(n, g, hk_r, d), v_m.reshape(n, g, hk_r, d)], dim=2)
    packed = packed.transpose(0, 1).reshape(g * n, hq_r + 2 * hk_r, d)
    total = sum(spec.rank_tokens)
    heads = all_to_all(packed, [n] * g, spec.rank_tokens, spec.group, me)  # [total, hq_r + 2 hk_r, D]
    q_h, k_h, v_h = heads.split([hq_r, hk_r, hk_r], dim=1)
    my_sinks = sinks[me * hq_r : (me + 1) * hq_r] if sinks is not None else None  # this member's heads
    out_h = block_attention(q_h, k_h, v_h, blocks, scale, kernel, my_sinks) if total else q_h
    back = all_to_all(out_h, spec.rank_tokens, [n] * g, spec.group, me)  # [g * n, hq_r, D], by head owner
    return back.reshape(g, n, hq_r, d).transpose(0, 1).reshape(n, h, d)


def ulysses_mode_attention(
    q: Tensor, k: Tensor, v: Tensor, ctx, segments, slices, scale: float, kernel: AttentionKernel, sinks=None
) -> Tensor:
    """The Ulysses mode's entry for dispatch.cp_attention (hf_cp/modes/ulysses.py)."""
    tokens = tuple(sum(s.length for s in m) for m in segments)
    spec = UlyssesSpec(ctx.group, ctx.member, tokens, tuple(ctx.distributed_lengths), slices)
    return ulysses_attention(q, k, v, spec, scale, kernel, sinks)
