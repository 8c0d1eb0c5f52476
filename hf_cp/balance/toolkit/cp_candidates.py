"""Candidate plans of per-sample CP sizes, shared by `dynamic_cp` and `flexsp`.

Given a CP size per sample: place the distributed samples on the aligned block whose busiest
member is least loaded, fill the ranks with the local samples (LPT, then moves and swaps off
the busiest rank), pack them into micro-batches under the cap, assemble the waves (largest
groups first, so that aligned blocks never wait for each other), and keep the fastest of
several candidates (closest ones priced by the simulator's timing rule).
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.toolkit.assign import improve_max_load, lpt_assign
from hf_cp.balance.toolkit.bounds import request_distributed_vision_ms
from hf_cp.balance.toolkit.costs import CostMemo
from hf_cp.balance.toolkit.packing import first_fit_sorted_runs
from hf_cp.balance.toolkit.placement import masks_of
from hf_cp.balance.toolkit.pricing import pricer_for
from hf_cp.balance.toolkit.ring_layout import group_fits, pick_ring_mode
from hf_cp.balance.toolkit.waves import WaveBuilder, block_ranks
from hf_cp.cost.vision import smallest_vision_group
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.sorting import stable_order
from hf_cp.plan.step_plan import Group, StepPlan
from hf_cp.plan.vision_encoders import member_held_patches
from hf_cp.samples.masks import SampleMask


def memory_min_sizes(memo: CostMemo, lengths: np.ndarray, req: PlanRequest, ladder=None) -> np.ndarray:
    """Smallest registered group size per sample whose per-document shards fit the cap (of
    `ladder`, ascending; default the aligned sizes), a sample with images or clips counting
    their activations on the members that may encode them (cost/vision.smallest_vision_group,
    the count StepPlan.validate checks)."""
    cl = req.cluster
    cap = cl.max_tokens_per_rank
    ladder = cl.group_sizes if ladder is None else ladder
    sizes = np.ones(len(lengths), dtype=np.int64)
    grids = req.vision or {}
    for i in np.nonzero(req.memory_length_array > cap)[0].tolist():
        n, s = int(lengths[i]), req.sample_ids[i]
        if s in grids:
            g = smallest_vision_group(n, grids[s], ladder, cap, req.cost)
        else:
            g = next((k for k in ladder if k * cap >= n and max(memo.per_doc_member_tokens(n, k)) <= cap), None)
        if g is None:  # PlanRequest rejects these; kept as a guard against a changed registry
            raise ValueError(f"sample {s} ({n} tokens) fits no group of {tuple(ladder)} with cap {cap}")
        sizes[i] = g
    return sizes


def pack_vision_tokens(req: PlanRequest, pack: Sequence[int], ranks: Sequence[int]) -> Optional[np.ndarray]:
    """Per member of `ranks`, the activations (in tokens) of the items of the distributed samples
    at indices `pack` it may encode (StepPlan.vision_held_tokens of that group); None when
    none of them has images or clips."""
    grids = req.vision
    if not grids or not any(req.sample_ids[i] in grids for i in pack):
        return None
    group = Group(ranks=tuple(ranks), distributed=[req.sample_ids[i] for i in pack], mode=ShardMode.RING_PER_DOC)
    return np.asarray([req.cost.vision_tokens(p) for p in member_held_patches(group, grids)], dtype=np.int64)


def pack_fits(req: PlanRequest, pack: Sequence[int], ranks: Sequence[int], cap: int) -> bool:
    """Whether the distributed samples at indices `pack` fit the cap on `ranks` in a ring mode,
    the members' vision activations counted (pack_vision_tokens)."""
    docs = [req.lengths[i] for i in pack]
    extra = pack_vision_tokens(req, pack, ranks)
    modes = (ShardMode.RING_PER_DOC,) if len(pack) == 1 else (ShardMode.RING_PER_DOC, ShardMode.RING_ZIGZAG)
    return any(group_fits(m, docs, len(ranks), cap, extra) for m in modes)


