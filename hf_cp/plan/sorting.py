"""Stable orders of integer keys, fast: planning and validating a step of 10^5 samples sorts ids,
lengths and ranks many times, and numpy's stable argsort of int64 is a merge sort (~10x its
radix sort of 16-bit keys, ~4x its unstable vectorised sort)."""

from __future__ import annotations

import numpy as np

_INT16 = np.iinfo(np.int16)
_INT64_MAX = int(np.iinfo(np.int64).max)


def stable_order(keys) -> np.ndarray:
    """np.argsort(keys, kind="stable"), the same indices, by the fastest exact route:

    - integer keys that fit 16 bits: numpy's radix sort (it radix-sorts only those; the cast
      keeps every key);
    - other integer keys whose range leaves room for the indices in 63 bits: one unstable
      sort of (key - min) << b | index, whose keys are all distinct, so its order is the
      stable one; the low b bits are the indices;
    - anything else: numpy's stable sort.
    """
    keys = np.asarray(keys)
    n = len(keys)
    if keys.dtype.kind not in "iu" or n < 2:
        return np.argsort(keys, kind="stable")
    lo, hi = int(keys.min()), int(keys.max())
    if _INT16.min <= lo and hi <= _INT16.max:
        return np.argsort(keys.astype(np.int16), kind="stable")
    bits = (n - 1).bit_length()
    if hi > _INT64_MAX or (hi - lo).bit_length() + bits > 63:
        return np.argsort(keys, kind="stable")
    packed = (keys.astype(np.int64) - lo) << bits
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    return packed & ((1 << bits) - 1)
