"""The cluster a plan runs on: world size, memory cap, and the registry of CP groups.

Every group a plan may use is built once at start-up (DESIGN.md "Process groups"): here the
contiguous, aligned power-of-two blocks of ranks. A block never straddles a node boundary
unless it is larger than a node. Planners only pick from this registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Tuple


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class ClusterSpec:
    world_size: int
    max_tokens_per_rank: int  # memory cap per rank per micro-batch, in tokens
    gpus_per_node: int = 8
    max_group_size: Optional[int] = None  # largest CP group a plan may use (default: world)

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size <= 0:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if not is_power_of_two(self.world_size):
            raise ValueError(
                f"world_size {self.world_size} is not a power of two: CP groups are power-of-two "
                f"blocks of ranks (use a world of 1, 2, 4, 8, ...)"
            )
        if self.max_tokens_per_rank <= 0:
            raise ValueError(f"max_tokens_per_rank must be positive, got {self.max_tokens_per_rank}")
        if self.max_group_size is not None and (
            not is_power_of_two(self.max_group_size) or self.max_group_size > self.world_size
        ):
            raise ValueError(
                f"max_group_size {self.max_group_size} must be a power of two <= world_size {self.world_size}"
            )

    @cached_property
    def group_sizes(self) -> Tuple[int, ...]:
        top = self.max_group_size or self.world_size
        return tuple(1 << i for i in range(top.bit_length()) if (1 << i) <= top)

    def blocks(self, size: int) -> List[Tuple[int, ...]]:
        """The registry's groups of one size: aligned contiguous blocks."""
        if size not in self.group_sizes:
            raise ValueError(f"group size {size} not in the registry {self.group_sizes}")
        return [tuple(range(s, s + size)) for s in range(0, self.world_size, size)]

    def is_registered(self, ranks: Tuple[int, ...]) -> bool:
        g = len(ranks)
        return (
            g in self.group_sizes
            and ranks[0] % g == 0
            and ranks[-1] < self.world_size
            and tuple(ranks) == tuple(range(ranks[0], ranks[0] + g))
        )

    def all_groups(self) -> List[Tuple[int, ...]]:
        return [b for g in self.group_sizes if g > 1 for b in self.blocks(g)]

    def smallest_group_for(self, length: int) -> Optional[int]:
        """Smallest registered group size whose combined cap holds `length` tokens."""
        for g in self.group_sizes:
            if g * self.max_tokens_per_rank >= length:
                return g
        return None

    @property
    def largest_capacity(self) -> int:
        return self.group_sizes[-1] * self.max_tokens_per_rank
