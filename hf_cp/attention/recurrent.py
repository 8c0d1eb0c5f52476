"""Token mixers outside softmax attention (Gated DeltaNet, Mamba, Mamba2, short convolutions) on packed documents and across
a CP group, exactly: every document runs through the layer alone.

A recurrent layer mixes tokens by its state and its short causal convolution, both of which must
restart at every document start, and a document spread over a CP group must see its whole
history. The layer's own forward (transformers' torch path, or the kernels it dispatches to) is
exact on one whole document, so this module calls it once per document:
- this rank's local documents: their rows, one call each;
- the distributed documents of a Gated DeltaNet layer: state passing (attention/state_passing.py),
  each member running its own rows only, from the state the pieces before them leave;
- the distributed documents of the other layers (Mamba, Mamba2, short convolutions, and shared-
  prompt samples): each member's rows are gathered over the group (one differentiable
  all-to-all: every member sends its shard rows to every other), each document is assembled in
  token order from the members' segments (any shard mode: Ulysses, ring zigzag and per document,
  blocks), runs once, and this rank keeps the outputs of its own segments. The gradients of the
  gathered rows flow back through the all-to-all and add up on their owner; each member's
  parameter gradients come from its own rows' outputs only, so their sum over the group (the
  data-parallel reduction) is the single-process gradient. That recurrent work is repeated on
  every member of the group (it is linear in tokens); head sharding is not built.

A shared-prompt sample [prompt][answer 1]...[answer n] runs as n sequences [prompt][answer i],
the prompt's rows shared: each answer continues from the prompt's state, as it would trained
alone after the prompt, the prompt's outputs are the first run's (the same in every run), and
the prompt rows' gradients sum over the answers that read them.

A ChunkFlow dependent chunk through a Gated DeltaNet layer continues the earlier chunks' state
and convolution window from ChunkFlow's state store (attention/chunk_recurrence.py).

Refused by name, never run: a dependent chunk through any other recurrent layer (Mamba, Mamba2,
short convolutions: the store carries no state of theirs), a sample with another mask (a window, a prefix, blocks, explicit slices: an
attention pattern with no recurrent meaning), a padding mask on a packed row. A padded batch of
one sequence a row outside a CP context (TRL scoring GRPO and RLOO rollouts) runs the layer's
own forward, which zeroes the padded positions' inputs so that each row starts from zero state.
"""

from __future__ import annotations

import functools
import importlib.util
from collections import Counter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hf_cp.attention.chunk_recurrence import chunk_recurrent_forward
from hf_cp.attention.chunk_state import current_chunk_context
from hf_cp.attention.comm import all_to_all
from hf_cp.attention.context import ContextSlot, CPContext, current_cp_context
from hf_cp.attention.state_passing import STATE_PASSING_MIXERS, state_passing_outputs
from hf_cp.modes.segments import Segment

Tensor = torch.Tensor

# Layer classes whose forward is exact on one whole document (checked against a per-document
# reference in tests/test_recurrent_mixers.py); model_checks refuses every other recurrent class.
DOCUMENT_EXACT_MIXERS = frozenset(
    {
        "Qwen3NextGatedDeltaNet",  # Qwen3-Next: Gated DeltaNet
        "Qwen3_5GatedDeltaNet",  # Qwen3.5
        "Qwen3_5MoeGatedDeltaNet",  # Qwen3.5-MoE
        "BambaMixer",  # Bamba: Mamba2
        "FalconH1Mixer",  # Falcon-H1: Mamba2 beside attention in every layer
        "JambaMambaMixer",  # Jamba: Mamba
        "Lfm2ShortConv",  # LFM2: a gated short convolution
    }
)
ATTACHED = "_hf_cp_per_document"  # set on a module whose forward runs per document

# The packed row's position_ids of the current forward, for a call outside a CP context (the
# recurrent layers are not handed position_ids by their decoder layer).
_POSITIONS: ContextSlot[Tensor] = ContextSlot()
_FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "position_ids")


def _documents_from_positions(position_ids: Tensor, seq: int) -> List[int]:
    if position_ids.ndim == 3 and position_ids.shape[0] == 4:
        # a multimodal-RoPE model's [4, B, T]: the 1-D positions first, then the three M-RoPE rows
        position_ids = position_ids[0]
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    if pos.shape[0] != 1 or pos.shape[1] != seq:
        raise ValueError(
            f"hf_cp recurrent layer: position_ids of shape {tuple(position_ids.shape)} for one packed row of {seq} "
            "tokens; pack documents into one row with position_ids restarting at 0"
        )
    starts = torch.nonzero(pos[0, 1:] != pos[0, :-1] + 1).flatten().add(1).tolist()
    bounds = [0] + starts + [seq]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _member_rows(ctx: CPContext) -> List[List[Segment]]:
    return [ctx.segments(m) for m in range(ctx.group_size)]


