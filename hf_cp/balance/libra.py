"""`libra` (Libra's VRSP, survey section 2.1): LPT placement of packed sequences over bounded pools.

Libra leaves the packing alone: the step's samples are packed to a fixed length in data
order (here first fit among the last 8 open packs, common.windowed_first_fit, to N ranks x cap tokens, N one CP size: by default the smallest
registered group holding the step's longest sample, `cp_scope="dataset"` the dataset's), and
no packed sequence is ever split, merged or repacked. What it changes is *where* each
packed sequence runs:

* Bounded pools. `pool_size` (P, default 8) neighbouring DP replicas form a pool location;
  the world holds W/(N P) locations, and growing the world adds locations, never widens a
  pool (Libra's weak-scaling argument: the balancing domain stays inside a locality domain).
* VRSP. The step's D packed sequences fill pools of at most P sequences each: heaviest
  first (predicted compute, CostModel.sample_local_ms summed over the pack) onto the
  currently lightest pool that is not yet full. There are ceil(D/P) pools rounded up to a
  multiple of the number of locations, so that every location runs the same number of
  pools (with one pool too many, one location would run a whole extra round).
* Pools are then dealt to locations heaviest first in serpentine order, each location
  running its pools one after another (one pool per wave), and inside a pool each sequence goes to one of the
  location's P replicas, heaviest sequence to the least loaded replica. A pool's sequences
  always run together, on one location, in one wave. (Libra balances what remains inside a
  pool with tile-level attention placement, TAP, which moves computation rather than data;
  that needs a block-placement executor hf_cp does not have yet.)
Each packed sequence on N > 1 ranks takes zigzag or per-document sharding, whichever the
cost model predicts faster and fits (common.pick_ring_mode).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ..plan import Group, StepPlan
from . import register_balancer
from .base import PlanRequest
from .common import (WaveBuilder, block_ranks, check_cp_options, cost_memo, descending_order, even_cap,
                     fixed_cp_size, pick_ring_mode, serpentine, windowed_first_fit)


@dataclass
class PoolLayout:
    """How VRSP laid out one step (indices refer to the request's samples)."""

    cp_size: int
    pool_size: int  # replicas per pool location
    packs: List[List[int]]  # fixed-length packs, data order
    pack_work: List[float]
    pools: List[List[int]]  # pack indices per pool
    location: List[int]  # pool -> location index
    replica_of_pack: List[int]  # pack -> replica (DP index)
    wave_of_pool: List[int]  # pool -> its position in its location's sequence


def vrsp(work: np.ndarray, pool_size: int, n_pools: int) -> List[List[int]]:
    """Survey's VRSP: heaviest first into the lightest of `n_pools` pools not yet holding
    `pool_size` items."""
    if n_pools * pool_size < len(work):
        raise ValueError(f"{len(work)} packed sequences do not fit {n_pools} pools of {pool_size}")
    heap = [(0.0, p) for p in range(n_pools)]
    pools: List[List[int]] = [[] for _ in range(n_pools)]
    for i in descending_order(work).tolist():
        load, p = heapq.heappop(heap)
        pools[p].append(i)
        if len(pools[p]) < pool_size:
            heapq.heappush(heap, (load + float(work[i]), p))
    return pools


@register_balancer("libra")
class LibraBalancer:
    name = "libra"

    def __init__(self, pool_size: int = 8, cp_size: Optional[int] = None, cp_scope: str = "step"):
        check_cp_options(cp_size, cp_scope, self.name)
        if not isinstance(pool_size, int) or pool_size <= 0 or pool_size & (pool_size - 1):
            raise ValueError(f"libra: pool_size {pool_size!r} must be a power of two (replicas per pool)")
        self.pool_size = pool_size
        self.cp_size = cp_size
        self.cp_scope = cp_scope

    def layout(self, req: PlanRequest) -> PoolLayout:
        cl = req.cluster
        N = fixed_cp_size(req, self.cp_size, self.name, self.cp_scope)
        dp = cl.world_size // N
        P = min(self.pool_size, dp)
        n_loc = dp // P
        memo = cost_memo(req.cost)
        lens = np.asarray(req.lengths, dtype=np.int64)
        # a pack this size always fits zigzag-split; a longer sample (odd cap) is a pack of its own
        packs = windowed_first_fit(req.lengths, N * even_cap(cl.max_tokens_per_rank, N), oversize_alone=True)
        work_per_sample = memo.local_ms_array(lens)
        pack_of = np.empty(len(lens), dtype=np.int64)
        for k, p in enumerate(packs):
            pack_of[p] = k
        pack_work = np.bincount(pack_of, weights=work_per_sample, minlength=len(packs))
        rounds = -(-len(packs) // (P * n_loc))
        pools = vrsp(pack_work, P, rounds * n_loc)
        pool_work = np.asarray([pack_work[p].sum() for p in pools])
        location = np.empty(len(pools), dtype=np.int64)
        location[descending_order(pool_work)] = serpentine(len(pools), n_loc)
        replica_load = np.zeros(dp)
        replica_of_pack = [0] * len(packs)
        wave_of_pool = [0] * len(pools)
        seen = [0] * n_loc
        for p in descending_order(pool_work).tolist():  # each location runs its heaviest pools first
            loc = int(location[p])
            wave_of_pool[p] = seen[loc]
            seen[loc] += 1
            reps = loc * P + np.argsort(replica_load[loc * P:(loc + 1) * P], kind="stable")
            for r, k in zip(reps.tolist(), sorted(pools[p], key=lambda k: (-pack_work[k], k))):
                replica_of_pack[k] = r
                replica_load[r] += pack_work[k]
        return PoolLayout(cp_size=N, pool_size=P, packs=packs, pack_work=pack_work.tolist(), pools=pools,
                          location=location.tolist(), replica_of_pack=replica_of_pack, wave_of_pool=wave_of_pool)

    def plan(self, req: PlanRequest) -> StepPlan:
        lay = self.layout(req)
        N, cap = lay.cp_size, req.cluster.max_tokens_per_rank
        memo = cost_memo(req.cost)
        builder = WaveBuilder(req.cluster.world_size)
        order = sorted(range(len(lay.pools)), key=lambda p: (lay.wave_of_pool[p], lay.location[p]))
        for p in order:
            for k in sorted(lay.pools[p], key=lambda k: lay.replica_of_pack[k]):
                ranks = block_ranks(lay.replica_of_pack[k], N)
                ids = [req.sample_ids[i] for i in lay.packs[k]]
                if N == 1:
                    builder.add(Group(ranks=ranks, local={ranks[0]: ids}), at_least=lay.wave_of_pool[p])
                else:
                    mode = pick_ring_mode(req.cost, [req.lengths[i] for i in lay.packs[k]], ranks, cap, memo=memo)
                    builder.add(Group(ranks=ranks, distributed=ids, mode=mode), at_least=lay.wave_of_pool[p])
        plan = req.empty_plan(self.name)
        plan.waves = builder.build()
        return plan
