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

One candidate plan per `theta` (and the memory-only one); each distinct candidate is run
through `hf_cp.sim.simulate` and the fastest is kept.

Execution order makes groups never wait for each other: every rank runs its distributed
micro-batches from the largest group size to the smallest, then its local ones. Aligned
blocks nest, so the members of a block of size g have done exactly the same larger-group
work before it and reach it at the same moment.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..cost import CostModel, RankCost
from ..plan import Group, StepPlan
from ..shard import ShardMode
from ..sim import simulate
from . import register_balancer
from .base import PlanRequest
from .common import CostMemo, WaveBuilder, block_ranks, cost_memo, lpt_assign, pick_ring_mode, split_to_cap

DEFAULT_THETAS: Tuple[Optional[float], ...] = (None, 1.0, 0.5, 0.25, 0.125)


def memory_min_sizes(memo: CostMemo, lengths: np.ndarray, req: PlanRequest) -> np.ndarray:
    """Smallest registered group size per sample whose per-document shards fit the cap."""
    cl = req.cluster
    cap = cl.max_tokens_per_rank
    sizes = np.ones(len(lengths), dtype=np.int64)
    for i in np.nonzero(lengths > cap)[0].tolist():
        n = int(lengths[i])
        g = cl.smallest_group_for(n)
        while g is not None and max(memo.per_doc_member_tokens(n, g)) > cap:
            g = next((s for s in cl.group_sizes if s > g), None)
        if g is None:  # PlanRequest rejects these; kept as a guard against a changed registry
            raise ValueError(
                f"sample {req.sample_ids[i]} ({n} tokens) fits no group of {cl.group_sizes} with cap {cap}"
            )
        sizes[i] = g
    return sizes


def per_rank_ms(memo: CostMemo, length: int, group_size: int) -> float:
    """Time a sample adds to each member of its group: one micro-batch of its own if distributed."""
    if group_size == 1:
        return memo.local_ms(length)
    return memo.doc_on_group_ms(length, group_size) + memo.overhead_ms


def balance_sizes(
    memo: CostMemo,
    lengths: np.ndarray,
    min_sizes: np.ndarray,
    local_ms: np.ndarray,
    largest: int,
    quota_ms: float,
    theta: Optional[float],
) -> np.ndarray:
    """Workload pass: double the CP size of samples over theta x quota while that helps."""
    sizes = min_sizes.copy()
    if theta is None:
        return sizes
    limit = theta * quota_ms
    for i in np.nonzero((local_ms > limit) | (min_sizes > 1))[0].tolist():
        n, g = int(lengths[i]), int(sizes[i])
        t = per_rank_ms(memo, n, g)
        while t > limit and g < largest:
            t2 = per_rank_ms(memo, n, 2 * g)
            if t2 >= t:
                break
            g, t = 2 * g, t2
        sizes[i] = g
    return sizes


