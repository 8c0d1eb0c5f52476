"""Wave assembly: groups in execution order become waves of disjoint groups."""

from __future__ import annotations

from typing import List, Tuple

from hf_cp.plan.step_plan import Group, Wave


class WaveBuilder:
    """Assembles groups into waves: each group goes to the first wave after every earlier
    group of any of its ranks, so groups of a wave are disjoint and every rank runs its
    groups in the order they were added."""

    def __init__(self, world_size: int):
        self.next_wave = [0] * world_size
        self.waves: List[List[Group]] = []

    def add(self, group: Group, at_least: int = 0) -> int:
        """Add `group` to the first wave (not before `at_least`) after its ranks' earlier groups."""
        ranks = group.ranks
        if len(ranks) == 1:  # most groups of a step (local micro-batches): no generator
            r = ranks[0]
            w = max(at_least, self.next_wave[r])
            self.next_wave[r] = w + 1
        else:
            w = max(at_least, max(self.next_wave[r] for r in ranks))
            for r in ranks:
                self.next_wave[r] = w + 1
        while len(self.waves) <= w:
            self.waves.append([])
        self.waves[w].append(group)
        return w

    def build(self) -> List[Wave]:
        return [Wave(sorted(gs, key=lambda g: g.ranks[0])) for gs in self.waves]


def block_ranks(index: int, size: int) -> Tuple[int, ...]:
    """Ranks of the `index`-th aligned block of `size` ranks."""
    return tuple(range(index * size, (index + 1) * size))
