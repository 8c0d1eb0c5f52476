"""ChunkFlow's K/V state store: a long sample's dependent chunks attend to each other's keys.

A sample cut into N chunks (hf_cp/plan/chunks.py) runs one chunk at a time. Inside a chunk context
the attention of layer l takes the chunk's queries over the keys of every earlier chunk (all of
them: full) and over its own keys (causal), with the same kernels and log-sum-exp merge as the
rest of hf_cp. Keys arrive rotary-embedded, so the store needs no positions of its own.

Gradient across chunks without one autograd graph over the whole sample: the store keeps each
layer's K/V values as plain tensors (no autograd), and per layer one float32 accumulator of
their gradients. The backward of chunk i adds dK/dV of the earlier chunks' rows into the
accumulator, and adds the accumulated dK/dV of its own rows (from every later chunk) to the
gradient of its own K/V, which then flows through its own graph into the parameters. That is
exact when, in every layer, chunk i's attention backward runs after every later chunk's. The
store checks exactly that per layer and refuses any other order (ChunkOrderError): a backward
that passes the check is exact, one that would be wrong fails loudly (e.g. one backward over
several chunks' losses, whose order autograd does not fix).
A chunk's K/V are written on its first forward; a recomputed forward reuses them.

The recurrent layers of a Gated DeltaNet hybrid (attention/chunk_recurrence.py) keep, the same
way, per layer and per chunk but the last: its final recurrent state (float32) and its last
conv-window input rows (the next chunks' halo), each with a float32 gradient accumulator that
the later chunks' backward fills and the chunk's own backward reads, in the same strict
reverse order.

Token-major tensors as everywhere in hf_cp.attention: q [c, H, D], k/v [c, H_kv, D].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hf_cp.attention.context import ContextSlot
from hf_cp.attention.kernels import AttentionKernel, kernel_for
from hf_cp.attention.local import merge_lse
from hf_cp.plan.chunks import chunk_starts

Tensor = torch.Tensor


class ChunkOrderError(RuntimeError):
    """Dependent chunks ran out of order (their K/V or their gradients would be wrong)."""


class ChunkStateStore:
    """Per layer: the K/V of a sample's chunks written so far, and the gradient accumulators."""

    def __init__(self, chunk_sizes: Sequence[int]):
        self.sizes = [int(n) for n in chunk_sizes]
        if not self.sizes or any(n <= 0 for n in self.sizes):
            raise ValueError(f"chunk sizes must be positive, got {list(chunk_sizes)}")
        self.starts = chunk_starts(self.sizes)
        self.total = sum(self.sizes)
        self._k: Dict[int, Tensor] = {}
        self._v: Dict[int, Tensor] = {}
        self._dk: Dict[int, Tensor] = {}
        self._dv: Dict[int, Tensor] = {}
        self._written: Dict[int, int] = {}  # layer -> chunks whose K/V are stored (always a prefix)
        self._next_backward: Dict[int, int] = {}  # layer -> the only chunk whose backward may run next
        # recurrent layers: layer -> per chunk, its final state, its tail rows, and their gradients
        self._state: Dict[int, List[Tensor]] = {}
        self._tail: Dict[int, List[Tensor]] = {}
        self._dstate: Dict[int, List[Optional[Tensor]]] = {}
        self._dtail: Dict[int, List[Optional[Tensor]]] = {}
        self._recurrent_next: Dict[int, int] = {}  # layer -> the only chunk whose backward may run next
        self._leaves: Dict[int, Dict[int, List[int]]] = {}  # layer -> chunk -> [leaf gradients due, arrived]
        self.peak_bytes = 0

    @property
    def num_chunks(self) -> int:
        return len(self.sizes)

    def bounds(self, i: int) -> Tuple[int, int]:
        return self.starts[i], self.starts[i] + self.sizes[i]

    @property
    def nbytes(self) -> int:
        """Bytes the store holds now (K/V values and gradient accumulators of every layer)."""
        kv = sum(t.numel() * t.element_size() for d in (self._k, self._v, self._dk, self._dv) for t in d.values())
        rec = (self._state, self._tail, self._dstate, self._dtail)
        return kv + sum(t.numel() * t.element_size() for d in rec for ts in d.values() for t in ts if t is not None)

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def write(self, layer: int, i: int, k: Tensor, v: Tensor) -> None:
        """Store chunk i's keys and values of `layer` (no-op when already stored: a recompute)."""
        done = self._written.get(layer, 0)
        if i < done:
            return
        if i > done:
            raise ChunkOrderError(
                f"layer {layer}: chunk {i} ran before chunk {done}; dependent chunks run in order 0..{self.num_chunks - 1}"
            )
        s, e = self.bounds(i)
        if k.shape[0] != e - s or v.shape[0] != e - s:
            raise ValueError(f"layer {layer}, chunk {i}: {k.shape[0]} key rows, expected the chunk's {e - s} tokens")
        if layer not in self._k:
            self._k[layer] = k.new_empty((self.total,) + tuple(k.shape[1:]))
            self._v[layer] = v.new_empty((self.total,) + tuple(v.shape[1:]))
            self._note_peak()
        with torch.no_grad():
            self._k[layer][s:e].copy_(k)
            self._v[layer][s:e].copy_(v)
        self._written[layer] = i + 1

    def prefix(self, layer: int, i: int) -> Tuple[Tensor, Tensor]:
        """Keys and values of chunks 0..i-1 of `layer` (views of the store)."""
        s = self.starts[i]
        if self._written.get(layer, 0) < i:
            raise ChunkOrderError(f"layer {layer}: chunk {i} needs the K/V of chunks 0..{i - 1}, which are not stored")
        return self._k[layer][:s], self._v[layer][:s]

    def begin_backward(self, layer: int, i: int) -> None:
        """Chunk i's backward of `layer` starts: only allowed once every later chunk's has run."""
        expected = self._next_backward.get(layer, self.num_chunks - 1)
        if i != expected:
            raise ChunkOrderError(
                f"layer {layer}: the backward of chunk {i} ran when chunk {expected}'s was due. Dependent chunks "
                f"backpropagate one at a time, last chunk first (hf_cp.train.step.chunkflow.run_chunked_sample); a single "
                f"backward over several chunks' losses gives autograd the order and is refused"
            )
        self._next_backward[layer] = i - 1

    def add_prefix_grad(self, layer: int, i: int, dk: Tensor, dv: Tensor) -> None:
        """Add the gradient of chunks 0..i-1's K/V (rows 0..start_i-1) from chunk i's attention."""
        s = self.starts[i]
        if layer not in self._dk:
            self._dk[layer] = torch.zeros(self._k[layer].shape, dtype=torch.float32, device=dk.device)
            self._dv[layer] = torch.zeros(self._v[layer].shape, dtype=torch.float32, device=dv.device)
            self._note_peak()
        self._dk[layer][:s] += dk
        self._dv[layer][:s] += dv

    def own_grad(self, layer: int, i: int) -> Optional[Tuple[Tensor, Tensor]]:
        """The gradient every later chunk gave chunk i's K/V (float32), or None if none did."""
        if layer not in self._dk:
            return None
        s, e = self.bounds(i)
        return self._dk[layer][s:e], self._dv[layer][s:e]

    def write_recurrent(self, layer: int, i: int, state: Tensor, tail: Tensor) -> None:
        """Store chunk i's final recurrent state and last input rows of recurrent `layer` for the
        chunks after it (no-op when already stored, a recompute, or for the last chunk: none read it)."""
        done = len(self._state.get(layer, ()))
        if i < done or i == self.num_chunks - 1:
            return
        if i > done:
            raise ChunkOrderError(
                f"recurrent layer {layer}: chunk {i} ran before chunk {done}; dependent chunks run in order "
                f"0..{self.num_chunks - 1}"
            )
        for d, t in ((self._state, state), (self._tail, tail)):
            d.setdefault(layer, []).append(t.detach().clone())
        self._dstate.setdefault(layer, []).append(None)
        self._dtail.setdefault(layer, []).append(None)
        self._note_peak()

    def recurrent_inputs(self, layer: int, i: int, width: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """What chunk i of recurrent `layer` starts from: chunk i-1's final state and the last
        `width` input rows before the chunk (None, None for the first chunk)."""
        if i == 0:
            return None, None
        if len(self._state.get(layer, ())) < i:
            raise ChunkOrderError(
                f"recurrent layer {layer}: chunk {i} needs the states of chunks 0..{i - 1}, which are not stored"
            )
        tails = self._tail[layer][:i]
        halo = torch.cat(tails[-width:], dim=0)[-width:] if width else tails[-1][:0]
        return self._state[layer][i - 1], halo

    def expect_leaf_grads(self, layer: int, i: int, leaves: int) -> None:
        """Chunk i's forward with a graph of recurrent `layer` reads `leaves` stored tensors (state,
        halo), whose gradients its backward hands back before chunk i-1's may start."""
        self._leaves.setdefault(layer, {})[i] = [leaves, 0]

    def begin_recurrent_backward(self, layer: int, i: int) -> None:
        """Chunk i's backward of recurrent `layer` starts: only once every later chunk's has run
        and handed back its gradients."""
        expected = self._recurrent_next.get(layer, self.num_chunks - 1)
        leaves, arrived = self._leaves.get(layer, {}).get(i + 1, (0, 0))
        if i != expected or arrived < leaves:
            raise ChunkOrderError(
                f"recurrent layer {layer}: the backward of chunk {i} ran when chunk {expected}'s was due"
                + (f" (chunk {i + 1} had not handed back its stored state's gradients)" if i == expected else "")
                + ". Dependent chunks backpropagate one at a time, last chunk first "
                "(hf_cp.train.step.chunkflow.run_chunked_sample)"
            )
        self._recurrent_next[layer] = i - 1

    def _arrived(self, layer: int, i: int) -> None:
        self._leaves[layer][i][1] += 1

    def add_state_grad(self, layer: int, i: int, grad: Tensor) -> None:
        """Chunk i's gradient of its incoming state: chunk i-1's final state's."""
        self._accumulate(self._dstate[layer], i - 1, grad)
        self._arrived(layer, i)

    def add_halo_grad(self, layer: int, i: int, grad: Tensor) -> None:
        """Chunk i's gradient of its halo rows, into the tails of the chunks that hold them."""
        end = grad.shape[0]
        for j in reversed(range(i)):
            if end == 0:
                break
            n = min(end, self._tail[layer][j].shape[0])
            tail = self._dtail[layer][j]
            if tail is None:
                tail = self._dtail[layer][j] = torch.zeros(
                    self._tail[layer][j].shape, dtype=torch.float32, device=grad.device
                )
                self._note_peak()
            tail[tail.shape[0] - n :] += grad[end - n : end].float()
            end -= n
        self._arrived(layer, i)

    def _accumulate(self, grads: List[Optional[Tensor]], j: int, grad: Tensor) -> None:
        if grads[j] is None:
            grads[j] = grad.float().clone()
            self._note_peak()
        else:
            grads[j] += grad.float()

    def own_recurrent_grad(self, layer: int, i: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """The gradient the later chunks gave chunk i's final state and tail rows (float32), or None."""
        if i >= len(self._dstate.get(layer, ())):
            return None, None
        return self._dstate[layer][i], self._dtail[layer][i]

    def release(self) -> None:
        """Free every tensor (after the sample's last backward, or on an error)."""
        for d in (self._k, self._v, self._dk, self._dv, self._state, self._tail, self._dstate, self._dtail):
            d.clear()


@dataclass(frozen=True)
class ChunkContext:
    """The chunk being run: attention inside reads and writes `store` as chunk `index`."""

    store: ChunkStateStore
    index: int

    def __post_init__(self):
        if not 0 <= self.index < self.store.num_chunks:
            raise ValueError(f"chunk {self.index} outside the sample's {self.store.num_chunks} chunks")


_CURRENT: ContextSlot[ChunkContext] = ContextSlot()


def current_chunk_context() -> Optional[ChunkContext]:
    return _CURRENT.value


def chunk_context(ctx: Optional[ChunkContext]):
    """Set the chunk context for the forward (and any recomputing backward) inside the block."""
    return _CURRENT.holding(ctx)


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, store: ChunkStateStore, layer: int, i: int, kernel: AttentionKernel, scale: float):
        c = q.shape[0]
        out, lse = kernel.forward(q, k, v, [c], [c], True, scale)  # own keys, causal
        out = out.float()
        s = store.starts[i]
        if s:  # every earlier key, seen by every query of this chunk
            pk, pv = store.prefix(layer, i)
            o2, l2 = kernel.forward(q, pk, pv, [c], [s], False, scale)
            out, lse = merge_lse(out, lse, o2.float(), l2)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.store, ctx.layer, ctx.i, ctx.kernel, ctx.scale = store, layer, i, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        store, layer, i, kernel, scale = ctx.store, ctx.layer, ctx.i, ctx.kernel, ctx.scale
        store.begin_backward(layer, i)
        dout = dout.contiguous()
        c = q.shape[0]
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, [c], [c], True, scale)
        dq, dk, dv = dq.float(), dk.float(), dv.float()
        s = store.starts[i]
        if s:
            pk, pv = store.prefix(layer, i)
            g = kernel.backward(dout, q, pk, pv, out, lse, [c], [s], False, scale)
            dq = dq + g[0].float()
            store.add_prefix_grad(layer, i, g[1].float(), g[2].float())
        later = store.own_grad(layer, i)
        if later is not None:
            dk, dv = dk + later[0], dv + later[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def chunk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: int,
    ctx: ChunkContext,
    scale: float,
    kernel: Optional[AttentionKernel] = None,
) -> Tensor:
    """Attention of chunk ctx.index's rows (q [c, H, D], k/v [c, H_kv, D]) of `layer` over the
    stored keys of the earlier chunks and its own (causal); stores its K/V for later chunks."""
    store, i = ctx.store, ctx.index
    s, e = store.bounds(i)
    if q.shape[0] != e - s:
        raise ValueError(
            f"layer {layer}: chunk {i} has {e - s} tokens (positions {s}..{e - 1}) but the attention got "
            f"{q.shape[0]} query rows"
        )
    store.write(layer, i, k.detach(), v.detach())
    kernel = kernel or kernel_for(q.device, dtype=q.dtype)
    return _ChunkAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), store, layer, i, kernel, scale)
