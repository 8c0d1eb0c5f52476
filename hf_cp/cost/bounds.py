"""Lower bounds on a plan's simulated step time (cost/simulate.py): no valid plan of the samples on
the cluster takes less. `lower_bound_ms` charges only the samples' compute; `charged_lower_bound_ms`
also charges a group's communication, kernel efficiency and micro-batch overheads. Torch-free.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from hf_cp.cost.model import CostModel
from hf_cp.cost.vision import StepVision, alone_held_tokens, distributed_vision_ms
from hf_cp.modes.ring import per_doc_max_member_tokens
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.cluster import ClusterSpec


def lower_bound_ms(
    lengths: Sequence[int],
    cluster: ClusterSpec,
    cost: CostModel,
    masks=None,
    local_ms: Optional[Sequence[float]] = None,
    vision: Optional[StepVision] = None,
) -> float:
    """No valid plan of these samples on this cluster can take less time in `simulate`.

    max( sum over samples of their cheapest rank-ms / world, the costliest sample at its best
    group size ). A sample's cheapest rank-ms is its whole-document compute on one rank:
    sharding only adds (shorter query chunks run at lower efficiency, head splitting costs
    extra, communication and per-micro-batch overheads are never negative). On a group of g
    ranks its slowest member carries at least 1/g of that, so its best wall time is bounded by
    that share at the largest registered group size. `masks` (aligned with the lengths, None
    entries causal) price masked samples by their masked area, as the simulator does;
    `local_ms`: the samples' single-rank times (CostModel.local_ms), if already known.
    `vision`: the step's vision tower work (cost/vision.py), counted as the simulator counts it:
    each sample's encoder time is rank time somewhere, and no item is encoded faster than alone.
    """
    lens = _check_fits(lengths, cluster)
    gmax = cluster.all_group_sizes[-1]  # any registered size: a run of 6 ranks on a node with them
    areas = np.asarray(samples_local_ms(lens, cost, masks) if local_ms is None else local_ms)
    if not len(areas):
        return 0.0
    if vision is not None:
        areas = areas + vision.sample_ms
    bound = max(float(areas.sum()) / cluster.world_size, float(areas.max()) / gmax)
    return max(bound, vision.largest_item_ms) if vision is not None else bound


def charged_lower_bound_ms(
    lengths: Sequence[int],
    cluster: ClusterSpec,
    cost: CostModel,
    local_ms: Optional[Sequence[float]] = None,
    alone_ms: Optional[Callable[[int, int], float]] = None,
    longest_checked: int = 8,
    masks=None,
    vision: Optional[StepVision] = None,
) -> float:
    """A tighter bound that charges a group's communication, kernel efficiency and overheads.

    max( (the samples' rank-time + ceil(tokens / cap) micro-batch overheads) / world, the
    longest samples' best time alone on a group: min over the group sizes whose
    per-document shards fit the cap of the slowest member's time (CostModel, the sample
    per-document sharded over a registered group: every size the cluster registers, runs of
    any size included) plus one overhead ). A sample's rank-time is
    its single-rank compute, or for a sample over the cap the least g x its time alone on g
    ranks over the sizes it fits.

    A rank holds at most `cap` tokens per micro-batch, each micro-batch costs an overhead,
    and sharding never lowers compute. The rest holds for plans that run every distributed
    sample per-document sharded or local (as dynamic_cp, flexsp, skrull and megatron do): a
    member's tokens, attention and ring bytes only grow when other documents share its
    micro-batch, so the sample's micro-batch lasts at least as long as the sample alone, on
    every rank of its group. The longest sample's two charges come from one group size: the
    bound is at least, at the best size for it, the larger of its time there and the world's
    work with its rank-time there. lower_bound_ms instead lets the costliest sample
    spread over the whole world for free: on an under-filled step that is up to 3.6x looser.
    A zigzag pack splits its documents differently; the argument does not cover it (the
    benchmark reports plan / charged bound, so a plan under it would show).
    `alone_ms(length, g)`: the sample alone on g ranks, if cached (CostMemo.doc_on_group_ms).
    `masks` (aligned with the lengths, None entries causal): a masked sample counts by its
    masked area and is left out of the group charges (its time alone would be a causal one's).
    `vision` (cost/vision.py): each sample's encoder time joins its rank-time (the world's work),
    and the costliest item alone bounds the step. A sample over the cap with images or clips
    holds its g ranks until its busiest encoder is done: at least its least loaded member's
    text plus cost/vision.distributed_vision_ms (items are encoded whole), so its rank-time
    there is g x the larger of that and its time alone. Such a sample is over the cap when its
    tokens and its items' activations are (cost/vision.alone_held_tokens, as StepPlan.validate
    counts them), and fits the groups where its fullest member holds at most the cap.
    """
    lens = _check_fits(lengths, cluster)
    if not len(lens):
        return 0.0
    text_areas = np.asarray(samples_local_ms(lens, cost, masks) if local_ms is None else local_ms)
    areas = text_areas if vision is None else text_areas + vision.sample_ms
    floor = vision.largest_item_ms if vision is not None else 0.0
    if masks is not None and any(m is not None for m in masks):
        causal = np.asarray([m is None for m in masks], dtype=bool)
        work = float(areas.sum()) + -(-int(lens.sum()) // cluster.max_tokens_per_rank) * cost.micro_batch_overhead_ms()
        if not causal.any():
            return max(work / cluster.world_size, floor)
        inner = charged_lower_bound_ms(
            lens[causal],
            cluster,
            cost,
            text_areas[causal],
            alone_ms,
            longest_checked,
            vision=vision.subset(causal) if vision is not None else None,
        )
        return max(inner, work / cluster.world_size, floor)
    cap = cluster.max_tokens_per_rank
    overhead = cost.micro_batch_overhead_ms()
    alone = alone_ms or (lambda n, g: alone_on_group_ms(cost, n, g))
    grids = vision.sample_grids if vision is not None and vision.sample_grids else None
    least: dict = {}
    over = lens > cap
    if grids is not None:  # a sample with items is over the cap with their activations counted
        over |= np.asarray([bool(g) and alone_held_tokens(n, g, 1, cost) > cap for n, g in zip(lens.tolist(), grids)])

    def fitting_sizes(n: int, i: Optional[int] = None) -> List[int]:
        # a sample no group holds runs as dependent chunks on one rank (ChunkFlow), in at least
        # its single-rank compute: chunks run at lower kernel efficiency, and some are recomputed
        if i is not None and grids is not None and grids[i]:  # sample i's tokens and items' activations
            return [g for g in cluster.all_group_sizes if alone_held_tokens(n, grids[i], g, cost) <= cap] or [1]
        return [g for g in cluster.all_group_sizes if per_doc_max_member_tokens(n, g) <= cap] or [1]

    def on_group(i: int, n: int, g: int) -> float:
        """Sample i's rank-time alone on g ranks: g x its micro-batch's least duration."""
        t = alone(n, g)
        if grids is not None and grids[i] and g > 1:
            if (n, g) not in least:
                least[(n, g)] = least_member_ms(cost, n, g)
            t = max(t, least[(n, g)] + distributed_vision_ms(grids[i], g, cost))
        return g * t

    # a sample over the cap holds a whole group for at least its time alone there: charge it
    # the cheapest such group's rank-time instead of its single-rank compute
    def held(n: int) -> float:
        return max(float(cost.sample_local_ms(n)), min(g * alone(n, g) for g in fitting_sizes(n)))

    def held_at(i: int) -> float:
        """Sample i's charge in the world's work (its rank-time in any plan)."""
        n = int(lens[i])
        if not over[i]:
            return float(areas[i])
        if grids is not None and grids[i]:
            # on_group is at least g x alone (cached): sizes where that reaches the best so far
            # cannot lower it, and are not costed member by member
            best = float("inf")
            for g in sorted(fitting_sizes(n, i), key=lambda g: (g * alone(n, g), g)):
                if g * alone(n, g) >= best:
                    break
                best = min(best, on_group(i, n, g))
            return max(float(areas[i]), best)
        return float(areas[i]) + held(n) - float(cost.sample_local_ms(n))

    work = float(areas.sum())
    if over.any():
        seen = over if grids is None else over & np.asarray([not g for g in grids], dtype=bool)
        uniq, counts = np.unique(lens[seen], return_counts=True)
        work += sum(k * (held(n) - float(cost.sample_local_ms(n))) for n, k in zip(uniq.tolist(), counts.tolist()))
        if grids is not None:
            work += sum(held_at(i) - float(areas[i]) for i in np.flatnonzero(over & ~seen).tolist())
    world = cluster.world_size
    work += -(-int(lens.sum()) // cap) * overhead
    bound = max(work / world, floor)
    for n in np.unique(lens)[::-1][:longest_checked].tolist():
        bound = max(bound, min((alone(n, g) for g in fitting_sizes(n)), default=float("inf")) + overhead)
    # the longest sample picks one group size for both: its time there, and its rank-time
    # there beside everything else's
    i = int(np.argmax(lens))
    n = int(lens[i])
    rest = work - held_at(i) if grids is not None else work - held(n)
    sizes = fitting_sizes(n, i) if over[i] else fitting_sizes(n)
    return max(bound, min(max(alone(n, g) + overhead, (rest + on_group(i, n, g)) / world) for g in sizes))


def least_member_ms(cost: CostModel, length: int, group_size: int) -> float:
    """The least loaded member's time of one document alone, per-document sharded over
    `group_size` ranks (every member costed: used only for samples with vision over the cap)."""
    ranks = list(range(group_size))
    return min(c.total_ms for c in cost.distributed_rank_costs([length], ShardMode.RING_PER_DOC, ranks, ranks))


def samples_local_ms(lens: np.ndarray, cost: CostModel, masks=None) -> List[float]:
    """Every sample's single-rank time (masked area where masked): what both bounds start from
    (simulate computes it once for both)."""
    if masks is None or all(m is None for m in masks):
        # each distinct length once: a 4096-rank step holds 10^5-10^6 samples of far fewer lengths
        uniq, inv = np.unique(np.asarray(lens, dtype=np.int64), return_inverse=True)
        return np.asarray([cost.sample_local_ms(n) for n in uniq.tolist()], dtype=np.float64)[inv].tolist()
    return [cost.local_ms([n], [m]) for n, m in zip(lens.tolist(), masks)]


def alone_on_group_ms(cost: CostModel, length: int, group_size: int, mask=None) -> float:
    """One document alone, per-document sharded over an aligned block of `group_size` ranks: the
    slower of the block's two end members (micro-batch overhead excluded). A shard's first and
    last members hold its extremes (the first chunk and the last); the others were within 6e-5
    of them on 40K-1M tokens over 2-256 ranks, and a bound may only come out lower. Costing
    every member was O(ranks) a call: the charged bound of a 4096-rank step of Wikipedia spent
    140 s in it. A masked sample (`mask`, a SampleMask) is priced by its masked area on every
    member: its extremes need not sit at the ends (a shared prompt's answers are cheaper than
    its prompt), and balancers price the few distributed masked samples of a step this way."""
    if group_size == 1:
        return cost.sample_local_ms(length) if mask is None else cost.local_ms([length], [mask])
    ranks = list(range(group_size))
    members = (0, group_size - 1) if mask is None else ranks
    masks = None if mask is None else [mask]
    costs = cost.distributed_rank_costs([length], ShardMode.RING_PER_DOC, ranks, members, masks=masks)
    return max(c.total_ms for c in costs)


def _check_fits(lengths: Sequence[int], cluster: ClusterSpec) -> np.ndarray:
    """The lengths as an array; ValueError naming the first non-positive one. A sample longer
    than the largest group holds is valid here: ChunkFlow runs it as dependent chunks on one
    rank (the plan's validate() checks that its chunks and K/V state store fit the rank)."""
    lens = np.asarray(lengths, dtype=np.int64)
    if len(lens) and int(lens.min()) <= 0:
        i = int(np.argmax(lens <= 0))
        raise ValueError(f"sample {i} has {int(lens[i])} tokens; lengths must be positive")
    return lens
