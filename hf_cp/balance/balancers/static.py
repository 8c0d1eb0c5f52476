"""`static`: what users run today, the baseline every other balancer is measured against.

One CP size for the whole run (the smallest power of two whose combined cap fits the longest
sample of the dataset), fixed-length first-fit packing in data order (as an offline packer,
e.g. TRL's packing=True, packs a dataset), every pack zigzag-split over its CP group, packs
dealt to the DP replicas in turn, as a distributed sampler deals them.

Every replica gets k packs and its share of the step's tokens, as a Trainer with packing and
per_device_train_batch_size=k gives (StaticBalancer.pack): k is what the step's tokens need at
cp * cap tokens a pack. A Trainer user's step takes k full packs a replica and its tokens follow
from k; hf_cp cuts steps by tokens for every balancer alike, so static cuts each replica's share
into k packs of the share's length / k instead. Dealing full cp*cap packs in turn would leave
some replicas a pack more than others (near-uniform 4K samples at 64 ranks: 6 replicas with 3
packs, 58 with 2, 1.5x the bound), which no Trainer user sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Sequence, Tuple

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.options import BalancerOptions
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.modes.segments import ShardMode
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
    def pack(req: PlanRequest, replicas: int, capacity: int) -> List[List[List[int]]]:
        """Per replica, its k packs, shortest first. The step is cut in data order into the
        replicas' shares, contiguous, with the largest share as small as it can be
        (contiguous_shares); each share is cut the same way into k packs, k the most any share
        needs at `capacity` tokens a pack, grown until no pack is over `capacity`. Shortest
        first: the waves synchronise the replicas, so the w-th wave pairs every replica's w-th
        shortest pack, as a Trainer's equal packs would."""
        ids, lens = list(req.sample_ids), list(req.lengths)
        shares = contiguous_shares(lens, replicas)
        k = max(1, max(-(-sum(lens[a:b]) // capacity) for a, b in shares))
        while True:
            out: List[List[List[int]]] = []
            biggest = 0
            for a, b in shares:
                runs = exactly_runs(lens[a:b], k)
                packs = [(sum(lens[a + i : a + j]), ids[a + i : a + j]) for i, j in runs]
                biggest = max([biggest] + [t for t, _ in packs])
                out.append([p for _, p in sorted(packs, key=lambda x: x[0])])
            if biggest <= capacity:
                return out
            k += 1

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
        shares = self.pack(req, dp, cp * cap)
        plan = req.empty_plan(self.name)
        k = max(len(s) for s in shares)
        for d, share in enumerate(shares):
            if 0 < len(share) < k:  # its share holds fewer samples than a pack each
                held = [s for pack in share for s in pack]
                plan.notes.append(
                    f"static: replica {d} (ranks {d * cp}-{(d + 1) * cp - 1}) runs {len(share)} packs where the others "
                    f"run {k}: its share of the step is {len(held)} sample(s), {held[:4]}"
                )
        for w in range(max(len(s) for s in shares)):
            groups = []
            for d, share in enumerate(shares):
                pack = share[w] if w < len(share) else []
                if not pack:  # a replica whose share ran out: no work in this wave
                    continue
                ranks = tuple(range(d * cp, (d + 1) * cp))
                if cp == 1:
                    groups.append(Group(ranks=ranks, local={ranks[0]: pack}))
                else:
                    groups.append(Group(ranks=ranks, distributed=pack, mode=mode))
            if groups:
                plan.waves.append(Wave(groups))
        return fit_vision_memory(plan, req)  # within the cap with its encoders' activations


def exactly_runs(lengths: Sequence[int], parts: int) -> List[Tuple[int, int]]:
    """contiguous_shares cut into `parts` runs where the lengths allow it: that search may take
    fewer (a share whose one long sample sets the largest run), and a replica with fewer packs
    than the others is not what a Trainer's packing gives. The run of most samples is split in
    two, balanced, until there are `parts` or every run holds one sample; splitting never makes
    the largest run larger."""
    runs = contiguous_shares(lengths, parts)
    while len(runs) < parts:
        i = max(range(len(runs)), key=lambda r: (runs[r][1] - runs[r][0], -r))
        a, b = runs[i]
        if b - a < 2:
            break
        (x, y), (_, z) = contiguous_shares(lengths[a:b], 2)
        runs[i : i + 1] = [(a + x, a + y), (a + y, a + z)]
    return runs


def contiguous_shares(lengths: Sequence[int], parts: int) -> List[Tuple[int, int]]:
    """[start, end) of at most `parts` contiguous runs of `lengths`, in order, whose largest sum
    is as small as it can be (binary search on it, each bound checked greedily); runs past the
    last sample are left out."""
    if not lengths:
        return []
    lo, hi = max(lengths), sum(lengths)
    while lo < hi:  # the smallest largest-run sum that `parts` runs achieve
        mid = (lo + hi) // 2
        runs, acc = 1, 0
        for n in lengths:
            if acc + n > mid:
                runs, acc = runs + 1, n
            else:
                acc += n
        if runs <= parts:
            hi = mid
        else:
            lo = mid + 1
    out, start, acc = [], 0, 0
    for i, n in enumerate(lengths):
        if acc + n > lo:
            out.append((start, i))
            start, acc = i, 0
        acc += n
    out.append((start, len(lengths)))
    return out
