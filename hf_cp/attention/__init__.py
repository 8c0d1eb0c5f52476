"""Context-parallel attention: local packed documents, Ulysses, ring (zigzag / per-document)
and the block engine (any placement of chunks and compute blocks, any mask).

Importing the package registers "hf_cp" with transformers' AttentionInterface /
AttentionMaskInterface (`interface`, the one module here that imports transformers).
"""

from hf_cp.attention.blocks import Block, document_blocks, segment_blocks
from hf_cp.attention.chunk_state import ChunkContext, ChunkOrderError, ChunkStateStore, chunk_attention, chunk_context
from hf_cp.attention.comm import COUNTER as COMM_COUNTER
from hf_cp.attention.comm import CommStats
from hf_cp.attention.context import CPContext, cp_context, current_cp_context
from hf_cp.attention.dispatch import cp_attention, expected_tokens, group_segments, layer_slices
from hf_cp.attention.engine import EngineSpec, engine_attention
from hf_cp.attention.interface import ATTN_IMPLEMENTATION, hf_cp_attention, hf_cp_mask, register
from hf_cp.attention.kernels import AttentionKernel, kernel_for
from hf_cp.attention.local import block_attention, packed_attention
from hf_cp.attention.ring import RingSpec, ring_attention
from hf_cp.attention.ulysses import UlyssesSpec, check_ulysses_heads, ulysses_attention

__all__ = [
    "Block",
    "document_blocks",
    "segment_blocks",
    "ChunkContext",
    "ChunkOrderError",
    "ChunkStateStore",
    "chunk_attention",
    "chunk_context",
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
    "ATTN_IMPLEMENTATION",
    "hf_cp_attention",
    "hf_cp_mask",
    "register",
]