def pack_mode(req: PlanRequest, memo: CostMemo, pack: Sequence[int], ranks: Sequence[int], cap: int) -> ShardMode:
    """The ring mode of a pack of distributed samples (indices): pick_ring_mode with the
    members' vision activations counted; per document for one sample."""
    if len(pack) == 1:
        return ShardMode.RING_PER_DOC
    docs = [req.lengths[i] for i in pack]
    return pick_ring_mode(req.cost, docs, ranks, cap, local_tokens=pack_vision_tokens(req, pack, ranks), memo=memo)


def per_rank_ms(memo: CostMemo, length: int, group_size: int, mask: Optional[SampleMask] = None) -> float:
    """Time a sample adds to each member of its group: one micro-batch of its own if distributed.
    A masked sample by its masked area (as the simulator prices it): priced as causal, a
    shared prompt with long answers looked several times heavier on its group than it is, and
    the groups holding such samples were left short of work (GRPO-like steps, issue 39)."""
    if group_size == 1:
        return memo.local_ms(length) if mask is None else memo.doc_on_group_ms(length, 1, mask)
    return memo.doc_on_group_ms(length, group_size, mask) + memo.overhead_ms


def request_masks(req: PlanRequest) -> Optional[List[Optional[SampleMask]]]:
    """The request's masks aligned with its samples (None entries causal); None without masks."""
    return masks_of(req.sample_ids, req.masks) if req.masks else None


def distributed_times(
    memo: CostMemo,
    lengths: np.ndarray,
    sizes: np.ndarray,
    dist: np.ndarray,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
) -> np.ndarray:
    """per_rank_ms of the samples at indices `dist` on their sizes."""
    if masks is None:
        return np.array([per_rank_ms(memo, int(lengths[i]), int(sizes[i])) for i in dist.tolist()])
    return np.array([per_rank_ms(memo, int(lengths[i]), int(sizes[i]), masks[i]) for i in dist.tolist()])


def balance_sizes(
    memo: CostMemo,
    lengths: np.ndarray,
    min_sizes: np.ndarray,
    local_ms: np.ndarray,
    largest: int,
    quota_ms: float,
    theta: Optional[float],
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
) -> np.ndarray:
    """Workload pass: double the CP size of samples over theta x quota while that helps
    (`masks` aligned with the lengths, None entries causal: request_masks)."""
    sizes = min_sizes.copy()
    if theta is None:
        return sizes
    limit = theta * quota_ms
    for i in np.nonzero((local_ms > limit) | (min_sizes > 1))[0].tolist():
        n, g = int(lengths[i]), int(sizes[i])
        mask = masks[i] if masks is not None else None
        t = per_rank_ms(memo, n, g, mask)
        while t > limit and g < largest:
            t2 = per_rank_ms(memo, n, 2 * g, mask)
            if t2 >= t:
                break
            g, t = 2 * g, t2
        sizes[i] = g
    return sizes


