"""The vision tower's work in a plan: which member of a group encodes each image or clip, and
what that costs it. The one count the simulator, the bounds and the balancers share.

A local (or chunked) sample's items are encoded by the rank that holds it; a distributed
sample's by the member plan/vision_encoders.assign_encoders picks, on the same work unit the
executor gives it (patches, train/data/vision_rows.py). The executor breaks ties between
equally loaded members by the placeholder tokens each holds, which a plan's lengths do not
say: here ties go to the lowest member. Either way the members' encoder loads are the same
multiset, so the busiest encoder's load is the same; which member carries it may differ, and
with it (by the members' small differences in text work) the group's slowest member. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hf_cp.cost.model import CostModel
from hf_cp.plan.step_plan import Group
from hf_cp.plan.vision_encoders import assign_encoders
from hf_cp.samples.vision_grids import GridTHW, SampleGrids

# sample id -> its items' patch grids (t, h, w), images first then clips; absent: no images
VisionGrids = Mapping[int, Sequence[GridTHW]]


def grid_patches(grid: GridTHW) -> int:
    t, h, w = grid
    return t * h * w


@dataclass(frozen=True)
class MemberVision:
    """One member's vision work in a group's micro-batch."""

    ms: float  # the tower's forward and backward over the items it encodes
    patches: int  # their patches (activations held until backward)


NO_VISION = MemberVision(0.0, 0)


def group_vision(group: Group, grids: Optional[VisionGrids], cost: CostModel) -> List[MemberVision]:
    """Per member of `group`: the vision work it runs in the group's micro-batch (module docstring)."""
    size = len(group.ranks)
    if not grids:
        return [NO_VISION] * size
    items: List[List[GridTHW]] = [[] for _ in range(size)]
    for m, r in enumerate(group.ranks):
        items[m] = [tuple(g) for s in group.local.get(r, []) for g in grids.get(s, ())]
        items[m] += [tuple(g) for c in group.chunked.get(r, []) for g in grids.get(c.sample, ())]
    spread = [tuple(g) for s in group.distributed for g in grids.get(s, ())]
    if spread:
        work = [sum(grid_patches(g) for g in mine) for mine in items]
        chosen = assign_encoders([grid_patches(g) for g in spread], [[0] * size for _ in spread], work)
        for g, m in zip(spread, chosen):
            items[m].append(g)
    if not any(items):
        return [NO_VISION] * size
    return [
        MemberVision(cost.vision_ms(mine), sum(grid_patches(g) for g in mine)) if mine else NO_VISION for mine in items
    ]


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
