"""The Balancer protocol, the request it plans, and the checks every balancer shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Tuple, runtime_checkable

from ..cluster import ClusterSpec
from ..cost import CostModel
from ..plan import StepPlan
from ..shard import ShardMode, rank_segments, segment_tokens


class SampleTooLongError(ValueError):
    """A sample cannot fit even the largest registered group."""


@dataclass(frozen=True)
class PlanRequest:
    """Everything a balancer may look at: a pure function of this gives the plan."""

    sample_ids: Tuple[int, ...]
    lengths: Tuple[int, ...]
    cluster: ClusterSpec
    cost: CostModel
    seed: int = 0
    step: int = 0
    dataset_max_length: Optional[int] = None  # longest sample of the whole dataset, if known

    def __post_init__(self):
        object.__setattr__(self, "sample_ids", tuple(int(s) for s in self.sample_ids))
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        if len(self.sample_ids) != len(self.lengths):
            raise ValueError(f"{len(self.sample_ids)} sample ids but {len(self.lengths)} lengths")
        if not self.sample_ids:
            raise ValueError(f"step {self.step}: empty global batch, nothing to plan")
        cap = self.cluster.largest_capacity
        for s, n in zip(self.sample_ids, self.lengths):
            if n <= 0:
                raise ValueError(f"sample {s}: length {n} must be positive")
            if n > cap:
                raise SampleTooLongError(
                    f"sample {s} has {n} tokens; the largest group ({self.cluster.group_sizes[-1]} ranks x "
                    f"{self.cluster.max_tokens_per_rank} tokens per rank) holds {cap}. Raise "
                    f"max_tokens_per_rank or the world size, or truncate/drop it in preprocessing"
                )

    def empty_plan(self, balancer: str) -> StepPlan:
        return StepPlan(
            world_size=self.cluster.world_size,
            max_tokens_per_rank=self.cluster.max_tokens_per_rank,
            sample_ids=list(self.sample_ids),
            lengths=list(self.lengths),
            step=self.step,
            balancer=balancer,
        )


@runtime_checkable
class Balancer(Protocol):
    """Plans one optimizer step. Must be deterministic in its request."""

    name: str

    def plan(self, request: PlanRequest) -> StepPlan: ...


def max_member_tokens(mode: ShardMode, doc_lengths: Sequence[int], group_size: int) -> int:
    """Tokens the fullest member holds when `doc_lengths` are distributed with `mode`."""
    if group_size == 1:
        return sum(doc_lengths)
    return max(segment_tokens(rank_segments(mode, doc_lengths, group_size, m)) for m in range(group_size))
