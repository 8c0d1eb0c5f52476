"""Assigning weighted items to bins: LPT, water-filling, snake dealing, grouping by label.

Deterministic in the arguments: equal weights keep their input order, ties go to the lowest bin.
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence, Tuple

import numpy as np


def descending_order(weights: np.ndarray) -> np.ndarray:
    """Indices by decreasing weight; equal weights keep their input order (stable)."""
    return np.argsort(-np.asarray(weights, dtype=np.float64), kind="stable")


# LPT goes one item at a time through a heap until items weigh less than this share of the
# mean bin load; the lighter rest is water-filled in one vectorised pass (each bin then ends
# within one such item, < 1/64 of the mean, of where the heap would leave it).
EXACT_LPT_SHARE = 1.0 / 64


def split_exact_tail(weights_desc: np.ndarray, n_bins: int, total_with_loads: float, min_exact: int) -> int:
    """How many of the heaviest items (sorted heaviest first) LPT places one by one."""
    light = weights_desc < EXACT_LPT_SHARE * total_with_loads / n_bins
    first_light = int(np.argmax(light)) if light.any() else len(weights_desc)
    return min(len(weights_desc), max(min_exact, first_light))


def lpt_assign(
    weights: Sequence[float], n_bins: int, loads: Optional[Sequence[float]] = None, exact_items: Optional[int] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Longest-processing-time-first: heaviest item onto the least loaded bin.

    Returns (bin of every item, final bin loads). `loads` are the bins' starting loads.
    The heaviest items (all but those lighter than EXACT_LPT_SHARE of the mean bin load, and
    at least 2 per bin; or exactly `exact_items`) go one by one through a heap; the light
    tail is water-filled (water_fill).
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    bins = np.zeros(n, dtype=np.int64)
    load = np.zeros(n_bins, dtype=np.float64) if loads is None else np.array(loads, dtype=np.float64)
    if n == 0:
        return bins, load
    order = descending_order(w)
    k = (
        split_exact_tail(w[order], n_bins, float(w.sum() + load.sum()), 2 * n_bins)
        if exact_items is None
        else min(n, exact_items)
    )
    heap = [(float(l), b) for b, l in enumerate(load.tolist())]
    heapq.heapify(heap)
    wl = w.tolist()
    for i in order[:k].tolist():
        l, b = heap[0]
        bins[i] = b
        heapq.heapreplace(heap, (l + wl[i], b))
    for l, b in heap:
        load[b] = l
    if k < n:
        tail = order[k:]
        bins[tail] = water_fill(w[tail], load)
        np.add.at(load, bins[tail], w[tail])
    return bins, load


def water_fill(weights: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Bins for light items so that the bins' loads rise to one common level.

    The level T solves sum(max(0, T - load)) = sum(weights); the items, in the given order,
    are laid end to end over the bins' deficits (lightest bin first) and each goes to the
    bin whose deficit holds its midpoint.
    """
    n_bins = len(loads)
    by_load = np.argsort(loads, kind="stable")
    sl = loads[by_load]
    levels = (float(np.sum(weights)) + np.cumsum(sl)) / np.arange(1, n_bins + 1)
    k = int(np.nonzero(levels >= sl)[0][-1]) + 1  # fill the k lightest bins up to the level
    bounds = np.cumsum(np.maximum(0.0, levels[k - 1] - sl))
    mid = np.cumsum(weights) - weights / 2.0
    pos = np.minimum(np.searchsorted(bounds, mid, side="right"), n_bins - 1)
    return by_load[pos]


def group_indices(labels: np.ndarray, n_groups: int) -> List[np.ndarray]:
    """Indices of each label 0..n_groups-1, in increasing index order."""
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=n_groups)
    return np.split(order, np.cumsum(counts)[:-1])


def serpentine(n_items: int, n_bins: int) -> np.ndarray:
    """Bin of each position when items are dealt 0,1,..,m-1,m-1,..,1,0,0,1,.. (snake order):
    dealt heaviest first, every bin gets a fair share of heavy and light items."""
    p = np.arange(n_items)
    r = p % (2 * n_bins)
    return np.where(r < n_bins, r, 2 * n_bins - 1 - r)
