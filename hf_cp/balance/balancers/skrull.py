"""`skrull` (Skrull, Xu et al. 2025; survey section 2.2): global data scheduling + DACP.

The parallel configuration is fixed within a step, as in Skrull: one CP size N, so the world
is W/N data-parallel replicas of N ranks each. Skrull takes N from its configuration; by
default (`cp_scope="search"`) each step starts at the size at which its longest sample stops
being the straggler (cp_size.fixed_cp_size, scope "balanced") and halves it, down to the
smallest registered group that holds that sample, while the plan's predicted time improves,
at most `search_halvings` times (default 1: two plans per step, to stay within the planning
time budget). `cp_size` fixes N; `cp_scope`
"step", "balanced" or "dataset" picks one size as cp_size.fixed_cp_size does.

1. GDS, across replicas: bin packing of the step's samples on predicted compute
   (CostModel.sample_local_ms, Skrull's FLOPs proxy), heaviest first onto the lightest
   replica (LPT).
2. GDS, inside a replica: the replica's samples are cut into as few micro-batches as its
   memory allows (N ranks x cap tokens, times `fill`), dealt heaviest first in a serpentine
   order so that long and short samples are interleaved and every micro-batch holds a
   share of the long ones.
3. DACP, inside each micro-batch (one CP group): the survey's pseudo-code. Sequences in
   ascending length; principle 1, avoid splitting: try local on the member with the least
   compute (principle 2), then on the member with the most free memory; only then
   distributed (per-document sharding, every member takes its share); if even that does
   not fit, roll back: turn the largest local sequence of the member with the least free
   memory into a distributed one (principle 3) and place the sequence again.
   Extension (`split_stragglers`, default on; off gives the pseudo-code as written): DACP
   splits only when memory forces it, so a sequence whose compute alone exceeds the
   micro-batch's mean member load would stay local and be the straggler whatever else is
   balanced. DACP is therefore also run with such sequences made distributed before the
   others are placed (principle 2, balance compute, taking precedence), and the
   classification whose slowest member is predicted faster is kept.
   Ascending order decides *which* sequences stay local; the locals are then re-placed
   heaviest first onto the least loaded member with room (LPT), which balances the same
   classification better (kept only when it fits, else DACP's own placement stays).
   The distributed sequences take zigzag or per-document sharding, whichever the cost
   model predicts faster and fits (ring_layout.pick_ring_mode).
A micro-batch DACP cannot fit (fragmentation) is split in two and each half planned again.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.balance.base import PlanRequest
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option
from hf_cp.balance.registry import register_balancer
from hf_cp.balance.toolkit.assign import descending_order, group_indices, lpt_assign, serpentine, water_fill
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.balance.toolkit.costs import CostMemo, cost_memo
from hf_cp.balance.toolkit.cp_size import CP_SCOPES, check_cp_options, fixed_cp_size
from hf_cp.balance.toolkit.packing import even_cap, split_to_cap
from hf_cp.balance.toolkit.pricing import pricer_for
from hf_cp.balance.toolkit.ring_layout import pick_ring_mode
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.balance.toolkit.waves import WaveBuilder, block_ranks
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.step_plan import Group, StepPlan


def interleave_micro_batches(lengths: np.ndarray, weights: np.ndarray, budget: int) -> List[np.ndarray]:
    """Indices (into `lengths`) of micro-batches of at most `budget` tokens each, long and short
    interleaved: heaviest first, dealt in serpentine order over as few micro-batches as fit."""
    total = int(lengths.sum())
    order = descending_order(weights)
    m0 = max(1, -(-total // budget))
    for m in range(m0, m0 + 4):
        bins = serpentine(len(order), m)
        tokens = np.bincount(bins, weights=lengths[order], minlength=m)
        if tokens.max() <= budget:
            return [order[bins == b] for b in range(m)]
    # a few very long samples defeat dealing: first-fit decreasing on tokens instead
    idx = order.tolist()
    return [np.asarray(mb, dtype=np.int64) for mb in split_to_cap(idx, lengths[order].tolist(), budget)]


SHORT_FRACTION = 1.0 / 16  # see Dacp.classify


class Dacp:
    """DACP of one micro-batch on a group of N members with a per-member cap of C tokens."""

    def __init__(self, memo: CostMemo, n_members: int, cap: int):
        self.memo, self.n, self.cap = memo, n_members, cap

    def classify(
        self, lens: Sequence[int], costs: Sequence[float], split_first: Sequence[int] = ()
    ) -> Optional[List[int]]:
        """Survey pseudo-code. Returns the member of each local item or -1 if distributed, or
        None when the micro-batch cannot be fitted. Items of `split_first` are made
        distributed before anything is placed (when their shares fit)."""
        N, memo = self.n, self.memo
        rb = [self.cap] * N  # remaining budget (tokens)
        load = [0.0] * N
        where = [-2] * len(lens)  # -2: not placed yet, -1: distributed, else member
        on: List[List[int]] = [[] for _ in range(N)]  # local items per member
        heap = [(0.0, m) for m in range(N)]  # (load, member); entries go stale when load changes

        def put_local(i: int, t: int) -> None:
            where[i] = t
            on[t].append(i)
            rb[t] -= lens[i]
            load[t] += costs[i]
            heapq.heappush(heap, (load[t], t))

        def put_distributed(i: int) -> bool:
            share = memo.per_doc_member_tokens(lens[i], N)
            if any(r < s for r, s in zip(rb, share)):
                return False
            where[i] = -1
            c = memo.doc_on_group_ms(lens[i], N)
            for m in range(N):
                rb[m] -= share[m]
                load[m] += c
            heap[:] = [(l, m) for m, l in enumerate(load)]
            heapq.heapify(heap)
            return True

        for i in split_first:
            put_distributed(i)
        order = sorted((i for i in range(len(lens)) if where[i] == -2), key=lambda i: (lens[i], i))
        # Short sequences first. Those up to SHORT_FRACTION of the cap cannot run out of
        # memory while placed (checked below), so for them the loop reduces to "onto the member
        # with the least compute": done in one vectorised water-filling pass instead.
        n_short = bisect.bisect_right([lens[i] for i in order], int(SHORT_FRACTION * self.cap))
        if n_short > N:
            short = np.asarray(order[:n_short], dtype=np.int64)
            short_costs = np.asarray(costs, dtype=np.float64)[short]
            member = water_fill(short_costs, np.asarray(load))
            used = np.bincount(member, weights=np.asarray(lens, dtype=np.float64)[short], minlength=N)
            if np.all(used <= np.asarray(rb)):
                for i, t in zip(short.tolist(), member.tolist()):
                    where[i] = t
                    on[t].append(i)
                added = np.bincount(member, weights=short_costs, minlength=N).tolist()
                for t in range(N):
                    rb[t] -= int(used[t])
                    load[t] += added[t]
                heap[:] = [(l, m) for m, l in enumerate(load)]
                heapq.heapify(heap)
                order = order[n_short:]
        for i in order:
            n = lens[i]
            while True:
                while heap[0][0] != load[heap[0][1]]:
                    heapq.heappop(heap)
                t = heap[0][1]  # principle 2: the member with the least compute
                if rb[t] >= n:
                    put_local(i, t)
                    break
                t = max(range(N), key=lambda m: (rb[m], -m))  # principle 1: the most free memory
                if rb[t] >= n:
                    put_local(i, t)
                    break
                if put_distributed(i):
                    break
                # principle 3: roll back the largest local of the fullest member, then retry
                t = min(range(N), key=lambda m: (rb[m], m))
                if not on[t]:
                    return None
                j = max(on[t], key=lambda k: (lens[k], k))
                on[t].remove(j)
                rb[t] += lens[j]
                load[t] -= costs[j]
                if not put_distributed(j):
                    return None
        return where

    def member_loads(self, lens: Sequence[int], costs: Sequence[float], where: Sequence[int]) -> List[float]:
        """Predicted compute of every member: its locals plus its share of the distributed."""
        load = [0.0] * self.n
        dist = 0.0
        for i, m in enumerate(where):
            if m >= 0:
                load[m] += costs[i]
            else:
                dist += self.memo.doc_on_group_ms(lens[i], self.n)
        return [l + dist for l in load]

    def balance_locals(self, lens: Sequence[int], costs: Sequence[float], where: List[int]) -> List[int]:
        """Re-place DACP's locals heaviest first on the least loaded member with room."""
        N, memo = self.n, self.memo
        rb = [self.cap] * N
        load = [0.0] * N
        for i, m in enumerate(where):
            if m == -1:
                share = memo.per_doc_member_tokens(lens[i], N)
                c = memo.doc_on_group_ms(lens[i], N)
                for k in range(N):
                    rb[k] -= share[k]
                    load[k] += c
        heap = [(load[m], m) for m in range(N)]
        heapq.heapify(heap)
        locals_ = [i for i, m in enumerate(where) if m >= 0]
        locals_.sort(key=lambda i: (-costs[i], i))
        out = list(where)
        for i in locals_:
            skipped = []
            while heap and rb[heap[0][1]] < lens[i]:
                skipped.append(heapq.heappop(heap))
            if not heap:
                return where  # LPT cannot fit what DACP fitted: keep DACP's placement
            l, t = heapq.heappop(heap)
            out[i] = t
            rb[t] -= lens[i]
            heapq.heappush(heap, (l + costs[i], t))
            for s in skipped:
                heapq.heappush(heap, s)
        return out


