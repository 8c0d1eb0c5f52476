"""Packing primitives shared by balancers."""
from __future__ import annotations

from typing import List, Sequence


class FirstFitPacker:
    """First-fit bin packing in O(log bins) per item: a max-tree over remaining capacities.

    Bins are opened on demand, all with the same capacity; `add` returns the bin index.
    """

    def __init__(self, capacity: int, max_bins: int):
        self.capacity = capacity
        self.size = 1
        while self.size < max(1, max_bins):
            self.size *= 2
        self.tree = [capacity] * (2 * self.size)  # bins not yet opened are empty (full capacity)
        self.bins: List[List[int]] = []
        self.loads: List[int] = []

    def add(self, item: int, weight: int) -> int:
        tree, size = self.tree, self.size
        if weight > self.capacity:
            raise ValueError(f"item {item} weighs {weight}, more than the bin capacity {self.capacity}")
        if tree[1] < weight:
            raise ValueError(f"more than {size} bins needed")
        i = 1
        while i < size:  # descend to the leftmost leaf with room
            i = 2 * i if tree[2 * i] >= weight else 2 * i + 1
        b = i - size
        if b == len(self.bins):  # bins open left to right: the new one is the next
            self.bins.append([])
            self.loads.append(0)
        self.bins[b].append(item)
        self.loads[b] += weight
        tree[i] -= weight
        i //= 2
        while i:  # refresh maxima upwards; stop once a node's maximum is unchanged
            left, right = tree[2 * i], tree[2 * i + 1]
            m = left if left >= right else right
            if tree[i] == m:
                break
            tree[i] = m
            i //= 2
        return b


def first_fit(ids: Sequence[int], weights: Sequence[int], capacity: int) -> List[List[int]]:
    """First-fit packing of items in the given order into bins of `capacity`."""
    # first fit leaves at most one bin half empty, so it never needs more than 2*total/capacity + 1
    bound = 2 * (sum(weights) // max(capacity, 1)) + 2
    packer = FirstFitPacker(capacity, min(len(ids), bound))
    for s, w in zip(ids, weights):
        packer.add(s, w)
    return packer.bins
