"""`wlb` (WLB-LLM, Wang et al. 2025; survey sections 2.3 and 4.3): workload-aware packing.

The parallel configuration stays fixed within a step: one CP size N. WLB-LLM takes it from
its configuration; by default (`cp_scope="balanced"`, cp_size.fixed_cp_size) it is the
smallest registered group that holds the step's longest sample, doubled while that sample
alone would still outlast the mean rank's share of the step. `cp_scope="search"` plans the
step with both that size and the memory minimum and keeps the plan the cost model predicts
faster (every micro-batch's slowest member, from the same comparison that picks its
sharding mode): better plans on some data (a long-tailed step whose longest sample is
cheap enough at the smaller size), at twice the planning time and more for the predictions,
over the 300 ms budget at 512 ranks on Wikipedia. `cp_size` fixes N; `cp_scope` "step" or
"dataset" picks one size as cp_size.fixed_cp_size does. What changes is the packing:

* Variable-length packing. Micro-batches are no longer cut at a fixed context window: the
  only size limit is memory (N ranks x cap tokens). The step is packed into as few
  micro-batches as memory allows at `fill` (the same number per replica), documents in
  decreasing length, each onto the micro-batch with the least predicted workload
  (CostModel.sample_local_ms: linear plus quadratic attention work); if it has no room,
  onto the micro-batch with the fewest tokens; if that has none either, the step gets one
  more round of micro-batches and is packed again.
* Outlier delay queue. Documents of at least `outlier_fraction` of the window are outliers.
  WLB-LLM holds them in a FIFO queue across steps until there is one per micro-batch. A plan
  here is a pure function of one step's batch (every sample is trained in its own step), so
  the queue lives within the step: the step's outliers are queued in data order and, before
  any other document is packed, dealt one per micro-batch (the number of micro-batches is
  raised so that no micro-batch gets two), spread over the replicas first. Outliers thus
  never share a micro-batch and are spread evenly over replicas, which is the balancing
  effect of the queue, without moving samples between steps.
* Per-sequence vs per-document sharding. For every micro-batch on N > 1 ranks the cost model
  predicts zigzag over the packed sequence and per-document sharding, and the faster mode
  that fits memory is kept (ring_layout.pick_ring_mode).
WLB-LLM balances micro-batches because in its pipeline each one synchronises the stages;
under data parallelism what synchronises is each replica's whole step, so the greedy's
"least workload" is the replica's (see workload_greedy). Each replica runs its micro-batches
one per wave.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

import numpy as np

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.assign import descending_order, group_indices, split_exact_tail, water_fill
from hf_cp.balance.toolkit.bounds import BoundCache, request_sample_ms
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.balance.toolkit.cp_size import CP_SCOPES, check_cp_options, fixed_cp_size
from hf_cp.balance.toolkit.packing import even_cap
from hf_cp.balance.toolkit.ring_layout import ring_mode_and_ms
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.balance.toolkit.waves import WaveBuilder, block_ranks
from hf_cp.cost.vision import group_vision
from hf_cp.plan.step_plan import Group, StepPlan


def workload_greedy(
    lengths: np.ndarray,
    work: np.ndarray,
    n_replicas: int,
    rounds: int,
    capacity: int,
    first: Optional[List[int]] = None,
    exact_items: Optional[int] = None,
) -> Optional[np.ndarray]:
    """WLB-LLM's packing greedy over `n_replicas` x `rounds` micro-batches of `capacity` tokens.

    Returns every item's micro-batch (replica * rounds + slot), or None if an item fits
    nowhere. What must come out equal is each replica's total workload (its micro-batches
    run one after another, and replicas meet at the gradient reduction), so "the micro-batch
    with the least workload" is read as: a micro-batch of the replica with the least
    workload; there the one with the fewest tokens, if it has room. If none of that
    replica's has room, the next replica by workload; if no replica has, the micro-batch
    with the fewest tokens anywhere (WLB-LLM's fallback) if it has room.

    `first` items (the outlier queue) go one per micro-batch before the rest, spread over
    the replicas first (the i-th to replica i mod n_replicas); they may exceed `capacity`
    (a document alone always fits its group in per-document sharding), and such a
    micro-batch takes nothing else. For speed the light tail (assign.split_exact_tail, or
    past `exact_items`) is water-filled over replicas on workload and, inside each replica,
    over its micro-batches on tokens (assign.water_fill), kept when that respects every
    capacity, else placed one by one too.
    """
    n = len(lengths)
    n_bins = n_replicas * rounds
    bins = np.full(n, -1, dtype=np.int64)
    rep_load = np.zeros(n_replicas)
    tokens = np.zeros(n_bins, dtype=np.int64)
    first = first or []
    if len(first) > n_bins:
        return None
    for q, i in enumerate(first):  # alone in its micro-batch, so it fits whatever its size
        b = (q % n_replicas) * rounds + q // n_replicas
        bins[i] = b
        rep_load[b // rounds] += work[i]
        tokens[b] = max(capacity, int(lengths[i]))
    rest = np.nonzero(bins < 0)[0]
    rest = rest[np.argsort(-lengths[rest], kind="stable")]
    k = (
        split_exact_tail(work[rest][descending_order(work[rest])], n_replicas, float(work.sum()), 2 * n_replicas)
        if exact_items is None
        else min(len(rest), exact_items)
    )

    def place(items) -> bool:
        heap = [(float(rep_load[r]), r) for r in range(n_replicas)]
        heapq.heapify(heap)
        lens, wk = lengths.tolist(), work.tolist()
        ld, tk = rep_load.tolist(), tokens.tolist()
        for i in items:
            ni = lens[i]
            skipped = []
            b = -1
            while heap:
                l, r = heap[0]
                if l != ld[r]:  # stale entry
                    heapq.heappop(heap)
                    continue
                slot = min(range(rounds), key=lambda j: (tk[r * rounds + j], j))
                if tk[r * rounds + slot] + ni <= capacity:
                    b = r * rounds + slot
                    break
                skipped.append(heapq.heappop(heap))
            for e in skipped:
                heapq.heappush(heap, e)
            if b < 0:
                b = min(range(n_bins), key=lambda j: (tk[j], j))
                if tk[b] + ni > capacity:
                    return False
            r = b // rounds
            bins[i] = b
            ld[r] += wk[i]
            tk[b] += ni
            heapq.heappush(heap, (ld[r], r))
        rep_load[:] = ld
        tokens[:] = tk
        return True

    if not place(rest[:k].tolist()):
        return None
    tail = rest[k:]
    if len(tail):
        tail_rep = water_fill(work[tail], rep_load)
        tail_bins = np.empty(len(tail), dtype=np.int64)
        for r, pos in enumerate(group_indices(tail_rep, n_replicas)):
            if len(pos):
                mine = slice(r * rounds, (r + 1) * rounds)
                tail_bins[pos] = r * rounds + water_fill(
                    lengths[tail[pos]].astype(np.float64), tokens[mine].astype(np.float64)
                )
        new_tokens = tokens + np.bincount(tail_bins, weights=lengths[tail], minlength=n_bins).astype(np.int64)
        if new_tokens.max() <= capacity:
            bins[tail] = tail_bins
        elif not place(tail.tolist()):
            return None
    return bins


ALL_MEMBERS_BUDGET = 50_000


@dataclass(frozen=True)
class WlbOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "wlb"

    cp_size: Optional[int] = option(None, "the step's one CP size (a power of two); default: chosen by cp_scope")
    outlier_fraction: float = option(
        0.5, "documents of at least this fraction of the packing window are outliers, one per micro-batch"
    )
    fill: float = option(0.95, "target fill of the micro-batches' memory when choosing how many to pack, in (0, 1]")
    cp_scope: str = option(
        "balanced",
        "how the CP size is chosen when cp_size is not set: balanced, step, dataset or search (cp_size.fixed_cp_size)",
    )

    def check(self) -> None:
        check_cp_options(self.cp_size, self.cp_scope, self.BALANCER, CP_SCOPES + ("search",))
        if not 0 < self.fill <= 1:
            raise BalancerOptionError(f"wlb: fill {self.fill} must be in (0, 1]")
        if not 0 < self.outlier_fraction <= 1:
            raise BalancerOptionError(f"wlb: outlier_fraction {self.outlier_fraction} must be in (0, 1]")


@register_balancer("wlb", auto_member=True)
class WlbBalancer:
    name = "wlb"
    options_class = WlbOptions

    def __init__(self, **options):
        self.options = o = WlbOptions.from_dict(options)
        self.cp_size, self.cp_scope = o.cp_size, o.cp_scope
        self.fill, self.outlier_fraction = o.fill, o.outlier_fraction

    def cp_sizes(self, req: PlanRequest) -> List[int]:
        """The CP sizes the step is planned with (one, or two with cp_scope "search")."""
        if self.cp_size is None and self.cp_scope == "search":
            # the CP size is a configuration knob in WLB-LLM; here each step tries the smallest
            # size that holds its longest sample and the size at which that sample stops being
            # the straggler, and keeps the plan the cost model predicts faster
            return sorted(
                {fixed_cp_size(req, None, self.name, "step"), fixed_cp_size(req, None, self.name, "balanced")}
            )
        return [fixed_cp_size(req, self.cp_size, self.name, self.cp_scope)]

    def lower_bound_ms(self, req: PlanRequest, bounds: BoundCache) -> float:
        """No wlb plan of the request is faster (every sample on groups of one of cp_sizes)."""
        return min(bounds.fixed_size(n) for n in self.cp_sizes(req))

    def plan(self, req: PlanRequest) -> StepPlan:
        sizes = self.cp_sizes(req)
        best = min((self._plan_groups(req, N, estimate=len(sizes) > 1) for N in sizes), key=lambda r: r[0])
        builder = WaveBuilder(req.cluster.world_size)
        for group in best[1]:
            builder.add(group)
        plan = req.empty_plan(self.name)
        plan.waves = builder.build()
        return fit_vision_memory(plan, req)  # within the cap with its encoders' activations

    def _plan_groups(self, req: PlanRequest, N: int, estimate: bool = True) -> Tuple[float, List[Group]]:
        """(predicted step time, or nan without `estimate`; groups in execution order) with CP size N."""
        cl = req.cluster
        dp = cl.world_size // N
        cap = cl.max_tokens_per_rank
        window = N * even_cap(cap, N)  # a pack this size always fits zigzag-split (packing.even_cap)
        # (a document longer than that, possible with an odd cap, is an outlier: alone in its micro-batch)
        memo = cost_memo(req.cost)
        ids, lens = req.id_array, req.length_array
        work = request_sample_ms(req, memo)  # text and vision work, single-rank
        outliers = np.nonzero(lens >= self.outlier_fraction * window)[0].tolist()  # FIFO: data order
        # as few rounds of micro-batches as memory allows, at `fill` of it: a greedy cannot
        # pack every micro-batch to the last token, and a failed try costs a whole pass
        rounds = max(int(np.ceil(int(lens.sum()) / (dp * window * self.fill))), -(-len(outliers) // dp), 1)
        while True:
            bins = workload_greedy(lens, work, dp, rounds, window, first=outliers)
            if bins is not None:
                break
            rounds += 1  # cannot fail once every document has a micro-batch of its own
        groups: List[Group] = []
        replica_ms = np.zeros(dp)
        # zigzag's slowest member can be any: predict every member while that stays cheap
        # (member-document evaluations for the whole step), else sampled members
        every = estimate and N * len(lens) <= ALL_MEMBERS_BUDGET
        for b, items in enumerate(group_indices(bins, dp * rounds)):
            if not len(items):
                continue
            ranks = block_ranks(b // rounds, N)
            mb_ids = ids[items].tolist()
            if N == 1:
                groups.append(Group(ranks=ranks, local={ranks[0]: mb_ids}))
                ms = float(work[items].sum())
            else:
                mode, ms = ring_mode_and_ms(
                    req.cost, lens[items].tolist(), ranks, cap, memo=memo, estimate=estimate, all_members=every
                )
                groups.append(Group(ranks=ranks, distributed=mb_ids, mode=mode))
                if req.vision:  # the micro-batch waits for its busiest vision encoder
                    ms += max(v.ms for v in group_vision(groups[-1], req.vision, req.cost))
            replica_ms[b // rounds] += ms + memo.overhead_ms
        return float(replica_ms.max()), groups
