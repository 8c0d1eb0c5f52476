"""Assigning weighted items to bins: LPT, water-filling, snake dealing, grouping by label.

Deterministic in the arguments: equal weights keep their input order, ties go to the lowest bin.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.plan.sorting import stable_order


def descending_order(weights: np.ndarray, keys: Optional[np.ndarray] = None) -> np.ndarray:
    """Indices by decreasing weight; equal weights keep their input order (stable).

    `keys`: integer keys (a sample's length) that may order the weights the same way, when
    each weight is an increasing function of its key. The keys' descending order is sorted
    by radix or packed sort (plan/sorting.py) and taken when it is checked to be the
    weights' own: weights non-increasing along it, equal exactly where the keys are. A float
    merge sort of 10^5 weights costs ~4x that."""
    w = np.asarray(weights, dtype=np.float64)
    if keys is not None and len(keys) == len(w) and len(w) > 1:
        k = np.asarray(keys)
        if k.dtype.kind in "iu":
            order = stable_order(-k.astype(np.int64))
            ws, ks = w[order], k[order]
            same_key = ks[1:] == ks[:-1]
            if np.array_equal(ws[1:] == ws[:-1], same_key) and bool(np.all(ws[1:] <= ws[:-1])):
                return order
    return np.argsort(-w, kind="stable")


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
    weights: Sequence[float],
    n_bins: int,
    loads: Optional[Sequence[float]] = None,
    exact_items: Optional[int] = None,
    keys: Optional[np.ndarray] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Longest-processing-time-first: heaviest item onto the least loaded bin.

    Returns (bin of every item, final bin loads). `loads` are the bins' starting loads.
    The heaviest items (all but those lighter than EXACT_LPT_SHARE of the mean bin load, and
    at least 2 per bin; or exactly `exact_items`) go one by one through a heap; the light
    tail is water-filled (water_fill). `keys`: descending_order's hint (the items' lengths).
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    bins = np.zeros(n, dtype=np.int64)
    load = np.zeros(n_bins, dtype=np.float64) if loads is None else np.array(loads, dtype=np.float64)
    if n == 0:
        return bins, load
    order = descending_order(w, keys)
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


def group_offsets(labels: np.ndarray, n_groups: int) -> Tuple[np.ndarray, np.ndarray]:
    """(indices by label, each label's first position in them): label b's indices, in
    increasing order, are order[first[b]:first[b + 1]]."""
    order = stable_order(labels)
    first = np.zeros(n_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(labels, minlength=n_groups), out=first[1:])
    return order, first


def group_indices(labels: np.ndarray, n_groups: int) -> List[np.ndarray]:
    """Indices of each label 0..n_groups-1, in increasing index order."""
    order, first = group_offsets(labels, n_groups)
    return np.split(order, first[1:-1])


def serpentine(n_items: int, n_bins: int) -> np.ndarray:
    """Bin of each position when items are dealt 0,1,..,m-1,m-1,..,1,0,0,1,.. (snake order):
    dealt heaviest first, every bin gets a fair share of heavy and light items."""
    p = np.arange(n_items)
    r = p % (2 * n_bins)
    return np.where(r < n_bins, r, 2 * n_bins - 1 - r)


# improve_max_load runs up to 2 x bins rounds, each of which used to cost ~40 numpy calls on
# arrays of a few items (the busiest bin's and its partners'), an argmax and an argpartition over
# every bin: ~100 us a round, 0.3-0.5 s at 4096 ranks on long-document steps. The rounds now
# keep the bins sorted by (load, index) in a list (two bins change per round) and search the
# exchanges of small bins in plain Python; the arithmetic and every tie-break are those of the
# numpy version in tests/test_planner_scale.py, so the choices are the same (checked there).
# Up to this many (item of the busiest bin, partner) pairs the search runs in Python (about a
# microsecond a pair); above it, vectorised (~100 us a round, whatever the size).
PY_SEARCH_MAX_PAIRS = 96


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
    deterministic (ties: lowest indices; the partners are the `partners` least loaded bins by
    (load, index), the busiest left out).
    """
    bins = np.array(bins, dtype=np.int64, copy=True)
    loads = np.array(loads, dtype=np.float64, copy=True)
    w = np.asarray(weights, dtype=np.float64)
    n_bins = len(loads)
    if len(w) == 0 or n_bins < 2:
        return bins, loads
    wl = w.tolist()
    # each bin's items, in the order the numpy version kept them (increasing index, then as
    # exchanged), made when a bin is first looked at (most never are)
    grouped, first = group_offsets(bins, n_bins)
    members: Dict[int, List[int]] = {}
    by_weight: Dict[int, Tuple[List[float], List[int]]] = {}  # bins looked at: items by (weight, index)
    as_arrays: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}  # ... as arrays after a 0 (a move)

    def items_of(b: int) -> List[int]:
        v = members.get(b)
        if v is None:
            v = members[b] = grouped[first[b] : first[b + 1]].tolist()
        return v

    def sorted_items(b: int) -> Tuple[List[float], List[int]]:
        v = by_weight.get(b)
        if v is None:
            ix = sorted(items_of(b), key=lambda i: (wl[i], i))
            v = by_weight[b] = ([wl[i] for i in ix], ix)
        return v

    def sorted_arrays(b: int) -> Tuple[np.ndarray, np.ndarray]:
        v = as_arrays.get(b)
        if v is None:
            ix = np.asarray(items_of(b), dtype=np.int64)
            ix = ix[np.lexsort((ix, w[ix]))]
            v = as_arrays[b] = (np.concatenate(([0.0], w[ix])), np.concatenate(([-1], ix)))
        return v

    mean = float(loads.mean())
    k = min(partners, n_bins - 1)
    span = 2.0 * (float(w.max()) + float(loads.max()) + 1.0)  # keeps the partners' keys apart
    ld = loads.tolist()  # the loads as Python floats (the same float64 sums as numpy's)
    ranked = sorted(zip(ld, range(n_bins)))  # (load, bin), kept sorted as two bins change a round
    for _ in range(2 * n_bins if max_rounds is None else max_rounds):
        top = ranked[-1][0]
        hi = ranked[bisect_left(ranked, (top, -1))][1]  # np.argmax: the lowest bin of the top load
        a_idx = items_of(hi)
        if top <= mean * (1.0 + tolerance) or not a_idx:
            break
        light = _partners(ranked, hi, k)
        gaps = [top - ld[p] for p in light]
        if len(a_idx) * len(light) <= PY_SEARCH_MAX_PAIRS:
            segments = [sorted_items(p) for p in light]
            best_kept, best = _best_exchange_py([wl[i] for i in a_idx], gaps, segments, span)
        else:
            arrays = [sorted_arrays(p) for p in light]
            best_kept, best = _best_exchange_np(w[np.array(a_idx)], np.array(gaps), arrays, span)
        if best is None or best_kept <= 1e-12 * max(top, 1.0):
            break
        i, q, j = best
        p, item = light[q], a_idx[i]
        d = wl[item] - (wl[j] if j >= 0 else 0.0)
        old_hi, old_p = ld[hi], ld[p]
        ld[hi] = old_hi - d
        ld[p] = old_p + d
        loads[hi], loads[p] = ld[hi], ld[p]
        for old, b in ((old_hi, hi), (old_p, p)):
            del ranked[bisect_left(ranked, (old, b))]
        insort(ranked, (ld[hi], hi))
        insort(ranked, (ld[p], p))
        bins[item] = p
        hi_items = [x for x in members[hi] if x != item]
        p_items = items_of(p) + [item]
        if j >= 0:
            bins[j] = hi
            hi_items.append(j)
            p_items = [x for x in p_items if x != j]
        members[hi], members[p] = hi_items, p_items
        for b in (hi, p):
            by_weight.pop(b, None)
            as_arrays.pop(b, None)
    return bins, loads


def _partners(ranked: List[Tuple[float, int]], hi: int, k: int) -> List[int]:
    """The k least loaded bins but `hi`, by (load, index): equal loads go to the lowest bins.
    (It used to follow np.argpartition's pick among loads tied across the k-th place, which
    needed a partition of every bin on ~3 rounds in 4 at 4096 ranks, and is not specified
    across numpy builds; a plan must not depend on the CPU that made it.)"""
    return [b for _, b in ranked[: k + 1] if b != hi][:k]


def _best_exchange_py(a: List[float], gaps: List[float], segments, span: float):
    """_best_exchange_np in plain Python, for a few items: the same keys, bisections and choice
    (numpy's argmax over the first candidate's pairs, item-major; then the second candidate's
    best where it keeps more)."""
    last = len(segments) - 1
    parts = []
    for q, (wts, ix) in enumerate(segments):
        shift = q * span
        parts.append((q, shift, gaps[q], [0.0 + shift] + [x + shift for x in wts], [0.0, *wts], [-1, *ix]))
    kept1 = kept2 = -math.inf
    at1 = at2 = None
    for i, x in enumerate(a):
        for q, shift, g, keys, bw, ix in parts:
            # searchsorted over all partners' keys laid end to end lands in partner q's own
            # stretch (span keeps them apart) or just past it; its neighbours are other partners
            # (no exchange) except where np.clip folds the ends back onto the first and last
            pos = bisect_left(keys, (x - g / 2.0) + shift)
            c = pos - 1 if pos else (0 if q == 0 else -1)
            if c >= 0:
                d = x - bw[c]
                if d > 0 and d < g:
                    kept = min(d, g - d)
                    if kept > kept1:
                        kept1, at1 = kept, (i, q, ix[c])
            c = pos if pos < len(keys) else (pos - 1 if q == last else -1)
            if c >= 0:
                d = x - bw[c]
                if d > 0 and d < g:
                    kept = min(d, g - d)
                    if kept > kept2:
                        kept2, at2 = kept, (i, q, ix[c])
    best_kept, best = 0.0, None
    if at1 is not None and kept1 > best_kept:
        best_kept, best = kept1, at1
    if at2 is not None and kept2 > best_kept:
        best_kept, best = kept2, at2
    return best_kept, best


def _best_exchange_np(a: np.ndarray, gaps: np.ndarray, arrays, span: float):
    """The exchange of largest kept = min(d, gap - d) over every (item a, partner q) pair, d = a - b
    with b the partner's item nearest a - gap_q / 2 from below or above: (kept, (item position,
    partner position, b's index or -1 for a move)), or (0.0, None) when none sheds load."""
    # arrays: per partner, its items' weights and indices after a 0 and a -1 (a move), by
    # weight. Partner q's keys are its weights + q * span, so the keys of all partners are
    # sorted as they stand
    b_w = np.concatenate([bw for bw, _ in arrays])
    b_idx = np.concatenate([ix for _, ix in arrays])
    q_of = np.repeat(np.arange(len(arrays)), [len(bw) for bw, _ in arrays])
    key = b_w + q_of * span
    # for every (item a, partner q): the b nearest a - gap_q / 2, from below and above
    target = (a[:, None] - gaps[None, :] / 2.0) + np.arange(len(arrays))[None, :] * span
    pos = np.searchsorted(key, target)
    # both neighbours at once, below then above: argmax over the stacked pairs takes the first
    # maximum, i.e. the one below unless the one above keeps strictly more (the loop it replaced)
    c = np.stack((pos - 1, pos))
    np.minimum(np.maximum(c, 0, out=c), len(key) - 1, out=c)  # np.clip, without its per-call checks
    d = a[None, :, None] - b_w[c]
    g = gaps[None, None, :]
    ok = (q_of[c] == np.arange(len(arrays))[None, None, :]) & (d > 0) & (d < g)
    kept = np.where(ok, np.minimum(d, g - d), -np.inf)
    flat = int(np.argmax(kept))
    best_kept, best = 0.0, None
    if kept.flat[flat] > best_kept:
        _, i, q = np.unravel_index(flat, kept.shape)
        best_kept, best = float(kept.flat[flat]), (int(i), int(q), int(b_idx[c.flat[flat]]))
    return best_kept, best
