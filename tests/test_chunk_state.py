"""Chunk attention over the K/V state store (hf_cp/attention/chunk_state.py) against dense attention.

q, k, v of one causal sequence are cut into dependent chunks; each chunk's attention runs under
its chunk context, its backward last chunk first. Outputs and the gradients of q, k and v (float32,
hf_cp's kernels keep the log-sum-exp in float32) must equal a dense softmax(QK^T) V written out
here and computed in float64 (GQA heads repeated by hand).
"""

import pytest
import torch

from hf_cp.attention.chunk_state import (
    ChunkContext,
    ChunkOrderError,
    ChunkStateStore,
    chunk_attention,
)
from hf_cp.plan.chunks import chunk_starts, dependent_chunk_sizes

from helpers.chunk_state_reference import HKV, SCALE, D, dense_reference, leaves, run_chunked, tensors


@pytest.mark.parametrize("n, chunk, keep", [(23, 23, 1), (23, 12, 1), (23, 12, 2), (23, 5, 1), (23, 5, 3), (23, 5, 9)])
def test_chunked_attention_equals_dense_attention(n, chunk, keep):
    q, k, v, w = tensors(n)
    rq, rk, rv = leaves(q.double(), k.double(), v.double())
    ref = dense_reference(rq, rk, rv)
    (ref * w.double()).sum().backward()

    cq, ck, cv = leaves(q, k, v)
    sizes = dependent_chunk_sizes(n, chunk)
    out, peak, store = run_chunked(cq, ck, cv, w, sizes, keep)
    torch.testing.assert_close(out, ref.detach().float(), rtol=1e-5, atol=1e-5)
    for got, want in ((cq, rq), (ck, rk), (cv, rv)):
        torch.testing.assert_close(got.grad, want.grad.float(), rtol=1e-5, atol=1e-5)
    # the store held K and V (float32) and, with several chunks, their float32 gradient accumulators
    values = 2 * n * HKV * D * 4
    assert peak == (values + (2 * n * HKV * D * 4 if len(sizes) > 1 else 0))
    assert store.nbytes == 0, "released"


def test_each_query_sees_earlier_chunks_in_full_and_its_own_chunk_causally():
    # a value that changes only in chunk 0's keys must reach every query of chunk 1
    n, sizes = 10, [5, 5]
    q, k, v, _ = tensors(n, seed=1)
    v2 = v.clone()
    v2[0] += 10.0
    outs = []
    for vv in (v, v2):
        store = ChunkStateStore(sizes)
        rows = []
        for i in range(2):
            s, e = store.bounds(i)
            with torch.no_grad():
                rows.append(chunk_attention(q[s:e], k[s:e], vv[s:e], 0, ChunkContext(store, i), SCALE))
        outs.append(torch.cat(rows))
    changed = (outs[0] - outs[1]).abs().amax(dim=(1, 2)) > 1e-6
    assert changed.tolist() == [True] * 10  # key 0 precedes every query
    # and a change in the last key of chunk 1 reaches only its own last query
    v3 = v.clone()
    v3[9] += 10.0
    store = ChunkStateStore(sizes)
    with torch.no_grad():
        chunk_attention(q[:5], k[:5], v3[:5], 0, ChunkContext(store, 0), SCALE)
        last = chunk_attention(q[5:], k[5:], v3[5:], 0, ChunkContext(store, 1), SCALE)
    assert ((last - outs[0][5:]).abs().amax(dim=(1, 2)) > 1e-6).tolist() == [False] * 4 + [True]


def test_out_of_order_chunks_are_refused():
    q, k, v, w = tensors(10)
    store = ChunkStateStore([5, 5])
    with pytest.raises(ChunkOrderError, match="layer 0: chunk 1 ran before chunk 0"):
        chunk_attention(q[5:], k[5:], v[5:], 0, ChunkContext(store, 1), SCALE)
    with pytest.raises(ValueError, match="chunk 0 has 5 tokens .* but the attention got 4 query rows"):
        chunk_attention(q[:4], k[:4], v[:4], 0, ChunkContext(store, 0), SCALE)

    cq, ck, cv = leaves(q, k, v)
    store = ChunkStateStore([5, 5])
    losses = []
    for i in range(2):
        s, e = store.bounds(i)
        losses.append((chunk_attention(cq[s:e], ck[s:e], cv[s:e], 0, ChunkContext(store, i), SCALE) * w[s:e]).sum())
    # chunk 0's backward before chunk 1's would miss the gradient chunk 1 gives chunk 0's keys
    with pytest.raises(ChunkOrderError, match="layer 0: the backward of chunk 0 ran when chunk 1's was due"):
        losses[0].backward()


def test_chunk_context_bounds():
    with pytest.raises(ValueError, match="chunk 2 outside the sample's 2 chunks"):
        ChunkContext(ChunkStateStore([3, 3]), 2)
    with pytest.raises(ValueError, match="chunk sizes must be positive"):
        ChunkStateStore([3, 0])
    assert chunk_starts([3, 3, 2]) == [0, 3, 6]
