"""Packing documents into micro-batches and packs: first-fit decreasing under a rank's cap
(first fit itself is plan/bins.py), a streaming packer's look-ahead packing (libra), the even cap a zigzag
split can honour."""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import List, Sequence, Tuple

import numpy as np


def even_cap(cap: int, group_size: int) -> int:
    """Per-rank token budget that a zigzag split of a group's pack can always honour.

    A zigzag member holds two of 2g nearly equal chunks (modes/ring.py: split_member_tokens),
    i.e. at most 2*ceil(T/2g) tokens: with T <= g * (cap rounded down to even) that is <= cap.
    """
    return cap if group_size == 1 else cap - (cap & 1)


def split_to_cap(ids: Sequence[int], lengths: Sequence[int], cap: int) -> List[List[int]]:
    """Pack one rank's local documents into micro-batches of at most `cap` tokens.

    First-fit decreasing (each micro-batch costs a fixed overhead, so few and full is best);
    equal lengths keep their input order.
    """
    if not len(ids):
        return []
    lens = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lens, kind="stable").tolist()
    idl, lnl = list(ids), lens.tolist()
    return first_fit_sorted([idl[i] for i in order], [lnl[i] for i in order], cap)


def first_fit_sorted(ids: List[int], lengths: List[int], cap: int) -> List[List[int]]:
    """split_to_cap of documents already sorted longest first (equal lengths in their order):
    first fit, with no sorting (dynamic_cp's ranks arrive sorted, thousands a step).

    Built bin by bin, which gives first fit's bins exactly: an item lands in bin b when it fits
    there and in no earlier bin, and what bin b holds depends only on the items offered to it
    in order, so bin b is a greedy scan over the items the earlier bins left. The scan goes by
    runs: the items that fit are a suffix of the (descending) rest, found by bisection, and a
    run of them goes in at once by prefix sums; a bin takes a few runs, not one step per item
    (~430 items a rank at 64 ranks of short samples).
    """
    if lengths[0] > cap:
        raise ValueError(f"sample {ids[0]} has {lengths[0]} tokens, more than a rank's cap {cap}")
    if sum(lengths) <= cap:
        return [list(ids)]
    bins: List[List[int]] = []
    rest_ids, rest = list(ids), list(lengths)
    while rest:
        m = len(rest)
        neg = [-n for n in rest]  # ascending, for bisect
        prefix = list(accumulate(rest, initial=0))
        free, i, smallest = cap, 0, rest[-1]
        runs: List[Tuple[int, int]] = []
        while i < m and free >= smallest:
            i = bisect.bisect_left(neg, -free, i)  # the first item from i that fits
            if i == m:
                break
            e = bisect.bisect_right(prefix, prefix[i] + free, i + 1) - 1  # items i..e-1 fit together
            runs.append((i, e))
            free -= prefix[e] - prefix[i]
            i = e
        bins.append([s for a, e in runs for s in rest_ids[a:e]])
        keep_ids: List[int] = []
        keep: List[int] = []
        start = 0
        for a, e in runs + [(m, m)]:
            keep_ids += rest_ids[start:a]
            keep += rest[start:a]
            start = e
        rest_ids, rest = keep_ids, keep
    return bins


