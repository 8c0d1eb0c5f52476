"""`dynamic_cp` (Megatron-LM Dynamic CP, survey 2.4 / 3.1): a CP size per micro-batch.

The DP x CP grid is one pool of ranks; every sample gets its own CP size from the registered
power-of-two groups. Two passes, as in the survey's algorithm:

1. workload balancing: every rank's quota is the step's mean work (total single-rank time /
   world); a sample whose time per rank exceeds `theta` x quota at its memory-minimal CP size
   moves to larger groups (heavy samples cut finer) until it fits the quota or stops
   getting faster;
2. memory filling: distributed samples are placed on the aligned block whose busiest member
   is least loaded, then the remaining (local) samples fill the ranks lightest-first by LPT,
   packed into micro-batches under the per-rank token cap.

One candidate plan per `theta` (and the memory-only one); the fastest predicted candidate
is kept (the closest ones priced by the simulator's timing rule, pricing.PlanPricer). The
candidate machinery is toolkit/cp_candidates.py, which flexsp shares.

Execution order makes groups never wait for each other: every rank runs its distributed
micro-batches from the largest group size to the smallest, then its local ones. Aligned
blocks nest, so the members of a block of size g have done exactly the same larger-group
work before it and reach it at the same moment.

Option `any_size_groups` (FCP, arXiv 2602.21788; Megatron PR #7097): the CP sizes also come
from every size up to a node (a sample that needs 2.5 ranks' memory gets 3, not 4; the
workload pass steps one size at a time up to a node, then doubles), placed on the
contiguous runs of ranks inside a node that the cluster registers
(ClusterSpec.any_size_groups). Such runs do not nest, so the aligned schedule's no-wait
argument does not hold; instead the distributed samples are list-scheduled, largest groups
first (heaviest per rank first within a size), onto the run of their size that finishes
them first (a run starts when its busiest member is free; the least idle run on ties), and
every rank runs them in that order, then its local samples: the estimate counts the waits
as the simulator's timing rule does. These candidates are added to the aligned ones (the
same thetas; the aligned ones and their refinement unchanged), and the kept plan is picked
among all of them as above, the aligned one on ties. Plans shard every distributed sample
with a ring mode (per document, or zigzag for a pack), which runs on any group size;
Ulysses, which needs the heads to divide by the group size, is never chosen here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.bounds import request_distributed_vision_ms, request_sample_ms
from hf_cp.balance.toolkit.costs import CostMemo, cost_memo
from hf_cp.balance.toolkit.cp_candidates import (
    Candidate,
    SpreadCandidate,
    balance_sizes,
    distributed_times,
    fill_ranks,
    local_micro_batches,
    memory_min_sizes,
    pack_fits,
    pack_mode,
    per_rank_ms,
    pick_fastest,
    refine_best,
    request_masks,
)
from hf_cp.balance.toolkit.waves import WaveBuilder
from hf_cp.plan.cluster import ClusterSpec, is_power_of_two
from hf_cp.plan.step_plan import Group, StepPlan
from hf_cp.samples.masks import SampleMask

DEFAULT_THETAS: Tuple[Optional[float], ...] = (None, 1.0, 0.5, 0.25, 0.125)


@dataclass(frozen=True)
class DynamicCPOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "dynamic_cp"

    thetas: Tuple[Optional[float], ...] = option(
        DEFAULT_THETAS,
        "quota fractions tried in the workload pass, one candidate plan each (null: memory-minimal CP sizes only)",
    )
    simulate_within: float = option(
        0.003, "candidates predicted within this fraction of the best are simulated (at most two)"
    )
    simulate_samples_per_rank: float = option(
        16.0, "steps of more than this many samples per rank skip the simulation and keep the best prediction"
    )
    refine_candidates: int = option(
        1,
        "candidates (lowest estimates first) whose local samples are evened out by moves and swaps afterwards "
        "(a second one gains ~0.2% on coarse steps such as long documents at 64 ranks, for ~60% more time)",
    )
    any_size_groups: bool = option(
        False,
        "also try CP groups of any size up to a node (3, 5, 6, 7 ranks...), contiguous at any offset inside "
        "a node, and keep them where they predict faster; needs a cluster that registers them "
        "(ClusterSpec(any_size_groups=True)); off: aligned power-of-two blocks only (a world of one node that "
        "is not a power of two has none: there it plans on runs of any size either way)",
    )

    spread_sizes: Tuple[int, ...] = option(
        (2,),
        "on coarse steps, also a candidate per size g here with every sample that is not light on groups of g "
        "ranks, the blocks balanced as one LPT (cp_candidates.SpreadCandidate; sizes the cluster lacks are skipped)",
    )
    spread_samples_per_rank: float = option(
        4.0, "a step is coarse (spread candidates tried) up to this many samples per rank"
    )

    def check(self) -> None:
        if not self.thetas:
            raise BalancerOptionError("dynamic_cp: thetas must name at least one candidate")
        bad = [g for g in self.spread_sizes if not (isinstance(g, int) and g >= 2 and is_power_of_two(g))]
        if bad:
            raise BalancerOptionError(f"dynamic_cp: spread_sizes {bad} must be powers of two >= 2")
        if self.spread_samples_per_rank < 0:
            raise BalancerOptionError(
                f"dynamic_cp: spread_samples_per_rank {self.spread_samples_per_rank} must be >= 0"
            )
        if self.refine_candidates < 0:
            raise BalancerOptionError(f"dynamic_cp: refine_candidates {self.refine_candidates} must be >= 0")
        for t in self.thetas:
            if t is not None and not t > 0:
                raise BalancerOptionError(f"dynamic_cp: theta {t!r} must be positive (or null for memory-only)")


@register_balancer("dynamic_cp", auto_member=True)
class DynamicCPBalancer:
    """Per-sample CP size (workload first, then memory filling); best simulated candidate."""

    name = "dynamic_cp"
    options_class = DynamicCPOptions

    last_predicted_ms: Optional[float] = None  # set by every plan(): the kept candidate's predicted makespan

    def __init__(self, **options):
        self.options = o = DynamicCPOptions.from_dict(options)
        self.thetas = o.thetas
        self.simulate_within = o.simulate_within
        self.simulate_samples_per_rank = o.simulate_samples_per_rank
        self.refine_candidates = o.refine_candidates
        self.spread_sizes = tuple(o.spread_sizes)
        self.spread_samples_per_rank = o.spread_samples_per_rank
        # the cluster this balancer plans for must register groups of any size (the trainer
        # builds a process group for each registered group, ClusterSpec.any_size_groups)
        self.needs_any_size_groups = o.any_size_groups

    def plan(self, req: PlanRequest) -> StepPlan:
        memo = cost_memo(req.cost)
        cl = req.cluster
        if self.needs_any_size_groups and not cl.any_size_groups:
            raise BalancerOptionError(
                f"dynamic_cp: option any_size_groups plans groups of any size within a node, but this cluster "
                f"registers {cl.describe_registry()} only: build it with ClusterSpec(..., any_size_groups=True) "
                f"so that every rank creates those groups, or turn the option off"
            )
        # aligned blocks tile a power-of-two world only; a world of one node of another size
        # (six GPUs: ClusterSpec admits it with any_size_groups, and the trainer registers them
        # for it) is planned on runs of any size alone, whatever the option says: there is
        # nothing else to plan on
        aligned = is_power_of_two(cl.world_size)
        on_any_size = self.needs_any_size_groups or not aligned
        lengths = req.length_array
        local_ms = request_sample_ms(req, memo)  # text and vision work, single-rank
        quota = float(local_ms.sum()) / cl.world_size
        masks = request_masks(req)
        candidates: List[Candidate] = []
        if aligned:
            min_sizes = memory_min_sizes(memo, lengths, req)
            seen = set()
            for theta in self.thetas:
                sizes = balance_sizes(memo, lengths, min_sizes, local_ms, cl.group_sizes[-1], quota, theta, masks)
                key = sizes.tobytes()
                if key in seen:
                    continue
                seen.add(key)
                candidates.append(Candidate(req, memo, lengths, local_ms, sizes))
            if len(lengths) <= self.spread_samples_per_rank * cl.world_size:
                candidates += [
                    SpreadCandidate(req, memo, lengths, local_ms, min_sizes, g)
                    for g in self.spread_sizes
                    if g in cl.group_sizes
                ]
        refine_best(req, memo, candidates, lengths, local_ms, self.refine_candidates)
        if on_any_size:
            # refined apart, so that the aligned candidates (and their refinement) are exactly
            # those of the option off; listed after them: on equal estimates the aligned plan
            # is kept. Sizes that are all aligned ones are the aligned candidates' business
            # (they never wait): a copy here would only crowd pick_fastest's simulated places
            min_any = memory_min_sizes_any(memo, lengths, req)
            seen_any = set()
            any_size: List[Candidate] = []
            for theta in self.thetas:
                sizes = balance_sizes_on(cl.all_group_sizes, memo, lengths, min_any, local_ms, quota, theta, masks)
                key = sizes.tobytes()
                if key in seen_any or (aligned and np.isin(sizes, cl.group_sizes).all()):
                    continue
                seen_any.add(key)
                any_size.append(AnySizeCandidate(req, memo, lengths, local_ms, sizes))
            refine_best(req, memo, any_size, lengths, local_ms, self.refine_candidates)
            candidates += any_size
        plan, self.last_predicted_ms = pick_fastest(
            req,
            memo,
            candidates,
            self.name,
            self.simulate_within,
            simulate_up_to_samples=int(self.simulate_samples_per_rank * cl.world_size),
        )
        return plan


# ----------------------------------------------------------------------------- groups of any size
def memory_min_sizes_any(memo: CostMemo, lengths: np.ndarray, req: PlanRequest) -> np.ndarray:
    """Smallest registered size (ClusterSpec.all_group_sizes) per sample whose per-document
    shards fit the cap (cp_candidates.memory_min_sizes over every size, not the aligned ones)."""
    return memory_min_sizes(memo, lengths, req, req.cluster.all_group_sizes)


def balance_sizes_on(
    ladder: Sequence[int],
    memo: CostMemo,
    lengths: np.ndarray,
    min_sizes: np.ndarray,
    local_ms: np.ndarray,
    quota_ms: float,
    theta: Optional[float],
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
) -> np.ndarray:
    """Workload pass over the sizes of `ladder` (ascending): a sample over theta x quota
    moves to the next size while that makes it faster (cp_candidates.balance_sizes, whose
    ladder is the powers of two; `masks` as there)."""
    sizes = min_sizes.copy()
    if theta is None:
        return sizes
    limit = theta * quota_ms
    step_up = {a: b for a, b in zip(ladder, ladder[1:])}
    for i in np.nonzero((local_ms > limit) | (min_sizes > 1))[0].tolist():
        n, g = int(lengths[i]), int(sizes[i])
        mask = masks[i] if masks is not None else None
        t = per_rank_ms(memo, n, g, mask)
        while t > limit and g in step_up:
            g2 = step_up[g]
            t2 = per_rank_ms(memo, n, g2, mask)
            if t2 >= t:
                break
            g, t = g2, t2
        sizes[i] = g
    return sizes


class GroupChooser:
    """The registered groups of each size, as first ranks, and which of them finishes a
    sample first given every rank's free time."""

    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self._starts: Dict[int, np.ndarray] = {}

    def starts(self, size: int) -> np.ndarray:
        v = self._starts.get(size)
        if v is None:
            v = self._starts[size] = np.asarray([r[0] for r in self.cluster.groups_of_size(size)], dtype=np.int64)
        return v

    def best(self, free: np.ndarray, size: int) -> int:
        """First rank of the group of `size` whose busiest member is free first (it finishes
        the sample first); on ties the one whose members idle least waiting for each other,
        then the lowest."""
        starts = self.starts(size)
        if self.cluster.is_node_run_size(size):
            windows = np.lib.stride_tricks.sliding_window_view(free, size)[starts]
        else:  # aligned blocks: consecutive and disjoint
            windows = free[: len(starts) * size].reshape(len(starts), size)
        busiest = windows.max(axis=1)
        idle = busiest * size - windows.sum(axis=1)
        return int(starts[np.lexsort((starts, idle, busiest))[0]])


