"""The "hf_cp" attention implementation for transformers models.

Importing this module registers it with transformers' AttentionInterface and
AttentionMaskInterface (no model class is patched); select it with
`attn_implementation="hf_cp"` and run with `use_cache=False`.

Dispatch on current_cp_context():
- none: plain local attention over the packed documents of each batch row, found from
  cu_seq_lens_q (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) or from where
  position_ids stop counting up by one;
- a context: this rank's micro-batch in context.py's layout (dispatch.cp_attention);
- a chunk context: one dependent chunk of a long sample, over the K/V state store
  (chunk_state.chunk_attention, keyed by the module's layer_idx).
The mask function returns None, so no dense mask is ever built; documents come from the
inputs above, not from a mask.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .chunk_state import chunk_attention, current_chunk_context
from .context import current_cp_context
from .dispatch import cp_attention
from .local import packed_attention

ATTN_IMPLEMENTATION = "hf_cp"

Tensor = torch.Tensor

# position_ids is the same tensor in every layer of one forward: find its documents once.
_LAST_POSITIONS: List = [None, None]


def _docs_from_positions(position_ids: Tensor, batch: int, seq: int) -> List[List[int]]:
    if _LAST_POSITIONS[0] is position_ids:
        return _LAST_POSITIONS[1]
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[-1] != seq:
        raise ValueError(f"position_ids have {pos.shape[-1]} positions per row but the sequence has {seq} tokens")
    pos = pos.expand(batch, seq) if pos.shape[0] == 1 else pos
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    docs = []
    for row in starts.cpu():
        idx = torch.nonzero(row).flatten().tolist() + [seq]
        docs.append([b - a for a, b in zip(idx, idx[1:])])
    _LAST_POSITIONS[0], _LAST_POSITIONS[1] = position_ids, docs
    return docs


def _docs_from_cu_seqlens(cu: Tensor, batch: int, seq: int) -> List[List[int]]:
    lengths = torch.diff(cu.flatten().to("cpu", torch.long)).tolist()
    if batch != 1 or sum(lengths) != seq:
        raise ValueError(
            f"cu_seq_lens_q describes {sum(lengths)} packed tokens in one row, but the batch is "
            f"{batch} rows of {seq} tokens"
        )
    return [lengths]


def _refuse_unsupported(module, query: Tensor, key: Tensor, dropout: float, kwargs) -> None:
    name = type(module).__name__
    if kwargs.get("use_cache") and getattr(module, "training", False):
        raise ValueError(
            f"hf_cp attention ({name}): use_cache=True in training. transformers skips packed-document detection "
            "when a cache is used, and a cache serves no purpose in training. Set model.config.use_cache=False "
            "or pass use_cache=False to the forward call."
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"hf_cp attention ({name}): {query.shape[2]} queries against {key.shape[2]} keys, i.e. KV-cache "
            "decoding. hf_cp attention is for training on packed documents; generate with "
            "model.set_attn_implementation('sdpa')."
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"hf_cp attention ({name}): sliding_window={kwargs['sliding_window']} is not supported "
            "(only causal attention inside each document)"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(f"hf_cp attention ({name}): attention logit softcapping is not supported")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError(f"hf_cp attention ({name}): non-causal attention is not supported")
    if dropout:
        raise ValueError(
            f"hf_cp attention ({name}): attention dropout {dropout} is not supported; "
            "set the model's attention_dropout to 0"
        )


def hf_cp_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
):
    """transformers attention function: q [B, H, S, D], k/v [B, H_kv, S, D] -> ([B, S, H, D], None)."""
    _refuse_unsupported(module, query, key, dropout, kwargs)
    b, h, s, d = query.shape
    scale = scaling if scaling is not None else d**-0.5
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, S, heads, D] views
    ctx = current_cp_context()
    chunk = current_chunk_context()
    if chunk is not None:
        name = type(module).__name__
        if ctx is not None:
            raise ValueError(
                f"hf_cp attention ({name}): a chunk context and a CP context at once; chunked samples run on one rank"
            )
        if b != 1:
            raise ValueError(f"hf_cp attention ({name}): a dependent chunk runs as one row, got batch {b}")
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(
                f"hf_cp attention ({name}): ChunkFlow's state store needs the module's layer_idx, it has none"
            )
        return chunk_attention(q[0], k[0], v[0], int(layer), chunk, scale).unsqueeze(0), None
    if ctx is not None:
        if b != 1:
            raise ValueError(f"hf_cp attention under a CP context needs one packed row per micro-batch, got batch {b}")
        out = cp_attention(q[0], k[0], v[0], ctx, scale)
        return out.unsqueeze(0), None
    if kwargs.get("cu_seq_lens_q") is not None:
        docs = _docs_from_cu_seqlens(kwargs["cu_seq_lens_q"], b, s)
    elif kwargs.get("position_ids") is not None:
        docs = _docs_from_positions(kwargs["position_ids"], b, s)
    else:
        docs = [[s]] * b
    if b == 1:
        out = packed_attention(q[0], k[0], v[0], docs[0], scale)
    else:
        out = packed_attention(
            q.reshape(b * s, h, d),
            k.reshape(b * s, k.shape[2], d),
            v.reshape(b * s, v.shape[2], v.shape[3]),
            [n for row in docs for n in row],
            scale,
        )
    return out.view(b, s, h, v.shape[3]), None


def hf_cp_mask(*args, attention_mask: Optional[Tensor] = None, **kwargs):
    """No dense mask: documents are found from position_ids / cu_seqlens. A padding mask would
    be silently lost, so refuse one (pack documents instead of padding)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "hf_cp attention does not take padded batches (the attention_mask has zeros): pack the "
            "documents into one row with position_ids restarting at 0 for each document"
        )
    return None


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the attention and mask functions with transformers under `name` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, hf_cp_attention)
    AttentionMaskInterface.register(name, hf_cp_mask)
    return name


register()
