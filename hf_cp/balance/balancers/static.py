"""`static`: what users run today, the baseline every other balancer is measured against.

One CP size for the whole run (the smallest power of two whose combined cap fits the longest
sample of the dataset), fixed-length first-fit packing in data order (as an offline packer,
e.g. TRL's packing=True, packs a dataset), every pack zigzag-split over its CP group, packs
dealt to the DP replicas in turn, as a distributed sampler deals them: every replica gets its
share of the packs. Packs hold cp * cap tokens, or on a step too small to give every replica
one at that length (an epoch's partial last step) fewer (StaticBalancer.pack), so that no
replica idles while others work through several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.options import BalancerOptions
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.bins import first_fit
from hf_cp.plan.step_plan import Group, StepPlan, Wave


@dataclass(frozen=True)
class StaticOptions(BalancerOptions):
    """static takes no options."""

    BALANCER: ClassVar[str] = "static"


@register_balancer("static", auto_member=True)
class StaticBalancer:
    name = "static"
    # places by token counts alone, never by attention cost: a sample's mask cannot change its plan
    handles_masks = True
    options_class = StaticOptions

    def __init__(self, **options):
        self.options = StaticOptions.from_dict(options)

    @staticmethod
    def cp_size(req: PlanRequest) -> int:
        """The run's one CP size: the smallest group holding the dataset's longest sample."""
        return req.cluster.smallest_group_for(max(req.dataset_max_length or 0, max(req.lengths)))

    def lower_bound_ms(self, req: PlanRequest, bounds: BoundCache) -> float:
        """No static plan of the request is faster (every sample on a group of cp_size ranks)."""
        return bounds.fixed_size(self.cp_size(req))

    @staticmethod
    def pack(req: PlanRequest, replicas: int, capacity: int) -> List[List[int]]:
        """First fit in data order to `capacity` tokens, or on a step too small to give every
        replica a pack that long, to the shortest length (from the step's tokens / replicas
        up, by 25% steps, never below its longest sample) that makes no more packs than
        replicas."""
        ids, lens = req.sample_ids, req.lengths
        size = max(-(-sum(lens) // replicas), max(lens))
        while size < capacity:
            packs = first_fit(ids, lens, size)
            if len(packs) <= replicas:
                return packs
            size = -(-size * 5 // 4)
        return first_fit(ids, lens, capacity)

    def plan(self, req: PlanRequest) -> StepPlan:
        cl = req.cluster
        cp = self.cp_size(req)
        if cp is None:  # PlanRequest already rejects samples that fit no group
            raise ValueError(f"dataset_max_length {req.dataset_max_length} fits no group of {cl.group_sizes}")
        dp = cl.world_size // cp
        cap = cl.max_tokens_per_rank
        mode = ShardMode.RING_ZIGZAG
        # A pack of at most cp*cap tokens zigzag-splits into at most cap tokens per member
        # (each member takes two of 2*cp nearly equal chunks), so capacity is the only check.
        packs = self.pack(req, dp, cp * cap)
        plan = req.empty_plan(self.name)
        for w in range(0, len(packs), dp):
            groups = []
            for d, pack in enumerate(packs[w : w + dp]):
                ranks = tuple(range(d * cp, (d + 1) * cp))
                if cp == 1:
                    groups.append(Group(ranks=ranks, local={ranks[0]: pack}))
                else:
                    groups.append(Group(ranks=ranks, distributed=pack, mode=mode))
            plan.waves.append(Wave(groups))
        return plan