def _gather_rows(x: Tensor, counts: Sequence[int], ctx: CPContext) -> Tensor:
    """Every member's rows of the distributed documents, in member order, on every member: an
    all-to-all in which each member sends its rows to all (the backward sums their gradients)."""
    me = ctx.member
    send = torch.cat([x] * ctx.group_size, dim=0)
    return all_to_all(send, [counts[me]] * ctx.group_size, list(counts), ctx.group, me)


def _run(forward: Callable, rows: Tensor, kwargs: Dict) -> Tensor:
    return forward(hidden_states=rows.unsqueeze(0), **kwargs)[0] if rows.shape[0] else rows


def _run_document(forward: Callable, rows: Tensor, mask, kwargs: Dict) -> Tensor:
    """One document's outputs: one run, or for a shared-prompt sample one run per answer after
    the prompt (module docstring)."""
    if mask is None or mask.is_causal or not mask.answers:
        return _run(forward, rows, kwargs)
    p = mask.prompt
    pieces: List[Tensor] = []
    start = p
    for a in mask.answers:
        out = _run(forward, torch.cat([rows[:p], rows[start : start + a]], dim=0), kwargs)
        if not pieces:
            pieces.append(out[:p])
        pieces.append(out[p:])
        start += a
    return torch.cat(pieces, dim=0)


def _distributed_outputs(forward: Callable, x: Tensor, ctx: CPContext, kwargs: Dict) -> Tensor:
    """This rank's output rows of the distributed documents (its segments, in its order)."""
    segments = _member_rows(ctx)
    counts = [sum(s.length for s in segs) for segs in segments]
    if x.shape[0] != counts[ctx.member]:
        raise ValueError(
            f"hf_cp recurrent layer: {x.shape[0]} rows of distributed documents on member {ctx.member}, its "
            f"segments hold {counts[ctx.member]}"
        )
    full = _gather_rows(x, counts, ctx) if ctx.group_size > 1 else x
    # each document's pieces: (start in the document, row offset in `full`, length)
    pieces: List[List[Tuple[int, int, int]]] = [[] for _ in ctx.distributed_lengths]
    offset = 0
    for segs in segments:
        for s in segs:
            pieces[s.doc].append((s.start, offset, s.length))
            offset += s.length
    outputs: Dict[int, Tensor] = {}
    for doc, parts in enumerate(pieces):
        parts.sort()
        order = torch.cat([torch.arange(o, o + n) for _, o, n in parts]) if parts else torch.zeros(0, dtype=torch.long)
        mask = ctx.masks[doc] if doc < len(ctx.masks) else None
        outputs[doc] = _run_document(forward, full.index_select(0, order.to(full.device)), mask, kwargs)
    mine = [outputs[s.doc][s.start : s.start + s.length] for s in segments[ctx.member]]
    return torch.cat(mine, dim=0) if mine else x[:0]


def passes_state(module: torch.nn.Module, ctx: CPContext) -> bool:
    """Whether `module` runs its distributed documents by state passing (each member its own
    rows: attention/state_passing.py) rather than gathered whole on every member: Gated DeltaNet
    layers over a group of 2 or more whose distributed documents are plain causal ones (a
    shared-prompt sample's answers each continue from the prompt: gathered)."""
    return (
        type(module).__name__ in STATE_PASSING_MIXERS
        and ctx.group_size > 1
        and all(m is None or m.is_causal for m in ctx.masks)
    )


def _refuse(module, ctx: Optional[CPContext], attention_mask) -> None:
    name = type(module).__name__
    if current_chunk_context() is not None and name not in STATE_PASSING_MIXERS:
        raise ValueError(
            f"hf_cp recurrent layer ({name}): a dependent chunk (ChunkFlow) would start the layer's recurrent state "
            f"and convolution from zero at every chunk (ChunkFlow carries only Gated DeltaNet layers' state); plan "
            f"without chunking (a cp_balancer other than chunkflow, or auto with members that leave chunkflow out, "
            f"and a cap that holds every sample)"
        )
    masks = tuple(ctx.masks) + tuple(ctx.local_masks) if ctx is not None else ()
    other = next((m for m in masks if m is not None and not m.is_causal and m.kind != "shared_prompt"), None)
    if other is not None:
        raise ValueError(
            f"hf_cp recurrent layer ({name}): a sample with a {other.kind!r} attention mask: a recurrent layer has "
            f"no such pattern (it reads every earlier token of its sequence); only shared-prompt samples run through "
            f"one (each answer after the prompt); train {other.kind} masks with attention-only models"
        )
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
        raise ValueError(
            f"hf_cp recurrent layer ({name}): a padding mask; pack documents into one row instead of padding"
        )


