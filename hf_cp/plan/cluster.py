"""The cluster a plan runs on: world size, memory cap, and the registry of CP groups.

Every group a plan may use is built once at start-up (docs/design.md "Process groups"): here the
contiguous, aligned power-of-two blocks of ranks. A block never straddles a node boundary
unless it is larger than a node. Planners only pick from this registry.

With `any_size_groups` (FCP, arXiv 2602.21788; Megatron PR #7097) the registry also holds
every contiguous run of ranks inside one node, of any size (3, 5, 6, 7 ranks on a node of
8) and at any offset. Groups larger than a node stay aligned power-of-two blocks. Every
balancer plans with the aligned blocks (`group_sizes`, `blocks`); only the planners that ask
for it (dynamic_cp's `any_size_groups` option) use the other runs (`all_group_sizes`,
`groups_of_size`). The flag also admits a world that is not a power of two if it fits one
node (three GPUs: groups (0, 1), (1, 2) and (0, 1, 2)); the trainer's planning set-up turns it
on for such a world, and dynamic_cp (with magi, usp and auto on it) then plans on those runs
whatever its option says, as there are no aligned blocks to plan on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Tuple

# The most ranks a cluster may have: the planner prices each long sample on every group size up
# to the world, and a world of 65,536 plans a step of ten samples in about 20 s on one core;
# 1,048,576 ranks did not finish in hours. (hf_cp's benchmarks go to 4,096.)
MAX_WORLD_SIZE = 65536


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class ClusterSpec:
    world_size: int
    max_tokens_per_rank: int  # memory cap per rank per micro-batch, in tokens
    gpus_per_node: int = 8
    max_group_size: Optional[int] = None  # largest CP group a plan may use (default: world)
    # the registry also holds every contiguous run of ranks within one node (module docstring)
    any_size_groups: bool = False

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size <= 0:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"world_size {self.world_size} is above the most ranks hf_cp plans for, {MAX_WORLD_SIZE}")
        if self.any_size_groups and (not isinstance(self.gpus_per_node, int) or self.gpus_per_node <= 0):
            raise ValueError(f"gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        one_node = self.any_size_groups and self.world_size <= self.gpus_per_node
        if not is_power_of_two(self.world_size) and not one_node:
            raise ValueError(
                f"world_size {self.world_size} is not a power of two: CP groups are power-of-two "
                f"blocks of ranks, so use a world of 1, 2, 4, 8, ..., or one node of at most "
                f"{self.gpus_per_node} ranks"
                + ("" if self.any_size_groups else " with any_size_groups (the trainer's set-up turns it on there)")
            )
        if self.max_tokens_per_rank <= 0:
            raise ValueError(f"max_tokens_per_rank must be positive, got {self.max_tokens_per_rank}")
        if self.max_group_size is not None:
            within_node = self.any_size_groups and 0 < self.max_group_size <= min(self.gpus_per_node, self.world_size)
            if not within_node and (not is_power_of_two(self.max_group_size) or self.max_group_size > self.world_size):
                raise ValueError(
                    f"max_group_size {self.max_group_size} must be a power of two <= world_size {self.world_size}"
                    + (
                        f", or with any_size_groups any size up to a node ({self.gpus_per_node} ranks)"
                        if self.any_size_groups
                        else ""
                    )
                )

    @property
    def largest_group(self) -> int:
        """The most ranks one group may have: max_group_size, else the world."""
        return self.max_group_size or self.world_size

    @cached_property
    def group_sizes(self) -> Tuple[int, ...]:
        """Sizes of the aligned power-of-two blocks (what every balancer plans with)."""
        top = self.largest_group
        return tuple(1 << i for i in range(top.bit_length()) if (1 << i) <= top)

    @cached_property
    def all_group_sizes(self) -> Tuple[int, ...]:
        """Every registered group size: group_sizes, plus with any_size_groups every size up to
        a node (or up to max_group_size when that is smaller)."""
        if not self.any_size_groups:
            return self.group_sizes
        within = range(1, min(self.gpus_per_node, self.largest_group) + 1)
        return tuple(sorted(set(self.group_sizes) | set(within)))

    def blocks(self, size: int) -> List[Tuple[int, ...]]:
        """The registry's groups of one size: aligned contiguous blocks."""
        if size not in self.group_sizes:
            raise ValueError(f"group size {size} not in the registry {self.group_sizes}")
        # a world of one node that is not a power of two ends before its last block would
        return [tuple(range(s, s + size)) for s in range(0, self.world_size - size + 1, size)]

    def is_node_run_size(self, size: int) -> bool:
        """Whether the groups of `size` ranks are every contiguous run inside a node (any
        offset): with any_size_groups, up to a node; otherwise, and above, aligned blocks."""
        return self.any_size_groups and size <= min(self.gpus_per_node, self.largest_group)

    def groups_of_size(self, size: int) -> List[Tuple[int, ...]]:
        """Every registered group of `size` ranks: the contiguous runs inside each node when
        is_node_run_size(size), else the aligned blocks; ordered by first rank."""
        if size not in self.all_group_sizes:
            raise ValueError(f"group size {size} not in the registry {self.all_group_sizes}")
        if not self.is_node_run_size(size):
            return self.blocks(size)
        gpn = self.gpus_per_node
        return [
            tuple(range(s, s + size))
            for node_start in range(0, self.world_size, gpn)
            for s in range(node_start, min(node_start + gpn, self.world_size) - size + 1)
        ]

    def is_registered(self, ranks: Tuple[int, ...]) -> bool:
        g = len(ranks)
        if g == 0 or tuple(ranks) != tuple(range(ranks[0], ranks[0] + g)) or ranks[-1] >= self.world_size:
            return False
        if g in self.group_sizes and ranks[0] % g == 0:
            return True
        return self.is_node_run_size(g) and ranks[0] // self.gpus_per_node == ranks[-1] // self.gpus_per_node

    def all_groups(self) -> List[Tuple[int, ...]]:
        """Every registered group of two ranks or more, in a fixed order (every rank builds
        them in this order): the aligned blocks by size, then with any_size_groups the other
        runs inside a node, by size and first rank."""
        aligned = [b for g in self.group_sizes if g > 1 for b in self.blocks(g)]
        if not self.any_size_groups:
            return aligned
        seen = set(aligned)
        runs = [r for g in self.all_group_sizes if g > 1 and self.is_node_run_size(g) for r in self.groups_of_size(g)]
        return aligned + [r for r in runs if r not in seen]

    def describe_registry(self) -> str:
        """The registry in words, for error messages."""
        aligned = f"aligned power-of-two blocks of size in {self.group_sizes}"
        if not self.any_size_groups:
            return aligned
        top = min(self.gpus_per_node, self.largest_group)
        return f"contiguous runs of 1-{top} ranks within a node of {self.gpus_per_node}, and {aligned}"

    def smallest_group_for(self, length: int) -> Optional[int]:
        """Smallest aligned block size (group_sizes) whose combined cap holds `length` tokens."""
        for g in self.group_sizes:
            if g * self.max_tokens_per_rank >= length:
                return g
        return None

    @property
    def largest_capacity(self) -> int:
        """Tokens the largest aligned block holds: the longest sample every balancer can plan
        (the same as the largest group's when the world and max_group_size are powers of two)."""
        return self.group_sizes[-1] * self.max_tokens_per_rank
