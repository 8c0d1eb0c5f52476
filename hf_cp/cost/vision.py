"""The vision tower's work in a plan: which member of a group encodes each image or clip, and
what that costs it. The one count the simulator, the bounds and the balancers share.

A local (or chunked) sample's items are encoded by the rank that holds it; a distributed
sample's by the member plan/vision_encoders.assign_encoders picks, on the same work unit the
executor gives it (patches, train/data/vision_rows.py). The executor breaks ties between
equally loaded members by the placeholder tokens each holds, which a plan's lengths do not
say: here ties go to the lowest member. Either way the members' encoder loads are the same
multiset, so the busiest encoder's load is the same; which member carries it may differ, and
with it (by the members' small differences in text work) the group's slowest member.

Memory: an encoder holds its items' activations until backward, beside its tokens'. A member's
count against the cap adds, in tokens of the memory model (CostModel.vision_tokens), the most
patches the executor may give it whatever its tie-breaks (plan/vision_encoders.member_held_patches):
StepPlan.held_tokens, which the validator checks, the simulator reports and the balancers plan
against (alone_held_tokens for one sample). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hf_cp.cost.model import CostModel
from hf_cp.modes.registry import mode_spec
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.step_plan import Group
from hf_cp.plan.vision_encoders import grid_patches, member_held_patches, member_items
from hf_cp.samples.vision_grids import GridTHW, SampleGrids

# sample id -> its items' patch grids (t, h, w), images first then clips; absent: no images
VisionGrids = Mapping[int, Sequence[GridTHW]]


@dataclass(frozen=True)
class MemberVision:
    """One member's vision work in a group's micro-batch."""

    ms: float  # the tower's forward and backward over the items it encodes
    patches: int  # their patches (activations held until backward)


NO_VISION = MemberVision(0.0, 0)


def group_vision(group: Group, grids: Optional[VisionGrids], cost: CostModel) -> List[MemberVision]:
    """Per member of `group`: the vision work it runs in the group's micro-batch (module docstring)."""
    if not grids:
        return [NO_VISION] * len(group.ranks)
    items = member_items(group, grids)
    if not any(items):
        return [NO_VISION] * len(group.ranks)
    return [
        MemberVision(cost.vision_ms(mine), sum(grid_patches(g) for g in mine)) if mine else NO_VISION for mine in items
    ]


def alone_held_tokens(length: int, grids: SampleGrids, group_size: int, cost: CostModel) -> int:
    """The fullest member's count against the cap (StepPlan.held_tokens: its tokens and its
    encoder's activations, cost.vision_tokens) when a sample of `length` tokens with items
    `grids` runs alone: on one rank (`group_size` 1), or spread per document over a group of
    `group_size` ranks, its items encoded as the executor may place them
    (plan/vision_encoders.member_held_patches). What a sample needs of a rank at the least on a
    group of that size: the one count the balancers size groups by and the request refuses by."""
    if group_size == 1:
        return int(length) + cost.vision_tokens(sum(grid_patches(g) for g in grids))
    shares = mode_spec(ShardMode.RING_PER_DOC).member_tokens([int(length)], group_size)
    group = Group(ranks=tuple(range(group_size)), distributed=[0], mode=ShardMode.RING_PER_DOC)
    held = member_held_patches(group, {0: tuple(grids)})
    return max(int(t) + cost.vision_tokens(p) for t, p in zip(shares, held))


def smallest_vision_group(
    length: int, grids: SampleGrids, group_sizes: Sequence[int], cap: int, cost: CostModel
) -> Optional[int]:
    """The smallest of `group_sizes` on which a sample with items `grids` fits alone
    (alone_held_tokens within `cap`); None when it fits none (an item is encoded whole on one
    member, so a larger group stops helping once the largest item fills a rank)."""
    for g in sorted(group_sizes):
        if alone_held_tokens(length, grids, g, cost) <= cap:
            return int(g)
    return None


def distributed_vision_ms(grids: Sequence[GridTHW], group_size: int, cost: CostModel) -> float:
    """The least time the busiest encoder of a group of `group_size` members spends on one
    distributed sample's items (each item encoded whole, on one member): its costliest item, or
    an even share of them all. What a balancer charges every member of the sample's group
    before the group exists (its micro-batch waits for the busiest encoder); group_vision
    gives the exact split once it does."""
    if not grids:
        return 0.0
    each = [cost.vision_item_ms(tuple(g)) for g in grids]
    return max(max(each), sum(each) / max(1, group_size))


def samples_vision_ms(sample_ids: Sequence[int], grids: Optional[VisionGrids], cost: CostModel) -> np.ndarray:
    """Each sample's vision tower time, all its items on one rank (0 for a text-only sample):
    the encoder work a balancer adds to the sample's single-rank time, and the bounds count."""
    out = np.zeros(len(sample_ids), dtype=np.float64)
    if grids:
        for i, s in enumerate(sample_ids):
            g = grids.get(int(s))
            if g:
                out[i] = cost.vision_ms(g)
    return out


def largest_item_ms(grids: Optional[VisionGrids], cost: CostModel) -> float:
    """The costliest single item's tower time: no plan encodes it faster (an item is never split)."""
    if not grids:
        return 0.0
    return max((cost.vision_item_ms(tuple(g)) for gs in grids.values() for g in gs), default=0.0)


@dataclass(frozen=True)
class StepVision:
    """A step's vision work as the bounds count it."""

    sample_ms: np.ndarray  # per sample (in the step's order): its items' tower time on one rank
    largest_item_ms: float  # the costliest item alone
    sample_grids: Tuple[SampleGrids, ...] = ()  # per sample, its items' grids (() for text only)

    def subset(self, keep: np.ndarray) -> StepVision:
        """The samples where `keep` (a boolean array over the step) is true."""
        grids = tuple(g for g, k in zip(self.sample_grids, keep.tolist()) if k)
        return StepVision(self.sample_ms[keep], self.largest_item_ms, grids)


def step_vision(sample_ids: Sequence[int], grids: Optional[VisionGrids], cost: CostModel) -> Optional[StepVision]:
    """The step's StepVision (None: no sample of it has images or clips)."""
    if not grids or not any(int(s) in grids for s in sample_ids):
        return None
    mine = {int(s): tuple(grids[int(s)]) for s in sample_ids if int(s) in grids}
    per_sample = tuple(mine.get(int(s), ()) for s in sample_ids)
    return StepVision(samples_vision_ms(sample_ids, mine, cost), largest_item_ms(mine, cost), per_sample)