@dataclass(frozen=True)
class SkrullOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "skrull"

    cp_size: Optional[int] = option(None, "the step's one CP size (a power of two); default: chosen by cp_scope")
    fill: float = option(0.9, "fraction of a group's memory the interleaved micro-batches are packed to, in (0, 1]")
    cp_scope: str = option(
        "search",
        "how the CP size is chosen when cp_size is not set: search (halve from balanced while the estimate "
        "improves), balanced, step or dataset",
    )
    split_stragglers: bool = option(
        True, "also try distributing the documents whose compute alone exceeds the group's mean member load"
    )
    search_halvings: int = option(1, "how many times cp_scope=search may halve the CP size")

    def check(self) -> None:
        check_cp_options(self.cp_size, self.cp_scope, self.BALANCER, CP_SCOPES + ("search",))
        if self.search_halvings < 0:
            raise BalancerOptionError(
                f"skrull: search_halvings {self.search_halvings!r} must be a non-negative integer"
            )
        if not 0 < self.fill <= 1:
            raise BalancerOptionError(f"skrull: fill {self.fill} must be in (0, 1]")


@register_balancer("skrull", auto_member=True)
class SkrullBalancer:
    name = "skrull"
    options_class = SkrullOptions

    def __init__(self, **options):
        self.options = o = SkrullOptions.from_dict(options)
        self.cp_size, self.cp_scope, self.fill = o.cp_size, o.cp_scope, o.fill
        self.split_stragglers, self.search_halvings = o.split_stragglers, o.search_halvings

    def lower_bound_ms(self, req: PlanRequest, bounds: BoundCache) -> float:
        """No skrull plan of the request is faster: every sample runs inside one block of the
        CP size (bounds.blocks_bound_ms), for the sizes the search may end on."""
        if self.cp_size is None and self.cp_scope == "search":
            smallest = fixed_cp_size(req, None, self.name, "step")
            n = fixed_cp_size(req, None, self.name, "balanced")
            sizes = [n]
            for _ in range(self.search_halvings):
                if n // 2 < smallest:
                    break
                n //= 2
                sizes.append(n)
        else:
            sizes = [fixed_cp_size(req, self.cp_size, self.name, self.cp_scope)]
        return max(bounds.step(), min(bounds.blocks(n) for n in sizes))

    def plan(self, req: PlanRequest) -> StepPlan:
        if self.cp_size is None and self.cp_scope == "search":
            # Skrull's CP size is a configuration knob; here each step starts at the size at
            # which its longest sample stops being the straggler and halves it (down to the
            # smallest size that holds that sample) while its own load estimates improve
            smallest = fixed_cp_size(req, None, self.name, "step")
            N = fixed_cp_size(req, None, self.name, "balanced")
            best = self._plan_groups(req, N)
            for _ in range(self.search_halvings):
                if N // 2 < smallest:
                    break
                N //= 2
                trial = self._plan_groups(req, N)
                if trial[0] >= best[0]:
                    break
                best = trial
        else:
            best = self._plan_groups(req, fixed_cp_size(req, self.cp_size, self.name, self.cp_scope))
        plan = req.empty_plan(self.name)
        builder = WaveBuilder(req.cluster.world_size)
        memo = cost_memo(req.cost)
        cap = req.cluster.max_tokens_per_rank
        for group, dist_lens, local_tokens in best[1]:
            if len(dist_lens) > 1:  # the sharding mode only for the plan kept
                group.mode = pick_ring_mode(req.cost, dist_lens, group.ranks, cap, local_tokens, memo)
            builder.add(group)
        plan.waves = builder.build()
        return fit_vision_memory(plan, req)  # within the cap with its encoders' activations

    def _plan_groups(self, req: PlanRequest, N: int) -> Tuple[float, List[Tuple[Group, List[int], List[int]]]]:
        """(estimated step time, groups in execution order) of a plan with CP size N; each group
        with its distributed lengths and its members' local tokens, for choosing its mode."""
        cl = req.cluster
        dp = cl.world_size // N
        cap = cl.max_tokens_per_rank
        memo = cost_memo(req.cost)
        ids, lens = req.id_array, req.length_array
        flops = memo.local_ms_array(lens)
        replica, _ = lpt_assign(flops, dp)
        budget = max(int(lens.max()), int(N * even_cap(cap, N) * self.fill)) if N > 1 else cap
        dacp = Dacp(memo, N, cap)
        groups: List[Group] = []
        makespan = 0.0
        for d, mine in enumerate(group_indices(replica, dp)):
            if not len(mine):
                continue
            ranks = block_ranks(d, N)
            todo = [mine[mb] for mb in interleave_micro_batches(lens[mine], flops[mine], budget)]
            replica_ms = 0.0
            while todo:
                mb = todo.pop(0)
                made = self._micro_batch(req, dacp, ranks, ids[mb].tolist(), lens[mb].tolist(), flops[mb].tolist(), cap)
                if made is None:  # did not fit: plan each half on its own
                    todo[:0] = [mb[serpentine(len(mb), 2) == 0], mb[serpentine(len(mb), 2) == 1]]
                    continue
                group, ms, dist_lens, local_tokens = made
                groups.append((group, dist_lens, local_tokens))
                replica_ms += ms + memo.overhead_ms
            makespan = max(makespan, replica_ms)
        return makespan, groups

    def _micro_batch(self, req, dacp: Dacp, ranks, ids, lens, costs, cap):
        """(the micro-batch's group with per-document sharding, its slowest member's estimated
        compute, the distributed lengths, the members' local tokens), or None if it does not
        fit."""
        N = len(ranks)
        if N == 1:
            return Group(ranks=ranks, local={ranks[0]: ids}), float(sum(costs)), [], [sum(lens)]
        where = dacp.classify(lens, costs)
        if where is not None:
            where = dacp.balance_locals(lens, costs, where)
        if self.split_stragglers:
            # compute roll-back: a sequence whose local compute alone exceeds the group's mean
            # member load would be the straggler on any member; try splitting those up front
            # and keep whichever classification the member loads predict faster
            mean = sum(costs) / N
            stragglers = [i for i in range(len(lens)) if costs[i] > mean and (where is None or where[i] >= 0)]
            if stragglers:
                split = dacp.classify(lens, costs, stragglers)
                if split is not None:
                    split = dacp.balance_locals(lens, costs, split)
                    if where is None or (
                        max(dacp.member_loads(lens, costs, split)) < max(dacp.member_loads(lens, costs, where))
                    ):
                        where = split
        if where is None:
            if len(ids) == 1:
                raise AssertionError(f"skrull: sample {ids[0]} alone does not fit {N} ranks")  # PlanRequest prevents it
            return None
        dist = [i for i, m in enumerate(where) if m == -1]
        local: Dict[int, List[int]] = {}
        local_lens: Dict[int, List[int]] = {}
        for i, m in enumerate(where):
            if m >= 0:
                local.setdefault(ranks[m], []).append(ids[i])
                local_lens.setdefault(m, []).append(lens[i])
        # per-document sharding is what DACP accounted memory for; plan() may switch to zigzag
        group = Group(ranks=ranks, distributed=[ids[i] for i in dist], mode=ShardMode.RING_PER_DOC, local=local)
        local_tokens = [sum(local_lens.get(m, ())) for m in range(N)]
        loads = dacp.member_loads(lens, costs, where)
        dist_lens = [lens[i] for i in dist]
        if dist_lens:
            # every member by the cost model (pricing.PlanPricer: its share of one ring pass
            # over all the distributed sequences, plus its locals), not DACP's estimate, which
            # sums every distributed sequence's time alone and over-counts the communication
            pricer = pricer_for(req.cost)
            member = pricer.distributed_member_ms(dist_lens, ShardMode.RING_PER_DOC, ranks)
            for m, ls in local_lens.items():
                member[m] += sum(map(dacp.memo.local_ms, ls))
            est = float(member.max())
        else:
            est = max(loads)
        return group, est, dist_lens, local_tokens
