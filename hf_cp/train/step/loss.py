"""The language-model loss without the full logits: cross-entropy over the LM head a chunk of
tokens at a time.

At long context the logits are the largest tensor of a step: 32K tokens x 152K vocabulary is
20 GB in fp32, more than all checkpointed layer inputs of a 7B model together. Here the model
runs with its LM head short-circuited (it hands back its input, the final hidden states), and
the loss is summed over chunks of `chunk_tokens` tokens; each chunk's logits are recomputed in
backward (activation checkpointing), so at most one chunk's logits exist at a time. The sum is
the same per-token cross-entropy in fp32, only added in another order.

Only for heads whose output *is* the model's logits: models that scale or soft-cap logits
after the head (Gemma 2/3, Cohere, ...) are detected by `head_output_is_logits` and keep the
full-logits path.

With `use_liger_kernel` on CUDA, `liger_lm_head_loss` takes the chunked loss's place: the same
sum, by Liger's fused linear cross-entropy (Triton), which computes each chunk's logits, loss
and gradients in one pass in forward and never keeps the logits for backward.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)  # in the head's dtype, as the model computes them
    if logits.dtype != torch.float64:
        logits = logits.float()  # the loss in fp32 at least
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def chunked_lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    extra_rows: Optional[torch.Tensor] = None,
    extra_targets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """sum_t CE(hidden[t] @ weight.T + bias, targets[t]) in fp32, `chunk_tokens` tokens at a time,
    plus sum_j CE(hidden[extra_rows[j]] @ weight.T + bias, extra_targets[j]).

    hidden: [T, H]; weight: [V, H]; targets: [T] (ignore_index where no loss). Every chunk stays
    in the graph even when all its targets are ignored, so the head always receives a gradient
    (zero), as with the full logits. The extra targets are rows with more than one target (a
    shared prompt's last token predicts the first token of every answer: samples/targets.py).
    """
    _check_rows(hidden, targets, chunk_tokens)
    total = None
    for s in range(0, hidden.shape[0], chunk_tokens):
        part = checkpoint(
            _chunk_loss,
            hidden[s : s + chunk_tokens],
            weight,
            bias,
            targets[s : s + chunk_tokens],
            ignore_index,
            use_reentrant=False,
        )
        total = part if total is None else total + part
    rows, extra = _checked_extras(hidden.shape[0], extra_rows, extra_targets)
    for s in range(0, rows.numel(), chunk_tokens):
        part = checkpoint(
            _chunk_loss,
            hidden.index_select(0, rows[s : s + chunk_tokens]),
            weight,
            bias,
            extra[s : s + chunk_tokens],
            ignore_index,
            use_reentrant=False,
        )
        total = total + part
    return total


def _chunk_token_logps(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    if logits.dtype != torch.float64:
        logits = logits.float()
    return -F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")  # 0 where ignored


def chunked_lm_head_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    extra_rows: Optional[torch.Tensor] = None,
    extra_targets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(target) in fp32 (0 where the target is ignored), `chunk_tokens` rows of
    logits at a time, recomputed in backward: ([T], [k] for the extra targets). The summed
    cross-entropy above is minus their sum; sequence-level losses (DPO, GRPO) need them apart."""
    _check_rows(hidden, targets, chunk_tokens)
    parts = [
        checkpoint(
            _chunk_token_logps,
            hidden[s : s + chunk_tokens],
            weight,
            bias,
            targets[s : s + chunk_tokens],
            ignore_index,
            use_reentrant=False,
        )
        for s in range(0, hidden.shape[0], chunk_tokens)
    ]
    rows, extra = _checked_extras(hidden.shape[0], extra_rows, extra_targets)
    extras = [
        checkpoint(
            _chunk_token_logps,
            hidden.index_select(0, rows[s : s + chunk_tokens]),
            weight,
            bias,
            extra[s : s + chunk_tokens],
            ignore_index,
            use_reentrant=False,
        )
        for s in range(0, rows.numel(), chunk_tokens)
    ]
    empty = hidden.new_zeros(0, dtype=torch.float32 if hidden.dtype != torch.float64 else torch.float64)
    return torch.cat(parts), (torch.cat(extras) if extras else empty)


def logits_token_logps(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    extra_rows: Optional[torch.Tensor] = None,
    extra_targets: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The same per-token log-probs from full logits [T, V]."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    own = -F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")
    rows, extra = _checked_extras(logits.shape[0], extra_rows, extra_targets)
    more = -F.cross_entropy(logits.index_select(0, rows), extra, reduction="none") if rows.numel() else own[:0]
    return own, more


def logits_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    extra_rows: Optional[torch.Tensor] = None,
    extra_targets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The same sum from full logits [T, V] (models whose head output is not the logits)."""
    if logits.dtype != torch.float64:
        logits = logits.float()  # the loss in fp32 at least, as in the chunked path
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    rows, extra = _checked_extras(logits.shape[0], extra_rows, extra_targets)
    if rows.numel():
        total = total + F.cross_entropy(logits.index_select(0, rows), extra, reduction="sum")
    return total


def _check_rows(hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> None:
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    _check_shapes(hidden, targets)


def _check_shapes(hidden: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0] or hidden.shape[0] == 0:
        raise ValueError(
            f"hidden [T, H] and targets [T] with T > 0 expected, got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )


def _checked_extras(
    n_rows: int, rows: Optional[torch.Tensor], targets: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    if rows is None and targets is None:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    if rows is None or targets is None or rows.shape != targets.shape or rows.dim() != 1:
        raise ValueError(
            f"extra_rows and extra_targets must be given together, as [k] tensors of one shape; got "
            f"{None if rows is None else tuple(rows.shape)} and {None if targets is None else tuple(targets.shape)}"
        )
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n_rows):
        raise ValueError(f"extra_rows must index the {n_rows} rows, got rows {int(rows.min())}..{int(rows.max())}")
    return rows, targets


# ---------------------------------------------------------------------------- Liger's fused loss
LIGER_FUNCTIONAL = "liger_kernel.transformers.functional"  # pip install liger-kernel
# what the trainer logs at start-up when Liger's fused loss replaces the chunked one
LIGER_LOSS_LINE = "loss: Liger's fused linear cross-entropy in place of the chunked LM-head loss (use_liger_kernel)"


def liger_loss_problem(device_type: str, loss_chunk_tokens: int) -> Optional[str]:
    """Why `use_liger_kernel` cannot be honoured on a `device_type` run (None: it can): Liger's
    kernels are Triton kernels for CUDA, its package must import, and the loss must go through
    the LM head bypass (cp_loss_chunk_tokens > 0), where its fused loss replaces the chunked one."""
    if device_type != "cuda":
        return (
            f"use_liger_kernel is not supported on {device_type}: Liger's kernels are Triton kernels for CUDA, and "
            f"CPTrainer computes the loss with its own chunked LM-head loss (cp_loss_chunk_tokens bounds the "
            f"logits' memory); set use_liger_kernel: false"
        )
    if loss_chunk_tokens == 0:
        return (
            "use_liger_kernel with cp_loss_chunk_tokens: 0 (the full logits): Liger's fused loss replaces the chunked "
            "LM-head loss, which cp_loss_chunk_tokens: 0 turns off; set cp_loss_chunk_tokens > 0 or use_liger_kernel: false"
        )
    try:
        importlib.import_module(LIGER_FUNCTIONAL)
    except Exception as e:  # noqa: BLE001 - a broken Triton install raises more than ImportError
        return (
            f"use_liger_kernel needs liger-kernel (pip install liger-kernel): {LIGER_FUNCTIONAL} does not import "
            f"({type(e).__name__}: {str(e)[:200]})"
        )
    return None


def liger_lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    extra_rows: Optional[torch.Tensor] = None,
    extra_targets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """chunked_lm_head_loss's sum (the same arguments but the chunk size, which Liger chooses
    itself from the vocabulary and hidden sizes) by Liger's fused linear cross-entropy:
    sum_t CE(hidden[t] @ weight.T + bias, targets[t]) over the targets that are not
    ignore_index, plus the extra targets' rows (one more fused call on those rows). The loss is
    accumulated in fp32, the weight's gradient too where Liger has `accum_dtype`."""
    _check_shapes(hidden, targets)
    rows, extra = _checked_extras(hidden.shape[0], extra_rows, extra_targets)
    # liger-kernel is an optional dependency (CUDA only): imported when its loss is used
    fused = importlib.import_module(LIGER_FUNCTIONAL).liger_fused_linear_cross_entropy
    kw = dict(bias=bias, ignore_index=ignore_index, reduction="sum")
    # accum_dtype: liger-kernel 0.6.2 and later; older releases sum the gradient in the weight's dtype
    if "accum_dtype" in inspect.signature(fused).parameters:
        kw["accum_dtype"] = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    total = fused(hidden, weight, targets, **kw)
    if rows.numel():
        total = total + fused(hidden.index_select(0, rows.to(hidden.device)), weight, extra.to(targets.device), **kw)
    return total


