"""Context-parallel attention: local packed documents, Ulysses, ring (zigzag / per-document)
and the block engine (any placement of chunks and compute blocks, any mask).

Everything but the transformers registration imports only torch. `hf_cp_attention`,
`register` and `ATTN_IMPLEMENTATION` load `interface`, which imports transformers and
registers "hf_cp" with its AttentionInterface / AttentionMaskInterface.
"""

from .blocks import Block, document_blocks, segment_blocks
from .comm import COUNTER as COMM_COUNTER
from .comm import CommStats
from .context import CPContext, cp_context, current_cp_context
from .dispatch import cp_attention, expected_tokens, group_segments, layer_slices
from .engine import EngineSpec, engine_attention
from .kernels import AttentionKernel, kernel_for
from .local import block_attention, packed_attention
from .ring import RingSpec, ring_attention
from .ulysses import UlyssesSpec, check_ulysses_heads, ulysses_attention

_INTERFACE_NAMES = ("hf_cp_attention", "hf_cp_mask", "register", "ATTN_IMPLEMENTATION")


def __getattr__(name):
    if name in _INTERFACE_NAMES:
        from . import interface

        return getattr(interface, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Block",
    "document_blocks",
    "segment_blocks",
    "COMM_COUNTER",
    "CommStats",
    "CPContext",
    "cp_context",
    "current_cp_context",
    "cp_attention",
    "expected_tokens",
    "group_segments",
    "layer_slices",
    "EngineSpec",
    "engine_attention",
    "AttentionKernel",
    "kernel_for",
    "block_attention",
    "packed_attention",
    "RingSpec",
    "ring_attention",
    "UlyssesSpec",
    "check_ulysses_heads",
    "ulysses_attention",
    *_INTERFACE_NAMES,
]