def place_distributed(
    memo: CostMemo,
    lengths: np.ndarray,
    sizes: np.ndarray,
    world: int,
    loads: np.ndarray,
    extra_ms: Optional[np.ndarray] = None,
    masks: Optional[Sequence[Optional[SampleMask]]] = None,
) -> Dict[Tuple[int, int], List[int]]:
    """LPT over aligned blocks: heaviest distributed sample first, onto the block of its size
    whose busiest member is least loaded. Returns (block size, block index) -> sample indices
    and updates `loads` in place. `extra_ms` (aligned with the lengths): time a distributed
    sample adds to every member beyond its text (its vision encoders',
    bounds.request_distributed_vision_ms). `masks`: as in balance_sizes."""
    dist = np.nonzero(sizes > 1)[0]
    times = distributed_times(memo, lengths, sizes, dist, masks)
    if extra_ms is not None and len(dist):
        times = times + extra_ms[dist]
    placed: Dict[Tuple[int, int], List[int]] = {}
    if not len(dist):
        return placed
    # Every aligned block's busiest load, kept per block size and updated in place: recomputing
    # loads.reshape(world // g, g).max(axis=1) for every sample cost O(world) per sample, and
    # most of `auto`'s time at 4096 ranks on long-document steps. A placement adds t to every
    # rank of block (g, b): the blocks of smaller sizes inside it rise by t (floating addition
    # is monotone, so max(l + t) = max(l) + t exactly), and the one block of each larger size
    # around it rises to at most the placed block's new maximum.
    order = np.argsort(-times, kind="stable")
    samples, groups, weights = dist[order].tolist(), sizes[dist[order]].tolist(), times[order].tolist()
    if max(groups) <= HEAP_PLACE_MAX_SIZE:
        blocks = _blocks_by_heaps(groups, weights, world, loads)
        # the ranks' loads: every rank of each chosen block gets its sample's time, added in
        # placement order (np.add.at adds repeated indices one by one, in order: the same sums
        # as adding sample by sample)
        g_of = np.asarray(groups, dtype=np.int64)
        first = np.asarray(blocks, dtype=np.int64) * g_of
        offsets = np.arange(int(g_of.sum())) - np.repeat(np.cumsum(g_of) - g_of, g_of)
        np.add.at(loads, np.repeat(first, g_of) + offsets, np.repeat(times[order], g_of))
        for i, g, b in zip(samples, groups, blocks):
            placed.setdefault((g, b), []).append(i)
        return placed
    top = max(groups)
    level_sizes = [1 << e for e in range(top.bit_length()) if (1 << e) <= top]
    block_max = {h: loads.reshape(world // h, h).max(axis=1) for h in level_sizes if h > 1}
    block_max[1] = loads  # the loads themselves (updated in place, as before)
    for i, g, t in zip(samples, groups, times[order]):
        b = int(np.argmin(block_max[g]))
        for h in level_sizes:
            if h <= g:
                block_max[h][b * (g // h) : (b + 1) * (g // h)] += t
            else:
                j = b // (h // g)
                if block_max[h][j] < block_max[g][b]:
                    block_max[h][j] = block_max[g][b]
        placed.setdefault((g, b), []).append(i)
    return placed


# place_distributed keeps its block maxima in Python lists with a heap per size when no sample
# spans more than this many ranks: a placement then changes a few entries (numpy's per-call
# cost was most of the time at 4096 ranks on long-document steps). A placement on g ranks
# changes ~2g entries one by one, so steps with larger groups keep the arrays.
HEAP_PLACE_MAX_SIZE = 16


def _blocks_by_heaps(groups: List[int], weights: List[float], world: int, loads: np.ndarray) -> List[int]:
    """place_distributed's blocks (in placement order; `loads` left as it is): per size that
    samples are placed at, every block's maximum in a list and a heap of (maximum, block)
    whose top is np.argmin's answer (least maximum, lowest block on ties). Maxima only rise,
    so an entry whose value is no longer its block's is stale and dropped when it surfaces."""
    used = sorted(set(groups))
    block_max = {h: loads.reshape(world // h, h).max(axis=1).tolist() for h in used}
    heaps = {h: list(zip(block_max[h], range(world // h))) for h in used}
    for heap in heaps.values():
        heapq.heapify(heap)
    push = heapq.heappush
    blocks = []
    for g, t in zip(groups, weights):
        heap, mine = heaps[g], block_max[g]
        while heap[0][0] != mine[heap[0][1]]:
            heapq.heappop(heap)
        b = heap[0][1]
        blocks.append(b)
        for h in used:
            level, hp = block_max[h], heaps[h]
            if h <= g:
                r = g // h
                for j in range(b * r, (b + 1) * r):
                    level[j] += t
                    push(hp, (level[j], j))
            else:
                j = b // (h // g)
                if level[j] < mine[b]:
                    level[j] = mine[b]
                    push(hp, (level[j], j))
    return blocks


def fill_ranks(
    weights: np.ndarray,
    loads: np.ndarray,
    exact_per_rank: int = 2,
    light_fraction: float = 0.005,
    lengths: Optional[np.ndarray] = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Memory filling: local samples onto ranks, lightest rank first. Returns (rank of each
    sample, final loads).

    assign.lpt_assign with a finer exact part: samples heavier than `light_fraction` of the
    mean final load (and at least the `exact_per_rank` x world heaviest) go one by one to the
    least loaded rank; the light tail is water-filled, so every rank ends within one light
    sample of a common level.
    """
    world = len(loads)
    weights = np.asarray(weights, dtype=np.float64)
    mean_final = (float(weights.sum()) + float(np.sum(loads))) / world
    exact = max(min(len(weights), exact_per_rank * world), int(np.count_nonzero(weights > light_fraction * mean_final)))
    return lpt_assign(weights, world, loads, exact_items=exact, keys=lengths)


def local_micro_batches(
    rank_of: np.ndarray, lengths: np.ndarray, cap: int, ids: np.ndarray
) -> List[Tuple[int, List[int]]]:
    """Pack every rank's local samples into micro-batches of at most `cap` tokens.

    Returns (rank, sample ids) per micro-batch, by rank (`ids`: the sample ids, aligned with
    `rank_of` and `lengths`). Fast path: each rank takes the fewest micro-batches its tokens
    allow and deals its samples, longest first, in a snake order over them (near-equal token
    sums); ranks where that overflows fall back to first-fit decreasing (packing.split_to_cap's
    rule, on the rank's samples as they are already sorted; all such ranks at once:
    packing.first_fit_sorted_runs). Every sample then has a (rank, micro-batch) slot; one
    stable sort by slot lays the micro-batches out, and the ids are gathered once and sliced
    per micro-batch: a step has thousands of them.
    """
    if len(rank_of) == 0:
        return []
    # by rank, then longest first, then index: np.lexsort((-lengths, rank_of)) as two stable
    # sorts (plan/sorting.py: stable_order)
    by_length = stable_order(-lengths)
    order = by_length[stable_order(rank_of[by_length])]
    r_sorted, l_sorted = rank_of[order], lengths[order]
    starts = np.flatnonzero(np.concatenate(([True], r_sorted[1:] != r_sorted[:-1])))
    ranks = r_sorted[starts]
    counts = np.diff(np.append(starts, len(r_sorted)))
    totals = np.add.reduceat(l_sorted, starts)
    k = np.maximum(1, -(-totals // cap))
    pos = np.arange(len(order)) - np.repeat(starts, counts)
    kk = np.repeat(k, counts)
    p = pos % (2 * kk)
    mb = np.where(p < kk, p, 2 * kk - 1 - p)
    kmax = int(k.max())
    rank_idx = np.repeat(np.arange(len(ranks)), counts)
    sums = np.bincount(rank_idx * kmax + mb, weights=l_sorted, minlength=len(ranks) * kmax).reshape(len(ranks), kmax)
    bad = sums.max(axis=1) > cap
    if bad.any():
        in_bad = np.repeat(bad, counts)
        bad_counts = counts[bad]
        bad_starts = np.concatenate(([0], np.cumsum(bad_counts)[:-1]))
        mb[in_bad] = first_fit_sorted_runs(l_sorted[in_bad], bad_starts, cap)
    per_rank = int(mb.max()) + 1
    slot = rank_idx * per_rank + mb
    by_slot = stable_order(slot)
    slot_sorted = slot[by_slot]
    firsts = np.flatnonzero(np.concatenate(([True], slot_sorted[1:] != slot_sorted[:-1])))
    bounds = firsts.tolist() + [len(slot_sorted)]
    ids_by_slot = ids[order[by_slot]].tolist()
    mb_ranks = ranks[slot_sorted[firsts] // per_rank].tolist()
    return [(r, ids_by_slot[a:b]) for r, a, b in zip(mb_ranks, bounds, bounds[1:])]


def assemble_plan(
    req: PlanRequest,
    memo: CostMemo,
    placed: Dict[Tuple[int, int], List[int]],
    local_rank_of: np.ndarray,
    local_idx: np.ndarray,
    name: str,
) -> StepPlan:
    """Turn block and rank assignments (sample indices) into waves.

    A block's samples are packed in placement order into micro-batches whose per-document
    shards fit the cap, each with the faster ring mode; every rank's local samples are packed
    under the cap. Distributed groups are issued from the largest size down, local ones last
    (see the module docstring for why nothing waits).
    """
    cap = req.cluster.max_tokens_per_rank
    ids, lens = req.sample_ids, req.lengths
    waves = WaveBuilder(req.cluster.world_size)
    grids = req.vision or {}
    for g, b in sorted(placed, key=lambda k: (-k[0], k[1])):
        ranks = block_ranks(b, g)
        packs: List[List[int]] = []
        used = cap + 1
        for i in placed[(g, b)]:
            need = max(memo.per_doc_member_tokens(lens[i], g))
            # a pack with images or clips: checked as validate counts it (their encoders' activations)
            vision = packs and any(ids[k] in grids for k in packs[-1] + [i])
            if used + need > cap or (vision and not pack_fits(req, packs[-1] + [i], ranks, cap)):
                packs.append([])
                used = 0
            packs[-1].append(i)
            used += need
        for pack in packs:
            waves.add(
                Group(ranks=ranks, distributed=[ids[i] for i in pack], mode=pack_mode(req, memo, pack, ranks, cap))
            )
    id_arr, mem_arr = req.id_array, req.memory_length_array  # a local sample's items encoded on its rank
    for group in Group.one_rank_groups(local_micro_batches(local_rank_of, mem_arr[local_idx], cap, id_arr[local_idx])):
        waves.add(group)
    plan = req.empty_plan(name)
    plan.waves = waves.build()
    return plan


# Candidate.refine stops once the busiest rank is within this fraction of the mean. At 2e-3
# (improve_max_load's default) plans of shared-prompt steps at 64 ranks stopped 0.3% above the
# charged bound, just outside `auto`'s masked early stop, and auto planned every member
# (dcp and libra_tap: 30-60x magi's CPU) for nothing; at 5e-4 they end 0.18% above it.
REFINE_WITHIN = 5e-4


class Candidate:
    """One choice of CP sizes after the memory-filling pass, before it becomes a plan."""

    def __init__(self, req: PlanRequest, memo: CostMemo, lengths: np.ndarray, local_ms: np.ndarray, sizes: np.ndarray):
        world = req.cluster.world_size
        self.loads = np.zeros(world, dtype=np.float64)
        vision = request_distributed_vision_ms(req, sizes)
        self.placed = place_distributed(memo, lengths, sizes, world, self.loads, vision, request_masks(req))
        self.local_idx = np.flatnonzero(sizes == 1)
        self.local_rank_of, self.loads = fill_ranks(
            local_ms[self.local_idx], self.loads, lengths=lengths[self.local_idx]
        )
        self.refined = False
        self.estimate(req, memo, lengths)

    def estimate(self, req: PlanRequest, memo: CostMemo, lengths: np.ndarray) -> float:
        """Predicted makespan: per-rank work plus one overhead per cap-full of local tokens."""
        world = req.cluster.world_size
        local_tokens = np.bincount(self.local_rank_of, weights=lengths[self.local_idx], minlength=world)
        cap = req.cluster.max_tokens_per_rank
        self.estimate_ms = float(np.max(self.loads + np.ceil(local_tokens / cap) * memo.overhead_ms))
        return self.estimate_ms

    def refine(self, req: PlanRequest, memo: CostMemo, lengths: np.ndarray, local_ms: np.ndarray) -> None:
        """Even out the local samples by moves and swaps off the busiest rank (assign.improve_max_load)."""
        if not self.refined:
            w = local_ms[self.local_idx]
            self.local_rank_of, self.loads = improve_max_load(
                w, self.local_rank_of, self.loads, tolerance=REFINE_WITHIN
            )
            self.refined = True
            self.estimate(req, memo, lengths)

    def plan(self, req: PlanRequest, memo: CostMemo, name: str) -> StepPlan:
        return assemble_plan(req, memo, self.placed, self.local_rank_of, self.local_idx, name)


class SpreadCandidate(Candidate):
    """Every sample but the light ones on a group of at least `size` ranks, the aligned blocks of
    `size` balanced as the bins of one LPT with moves and swaps (assign.lpt_assign,
    improve_max_load).

    For coarse steps, a few samples a rank each near the cap (GRPO-like steps: long completions
    of shared prompts): Candidate places its distributed samples block by block and then fills
    the ranks with local samples that are too coarse to level what the blocks left uneven
    (7% above the bound at 64 ranks). Here the items are halves (or quarters) of samples, and
    the bins fewer: the blocks end within a fraction of a sample of each other. Samples whose
    memory needs a larger group are placed first (place_distributed); samples lighter than
    `light_share` of a rank's mean work stay local and fill the ranks afterwards."""

    def __init__(
        self,
        req: PlanRequest,
        memo: CostMemo,
        lengths: np.ndarray,
        local_ms: np.ndarray,
        min_sizes: np.ndarray,
        size: int,
        light_share: float = 0.05,
    ):
        world = req.cluster.world_size
        masks = request_masks(req)
        quota = float(local_ms.sum()) / world
        sizes = np.where((min_sizes == 1) & (local_ms < light_share * quota), 1, np.maximum(min_sizes, size))
        vision = request_distributed_vision_ms(req, sizes)
        larger = np.where(sizes > size, sizes, 1)
        self.loads = np.zeros(world, dtype=np.float64)
        self.placed = place_distributed(memo, lengths, larger, world, self.loads, vision, masks)
        spread = np.flatnonzero(sizes == size)
        if len(spread):
            times = distributed_times(memo, lengths, sizes, spread, masks)
            if vision is not None:
                times = times + vision[spread]
            # a larger group covers whole blocks of `size`, so every member of a block carries the same load
            blocks = self.loads.reshape(world // size, size).max(axis=1)
            block_of, blocks = lpt_assign(times, world // size, blocks, keys=lengths[spread])
            block_of, blocks = improve_max_load(times, block_of, blocks)
            for i, b in zip(spread.tolist(), block_of.tolist()):
                self.placed.setdefault((size, b), []).append(i)
            self.loads = np.repeat(blocks, size)
        self.local_idx = np.flatnonzero(sizes == 1)
        self.local_rank_of, self.loads = fill_ranks(
            local_ms[self.local_idx], self.loads, lengths=lengths[self.local_idx]
        )
        self.refined = False
        self.estimate(req, memo, lengths)


def refine_best(
    req: PlanRequest,
    memo: CostMemo,
    candidates: Sequence[Candidate],
    lengths: np.ndarray,
    local_ms: np.ndarray,
    top: int,
) -> None:
    """Refine the `top` candidates of lowest estimate (refinement costs more than a candidate)."""
    for i in sorted(range(len(candidates)), key=lambda i: (candidates[i].estimate_ms, i))[:top]:
        candidates[i].refine(req, memo, lengths, local_ms)


def pick_fastest(
    req: PlanRequest,
    memo: CostMemo,
    candidates: Sequence[Candidate],
    name: str,
    tolerance: float,
    max_simulated: int = 2,
    simulate_up_to_samples: Optional[int] = None,
) -> Tuple[StepPlan, float]:
    """Keep the candidate with the smallest makespan: (its plan, its predicted makespan).

    Candidates are ranked by their predicted makespan (the cost model's per-rank work under a
    schedule that never waits). Its only approximations are per-micro-batch overheads (one
    per distributed sample, one per cap-full of local tokens), so the (at most
    `max_simulated`) candidates within `tolerance` of the best are priced with the
    simulator's timing rule (pricing.PlanPricer) and the fastest wins (the first on ties). Steps with
    more than `simulate_up_to_samples` samples skip that check: their ranks hold many light
    samples, an overhead is a negligible share of a rank's time, and simulating every
    document would cost more than the planning budget.
    """
    ranked = sorted(range(len(candidates)), key=lambda i: (candidates[i].estimate_ms, i))
    best_estimate = candidates[ranked[0]].estimate_ms
    shortlist = [
        candidates[i]
        for i in ranked[: max(1, max_simulated)]
        if candidates[i].estimate_ms <= best_estimate * (1.0 + tolerance)
    ]
    if simulate_up_to_samples is not None and len(req.sample_ids) > simulate_up_to_samples:
        shortlist = shortlist[:1]
    plans = [c.plan(req, memo, name) for c in shortlist]
    if len(plans) == 1:
        return plans[0], shortlist[0].estimate_ms
    pricer = pricer_for(req.cost)
    times = [pricer.makespan_ms(p) for p in plans]
    best = int(np.argmin(times))
    return plans[best], times[best]
