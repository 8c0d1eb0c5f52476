"""The cost model's numbers for DCP's blocks (Weights), and long samples cut into data blocks
(token chunks) and compute blocks (query block x key block pairs with masked pairs).

A long sample's blocks are numpy arrays: one spread over p ranks has at least 2p data blocks and,
causal, about 2p^2 compute blocks (2.1M at 1024 ranks), so nothing here loops over them in Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.cost.model import CostModel
from hf_cp.modes.segments import split_sizes
from hf_cp.plan.block_layout import Chunk, attended_chunk_pairs
from hf_cp.samples.masks import AttnSlice, SampleMask, SliceKind, rect_pairs


class Weights:
    """The cost model's numbers for blocks: time in ms (all layers), bytes per layer x layers."""

    def __init__(self, cost: CostModel):
        d = cost.dims
        self.cost = cost
        self.L = d.num_layers
        bpe = cost.profile.bytes_per_element
        # a copy of a data block's keys: K and V forward, dK and dV back (per token, all layers)
        # (on the softmax layers only: a hybrid's others exchange no K/V)
        self.kv_bytes_per_token = d.softmax_layers * 2 * 2 * d.num_kv_heads * d.head_dim * bpe
        # a copy of its queries: Q out, O back (+ log-sum-exp), dO out, dQ back
        self.q_bytes_per_token = d.softmax_layers * 4 * d.num_heads * d.head_dim * bpe
        self._lin = cost.c1 * self.L + cost.head_ms_per_token
        self._per_pair: Dict[int, float] = {}

    def linear_ms(self, tokens):
        """Linear work of `tokens` (an int, or an array elementwise)."""
        return self._lin * tokens

    def pair_ms(self, q_len: int) -> float:
        """Time of one masked pair in a query chunk of q_len tokens (all layers)."""
        f = self._per_pair.get(q_len)
        if f is None:  # blocks of a step come in few lengths
            f = self._per_pair[q_len] = self.L * self.cost.c2 / self.cost.chunk_efficiency(q_len)
        return f

    def attention_ms(self, pairs, q_len):
        """Attention time of `pairs` masked pairs in query chunks of `q_len` tokens (ints, or
        arrays elementwise)."""
        if np.ndim(q_len) == 0:
            return self.pair_ms(int(q_len)) * pairs
        q_len = np.asarray(q_len)
        if q_len.size == 0:
            return np.zeros(0)
        uniq, inv = np.unique(q_len, return_inverse=True)
        return np.array([self.pair_ms(int(n)) for n in uniq])[inv] * pairs

    def sample_ms(self, length: int, slices: Sequence[AttnSlice]) -> float:
        return self.linear_ms(length) + self.attention_ms(rect_pairs(slices, 0, length, 0, length), length)


def causal_slices(n: int) -> List[AttnSlice]:
    return [AttnSlice(0, n, 0, n, SliceKind.CAUSAL)]


def sample_times(lengths: Sequence[int], masks: Sequence[Optional[SampleMask]], w: Weights) -> np.ndarray:
    """Predicted ms of every sample, whole on one rank (causal ones per distinct length)."""
    n = np.asarray(lengths, dtype=np.int64)
    uniq, inv = np.unique(n, return_inverse=True)
    causal = w.linear_ms(uniq) + w.attention_ms(uniq * (uniq + 1) // 2, uniq)
    times = np.asarray(causal, dtype=np.float64)[inv]
    for i, m in enumerate(masks):
        if m is not None:
            times[i] = w.sample_ms(int(n[i]), m.slices())
    return times


# --------------------------------------------------------------------------- blocks of a wave
@dataclass
class LongSample:
    """A sample cut into data blocks; its compute blocks pair them (query block, key block).
    Arrays: `starts` / `lens` per data block, `cq` / `ck` / `pairs` per compute block."""

    index: int  # into the request's samples
    length: int
    starts: np.ndarray
    lens: np.ndarray
    cq: np.ndarray
    ck: np.ndarray
    pairs: np.ndarray

    @property
    def blocks(self) -> List[Tuple[int, int]]:
        """(start, length) of every data block."""
        return list(zip(self.starts.tolist(), self.lens.tolist()))

    @property
    def compute(self) -> List[Tuple[int, int, int]]:
        """(q block, k block, masked pairs) of every compute block."""
        return list(zip(self.cq.tolist(), self.ck.tolist(), self.pairs.tolist()))


def block_count(length: int, base: int, parts: int, max_blocks: int) -> int:
    """Data blocks of a long sample: blocks of about `base` tokens, in a multiple of 2 x the
    parts it should spread over (zigzag-paired rows then deal evenly), at most
    max(max_blocks, 2 * parts) blocks (rounded down to that multiple)."""
    step = 2 * parts
    n = max(-(-length // base), step)
    n = -(-n // step) * step
    top = max(max_blocks, step) // step * step
    return max(1, min(n, top, length))


def cut_sample(index: int, length: int, slices: Sequence[AttnSlice], n_blocks: int) -> LongSample:
    """The sample in n_blocks nearly equal data blocks and its compute blocks (every (query
    block, key block) pair with masked pairs, query blocks in order, then key blocks)."""
    lens = np.asarray(split_sizes(length, n_blocks), dtype=np.int64)
    starts = np.cumsum(lens) - lens
    causal = len(slices) == 1 and slices[0].kind == SliceKind.CAUSAL and slices[0].q_start == 0
    if causal:  # the same cuts for queries and keys: full squares below the diagonal
        cq, ck = np.tril_indices(n_blocks)
        cq, ck = cq.astype(np.int64), ck.astype(np.int64)
        lq, lk = lens[cq], lens[ck]
        pairs = np.where(cq == ck, lq * (lq + 1) // 2, lq * lk)
        return LongSample(index, length, starts, lens, cq, ck, pairs)
    # any other mask: only the pairs it attends (bisected per query block), each counted exactly
    chunks = [Chunk(0, int(s), int(n), 0) for s, n in zip(starts.tolist(), lens.tolist())]
    qs, ks, ps = [], [], []
    for qi, ki in attended_chunk_pairs(chunks, [tuple(slices)]):
        a, b = chunks[qi], chunks[ki]
        p = rect_pairs(slices, a.start, a.start + a.length, b.start, b.start + b.length)
        if p:
            qs.append(qi)
            ks.append(ki)
            ps.append(p)
    as_ints = [np.asarray(v, dtype=np.int64) for v in (qs, ks, ps)]
    return LongSample(index, length, starts, lens, *as_ints)
