"""Packing documents into micro-batches and packs: first-fit decreasing under a rank's cap
(first fit itself is plan/bins.py), a streaming packer's look-ahead packing (libra), the even cap a zigzag
split can honour."""

from __future__ import annotations

import bisect
from typing import List, Sequence

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
    first fit, with no sorting (dynamic_cp's ranks arrive sorted, thousands a step)."""
    if lengths[0] > cap:
        raise ValueError(f"sample {ids[0]} has {lengths[0]} tokens, more than a rank's cap {cap}")
    if sum(lengths) <= cap:
        return [list(ids)]
    bins: List[List[int]] = []
    free: List[int] = []
    for s, n in zip(ids, lengths):
        for b, f in enumerate(free):
            if f >= n:
                bins[b].append(s)
                free[b] = f - n
                break
        else:
            bins.append([s])
            free.append(cap - n)
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
