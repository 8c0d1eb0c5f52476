"""`wlb` (WLB-LLM, Wang et al. 2025; survey sections 2.3 and 4.3): workload-aware packing.

The parallel configuration stays fixed within a step: one CP size N, by default the smallest
registered group that holds the step's longest sample, doubled while that sample alone would
outlast the mean rank's work (common.fixed_cp_size, scope "balanced"; `cp_scope="step"`
stops at the memory minimum, `"dataset"` sizes for the dataset's longest sample, one size
for the run like `static`; `cp_size` fixes N). What changes is the packing:

* Variable-length packing. Micro-batches are no longer cut at a fixed context window: the
  only size limit is memory (N ranks x cap tokens). The step is packed into as few
  micro-batches as memory allows (a multiple of the W/N replicas, so every replica runs the
  same number), documents in decreasing length, each onto the micro-batch with the least
  predicted workload (CostModel.sample_local_ms: linear plus quadratic attention work); if
  it has no room, onto the micro-batch with the fewest tokens; if that has none either, the
  step gets one more round of micro-batches and is packed again.
* Outlier delay queue. Documents of at least `outlier_fraction` of the window are outliers.
  WLB-LLM holds them in a FIFO queue across steps until there is one per micro-batch. A plan
  here is a pure function of one step's batch (every sample is trained in its own step), so
  the queue lives within the step: the step's outliers are queued in data order and, before
  any other document is packed, dealt one per micro-batch (the number of micro-batches is
  raised so that no micro-batch gets two). Outliers thus never share a micro-batch and are
  spread evenly over replicas, which is the balancing effect of the queue, without moving
  samples between steps.
* Per-sequence vs per-document sharding. For every micro-batch on N > 1 ranks the cost model
  predicts zigzag over the packed sequence and per-document sharding, and the faster mode
  that fits memory is kept (common.pick_ring_mode).
Micro-batches are dealt to replicas heaviest first in serpentine order, one per wave.
"""
from __future__ import annotations

import heapq
from typing import List, Optional

import numpy as np

from ..plan import Group, StepPlan
from . import register_balancer
from .base import PlanRequest
from .common import (WaveBuilder, block_ranks, check_cp_options, cost_memo, descending_order, even_cap,
                     fixed_cp_size, group_indices, pick_ring_mode, serpentine, split_exact_tail, water_fill)


def workload_greedy(lengths: np.ndarray, work: np.ndarray, n_bins: int, capacity: int,
                    first: Optional[List[int]] = None, exact_items: Optional[int] = None) -> Optional[np.ndarray]:
    """WLB-LLM's packing greedy. Returns the bin of every item, or None if some item fits nowhere.

    `first` items (the outlier queue) go one per bin, bin i for the i-th, before the rest;
    they may exceed `capacity` (a document alone always fits its group in per-document
    sharding), and such a bin takes nothing else. The rest, longest first, onto the bin
    with the least workload, else the bin with the fewest tokens. For speed the light tail
    (common.split_exact_tail, or past `exact_items`) is water-filled on workload in one pass
    (common.water_fill) when that respects every capacity, else placed one by one too.
    """
    n = len(lengths)
    bins = np.full(n, -1, dtype=np.int64)
    load = np.zeros(n_bins)
    tokens = np.zeros(n_bins, dtype=np.int64)
    first = first or []
    if len(first) > n_bins:
        return None
    for b, i in enumerate(first):  # alone in its bin, so it fits whatever its size
        bins[i] = b
        load[b] += work[i]
        tokens[b] += lengths[i]
    rest = np.nonzero(bins < 0)[0]
    rest = rest[np.argsort(-lengths[rest], kind="stable")]
    k = (split_exact_tail(work[rest][descending_order(work[rest])], n_bins, float(work.sum()), 2 * n_bins)
         if exact_items is None else min(len(rest), exact_items))

    def place(items) -> bool:
        by_work = [(float(load[b]), b) for b in range(n_bins)]
        by_tokens = [(int(tokens[b]), b) for b in range(n_bins)]
        heapq.heapify(by_work)
        heapq.heapify(by_tokens)
        lens, wk = lengths.tolist(), work.tolist()
        ld, tk = load.tolist(), tokens.tolist()
        for i in items:
            ni = lens[i]
            while by_work[0][0] != ld[by_work[0][1]]:  # drop stale entries
                heapq.heappop(by_work)
            b = by_work[0][1]
            if tk[b] + ni > capacity:
                while by_tokens[0][0] != tk[by_tokens[0][1]]:
                    heapq.heappop(by_tokens)
                b = by_tokens[0][1]
                if tk[b] + ni > capacity:
                    return False
            bins[i] = b
            ld[b] += wk[i]
            tk[b] += ni
            heapq.heappush(by_work, (ld[b], b))
            heapq.heappush(by_tokens, (tk[b], b))
        load[:] = ld
        tokens[:] = tk
        return True

    if not place(rest[:k].tolist()):
        return None
    tail = rest[k:]
    if len(tail):
        # the tail, longest first, water-filled on workload; kept if it respects every bin's
        # capacity, else the heaps place it one by one
        tail_bins = water_fill(work[tail], load)
        new_tokens = tokens + np.bincount(tail_bins, weights=lengths[tail], minlength=n_bins).astype(np.int64)
        if new_tokens.max() <= capacity:
            bins[tail] = tail_bins
        elif not place(tail.tolist()):
            return None
    return bins