def place_distributed(
    memo: CostMemo, lengths: np.ndarray, sizes: np.ndarray, world: int, loads: np.ndarray
) -> Dict[Tuple[int, int], List[int]]:
    """LPT over aligned blocks: heaviest distributed sample first, onto the block of its size
    whose busiest member is least loaded. Returns (block size, block index) -> sample indices
    and updates `loads` in place."""
    dist = np.nonzero(sizes > 1)[0]
    times = np.array([per_rank_ms(memo, int(lengths[i]), int(sizes[i])) for i in dist.tolist()])
    placed: Dict[Tuple[int, int], List[int]] = {}
    for k in np.argsort(-times, kind="stable").tolist():
        i, g = int(dist[k]), int(sizes[dist[k]])
        b = int(np.argmin(loads.reshape(world // g, g).max(axis=1)))
        loads[b * g : (b + 1) * g] += times[k]
        placed.setdefault((g, b), []).append(i)
    return placed


def fill_ranks(
    weights: np.ndarray, loads: np.ndarray, exact_per_rank: int = 2, light_fraction: float = 0.005
) -> Tuple[np.ndarray, np.ndarray]:
    """Memory filling: local samples onto ranks, lightest rank first. Returns (rank of each
    sample, final loads).

    common.lpt_assign with a finer exact part: samples heavier than `light_fraction` of the
    mean final load (and at least the `exact_per_rank` x world heaviest) go one by one to the
    least loaded rank; the light tail is water-filled, so every rank ends within one light
    sample of a common level.
    """
    world = len(loads)
    weights = np.asarray(weights, dtype=np.float64)
    mean_final = (float(weights.sum()) + float(np.sum(loads))) / world
    exact = max(min(len(weights), exact_per_rank * world), int(np.count_nonzero(weights > light_fraction * mean_final)))
    return lpt_assign(weights, world, loads, exact_items=exact)


def local_micro_batches(rank_of: np.ndarray, lengths: np.ndarray, cap: int) -> List[Tuple[int, np.ndarray]]:
    """Pack every rank's local samples into micro-batches of at most `cap` tokens.

    Returns (rank, sample indices) per micro-batch, by rank. Fast path: each rank takes the
    fewest micro-batches its tokens allow and deals its samples, longest first, in a snake
    order over them (near-equal token sums); ranks where that overflows fall back to
    first-fit decreasing (common.split_to_cap).
    """
    out: List[Tuple[int, np.ndarray]] = []
    if len(rank_of) == 0:
        return out
    order = np.lexsort((-lengths, rank_of))  # by rank, then longest first (stable)
    r_sorted, l_sorted = rank_of[order], lengths[order]
    ranks, starts, counts = np.unique(r_sorted, return_index=True, return_counts=True)
    totals = np.add.reduceat(l_sorted, starts)
    k = np.maximum(1, -(-totals // cap))
    pos = np.arange(len(order)) - np.repeat(starts, counts)
    kk = np.repeat(k, counts)
    p = pos % (2 * kk)
    mb = np.where(p < kk, p, 2 * kk - 1 - p)
    kmax = int(k.max())
    slot = np.repeat(np.arange(len(ranks)), counts) * kmax + mb
    sums = np.bincount(slot, weights=l_sorted, minlength=len(ranks) * kmax).reshape(len(ranks), kmax)
    bad = sums.max(axis=1) > cap
    by_slot = np.argsort(slot, kind="stable")
    slot_sorted = slot[by_slot]
    bounds = np.flatnonzero(np.diff(slot_sorted)) + 1
    for piece, first in zip(np.split(order[by_slot], bounds), np.concatenate(([0], bounds)).tolist()):
        ri = int(slot_sorted[first]) // kmax
        if not bad[ri]:
            out.append((int(ranks[ri]), piece))
    for ri in np.flatnonzero(bad).tolist():
        idx = order[starts[ri] : starts[ri] + counts[ri]]
        for mbatch in split_to_cap(idx.tolist(), lengths[idx].tolist(), cap):
            out.append((int(ranks[ri]), np.asarray(mbatch, dtype=np.int64)))
    out.sort(key=lambda t: t[0])  # stable: a rank's micro-batches keep their order
    return out


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
    for g, b in sorted(placed, key=lambda k: (-k[0], k[1])):
        ranks = block_ranks(b, g)
        packs: List[List[int]] = []
        used = cap + 1
        for i in placed[(g, b)]:
            need = max(memo.per_doc_member_tokens(lens[i], g))
            if used + need > cap:
                packs.append([])
                used = 0
            packs[-1].append(i)
            used += need
        for pack in packs:
            doc_lens = [lens[i] for i in pack]
            mode = pick_ring_mode(req.cost, doc_lens, ranks, cap) if len(pack) > 1 else ShardMode.RING_PER_DOC
            waves.add(Group(ranks=ranks, distributed=[ids[i] for i in pack], mode=mode))
    id_arr = np.asarray(ids, dtype=np.int64)
    len_arr = np.asarray(lens, dtype=np.int64)
    for r, piece in local_micro_batches(local_rank_of, len_arr[local_idx], cap):
        waves.add(Group(ranks=(r,), local={r: id_arr[local_idx[piece]].tolist()}))
    plan = req.empty_plan(name)
    plan.waves = waves.build()
    return plan


class Candidate:
    """One choice of CP sizes after the memory-filling pass, before it becomes a plan."""

    def __init__(self, req: PlanRequest, memo: CostMemo, lengths: np.ndarray, local_ms: np.ndarray, sizes: np.ndarray):
        world = req.cluster.world_size
        self.loads = np.zeros(world, dtype=np.float64)
        self.placed = place_distributed(memo, lengths, sizes, world, self.loads)
        self.local_idx = np.flatnonzero(sizes == 1)
        self.local_rank_of, self.loads = fill_ranks(local_ms[self.local_idx], self.loads)
        # predicted makespan: per-rank work plus one overhead per cap-full of local tokens
        local_tokens = np.bincount(self.local_rank_of, weights=lengths[self.local_idx], minlength=world)
        cap = req.cluster.max_tokens_per_rank
        self.estimate_ms = float(np.max(self.loads + np.ceil(local_tokens / cap) * memo.overhead_ms))

    def plan(self, req: PlanRequest, memo: CostMemo, name: str) -> StepPlan:
        return assemble_plan(req, memo, self.placed, self.local_rank_of, self.local_idx, name)


class MemoizedCost(CostModel):
    """The request's CostModel with per-length memoised costs for local-only micro-batches.

    Identical numbers (a local-only member's cost is the sum of its documents' single-rank
    costs), so `simulate` gives the same result, minus the per-document recomputation.
    """

    def __init__(self, base: CostModel, memo: CostMemo):
        self.__dict__.update(base.__dict__)
        self._memo = memo

    def distributed_rank_cost(self, doc_lengths, mode, ranks, member, local_lengths=(), masks=None, local_masks=None):
        masked = any(m is not None for m in (local_masks or ()))
        if doc_lengths or not local_lengths or masked:
            return super().distributed_rank_cost(doc_lengths, mode, ranks, member, local_lengths, masks, local_masks)
        return RankCost(
            compute_ms=sum(map(self._memo.local_ms, local_lengths)),
            comm_ms=0.0,
            comm_bytes=0,
            tokens=sum(local_lengths),
        )


def pick_fastest(
    req: PlanRequest,
    memo: CostMemo,
    candidates: Sequence[Candidate],
    name: str,
    tolerance: float,
    max_simulated: int = 2,
    simulate_up_to_samples: Optional[int] = None,
) -> StepPlan:
    """Keep the candidate with the smallest makespan.

    Candidates are ranked by their predicted makespan (the cost model's per-rank work under a
    schedule that never waits). Its only approximations are per-micro-batch overheads (one
    per distributed sample, one per cap-full of local tokens), so the (at most
    `max_simulated`) candidates within `tolerance` of the best are run through
    `hf_cp.sim.simulate` and the fastest simulated plan wins (the first on ties). Steps with
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
        return plans[0]
    sim_cost = MemoizedCost(req.cost, memo)
    times = [simulate(p, sim_cost).makespan_ms for p in plans]
    return plans[int(np.argmin(times))]


@register_balancer("dynamic_cp")
class DynamicCPBalancer:
    """Per-sample CP size (workload first, then memory filling); best simulated candidate.

    thetas: quota fractions tried in the workload pass (None = memory-minimal sizes only).
    simulate_within: candidates predicted within this fraction of the best are simulated
    (at most two, and only in steps of at most simulate_samples_per_rank x world samples).
    """

    name = "dynamic_cp"

    def __init__(
        self,
        thetas: Sequence[Optional[float]] = DEFAULT_THETAS,
        simulate_within: float = 0.003,
        simulate_samples_per_rank: float = 16.0,
    ):
        if not thetas:
            raise ValueError("dynamic_cp: thetas must name at least one candidate")
        for t in thetas:
            if t is not None and not t > 0:
                raise ValueError(f"dynamic_cp: theta {t!r} must be positive (or None for memory-only)")
        self.thetas = tuple(thetas)
        self.simulate_within = float(simulate_within)
        self.simulate_samples_per_rank = float(simulate_samples_per_rank)

    def plan(self, req: PlanRequest) -> StepPlan:
        memo = cost_memo(req.cost)
        cl = req.cluster
        lengths = np.asarray(req.lengths, dtype=np.int64)
        local_ms = memo.local_ms_array(lengths)
        min_sizes = memory_min_sizes(memo, lengths, req)
        quota = float(local_ms.sum()) / cl.world_size
        seen = set()
        candidates: List[Candidate] = []
        for theta in self.thetas:
            sizes = balance_sizes(memo, lengths, min_sizes, local_ms, cl.group_sizes[-1], quota, theta)
            key = sizes.tobytes()
            if key in seen:
                continue
            seen.add(key)
            candidates.append(Candidate(req, memo, lengths, local_ms, sizes))
        return pick_fastest(
            req,
            memo,
            candidates,
            self.name,
            self.simulate_within,
            simulate_up_to_samples=int(self.simulate_samples_per_rank * cl.world_size),
        )
