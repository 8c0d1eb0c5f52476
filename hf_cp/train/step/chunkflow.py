"""ChunkFlow's executor: forward and backward of one long sample as dependent chunks.

The state-aware schedule of the survey (section 5), for N chunks keeping K:
1. forward every chunk in order; the last K keep their graphs (activations), the first N-K run
   without one (torch.no_grad, LM head skipped): only their K/V stay, in the state store;
2. backward the K kept chunks, last first;
3. for each earlier chunk, last first: run its forward again, then its backward.
Chunk attention (hf_cp/attention/chunk_state.py) carries K/V and their gradients between
chunks, so the summed gradients equal one unchunked forward and backward of the sample while
at most K chunks' activations (plus the whole sample's K/V) exist at once.

No optimizer here: gradients accumulate into the parameters' .grad like any micro-batch's, so
several chunked samples, standalone micro-batches and gradient accumulation mix freely. The
caller routes each backward (DeepSpeed's engine.backward with its accumulation boundary, DDP's
no_sync) through `backward`, told which call is the sample's last.

A vision-language sample (step/chunk_vision.py) runs the same schedule with `inputs`: its
images and clips are encoded before the first chunk (without a graph), each chunk's forward
places the embedding rows of the placeholder tokens it holds (M-RoPE positions: the sample's,
sliced with the chunk), and the rows' gradients, gathered over the later chunks' backward
passes, go through the tower once, in chunk 0's backward (the sample's last), from the graph its
forward builds.

The model must use attn_implementation="hf_cp" and run with use_cache=False.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

from hf_cp.attention.chunk_state import ChunkContext, ChunkStateStore, chunk_context
from hf_cp.plan.passes import BACKWARD, FORWARD, FORWARD_NO_GRAPH
from hf_cp.train.step.loss import chunked_lm_head_loss, lm_head_bypassed, lm_head_computing

Tensor = torch.Tensor
IGNORE_INDEX = -100


@dataclass
class SampleChunk:
    """One dependent chunk's rows: [1, c] each; position_ids continue from the previous chunk."""

    input_ids: Tensor
    shift_labels: Tensor  # the target of each token (the sample's next token), -100 for none
    position_ids: Tensor
    # a vision-language run: the chunk's M-RoPE positions [3, c], cut from the whole sample's
    rope_positions: Optional[Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])

    @property
    def model_positions(self) -> Tensor:
        """The position_ids the model is given: [1, c], or with M-RoPE [4, 1, c] (the 1-D
        positions first, then the three M-RoPE rows, as the executor passes them)."""
        if self.rope_positions is None:
            return self.position_ids
        return torch.cat([self.position_ids[None], self.rope_positions[:, None].to(self.position_ids.device)])


def sample_chunks(
    input_ids: Tensor, shift_labels: Tensor, chunk_sizes: Sequence[int], rope_positions: Optional[Tensor] = None
) -> List[SampleChunk]:
    """Cut one sample's rows ([T] or [1, T]; shift_labels already shifted over the whole sample,
    so a chunk's last token keeps its true target) into chunks of `chunk_sizes` tokens;
    `rope_positions` ([3, T], a vision-language sample's M-RoPE positions) are cut with them."""
    ids, tgt = input_ids.reshape(-1), shift_labels.reshape(-1)
    if ids.shape != tgt.shape:
        raise ValueError(f"input_ids has {ids.numel()} tokens but shift_labels {tgt.numel()}")
    if sum(chunk_sizes) != ids.numel() or any(n <= 0 for n in chunk_sizes):
        raise ValueError(f"chunk sizes {list(chunk_sizes)} do not cut a sample of {ids.numel()} tokens")
    if rope_positions is not None and tuple(rope_positions.shape) != (3, ids.numel()):
        raise ValueError(
            f"rope_positions of shape {tuple(rope_positions.shape)} for {ids.numel()} tokens, expected [3, T]"
        )
    out, s = [], 0
    for n in chunk_sizes:
        pos = torch.arange(s, s + n, device=ids.device)
        rope = rope_positions[:, s : s + n] if rope_positions is not None else None
        out.append(SampleChunk(ids[s : s + n][None], tgt[s : s + n][None], pos[None], rope))
        s += n
    return out


class ChunkInputs(Protocol):
    """What a sample's chunks take besides their tokens (step/chunk_vision.ChunkVision: the
    embedding rows of its images and clips), as run_chunked_sample drives it."""

    def forward(self, i: int, graph: bool) -> ContextManager:
        """Entered around each forward of chunk i (`graph`: one whose backward follows)."""

    def backward_term(self, i: int) -> Optional[Tensor]:
        """A term added to chunk i's scaled loss before its backward (None: nothing), called
        after every later chunk's backward."""

    def release(self) -> None:
        """The sample is done (or failed): free what it holds."""


