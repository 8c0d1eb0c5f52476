"""The "hf_cp" attention implementation for transformers models.

Importing this module registers it with transformers' AttentionInterface and
AttentionMaskInterface (no model class is patched); select it with
`attn_implementation="hf_cp"` and run with `use_cache=False`.

Dispatch on current_cp_context():
- none: plain local attention over the packed documents of each batch row, found from
  cu_seq_lens_q (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) or from where
  position_ids stop counting up by one;
- a context: this rank's micro-batch in context.py's layout (dispatch.cp_attention), with
  each sample's mask from the context;
- a chunk context: one dependent chunk of a long sample, over the K/V state store
  (chunk_state.chunk_attention, keyed by the module's layer_idx).
No dense mask is ever built. The mask function tells the attention function which pattern
transformers asked for on each layer: None for causal layers, a LayerMask carrying the window
for sliding-window layers, which is how a window the model applies only through its mask
(Qwen2-MoE, PhiMoE) reaches attention. The model's own attention features:
- sliding windows (`sliding_window` kwargs, `layer_types`, Qwen2's `use_sliding_window` +
  `max_window_layers`, mask-only windows): converted to a mask on each layer they apply to,
  intersected with the sample's mask in rotary positions;
- attention sinks (GPT-OSS `s_aux`): supported through the log-sum-exp merge;
- logit soft-capping (Gemma 2 `softcap`): the layer runs kernels.softcapped_kernel (the math
  kernel, capping each score before the mask); refused with ChunkFlow's dependent chunks;
- refused by name: a user-supplied attention mask tensor (4D or otherwise), chunked attention,
  extra mask functions (or/and overlays, e.g. bidirectional image tokens), non-causal attention,
  attention dropout, KV-cache decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from hf_cp.attention.chunk_state import chunk_attention, current_chunk_context
from hf_cp.attention.context import current_cp_context
from hf_cp.attention.dispatch import cp_attention, layer_slices
from hf_cp.attention.kernels import softcapped_kernel
from hf_cp.attention.local import packed_attention

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


@dataclass(frozen=True)
class LayerMask:
    """hf_cp_mask's answer for a sliding-window layer: the window transformers asked for
    (each query sees itself and the window-1 keys before it), in place of a dense mask."""

    sliding_window: int


def _layer_window(module, attention_mask, kwargs) -> Optional[int]:
    """The layer's sliding window from the mask transformers built for it and from the
    `sliding_window` the module passes; refuse any other mask and any disagreement."""
    name = type(module).__name__
    from_mask = None
    if isinstance(attention_mask, LayerMask):
        from_mask = attention_mask.sliding_window
    elif attention_mask is not None:
        shape = tuple(getattr(attention_mask, "shape", ()))
        raise ValueError(
            f"hf_cp attention ({name}): got an attention mask {type(attention_mask).__name__} of shape {shape}. "
            "A user-supplied (4D) attention mask is not supported: hf_cp builds no dense mask. Give each sample's "
            "pattern as a mask in the data (hf_cp.samples.masks.SampleMask: prefix-LM, shared prompt, block-causal, "
            "slices) and pack documents with position_ids restarting at 0."
        )
    from_kwargs = kwargs.get("sliding_window")
    if from_kwargs is not None and from_mask is not None and int(from_kwargs) != int(from_mask):
        raise ValueError(
            f"hf_cp attention ({name}): the layer passes sliding_window={from_kwargs} but its mask was built "
            f"with a window of {from_mask}"
        )
    w = from_mask if from_mask is not None else from_kwargs
    if w is not None and int(w) < 1:
        raise ValueError(f"hf_cp attention ({name}): sliding window {w} must be at least 1")
    return None if w is None else int(w)


def _multimodal_rope(module) -> bool:
    # Qwen2-VL-style models pass the attention only the text positions of [4, B, T] position ids
    rope = getattr(getattr(module, "config", None), "rope_parameters", None)
    return isinstance(rope, dict) and rope.get("mrope_section") is not None


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
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None) or ()
    if "chunked_attention" in layer_types or getattr(config, "attention_chunk_size", None):
        raise ValueError(
            f"hf_cp attention ({name}): chunked attention (attention_chunk_size / layer_types 'chunked_attention') "
            "is not supported"
        )
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise ValueError(f"hf_cp attention ({name}): non-causal attention is not supported")
    if dropout:
        raise ValueError(
            f"hf_cp attention ({name}): attention dropout {dropout} is not supported; "
            "set the model's attention_dropout to 0"
        )


def _one_dtype(module, query: Tensor, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The kernels take q, k and v in one dtype. Under autocast (mixed precision without
    DeepSpeed) RoPE hands q and k over in the fp32 of the residual stream while v comes from the
    bf16 projection: cast all three to the autocast dtype, as SDPA does under autocast."""
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        want = torch.get_autocast_dtype(dev)
        return query.to(want), key.to(want), value.to(want)
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            f"hf_cp attention ({type(module).__name__}): query, key and value arrive as {query.dtype}, {key.dtype} "
            f"and {value.dtype} outside autocast; the kernels need one dtype"
        )
    return query, key, value


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
    """transformers attention function: q [B, H, S, D], k/v [B, H_kv, S, D] -> ([B, S, H, D], None).
    MLA (DeepSeek-V2/V3: v's head dim differs from q/k's) runs padded to the larger head dim."""
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if d_v != d_qk:  # kernels need equal head dims; zero columns (of v, or of q and k) add no output and no gradient
        pad = lambda t, n: torch.nn.functional.pad(t, (0, n - t.shape[-1]))
        scaling = scaling if scaling is not None else d_qk**-0.5  # the scale of the unpadded q/k head dim
        if d_v < d_qk:
            value = pad(value, d_qk)
        else:
            query, key = pad(query, d_v), pad(key, d_v)
        out, weights = hf_cp_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        return out[..., :d_v].contiguous(), weights
    _refuse_unsupported(module, query, key, dropout, kwargs)
    query, key, value = _one_dtype(module, query, key, value)
    window = _layer_window(module, attention_mask, kwargs)
    sinks = kwargs.get("s_aux")  # GPT-OSS attention sinks: one logit per head
    b, h, s, d = query.shape
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise ValueError(
            f"hf_cp attention ({type(module).__name__}): attention sinks (s_aux) of shape {tuple(sinks.shape)}; "
            f"expected one per query head ({h},)"
        )
    scale = scaling if scaling is not None else d**-0.5
    softcap = kwargs.get("softcap")  # Gemma 2's attn_logit_softcapping: the math kernel caps each score
    kernel = softcapped_kernel(float(softcap)) if softcap else None
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
        if window is not None or sinks is not None or kernel is not None:
            # the store's attention is plain causal over every earlier chunk: a window, sinks or a cap would be dropped
            feature = " and ".join(
                ([f"a sliding window of {window}"] if window is not None else [])
                + (["attention sinks (s_aux)"] if sinks is not None else [])
                + ([f"attention logit soft-capping at {softcap:g}"] if kernel is not None else [])
            )
            raise ValueError(
                f"hf_cp attention ({name}, layer {layer}): the model's layer has {feature}, which ChunkFlow's "
                f"dependent chunks do not apply (they attend causally over the whole K/V state store). Plan without "
                f"chunking: a cp_balancer other than chunkflow, or auto with members that leave chunkflow out"
            )
        return chunk_attention(q[0], k[0], v[0], int(layer), chunk, scale).unsqueeze(0), None
    if ctx is not None:
        if b != 1:
            raise ValueError(f"hf_cp attention under a CP context needs one packed row per micro-batch, got batch {b}")
        out = cp_attention(q[0], k[0], v[0], ctx, scale, kernel, window=window, sinks=sinks)
        return out.unsqueeze(0), None
    if kwargs.get("cu_seq_lens_q") is not None:
        docs = _docs_from_cu_seqlens(kwargs["cu_seq_lens_q"], b, s)
    elif kwargs.get("position_ids") is not None:
        docs = _docs_from_positions(kwargs["position_ids"], b, s)
    else:
        if s > 1 and _multimodal_rope(module):
            raise ValueError(
                f"hf_cp attention ({type(module).__name__}): no position_ids reached the attention of a model with "
                "multimodal (M-RoPE) positions: it does so when given 2-D or 3-row position_ids, and a packed row "
                "would attend across its documents. Pass position_ids of shape [4, batch, seq]: the 1-D positions "
                "(restarting at 0 per document) first, then the three M-RoPE rows"
            )
        docs = [[s]] * b
    flat = [n for row in docs for n in row]
    slices = layer_slices(tuple(flat), (), window)
    if b == 1:
        out = packed_attention(q[0], k[0], v[0], docs[0], scale, kernel, slices, sinks)
    else:
        out = packed_attention(
            q.reshape(b * s, h, d),
            k.reshape(b * s, k.shape[2], d),
            v.reshape(b * s, v.shape[2], v.shape[3]),
            flat,
            scale,
            kernel,
            slices,
            sinks,
        )
    return out.view(b, s, h, v.shape[3]), None


