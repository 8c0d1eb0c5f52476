"""Chunk attention over the K/V state store by hand, and the dense float64 attention it must
equal: shared by the CPU tests (test_chunk_state.py) and the CUDA test (test_cuda.py)."""

import torch

from hf_cp.attention.chunk_state import ChunkContext, ChunkStateStore, chunk_attention, chunk_context

H, HKV, D = 4, 2, 8
SCALE = D**-0.5


def dense_reference(q, k, v):
    """Causal attention, float64, heads-first math on [T, H, D] rows."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    t = q.shape[0]
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


def tensors(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, D, generator=g, dtype=dtype) for h in (H, HKV, HKV))
    w = torch.randn(n, H, D, generator=g, dtype=dtype)  # loss = sum(out * w): every output row matters
    return q, k, v, w


def leaves(*xs):
    return [x.clone().requires_grad_(True) for x in xs]


def run_chunked(q, k, v, w, sizes, keep):
    """The state-aware schedule by hand, on one attention layer (layer index 3)."""
    store = ChunkStateStore(sizes)
    n = len(sizes)
    first_kept = max(0, n - keep)
    outs, kept = {}, {}

    def forward(i):
        s, e = store.bounds(i)
        with chunk_context(ChunkContext(store, i)):
            out = chunk_attention(q[s:e], k[s:e], v[s:e], 3, ChunkContext(store, i), SCALE)
        return out, (out * w[s:e]).sum()

    for i in range(n):
        if i < first_kept:
            with torch.no_grad():
                forward(i)
        else:
            outs[i], kept[i] = forward(i)
    for i in reversed(range(n)):
        if i < first_kept:
            outs[i], kept[i] = forward(i)
        with chunk_context(ChunkContext(store, i)):
            kept.pop(i).backward()
    peak = store.peak_bytes
    store.release()
    return torch.cat([outs[i].detach() for i in range(n)]), peak, store
