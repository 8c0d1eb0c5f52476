"""Packing documents into micro-batches and packs: first fit (static), first-fit decreasing
under a rank's cap, a streaming packer's look-ahead packing (libra), the even cap a zigzag
split can honour."""

from __future__ import annotations

import bisect
from typing import Iterable, List, Sequence

import numpy as np


class FirstFitPacker:
    """First-fit bin packing in O(log bins) per item: a max-tree over remaining capacities.

    Bins are opened on demand, all with the same capacity; `add` returns the bin index.
    In data order most items go to the newest bin (items are small next to the capacity, so
    a bin takes many before the next opens): an item no older bin can hold goes there with
    no tree descent when it fits, which makes packing a step's worth of items ~2.5x faster.
    """

    def __init__(self, capacity: int, max_bins: int):
        self.capacity = capacity
        self.size = 1
        while self.size < max(1, max_bins):
            self.size *= 2
        self.tree = [capacity] * (2 * self.size)  # bins not yet opened are empty (full capacity)
        self.bins: List[List[int]] = []
        # Every bin but the newest has less room than this: set to an item's weight whenever
        # the descent shows that no older bin holds it; rooms only shrink, so it stays true.
        self.older_room_below = 0

    @property
    def loads(self) -> List[int]:
        return [self.capacity - self.tree[self.size + b] for b in range(len(self.bins))]

    def add(self, item: int, weight: int) -> int:
        return self.extend((item,), (weight,))

    def extend(self, items: Iterable[int], weights: Iterable[int]) -> int:
        """Add the items in order; returns the bin of the last one (-1 if none)."""
        tree, size, capacity, bins = self.tree, self.size, self.capacity, self.bins
        below = self.older_room_below
        newest = len(bins) - 1
        b = -1
        try:
            for item, weight in zip(items, weights):
                if weight >= below and newest >= 0 and tree[size + newest] >= weight:
                    b = newest  # fits no older bin but fits the newest: first fit's choice
                    i = size + b
                else:
                    if weight > capacity:
                        raise ValueError(f"item {item} weighs {weight}, more than the bin capacity {capacity}")
                    if tree[1] < weight:
                        raise ValueError(f"more than {size} bins needed")
                    i = 1
                    while i < size:  # descend to the leftmost leaf with room
                        i += i
                        if tree[i] < weight:
                            i += 1
                    b = i - size
                    if b > newest:  # no open bin had room: bins open left to right, the new one is next
                        bins.append([])
                        newest = b
                        below = weight
                    elif b == newest and weight < below:
                        below = weight
                bins[b].append(item)
                room = tree[i] - weight
                tree[i] = room
                while i > 1:  # refresh maxima upwards; stop once a node's maximum is unchanged
                    sibling = tree[i ^ 1]
                    if sibling > room:
                        room = sibling
                    i >>= 1
                    if tree[i] == room:
                        break
                    tree[i] = room
        finally:
            self.older_room_below = below
        return b


def first_fit(ids: Sequence[int], weights: Sequence[int], capacity: int) -> List[List[int]]:
    """First-fit packing of items in the given order into bins of `capacity`."""
    # first fit leaves at most one bin half empty, so it never needs more than 2*total/capacity + 1
    bound = 2 * (sum(weights) // max(capacity, 1)) + 2
    packer = FirstFitPacker(capacity, min(len(ids), bound))
    packer.extend(ids, weights)
    return packer.bins


def even_cap(cap: int, group_size: int) -> int:
    """Per-rank token budget that a zigzag split of a group's pack can always honour.

    A zigzag member holds two of 2g nearly equal chunks, i.e. at most 2*ceil(T/2g) tokens:
    with T <= g * (cap rounded down to even) that is <= cap.
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
    if lnl[order[0]] > cap:
        raise ValueError(f"sample {idl[order[0]]} has {lnl[order[0]]} tokens, more than a rank's cap {cap}")
    total = int(lens.sum())
    if total <= cap:
        return [[idl[i] for i in order]]
    bins: List[List[int]] = []
    free: List[int] = []
    for i in order:
        n = lnl[i]
        for b, f in enumerate(free):
            if f >= n:
                bins[b].append(idl[i])
                free[b] = f - n
                break
        else:
            bins.append([idl[i]])
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