def hf_cp_mask(
    *args,
    attention_mask: Optional[Tensor] = None,
    local_size: Optional[int] = None,
    use_vmap: bool = False,
    config=None,
    **kwargs,
):
    """No dense mask: documents are found from position_ids / cu_seqlens, sample masks come
    from the CP context. Returns None for a causal layer and a LayerMask for a sliding-window
    one (transformers passes the window as local_size), which the attention function applies.
    A padding mask would be silently lost, so refuse one (pack documents instead of padding);
    refuse extra mask functions and chunked attention, which hf_cp cannot honour."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "hf_cp attention does not take padded batches (the attention_mask has zeros): pack the "
            "documents into one row with position_ids restarting at 0 for each document"
        )
    if use_vmap:  # transformers sets it exactly when the model adds or_mask_function / and_mask_function
        raise ValueError(
            "hf_cp attention: the model adds its own mask function on top of the causal mask (an or/and mask "
            "overlay, e.g. bidirectional attention over image tokens); hf_cp does not support it"
        )
    if local_size is None:
        return None
    if (
        getattr(config, "attention_chunk_size", None) == local_size
        and getattr(config, "sliding_window", None) != local_size
    ):
        raise ValueError("hf_cp attention: chunked attention (attention_chunk_size) is not supported")
    return LayerMask(int(local_size))


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the attention and mask functions with transformers under `name` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, hf_cp_attention)
    AttentionMaskInterface.register(name, hf_cp_mask)
    return name


register()
