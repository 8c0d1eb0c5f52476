"""Simulate a StepPlan with the cost model: per-rank time, idle, memory, communication.

Timing rule: a group's members start a wave's micro-batch together (when the last of them is
free), the micro-batch takes as long as its slowest member (attention synchronises the group
every layer), and each rank runs its waves in order. The step ends when the last rank ends
(the ZeRO-2 gradient reduction that follows is the same for every plan and left out).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .cluster import ClusterSpec
from .cost import CostModel
from .plan import Group, StepPlan
from .shard import ShardMode


@dataclass
class GroupRun:
    wave: int
    ranks: tuple
    start_ms: float
    duration_ms: float
    member_compute_ms: List[float]
    member_comm_ms: List[float]
    mode: Optional[str]
    n_distributed: int
    n_local: int


@dataclass
class SimResult:
    world_size: int
    compute_ms: List[float]  # per rank
    comm_ms: List[float]
    idle_ms: List[float]
    busy_ms: List[float]  # compute + comm
    peak_tokens: List[int]
    peak_memory_bytes: List[float]
    comm_bytes: int
    makespan_ms: float
    runs: List[GroupRun] = field(default_factory=list)
    cp_size_samples: Dict[int, int] = field(default_factory=dict)  # group size -> samples run distributed on it
    cp_size_tokens: Dict[int, int] = field(default_factory=dict)

    @property
    def mean_busy_ms(self) -> float:
        return sum(self.busy_ms) / len(self.busy_ms)

    @property
    def imbalance(self) -> float:
        """max / mean of per-rank busy time (1.0 = perfectly balanced)."""
        m = self.mean_busy_ms
        return max(self.busy_ms) / m if m > 0 else 1.0

    @property
    def idle_share(self) -> float:
        total = self.makespan_ms * self.world_size
        return sum(self.idle_ms) / total if total > 0 else 0.0


def group_costs(plan_lens: Dict[int, int], group: Group, cost: CostModel, masks: Optional[Dict] = None):
    """Per member: (compute_ms, comm_ms, comm_bytes, tokens) of one group's micro-batch;
    `masks` (sample id -> SampleMask) prices masked samples by their masked area."""
    masks = masks or {}
    dist = [plan_lens[s] for s in group.distributed]
    dist_masks = [masks.get(s) for s in group.distributed] if masks else None
    if group.distributed and group.mode == ShardMode.BLOCKS:
        from .block_cost import block_group_costs

        local = {m: [plan_lens[s] for s in group.local.get(r, [])] for m, r in enumerate(group.ranks)}
        local_masks = {m: [masks.get(s) for s in group.local.get(r, [])] for m, r in enumerate(group.ranks)}
        costs = block_group_costs(group.blocks, dist, group.ranks, cost, dist_masks, local, local_masks)
        return [(rc.compute_ms, rc.comm_ms, rc.comm_bytes, rc.tokens) for rc in costs]
    out = []
    for m, r in enumerate(group.ranks):
        local = [plan_lens[s] for s in group.local.get(r, [])]
        if not dist and not local:
            out.append((0.0, 0.0, 0, 0))
            continue
        local_masks = [masks.get(s) for s in group.local.get(r, [])] if masks else None
        if any(x is not None for x in (dist_masks or []) + (local_masks or [])):
            rc = cost.distributed_rank_cost(
                dist, group.mode, group.ranks, m, local, masks=dist_masks, local_masks=local_masks
            )
        else:  # the causal call (cost models that balancers wrap keep this signature)
            rc = cost.distributed_rank_cost(dist, group.mode, group.ranks, m, local)
        out.append((rc.compute_ms, rc.comm_ms, rc.comm_bytes, rc.tokens))
    return out


def simulate(plan: StepPlan, cost: CostModel) -> SimResult:
    W = plan.world_size
    lens = plan.length_of()
    clock = [0.0] * W
    compute = [0.0] * W
    comm = [0.0] * W
    idle = [0.0] * W
    peak_tokens = [0] * W
    comm_bytes = 0
    runs: List[GroupRun] = []
    cp_samples: Counter = Counter()
    cp_tokens: Counter = Counter()
    overhead = cost.micro_batch_overhead_ms()
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            costs = group_costs(lens, g, cost, plan.masks)
            if all(c[3] == 0 for c in costs):
                continue  # an empty group issues nothing
            start = max(clock[r] for r in g.ranks)
            # members with no tokens still join the group's collectives when it has distributed work
            active = [bool(c[3]) or bool(g.distributed) for c in costs]
            dur = max(c[0] + c[1] for c in costs) + overhead
            for (cm, cc, cb, tk), r, act in zip(costs, g.ranks, active):
                if not act:
                    continue
                idle[r] += start - clock[r] + (dur - overhead - cm - cc)
                compute[r] += cm + overhead
                comm[r] += cc
                comm_bytes += cb
                peak_tokens[r] = max(peak_tokens[r], tk)
                clock[r] = start + dur
            if g.distributed:
                cp_samples[g.size] += len(g.distributed)
                cp_tokens[g.size] += sum(lens[s] for s in g.distributed)
            for ids in g.local.values():
                cp_samples[1] += len(ids)
                cp_tokens[1] += sum(lens[s] for s in ids)
            runs.append(
                GroupRun(
                    w,
                    g.ranks,
                    start,
                    dur,
                    [c[0] for c in costs],
                    [c[1] for c in costs],
                    g.mode.value if g.distributed else None,
                    len(g.distributed),
                    sum(len(v) for v in g.local.values()),
                )
            )
    makespan = max(clock) if clock else 0.0
    for r in range(W):
        idle[r] += makespan - clock[r]
    return SimResult(
        world_size=W,
        compute_ms=compute,
        comm_ms=comm,
        idle_ms=idle,
        busy_ms=[a + b for a, b in zip(compute, comm)],
        peak_tokens=peak_tokens,
        peak_memory_bytes=[cost.memory_bytes(t) for t in peak_tokens],
        comm_bytes=comm_bytes,
        makespan_ms=makespan,
        runs=runs,
        cp_size_samples=dict(sorted(cp_samples.items())),
        cp_size_tokens=dict(sorted(cp_tokens.items())),
    )


def lower_bound_ms(lengths: Sequence[int], cluster: ClusterSpec, cost: CostModel, masks=None) -> float:
    """No valid plan of these samples on this cluster can take less time in `simulate`.

    max( sum over samples of their cheapest rank-ms / world, the costliest sample at its best
    group size ). A sample's cheapest rank-ms is its whole-document compute on one rank:
    sharding only adds (shorter query chunks run at lower efficiency, head splitting costs
    extra, communication and per-micro-batch overheads are never negative). On a group of g
    ranks its slowest member carries at least 1/g of that, so its best wall time is bounded by
    that share at the largest registered group size. `masks` (aligned with the lengths, None
    entries causal) price masked samples by their masked area, as the simulator does.
    """
    total_area = 0.0
    longest = 0.0
    gmax = cluster.group_sizes[-1]
    for i, n in enumerate(lengths):
        if n > cluster.largest_capacity:
            raise ValueError(
                f"sample {i} has {n} tokens, more than the largest group holds "
                f"({gmax} ranks x {cluster.max_tokens_per_rank} tokens per rank)"
            )
        area = cost.local_ms([n], [masks[i]] if masks else None)
        total_area += area
        longest = max(longest, area / gmax)
    return max(total_area / cluster.world_size, longest)
