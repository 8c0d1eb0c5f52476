"""The cost model's numbers for DCP's blocks (Weights), and long samples cut into data blocks
(token chunks) and compute blocks (query block x key block pairs with masked pairs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from hf_cp.cost.model import CostModel
from hf_cp.modes.segments import split_sizes
from hf_cp.plan.block_layout import received_row_bytes
from hf_cp.samples.masks import AttnSlice, SliceKind, rect_pairs


class Weights:
    """The cost model's numbers for blocks: time in ms (all layers), bytes per layer x layers."""

    def __init__(self, cost: CostModel):
        d = cost.dims
        self.cost = cost
        self.L = d.num_layers
        bpe = cost.profile.bytes_per_element
        # a copy of a data block's keys: K and V forward, dK and dV back (per token, all layers)
        self.kv_bytes_per_token = self.L * 2 * 2 * d.num_kv_heads * d.head_dim * bpe
        # a copy of its queries: Q out, O back (+ log-sum-exp), dO out, dQ back
        self.q_bytes_per_token = self.L * 4 * d.num_heads * d.head_dim * bpe
        self._lin = cost.c1 * self.L + cost.head_ms_per_token
        self._per_pair: Dict[int, float] = {}
        # memory of a received row against an owned token's, as StepPlan.validate counts it
        # (block_layout.received_token_equivalent: one layer's buffers, in activation tokens)
        self.kv_row_bytes, self.q_row_bytes = received_row_bytes(cost)
        self.token_bytes = int(cost.profile.activation_bytes_per_token)

    def linear_ms(self, tokens: int) -> float:
        return self._lin * tokens

    def attention_ms(self, pairs: int, q_len: int) -> float:
        f = self._per_pair.get(q_len)
        if f is None:  # blocks of a step come in few lengths
            f = self._per_pair[q_len] = self.L * self.cost.c2 / self.cost.chunk_efficiency(q_len)
        return f * pairs

    def sample_ms(self, length: int, slices: Sequence[AttnSlice]) -> float:
        return self.linear_ms(length) + self.attention_ms(rect_pairs(slices, 0, length, 0, length), length)


def causal_slices(n: int) -> List[AttnSlice]:
    return [AttnSlice(0, n, 0, n, SliceKind.CAUSAL)]


# --------------------------------------------------------------------------- blocks of a wave
@dataclass
class LongSample:
    """A sample cut into data blocks; its compute blocks pair them (query block, key block)."""

    index: int  # into the request's samples
    length: int
    blocks: List[Tuple[int, int]]  # (start, length) of every data block
    compute: List[Tuple[int, int, int]]  # (q block, k block, masked pairs)


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
    blocks, pos = [], 0
    for ln in split_sizes(length, n_blocks):
        blocks.append((pos, ln))
        pos += ln
    causal = len(slices) == 1 and slices[0].kind == SliceKind.CAUSAL and slices[0].q_start == 0
    comp = []
    for qi, (qs, ql) in enumerate(blocks):
        if causal:  # the same cuts for queries and keys: full squares below the diagonal
            comp.extend((qi, ki, ql * kl) for ki, (_, kl) in enumerate(blocks[:qi]))
            comp.append((qi, qi, ql * (ql + 1) // 2))
            continue
        for ki, (ks, kl) in enumerate(blocks):
            p = rect_pairs(slices, qs, qs + ql, ks, ks + kl)
            if p:
                comp.append((qi, ki, p))
    return LongSample(index, length, blocks, comp)