@contextlib.contextmanager
def lm_head_bypassed(head: torch.nn.Module, captured: List[torch.Tensor]) -> Iterator[None]:
    """Within the block the LM head appends its input to `captured` and returns an empty
    [..., 0] tensor instead of logits, so the model never materialises them.

    The empty output still depends on the head's parameters (a zero term, no values): DDP with
    find_unused_parameters (the Trainer's default) walks the forward's outputs to find unused
    parameters, and would otherwise mark the head ready at once and again when the chunked
    loss's backward reaches it ("marked as ready twice")."""

    def capture(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        captured.append(hidden)
        return hidden[..., :0]

    with lm_head_computing(head, capture):
        yield


@contextlib.contextmanager
def lm_head_computing(
    head: torch.nn.Module, compute: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
) -> Iterator[None]:
    """Within the block the LM head returns compute(hidden, weight, bias) (e.g. the chunked loss)
    instead of logits, so the model never materialises them and returns that as its `logits`.

    The result is computed inside the head's own forward and is its output: engines that hook
    the head's forward and its output's backward see an ordinary head. FSDP2 gathers the weight
    for that forward and gathers it again when the backward reaches the output, which a loss
    computed from the weight after the forward would skip (multiple forwards before a backward,
    as ChunkFlow runs, would then read freed storage). A zero term ties every head parameter to
    the result, so each gets a gradient even when all of the micro-batch's targets are ignored."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden, head.weight, getattr(head, "bias", None))
        params = [p for p in head.parameters() if p.requires_grad]  # as gathered now, inside the forward
        if params and torch.is_grad_enabled():
            out = out + sum(p.reshape(-1)[:1].sum() for p in params) * 0
        return out

    head.forward = forward  # instance attribute: shadows the class's forward
    try:
        yield
    finally:
        del head.forward


def head_output_is_logits(model: torch.nn.Module, head: torch.nn.Module, device, tokens: int = 8) -> bool:
    """True when the model's logits are exactly its LM head's output (no scaling, soft-capping
    or other post-processing), checked on one short forward of `tokens` tokens."""
    seen = []
    hook = head.register_forward_hook(lambda mod, inp, out: seen.append(out))
    try:
        vocab = max(1, int(getattr(model.config, "vocab_size", tokens)))
        ids = (torch.arange(tokens, device=device) % vocab).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        hook.remove()
    return len(seen) == 1 and seen[0].shape == logits.shape and torch.equal(seen[0], logits)


def chunkable_head(model: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The model's LM head when the chunked loss can replace it, else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, torch.nn.Linear) else None
