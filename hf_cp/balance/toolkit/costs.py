"""Per-length costs of one CostModel, computed once and shared by every balancer.

Values are exactly the model's (nothing here has a cost formula of its own), so plans do not
depend on the cache state.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from hf_cp.cost.bounds import alone_on_group_ms
from hf_cp.cost.model import CostModel
from hf_cp.modes.ring import split_member_tokens
from hf_cp.modes.segments import ShardMode
from hf_cp.samples.masks import SampleMask


class CostMemo:
    """Per-length results of one CostModel, computed once.

    `sample_local_ms` is a few microseconds per call and a step holds up to ~10^5 samples,
    while a trace holds far fewer distinct lengths: caching by length keeps planners at
    numpy speed. Values are exactly the model's, so plans do not depend on the cache state.
    """

    def __init__(self, cost: CostModel):
        self.cost = cost
        self._local: Dict[int, float] = {}
        self._on_group: Dict[Tuple[int, int], float] = {}
        self._masked_on_group: Dict[Tuple[SampleMask, int], float] = {}
        self._member_tokens: Dict[Tuple[int, int], Tuple[int, ...]] = {}
        self.overhead_ms = cost.micro_batch_overhead_ms()
        self._step_lengths: Optional[Tuple[int, ...]] = None
        self._step_local = np.zeros(0)
        # ring_layout.pick_ring_mode's choices by (pack's lengths, group size, link, cap): a
        # step's packs repeat a few length tuples (60 distinct of 1,471 packs on a long-document
        # step at 4096 ranks), and each choice prices up to 2 x 6 members (filled there)
        self.ring_modes: Dict[tuple, ShardMode] = {}

    def local_ms(self, length: int) -> float:
        """Whole-document compute of one sample on one rank (CostModel.sample_local_ms)."""
        v = self._local.get(length)
        if v is None:
            v = self._local[length] = self.cost.sample_local_ms(length)
        return v

    def step_local_ms(self, lengths: Sequence[int], as_array: Optional[np.ndarray] = None) -> np.ndarray:
        """local_ms_array of a step's lengths, kept for the last step asked: every member of
        `auto`, every bound and the pricer ask for the same step's (do not modify it).
        `as_array`: the same lengths as an int64 array, when the caller has it
        (PlanRequest.length_array)."""
        if self._step_lengths is not lengths:
            key = lengths if isinstance(lengths, tuple) else tuple(lengths)
            if key != self._step_lengths:
                arr = as_array if as_array is not None else np.asarray(key, dtype=np.int64)
                self._step_local = self.local_ms_array(arr)
            self._step_lengths = key
        return self._step_local

    def local_ms_array(self, lengths: np.ndarray) -> np.ndarray:
        """local_ms of every entry of an integer array (each distinct length priced once)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        get = self.local_ms
        if not len(lengths):
            return np.zeros(0, dtype=np.float64)
        top = int(lengths.max())
        if int(lengths.min()) >= 0 and top <= 4 * len(lengths) + (1 << 16):
            # a table by length: no sort (a step of 10^5 short samples has a few hundred lengths)
            uniq = np.flatnonzero(np.bincount(lengths, minlength=top + 1))
            table = np.zeros(top + 1, dtype=np.float64)
            table[uniq] = np.fromiter((get(n) for n in uniq.tolist()), dtype=np.float64, count=len(uniq))
            return table[lengths]
        uniq, inv = np.unique(lengths, return_inverse=True)
        return np.fromiter((get(int(n)) for n in uniq.tolist()), dtype=np.float64, count=len(uniq))[inv]

    def doc_on_group_ms(self, length: int, group_size: int, mask: Optional[SampleMask] = None) -> float:
        """cost.bounds.alone_on_group_ms, kept per (length, group size) and, for a masked
        sample, per (mask, group size)."""
        if mask is not None:
            mkey = (mask, group_size)
            v = self._masked_on_group.get(mkey)
            if v is None:
                v = self._masked_on_group[mkey] = alone_on_group_ms(self.cost, length, group_size, mask)
            return v
        key = (length, group_size)
        v = self._on_group.get(key)
        if v is None:
            v = self._on_group[key] = (
                self.local_ms(length) if group_size == 1 else alone_on_group_ms(self.cost, length, group_size)
            )
        return v

    def per_doc_member_tokens(self, length: int, group_size: int) -> Tuple[int, ...]:
        """Tokens each member holds when one document is per-document sharded over the group
        (ring.split_member_tokens: ring.per_doc_segments' layout in closed form), kept per
        length and group size."""
        key = (length, group_size)
        v = self._member_tokens.get(key)
        if v is None:
            v = self._member_tokens[key] = tuple(split_member_tokens(length, group_size))
        return v


_MEMOS: weakref.WeakKeyDictionary[CostModel, CostMemo] = weakref.WeakKeyDictionary()


def cost_memo(cost: CostModel) -> CostMemo:
    """The shared CostMemo of a CostModel (kept as long as the model lives)."""
    memo = _MEMOS.get(cost)
    if memo is None:
        memo = _MEMOS[cost] = CostMemo(cost)
    return memo