def per_document_forward(module: torch.nn.Module, forward: Callable, *args, **kwargs) -> Tensor:
    """The layer's `forward` run once per document of the packed row (see the module docstring)."""
    hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
    if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
        return forward(hidden_states=hidden, **kwargs)  # generation with a cache: one sequence, as written
    ctx = current_cp_context()
    attention_mask = kwargs.get("attention_mask")
    if ctx is None and attention_mask is not None and _POSITIONS.value is None and kwargs.get("cu_seq_lens_q") is None:
        # a padded batch of one sequence a row (TRL scoring rollouts): the layer's own forward,
        # which zeroes the padded positions' inputs, so each row's state starts from zero
        return forward(hidden_states=hidden, **kwargs)
    kwargs.pop("attention_mask", None)
    _refuse(module, ctx, attention_mask)
    rest = {k: v for k, v in kwargs.items() if k not in _FLASH_KWARGS}
    b, s = hidden.shape[0], hidden.shape[1]
    if b != 1:
        raise ValueError(f"hf_cp recurrent layer ({type(module).__name__}): one packed row per forward, got {b}")
    chunk = current_chunk_context()
    if chunk is not None:
        if ctx is not None:
            raise ValueError(
                f"hf_cp recurrent layer ({type(module).__name__}): a chunk context and a CP context at once; chunked "
                f"samples run on one rank"
            )
        return chunk_recurrent_forward(module, forward, hidden[0], chunk, rest).unsqueeze(0)
    if ctx is not None:
        local = list(ctx.local_lengths)
    elif kwargs.get("cu_seq_lens_q") is not None:
        local = torch.diff(kwargs["cu_seq_lens_q"].flatten().to("cpu", torch.long)).tolist()
    elif _POSITIONS.value is not None:
        local = _documents_from_positions(_POSITIONS.value, s)
    else:
        local = [s]
    x = hidden[0]
    outs, off = [], 0
    local_masks = tuple(ctx.local_masks) if ctx is not None else ()
    for i, n in enumerate(local):
        mask = local_masks[i] if i < len(local_masks) else None
        outs.append(_run_document(forward, x[off : off + n], mask, rest))
        off += n
    if ctx is not None and ctx.distributed_lengths and passes_state(module, ctx):
        outs.append(state_passing_outputs(module, forward, x[off:], ctx, rest))
    elif ctx is not None and ctx.distributed_lengths:
        outs.append(_distributed_outputs(forward, x[off:], ctx, rest))
    elif off != s:
        raise ValueError(
            f"hf_cp recurrent layer ({type(module).__name__}): the row has {s} tokens, its documents {off}"
        )
    return torch.cat(outs, dim=0).unsqueeze(0)


def _keep_positions(module, args, kwargs):
    _POSITIONS.value = kwargs.get("position_ids")


def attach_recurrent_layers(model: torch.nn.Module) -> List[str]:
    """Make every DOCUMENT_EXACT_MIXERS layer of `model` run per document (idempotent); returns the
    class names attached. The language model keeps the row's position_ids for calls made outside a
    CP context (a forward pre-hook: transformers hands recurrent layers no position_ids)."""
    attached = []
    for module in model.modules():
        if type(module).__name__ in DOCUMENT_EXACT_MIXERS and not getattr(module, ATTACHED, False):
            bound = type(module).forward.__get__(module)
            module.forward = functools.partial(per_document_forward, module, bound)
            setattr(module, ATTACHED, True)
            attached.append(type(module).__name__)
    if attached and not getattr(model, ATTACHED, False):
        model.register_forward_pre_hook(_keep_positions, with_kwargs=True)
        setattr(model, ATTACHED, True)
    return sorted(set(attached))


def _kernel_of(name: str) -> str:
    """Which kernel a recurrent layer class computes with: transformers dispatches Gated DeltaNet
    to flash-linear-attention and Mamba to mamba-ssm / causal-conv1d where installed (and on a
    GPU), else to its torch reference implementation."""
    if name in STATE_PASSING_MIXERS:
        return "flash-linear-attention" if importlib.util.find_spec("fla") else "transformers' torch reference"
    if "Mamba" in name or name in ("BambaMixer", "FalconH1Mixer"):
        return "mamba-ssm" if importlib.util.find_spec("mamba_ssm") else "transformers' torch reference"
    return "transformers' torch implementation"


def recurrent_layers_line(model: torch.nn.Module) -> Optional[str]:
    """The start-up line naming each attached recurrent layer class, how a document spread over a
    CP group runs through it, and its kernel (None: the model has none)."""
    counts = Counter(type(m).__name__ for m in model.modules() if type(m).__name__ in DOCUMENT_EXACT_MIXERS)
    if not counts:
        return None
    parts = []
    for name, n in sorted(counts.items()):
        how = "state passing across a CP group" if name in STATE_PASSING_MIXERS else "gathered on every member"
        parts.append(f"{n} x {name} (per document; spread documents: {how}; kernel: {_kernel_of(name)})")
    return "recurrent layers: " + ", ".join(parts)