# the summed token cross-entropy of one chunk (fp32), computed by running the model on it
TokenLoss = Callable[[torch.nn.Module, SampleChunk], Tensor]


def token_loss(
    head: Optional[torch.nn.Linear] = None, loss_chunk_tokens: int = 0, ignore_index: int = IGNORE_INDEX
) -> TokenLoss:
    """The trainer's per-micro-batch loss for a chunk: summed cross-entropy in fp32, through the
    chunked LM-head loss (hf_cp/train/step/loss.py) when `head` is given, else from the full logits."""
    if head is not None and loss_chunk_tokens <= 0:
        raise ValueError(f"loss_chunk_tokens must be positive with a head, got {loss_chunk_tokens}")

    def loss(model: torch.nn.Module, chunk: SampleChunk) -> Tensor:
        targets = chunk.shift_labels.reshape(-1)
        if head is None:
            out = model(input_ids=chunk.input_ids, position_ids=chunk.model_positions, use_cache=False)
            return F.cross_entropy(out.logits[0].float(), targets, ignore_index=ignore_index, reduction="sum")

        def summed(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
            return chunked_lm_head_loss(
                hidden[0], weight, targets, loss_chunk_tokens, bias=bias, ignore_index=ignore_index
            )

        with lm_head_computing(head, summed):
            return model(input_ids=chunk.input_ids, position_ids=chunk.model_positions, use_cache=False).logits

    return loss


def _plain_backward(loss: Tensor, is_last: bool) -> None:
    loss.backward()


def _state_forward(model: torch.nn.Module, chunk: SampleChunk) -> None:
    """A forward that only fills the state store: no graph, and no LM head when it can be skipped."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    with torch.no_grad():
        if isinstance(head, torch.nn.Module):
            with lm_head_bypassed(head, []):
                model(input_ids=chunk.input_ids, position_ids=chunk.model_positions, use_cache=False)
        else:
            model(input_ids=chunk.input_ids, position_ids=chunk.model_positions, use_cache=False)


def _rng_devices(chunk: SampleChunk) -> List[int]:
    dev = chunk.input_ids.device
    return [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []


@dataclass
class ChunkRunStats:
    """What one run_chunked_sample did (for tests and benchmarks)."""

    chunks: int = 0
    recomputed: int = 0
    backwards: int = 0
    store_peak_bytes: int = 0
    store_bytes_after: int = 0


def run_chunked_sample(
    model: torch.nn.Module,
    chunks: Sequence[SampleChunk],
    keep: int,
    loss_scale: float,
    loss_fn: Optional[TokenLoss] = None,
    backward: Optional[Callable[[Tensor, bool], None]] = None,
    last: bool = True,
    stats: Optional[ChunkRunStats] = None,
    on_pass: Optional[Callable[[str], None]] = None,
    inputs: Optional[ChunkInputs] = None,
) -> Tensor:
    """Forward and backward of one sample cut into `chunks`, by the state-aware schedule.

    Args:
        model: a causal LM with attn_implementation="hf_cp", in train mode.
        chunks: the sample's chunks in order (sample_chunks); position_ids continue across them.
        keep: K, chunks whose activations are kept after the forward pass (K >= N: none recomputed).
        loss_scale: every chunk's summed token loss is multiplied by it before its backward (the
            trainer's 1 / valid tokens of the global batch, times the world size).
        loss_fn: the summed token loss of one chunk (default: token_loss(), full logits).
        backward: called as backward(scaled_loss, is_last) once per chunk; default loss.backward().
            is_last is True for the sample's final backward when `last` is (the accumulation boundary).
        stats: filled with counts and the state store's peak bytes when given.
        on_pass: called with "f", "F" or "B" (plan/passes.py) before each forward without a graph,
            forward with one, and backward, outside the chunk's context: the executor runs other
            ranks' passes there as dummies when parameters are sharded.
        inputs: what the chunks take besides their tokens (ChunkInputs: a vision-language
            sample's embedding rows), entered around each chunk's forward; its backward_term is
            added to each chunk's scaled loss; released when the sample ends.

    Returns:
        The sample's summed token loss (unscaled, detached). Gradients are in the parameters' .grad.
    """
    if keep <= 0:
        raise ValueError(f"keep (K) must be positive, got {keep}")
    if not chunks:
        raise ValueError("a chunked sample needs at least one chunk")
    expect = 0
    for i, ch in enumerate(chunks):
        pos = ch.position_ids.reshape(-1)
        if ch.input_ids.shape[0] != 1 or pos.numel() != ch.num_tokens or ch.shift_labels.numel() != ch.num_tokens:
            raise ValueError(
                f"chunk {i}: input_ids, shift_labels and position_ids must be one row of the same length, got "
                f"{tuple(ch.input_ids.shape)}, {tuple(ch.shift_labels.shape)}, {tuple(ch.position_ids.shape)}"
            )
        if int(pos[0]) != expect or (pos.numel() > 1 and not bool((pos[1:] - pos[:-1] == 1).all())):
            raise ValueError(
                f"chunk {i}: position_ids must run {expect}..{expect + pos.numel() - 1} (each chunk continues the "
                f"previous one), got {pos[0].item()}..{pos[-1].item()}"
            )
        expect += pos.numel()
    loss_fn = loss_fn or token_loss()
    backward = backward or _plain_backward
    on_pass = on_pass or _no_pass_hook
    feed = inputs.forward if inputs is not None else _no_inputs
    n = len(chunks)
    first_kept = max(0, n - keep)
    store = ChunkStateStore([ch.num_tokens for ch in chunks])
    total = torch.zeros((), dtype=torch.float64)
    rng: Dict[int, tuple] = {}
    kept: Dict[int, Tensor] = {}
    stats = stats if stats is not None else ChunkRunStats()
    stats.chunks = n
    try:
        # 1. forward every chunk; only the last K keep their graphs
        for i, ch in enumerate(chunks):
            on_pass(FORWARD_NO_GRAPH if i < first_kept else FORWARD)
            with chunk_context(ChunkContext(store, i)):
                if i < first_kept:
                    devices = _rng_devices(ch)  # a recompute sees the same random numbers (dropout)
                    rng[i] = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices], devices)
                    with feed(i, False):
                        _state_forward(model, ch)
                else:
                    with feed(i, True):
                        kept[i] = loss_fn(model, ch)
        # 2. backward the kept chunks, last first; 3. recompute and backward the others, last first
        for i in reversed(range(n)):
            if i >= first_kept:
                loss = kept.pop(i)
            else:
                on_pass(FORWARD)
                with chunk_context(ChunkContext(store, i)):
                    cpu_state, cuda_states, devices = rng.pop(i)
                    with torch.random.fork_rng(devices=devices):
                        torch.set_rng_state(cpu_state)
                        for d, st in zip(devices, cuda_states):
                            torch.cuda.set_rng_state(st, d)
                        with feed(i, True):
                            loss = loss_fn(model, chunks[i])
                stats.recomputed += 1
            on_pass(BACKWARD)
            with chunk_context(ChunkContext(store, i)):
                scaled = loss * loss_scale
                extra = inputs.backward_term(i) if inputs is not None else None
                backward(scaled if extra is None else scaled + extra.to(scaled.dtype), last and i == 0)
                stats.backwards += 1
            total += loss.detach().to(device="cpu", dtype=torch.float64)
            del loss, scaled, extra
    finally:
        kept.clear()
        stats.store_peak_bytes = store.peak_bytes
        store.release()
        stats.store_bytes_after = store.nbytes
        if inputs is not None:
            inputs.release()
    return total


def _no_pass_hook(kind: str) -> None:
    return None


def _no_inputs(i: int, graph: bool) -> ContextManager:
    return contextlib.nullcontext()


def evaluate_chunked_sample(
    model: torch.nn.Module,
    chunks: Sequence[SampleChunk],
    loss_fn: Optional[TokenLoss] = None,
    inputs: Optional[ChunkInputs] = None,
) -> Tensor:
    """The summed token loss of one sample run forward only as dependent chunks (evaluation:
    each chunk attends the K/V the earlier ones left in the store; nothing is kept for backward).
    `inputs` as in run_chunked_sample. Call under torch.no_grad()."""
    if not chunks:
        raise ValueError("a chunked sample needs at least one chunk")
    loss_fn = loss_fn or token_loss()
    feed = inputs.forward if inputs is not None else _no_inputs
    store = ChunkStateStore([ch.num_tokens for ch in chunks])
    total = torch.zeros((), dtype=torch.float64)
    try:
        for i, ch in enumerate(chunks):
            with chunk_context(ChunkContext(store, i)), feed(i, False):
                total += loss_fn(model, ch).detach().to(device="cpu", dtype=torch.float64)
    finally:
        store.release()
        if inputs is not None:
            inputs.release()
    return total