class AnySizeCandidate(Candidate):
    """A Candidate whose distributed samples run on registered groups of any size.

    The samples are list-scheduled, largest groups first and heaviest per rank first within a
    size, each onto the group of its size that finishes it first (GroupChooser.best); a group starts when its busiest member is
    free, so `loads` hold when every rank is done with its distributed samples, waits
    included. Every rank runs its groups in that order, then its local samples (filled and
    refined as in Candidate)."""

    def __init__(self, req: PlanRequest, memo: CostMemo, lengths: np.ndarray, local_ms: np.ndarray, sizes: np.ndarray):
        free = np.zeros(req.cluster.world_size, dtype=np.float64)
        chooser = GroupChooser(req.cluster)
        dist = np.nonzero(sizes > 1)[0]
        times = distributed_times(memo, lengths, sizes, dist, request_masks(req))
        vision = request_distributed_vision_ms(req, sizes)
        if vision is not None and len(dist):
            times = times + vision[dist]
        self.scheduled: List[Tuple[int, int, int]] = []  # (sample index, first rank, size), in run order
        # largest groups first (they need the most ranks free at once), heaviest per rank first
        # within a size; ties keep the sample order
        for k in np.lexsort((np.arange(len(dist)), -times, -sizes[dist])).tolist():
            i, g = int(dist[k]), int(sizes[dist[k]])
            first = chooser.best(free, g)
            free[first : first + g] = free[first : first + g].max() + times[k]
            self.scheduled.append((i, first, g))
        self.local_idx = np.flatnonzero(sizes == 1)
        self.local_rank_of, self.loads = fill_ranks(local_ms[self.local_idx], free, lengths=lengths[self.local_idx])
        self.refined = False
        self.estimate(req, memo, lengths)

    def plan(self, req: PlanRequest, memo: CostMemo, name: str) -> StepPlan:
        """Groups in scheduling order; a sample joins the micro-batch of the group before it on
        the same ranks when nothing ran on them in between and its shards fit the cap (one
        micro-batch overhead less), the pack then sharded by the faster ring mode."""
        cap = req.cluster.max_tokens_per_rank
        ids, lens = req.sample_ids, req.lengths
        packs: List[Tuple[Tuple[int, ...], List[int]]] = []  # (ranks, sample indices) in run order
        held: List[int] = []  # per pack: tokens its busiest member holds
        latest: Dict[int, int] = {}  # rank -> index of its latest pack
        grids = req.vision or {}
        for i, first, g in self.scheduled:
            ranks = tuple(range(first, first + g))
            need = max(memo.per_doc_member_tokens(lens[i], g))
            k = latest.get(first)
            if (
                k is not None
                and packs[k][0] == ranks
                and all(latest.get(r) == k for r in ranks)
                and held[k] + need <= cap
                # with images or clips: as validate counts it (their encoders' activations)
                and (
                    not any(ids[j] in grids for j in packs[k][1] + [i]) or pack_fits(req, packs[k][1] + [i], ranks, cap)
                )
            ):
                packs[k][1].append(i)
                held[k] += need
                continue
            latest.update(dict.fromkeys(ranks, len(packs)))
            packs.append((ranks, [i]))
            held.append(need)
        waves = WaveBuilder(req.cluster.world_size)
        for ranks, pack in packs:
            waves.add(
                Group(ranks=ranks, distributed=[ids[i] for i in pack], mode=pack_mode(req, memo, pack, ranks, cap))
            )
        id_arr, mem_arr = req.id_array, req.memory_length_array  # a local sample's items encoded on its rank
        local = local_micro_batches(self.local_rank_of, mem_arr[self.local_idx], cap, id_arr[self.local_idx])
        for group in Group.one_rank_groups(local):
            waves.add(group)
        plan = req.empty_plan(name)
        plan.waves = waves.build()
        return plan
