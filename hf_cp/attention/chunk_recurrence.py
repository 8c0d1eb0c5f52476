"""ChunkFlow's dependent chunks through a Gated DeltaNet layer: the recurrent state and the
convolution window carried from chunk to chunk, exactly.

Chunk i of a sample runs the layer's own forward once, on [halo] + [its rows]: the halo is the
k-1 input rows before the chunk (the causal convolution's window, as in state_passing.py), and
the layer's gated delta rule kernel is intercepted to start from chunk i-1's final recurrent
state and to hand back chunk i's own. Both come from ChunkFlow's state store
(chunk_state.ChunkStateStore), written on a chunk's first forward and reused by a recompute.

Gradient, as for the K/V: the stored state and halo enter chunk i's graph as leaves, whose
gradients (caught by hooks during chunk i's backward) go into the store's float32 accumulators
of the chunks that produced them. Chunk i's output carries a zero term that depends on its final
state and its own input rows, whose backward adds the accumulated gradients to theirs, so they
flow on through chunk i's graph. Exact when chunk i's backward runs after every later chunk's,
which the store checks per layer (ChunkOrderError).
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional

import torch

from hf_cp.attention.chunk_state import ChunkContext, ChunkStateStore
from hf_cp.attention.state_passing import KERNEL_NAME, STATE_PASSING_MIXERS, kernel_replaced

Tensor = torch.Tensor


class _CarriedGradients(torch.autograd.Function):
    """A zero that depends on chunk i's final state and input rows: its backward hands them the
    gradients every later chunk gave them (from the store)."""

    @staticmethod
    def forward(ctx, final_state, rows, store: ChunkStateStore, layer: int, i: int):
        ctx.store, ctx.layer, ctx.i = store, layer, i
        ctx.state_shape, ctx.state_dtype = final_state.shape, final_state.dtype
        ctx.rows_shape, ctx.rows_dtype = rows.shape, rows.dtype
        return rows.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        store, layer, i = ctx.store, ctx.layer, ctx.i
        store.begin_recurrent_backward(layer, i)
        dstate, dtail = store.own_recurrent_grad(layer, i)
        d_final = None if dstate is None else dstate.to(ctx.state_dtype).reshape(ctx.state_shape)
        d_rows = None
        if dtail is not None:
            d_rows = torch.zeros(ctx.rows_shape, dtype=ctx.rows_dtype, device=dtail.device)
            d_rows[d_rows.shape[0] - dtail.shape[0] :] = dtail.to(ctx.rows_dtype)
        return d_final, d_rows, None, None, None


class _ChunkKernel:
    """Stands in for the layer's gated delta rule kernel for one chunk: runs the chunk's own rows
    (the `halo` rows in front only fed the convolution, and are in `initial` already) from
    `initial`, and keeps the final state."""

    def __init__(self, kernel: Callable, initial: Optional[Tensor], halo: int):
        self.kernel, self.initial, self.halo = kernel, initial, halo
        self.final: List[Tensor] = []

    def __call__(self, query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
        if self.final or initial_state is not None:
            raise RuntimeError("hf_cp ChunkFlow: the layer called its kernel other than once, from no state")
        kwargs.pop("cu_seqlens", None)
        h = self.halo
        own = [t[:, h:] for t in (query, key, value, g, beta)]
        out, final = self.kernel(*own, initial_state=self.initial, output_final_state=True, **kwargs)
        self.final.append(final)
        return torch.nn.functional.pad(out, (0, 0, 0, 0, h, 0)), None


def chunk_recurrent_forward(
    module: torch.nn.Module, forward: Callable, x: Tensor, chunk: ChunkContext, kwargs: Dict
) -> Tensor:
    """The outputs ([c, hidden]) of chunk `chunk.index`'s rows `x` ([c, hidden]) through the Gated
    DeltaNet layer `module`, continuing the earlier chunks' state and convolution window."""
    name = type(module).__name__
    if name not in STATE_PASSING_MIXERS:
        raise ValueError(f"hf_cp ChunkFlow: {name} is not a Gated DeltaNet layer")
    store, i = chunk.store, chunk.index
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(f"hf_cp recurrent layer ({name}): ChunkFlow's state store needs the module's layer_idx")
    s, e = store.bounds(i)
    if x.shape[0] != e - s:
        raise ValueError(
            f"hf_cp recurrent layer ({name}, layer {layer}): chunk {i} has {e - s} tokens, the layer got {x.shape[0]}"
        )
    width = int(module.conv_kernel_size) - 1
    state, halo = store.recurrent_inputs(int(layer), i, width)
    grad = torch.is_grad_enabled()
    leaves = 0
    if state is not None and grad:
        state = state.detach().requires_grad_()
        state.register_hook(lambda g: store.add_state_grad(int(layer), i, g))
        leaves += 1
    if halo is not None and halo.shape[0] and grad:
        halo = halo.detach().requires_grad_()
        halo.register_hook(lambda g: store.add_halo_grad(int(layer), i, g))
        leaves += 1
    if grad:
        store.expect_leaf_grads(int(layer), i, leaves)
    rows = x if halo is None else torch.cat([halo.to(x.dtype), x], dim=0)
    namespace = sys.modules[type(module).__module__]
    kernel = _ChunkKernel(getattr(namespace, KERNEL_NAME), state, rows.shape[0] - x.shape[0])
    with kernel_replaced(module, kernel):
        out = forward(hidden_states=rows.unsqueeze(0), **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    if not kernel.final:
        raise RuntimeError(f"hf_cp ChunkFlow: {name} never called {KERNEL_NAME}")
    final = kernel.final[0]
    out = out[0, rows.shape[0] - x.shape[0] :]
    tail = x[max(0, x.shape[0] - width) :]
    store.write_recurrent(int(layer), i, final, tail)
    if grad and (final.requires_grad or x.requires_grad):
        out = out + _CarriedGradients.apply(final, x, store, int(layer), i).to(out.dtype)
    return out