def first_fit_sorted_runs(lengths: np.ndarray, starts: np.ndarray, cap: int) -> np.ndarray:
    """first_fit_sorted on many independent runs of one array at once: the first-fit bin of
    every item within its run.

    `lengths` holds the runs back to back, each sorted longest first; run r is
    lengths[starts[r]:starts[r + 1]] (the last to the end). Same bins as first_fit_sorted on
    each run (its bin-by-bin scan, vectorised over the runs): for each bin, every run advances
    by one run of fitting items per numpy pass, a search for its first item that fits on keys
    that sort the runs one after the other (run x (cap + 1) + cap - length) and a search of
    its prefix sums for how many fit after it. The ~1,300 overflowing ranks of a 4096-rank
    step pack in ~10 ms this way, against ~60 ms rank by rank.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    n = len(lens)
    bins = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return bins
    if int(lens.max()) > cap:
        raise ValueError(f"item {int(np.argmax(lens > cap))} has {int(lens.max())} tokens, more than the cap {cap}")
    run_of = np.zeros(n, dtype=np.int64)
    run_of[np.asarray(starts, dtype=np.int64)[1:]] = 1
    run_of = np.cumsum(run_of)
    alive = np.arange(n)  # the items no bin took yet, in order
    b = 0
    while len(alive):
        left, runs = lens[alive], run_of[alive]
        m = len(left)
        first = np.flatnonzero(np.concatenate(([True], runs[1:] != runs[:-1])))
        end = np.append(first[1:], m)
        ordinal = np.repeat(np.arange(len(first)), np.diff(np.append(first, m)))
        keys = ordinal * (cap + 1) + (cap - left)  # ascending: by run, then shortest last
        prefix = np.concatenate(([0], np.cumsum(left)))
        at, free = first.copy(), np.full(len(first), cap, dtype=np.int64)
        taken = np.zeros(m + 1, dtype=np.int64)  # +1 at a run of taken items' start, -1 past its end
        active = np.arange(len(first))
        while len(active):
            # the first item from `at` on that fits the bin's free room: length <= free
            j = np.maximum(np.searchsorted(keys, active * (cap + 1) + cap - free[active], side="left"), at[active])
            fits = j < end[active]
            active, j = active[fits], j[fits]
            e = np.minimum(np.searchsorted(prefix, prefix[j] + free[active], side="right") - 1, end[active])
            np.add.at(taken, j, 1)
            np.add.at(taken, e, -1)
            free[active] -= prefix[e] - prefix[j]
            at[active] = e
            go_on = e < end[active]
            active = active[go_on]
        took = np.cumsum(taken[:m]) > 0
        bins[alive[took]] = b
        alive = alive[~took]
        b += 1
    return bins


def lookahead_pack(lengths: Sequence[int], capacity: int, max_skips: int = 16) -> np.ndarray:
    """Fixed-length packing in data order, as a streaming data loader packs: the pack index of
    every item.

    A pack takes the next items while they fit; an item that does not fit is set aside and
    the pack goes on with the items after it (up to `max_skips` times, or until no item of
    the step could fit, then it closes). The items set aside then go, in data order, into
    the first pack with room (first fit), opening new packs at the end if none has, so the
    waste gathers in the last packs as with first fit. An item over `capacity` is a pack of
    its own. Runs of items are found by bisection on prefix sums and the first fit scans in
    numpy, so the Python work is per pack and per item set aside, not per item.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    n = len(lens)
    prefix = np.concatenate([[0], np.cumsum(lens)]).tolist()
    pack_of = np.empty(n, dtype=np.int64)
    smallest = int(lens.min()) if n else 0  # a pack with less room than this is full
    set_aside: List[int] = []
    free: List[int] = []
    i = 0
    while i < n:
        k, room, skips, start = len(free), capacity, 0, i
        while i < n:
            e = bisect.bisect_right(prefix, prefix[i] + room, lo=i) - 1  # items i..e-1 fit
            if e > i:
                pack_of[i:e] = k
                room -= prefix[e] - prefix[i]
                i = e
            elif i == start:  # over capacity: a pack of its own
                pack_of[i] = k
                room = 0
                i += 1
                break
            if i >= n or skips == max_skips or room < smallest:
                break
            set_aside.append(i)
            i += 1
            skips += 1
        free.append(room)
    if set_aside:
        room_left = np.zeros(len(free) + len(set_aside), dtype=np.int64)
        room_left[: len(free)] = free
        n_packs = len(free)
        for i in set_aside:
            k = int(np.argmax(room_left[:n_packs] >= lens[i]))
            if room_left[k] < lens[i]:
                k = n_packs
                n_packs += 1
                room_left[k] = max(capacity, lens[i])
            pack_of[i] = k
            room_left[k] -= lens[i]
    return pack_of
