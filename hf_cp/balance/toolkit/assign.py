"""Assigning weighted items to bins: LPT, water-filling, snake dealing, grouping by label.

Deterministic in the arguments: equal weights keep their input order, ties go to the lowest bin.
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence, Tuple

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
    exact = order[:k]
    bins[exact] = least_loaded_first(w[exact], load)
    if k < n:
        tail = order[k:]
        bins[tail] = water_fill(w[tail], load)
        load += np.bincount(bins[tail], weights=w[tail], minlength=n_bins)
    return bins, load


# least_loaded_first: below this many items a round of the batched pass places, the heap
# takes over for HEAP_STRETCH_BINS x bins items (a round sorts every bin: it pays only when it
# places many items)
MIN_ROUND_ITEMS = 32
HEAP_STRETCH_BINS = 1


def least_loaded_first(items: np.ndarray, load: np.ndarray) -> np.ndarray:
    """Each item in turn onto the bin of least (load, index): the bins chosen, `load` updated
    in place. Exactly a heap of (load, bin) pairs popped and pushed back with the item added.

    The heap's pops come out in increasing (load, bin) order (a pushed pair is above the one
    popped), so a round sorts the bins once and gives the j-th next item to the j-th least
    loaded bin, for as long as that bin is below every pair pushed earlier in the round: the
    same pops the heap makes, with numpy doing the per-item work (the heap's Python loop was
    most of dynamic_cp's time on steps of ~10^5 short samples). A round stops at the first
    bin not strictly below them (ties go to the next round, which sorts them by index).
    Rounds that place few items (a few bins far below the rest) hand a stretch to the heap.
    """
    n = len(items)
    n_bins = len(load)
    out = np.empty(n, dtype=np.int64)
    index = np.arange(n_bins)
    pos = 0
    while pos < n:
        m = min(n_bins, n - pos)
        by_load = np.lexsort((index, load))[:m]
        start = load[by_load]
        pushed = start + items[pos : pos + m]
        # item j may take the j-th bin when it is below every pair pushed before it
        below = np.ones(m, dtype=bool)
        if m > 1:
            below[1:] = start[1:] < np.minimum.accumulate(pushed[:-1])
        took = m if below.all() else int(np.argmin(below))
        out[pos : pos + took] = by_load[:took]
        load[by_load[:took]] = pushed[:took]
        pos += took
        if took < MIN_ROUND_ITEMS and pos < n:
            stop = min(n, pos + HEAP_STRETCH_BINS * n_bins)
            out[pos:stop] = _heap_assign(items[pos:stop], load)
            pos = stop
    return out


def _heap_assign(items: np.ndarray, load: np.ndarray) -> List[int]:
    """least_loaded_first by a heap, one item at a time (`load` updated in place)."""
    heap = [(l, b) for b, l in enumerate(load.tolist())]
    heapq.heapify(heap)
    chosen = []
    replace = heapq.heapreplace
    for x in items.tolist():
        l, b = heap[0]
        chosen.append(b)
        replace(heap, (l + x, b))
    for l, b in heap:
        load[b] = l
    return chosen


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


def improve_max_load(
    weights: np.ndarray,
    bins: np.ndarray,
    loads: np.ndarray,
    partners: int = 4,
    tolerance: float = 2e-3,
    max_rounds: Optional[int] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Lower the heaviest bin by moving one item out or swapping two (after LPT's greedy pass).

    Each round takes the heaviest bin (lowest index on ties) and, over its items a, the
    `partners` lightest bins p and their items b (b = 0: a move), the exchange that sheds
    d = a - b in (0, gap_p) closest to half the gap: it leaves the larger of the two bins
    lowest. The search ends when no exchange lowers the heaviest bin, when that bin is within
    `tolerance` of the mean, or after `max_rounds` (default 2 x bins). LPT leaves coarse
    items (a few per bin) up to a few percent uneven; this closes most of that. `loads` may
    include work that cannot move (it is only added to). Returns new (bins, loads);
    deterministic (ties: lowest indices).
    """
    bins = np.array(bins, dtype=np.int64, copy=True)
    loads = np.array(loads, dtype=np.float64, copy=True)
    w = np.asarray(weights, dtype=np.float64)
    n_bins = len(loads)
    if len(w) == 0 or n_bins < 2:
        return bins, loads
    members: Dict[int, np.ndarray] = dict(enumerate(group_indices(bins, n_bins)))
    by_weight: Dict[int, np.ndarray] = {}  # bins looked at: their items by (weight, index)

    def sorted_items(b: int) -> np.ndarray:
        v = by_weight.get(b)
        if v is None:
            ix = members[b]
            v = by_weight[b] = ix[np.lexsort((ix, w[ix]))]
        return v

    mean = float(loads.mean())
    k = min(partners, n_bins - 1)
    span = 2.0 * (float(w.max()) + float(loads.max()) + 1.0)  # keeps the partners' keys apart
    for _ in range(2 * n_bins if max_rounds is None else max_rounds):
        hi = int(np.argmax(loads))
        top = float(loads[hi])
        a_idx = members[hi]
        if top <= mean * (1.0 + tolerance) or not len(a_idx):
            break
        a = w[a_idx]
        light = np.argpartition(loads, k)[: k + 1] if k + 1 < n_bins else np.arange(n_bins)
        light = light[np.lexsort((light, loads[light]))]
        light = light[light != hi][:k]
        gaps = top - loads[light]
        # every partner's items after a 0 (a move), by weight: partner q's keys are its
        # weights + q * span, so the keys of all partners are sorted as they stand
        segments = [sorted_items(p) for p in light.tolist()]
        b_idx = np.concatenate([x for seg in segments for x in (np.array([-1]), seg)])
        q_of = np.repeat(np.arange(len(light)), [len(seg) + 1 for seg in segments])
        b_w = np.where(b_idx >= 0, w[np.maximum(b_idx, 0)], 0.0)
        key = b_w + q_of * span
        # for every (item a, partner q): the b nearest a - gap_q / 2, from below and above
        target = (a[:, None] - gaps[None, :] / 2.0) + np.arange(len(light))[None, :] * span
        pos = np.searchsorted(key, target)
        best_kept, best = 0.0, None
        for cand in (pos - 1, pos):
            c = np.clip(cand, 0, len(key) - 1)
            same = q_of[c] == np.arange(len(light))[None, :]
            d = a[:, None] - b_w[c]
            g = gaps[None, :]
            kept = np.where(same & (d > 0) & (d < g), np.minimum(d, g - d), -np.inf)
            flat = int(np.argmax(kept))
            if kept.flat[flat] > best_kept:
                i, q = np.unravel_index(flat, kept.shape)
                best_kept, best = float(kept.flat[flat]), (int(i), int(q), int(c[i, q]))
        if best is None or best_kept <= 1e-12 * max(top, 1.0):
            break
        i, q, c = best
        p, item, j = int(light[q]), int(a_idx[i]), int(b_idx[c])
        d = w[item] - (w[j] if j >= 0 else 0.0)
        loads[hi] -= d
        loads[p] += d
        bins[item] = p
        hi_items = members[hi][members[hi] != item]
        p_items = np.append(members[p], item)
        if j >= 0:
            bins[j] = hi
            hi_items = np.append(hi_items, j)
            p_items = p_items[p_items != j]
        members[hi], members[p] = hi_items, p_items
        by_weight.pop(hi, None)
        by_weight.pop(p, None)
    return bins, loads
