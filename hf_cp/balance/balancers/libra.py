"""`libra` (Libra's VRSP, survey section 2.1): LPT placement of packed sequences over bounded pools.

Libra leaves the packing alone: the step's samples are packed to a fixed length in data
order (packing.lookahead_pack, a streaming packer with first fit's property that the waste
gathers in the last packs; to N ranks x cap tokens, N one CP size: by default the smallest
registered group holding the step's longest sample, `cp_scope="dataset"` the dataset's), and
no packed sequence is ever split, merged or repacked. What it changes is *where* each
packed sequence runs:

* Bounded pools. `pool_size` (P, default 8) neighbouring DP replicas form a pool; the world
  holds W/(N P) pools, and growing the world adds pools, never widens one (Libra's
  weak-scaling argument: the balancing domain stays inside a locality domain). A step runs
  k = ceil(D / replicas) rounds of micro-batches, so a pool holds at most P k packed
  sequences (Libra's window of P sequences per pool, over the step's k rounds).
* VRSP. The step's D packed sequences, heaviest first (predicted compute,
  CostModel.sample_local_ms summed over the pack), go onto the currently lightest pool that
  is not yet full; a full pool leaves the candidates.
* Inside a pool each sequence goes, heaviest first, to the least loaded of the pool's P
  replicas that runs fewer than k sequences, and every replica runs its sequences in that
  order, one per wave. Sequences never leave their pool. (Libra balances what remains
  inside a pool with tile-level attention placement, TAP, which moves computation rather
  than data; that needs a block-placement executor hf_cp does not have yet.)
Each packed sequence on N > 1 ranks takes zigzag or per-document sharding, whichever the
cost model predicts faster and fits (ring_layout.pick_ring_mode).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar, List, Optional

import numpy as np

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.assign import descending_order, group_indices
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.balance.toolkit.costs import cost_memo
from hf_cp.balance.toolkit.cp_size import check_cp_options, fixed_cp_size
from hf_cp.balance.toolkit.packing import even_cap, lookahead_pack
from hf_cp.balance.toolkit.ring_layout import pick_ring_mode
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.balance.toolkit.waves import WaveBuilder, block_ranks
from hf_cp.plan.step_plan import Group, StepPlan


@dataclass
class PoolLayout:
    """How VRSP laid out one step (indices refer to the request's samples)."""

    cp_size: int
    pool_size: int  # replicas per pool; pool i holds replicas i*pool_size ... (i+1)*pool_size-1
    rounds: int  # micro-batches per replica at most
    packs: List[List[int]]  # fixed-length packs, data order
    pack_work: List[float]
    pools: List[List[int]]  # pack indices per pool
    replica_of_pack: List[int]  # pack -> replica (DP index)
    slot_of_pack: List[int]  # pack -> its position in its replica's sequence (its wave)


def vrsp(work: np.ndarray, n_pools: int, pool_capacity: int) -> List[List[int]]:
    """Survey's VRSP: heaviest first onto the lightest of `n_pools` pools holding fewer than
    `pool_capacity` items; ties go to the lower pool."""
    if n_pools * pool_capacity < len(work):
        raise ValueError(f"{len(work)} packed sequences do not fit {n_pools} pools of {pool_capacity}")
    heap = [(0.0, p) for p in range(n_pools)]
    pools: List[List[int]] = [[] for _ in range(n_pools)]
    for i in descending_order(work).tolist():
        load, p = heapq.heappop(heap)
        pools[p].append(i)
        if len(pools[p]) < pool_capacity:
            heapq.heappush(heap, (load + float(work[i]), p))
    return pools


@dataclass(frozen=True)
class LibraOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "libra"

    pool_size: int = option(8, "DP replicas per pool, a power of two: the balancing domain never grows past it")
    cp_size: Optional[int] = option(None, "the step's one CP size (a power of two); default: chosen by cp_scope")
    cp_scope: str = option("step", "how the CP size is chosen when cp_size is not set: step, balanced or dataset")

    def check(self) -> None:
        check_cp_options(self.cp_size, self.cp_scope, self.BALANCER)
        p = self.pool_size
        if p <= 0 or p & (p - 1):
            raise BalancerOptionError(f"libra: pool_size {p!r} must be a power of two (replicas per pool)")


@register_balancer("libra", auto_member=True)
class LibraBalancer:
    name = "libra"
    options_class = LibraOptions

    def __init__(self, **options):
        self.options = o = LibraOptions.from_dict(options)
        self.pool_size, self.cp_size, self.cp_scope = o.pool_size, o.cp_size, o.cp_scope

    def lower_bound_ms(self, req: PlanRequest, bounds: BoundCache) -> float:
        """No libra plan of the request is faster (every pack on a group of the step's CP size)."""
        return bounds.fixed_size(fixed_cp_size(req, self.cp_size, self.name, self.cp_scope))

    def layout(self, req: PlanRequest) -> PoolLayout:
        cl = req.cluster
        N = fixed_cp_size(req, self.cp_size, self.name, self.cp_scope)
        dp = cl.world_size // N
        P = min(self.pool_size, dp)
        memo = cost_memo(req.cost)
        lens = req.length_array
        # a pack this size always fits zigzag-split; a longer sample (odd cap) is a pack of its own
        pack_of = lookahead_pack(lens, N * even_cap(cl.max_tokens_per_rank, N))
        n_packs = int(pack_of.max()) + 1
        packs = [p.tolist() for p in group_indices(pack_of, n_packs)]
        pack_work = np.bincount(pack_of, weights=memo.local_ms_array(lens), minlength=n_packs)
        rounds = -(-n_packs // dp)
        pools = vrsp(pack_work, dp // P, P * rounds)
        replica_of_pack = [0] * n_packs
        slot_of_pack = [0] * n_packs
        for p, pool in enumerate(pools):
            # inside the pool: LPT over its replicas, each taking at most `rounds` sequences
            heap = [(0.0, p * P + r) for r in range(P)]
            taken = {}
            for k in sorted(pool, key=lambda k: (-pack_work[k], k)):
                load, r = heapq.heappop(heap)
                replica_of_pack[k] = r
                slot_of_pack[k] = taken.get(r, 0)
                taken[r] = slot_of_pack[k] + 1
                if taken[r] < rounds:
                    heapq.heappush(heap, (load + float(pack_work[k]), r))
        return PoolLayout(
            cp_size=N,
            pool_size=P,
            rounds=rounds,
            packs=packs,
            pack_work=pack_work.tolist(),
            pools=pools,
            replica_of_pack=replica_of_pack,
            slot_of_pack=slot_of_pack,
        )

    def plan(self, req: PlanRequest) -> StepPlan:
        lay = self.layout(req)
        N, cap = lay.cp_size, req.cluster.max_tokens_per_rank
        memo = cost_memo(req.cost)
        builder = WaveBuilder(req.cluster.world_size)
        ids, lens = req.id_array, req.length_array
        for k in sorted(range(len(lay.packs)), key=lambda k: (lay.slot_of_pack[k], lay.replica_of_pack[k])):
            ranks = block_ranks(lay.replica_of_pack[k], N)
            pack_ids = ids[lay.packs[k]].tolist()
            if N == 1:
                builder.add(Group(ranks=ranks, local={ranks[0]: pack_ids}))
            else:
                mode = pick_ring_mode(req.cost, lens[lay.packs[k]].tolist(), ranks, cap, memo=memo)
                builder.add(Group(ranks=ranks, distributed=pack_ids, mode=mode))
        plan = req.empty_plan(self.name)
        plan.waves = builder.build()
        return fit_vision_memory(plan, req)  # within the cap with its encoders' activations