@register_balancer("wlb")
class WlbBalancer:
    name = "wlb"

    def __init__(self, cp_size: Optional[int] = None, outlier_fraction: float = 0.5, fill: float = 0.95,
                 cp_scope: str = "balanced"):
        check_cp_options(cp_size, cp_scope, self.name)
        if not 0 < fill <= 1:
            raise ValueError(f"wlb: fill {fill} must be in (0, 1]")
        self.fill = fill
        if not 0 < outlier_fraction <= 1:
            raise ValueError(f"wlb: outlier_fraction {outlier_fraction} must be in (0, 1]")
        self.cp_size = cp_size
        self.cp_scope = cp_scope
        self.outlier_fraction = outlier_fraction

    def plan(self, req: PlanRequest) -> StepPlan:
        cl = req.cluster
        N = fixed_cp_size(req, self.cp_size, self.name, self.cp_scope)
        dp = cl.world_size // N
        cap = cl.max_tokens_per_rank
        window = N * even_cap(cap, N)  # a pack this size always fits zigzag-split (common.even_cap)
        # (a document longer than that, possible with an odd cap, is an outlier: alone in its micro-batch)
        memo = cost_memo(req.cost)
        ids = np.asarray(req.sample_ids, dtype=np.int64)
        lens = np.asarray(req.lengths, dtype=np.int64)
        work = memo.local_ms_array(lens)
        outliers = np.nonzero(lens >= self.outlier_fraction * window)[0].tolist()  # FIFO: data order
        # as few rounds of micro-batches as memory allows, at `fill` of it: a greedy cannot
        # pack every micro-batch to the last token, and a failed try costs a whole pass
        rounds = max(int(np.ceil(int(lens.sum()) / (dp * window * self.fill))), -(-len(outliers) // dp), 1)
        while True:
            bins = workload_greedy(lens, work, dp * rounds, window, first=outliers)
            if bins is not None:
                break
            rounds += 1  # cannot fail once every document has a micro-batch of its own
        n_mb = dp * rounds
        mb_work = np.bincount(bins, weights=work, minlength=n_mb)
        order = descending_order(mb_work)
        replica = serpentine(n_mb, dp)
        members = group_indices(bins, n_mb)
        builder = WaveBuilder(cl.world_size)
        for pos, b in enumerate(order.tolist()):
            items = members[b]
            if not len(items):
                continue
            ranks = block_ranks(int(replica[pos]), N)
            mb_ids = ids[items].tolist()
            if N == 1:
                builder.add(Group(ranks=ranks, local={ranks[0]: mb_ids}))
            else:
                mode = pick_ring_mode(req.cost, lens[items].tolist(), ranks, cap, memo=memo)
                builder.add(Group(ranks=ranks, distributed=mb_ids, mode=mode))
        plan = req.empty_plan(self.name)
        plan.waves = builder.build()
        return plan
