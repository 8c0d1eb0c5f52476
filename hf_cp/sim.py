"""Simulate a StepPlan with the cost model: per-rank time, idle, memory, communication.

Timing rule: a group's members start a wave's micro-batch together (when the last of them is
free), the micro-batch takes as long as its slowest member (attention synchronises the group
every layer), and each rank runs its waves in order. The step ends when the last rank ends.

That is the plan's compute alone, what balancers are compared on by default. When the cost
model carries the run's execution (`CostModel.execution`, hf_cp/execution.py) the result is
the step's wall time instead: ranks without work in a wave run the dummy micro-batch; under
ZeRO-2 every wave ends in a world-wide gradient reduction (a barrier: the next wave starts
when the slowest rank of this one has finished and the reduction is done); under DDP one
reduction ends the step; and the profile's fixed cost per step is added.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .cluster import ClusterSpec
from .cost import CostModel
from .plan import Group, StepPlan


def max_over_mean(values: Sequence[float]) -> float:
    """max / mean of per-rank times (1.0 = perfectly balanced; 1.0 for no work). Not a quality
    signal on its own: compare a plan's makespan with the lower bound too."""
    m = sum(values) / len(values) if len(values) else 0.0
    return max(values) / m if m > 0 else 1.0


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
    member_tokens: List[int] = field(default_factory=list)


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
    tokens: List[int] = field(default_factory=list)  # per rank, over all its micro-batches
    # per rank: time inside its micro-batches, what CPTrainer measures of it: a group's members
    # wait for each other at every layer, so each spends the group's duration (and, when the
    # group starts later than the member is free, the wait in its first collective)
    occupied_ms: List[float] = field(default_factory=list)
    micro_batches: List[int] = field(default_factory=list)  # per rank: micro-batches with work
    reduction_ms: float = 0.0  # wall time in gradient reductions (with an execution)
    fixed_ms: float = 0.0  # the step's fixed cost (with an execution)

    @property
    def mean_busy_ms(self) -> float:
        return sum(self.busy_ms) / len(self.busy_ms)

    @property
    def imbalance(self) -> float:
        """max / mean of per-rank busy time (1.0 = perfectly balanced)."""
        return max_over_mean(self.busy_ms)

    @property
    def idle_share(self) -> float:
        total = self.makespan_ms * self.world_size
        return sum(self.idle_ms) / total if total > 0 else 0.0


def group_costs(plan_lens: Dict[int, int], group: Group, cost: CostModel):
    """Per member: (compute_ms, comm_ms, comm_bytes, tokens) of one group's micro-batch."""
    dist = [plan_lens[s] for s in group.distributed]
    out = []
    for m, r in enumerate(group.ranks):
        local = [plan_lens[s] for s in group.local.get(r, [])]
        if not dist and not local:
            out.append((0.0, 0.0, 0, 0))
            continue
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
    tokens = [0] * W
    micro_batches = [0] * W
    occupied = [0.0] * W
    overhead = cost.micro_batch_overhead_ms()
    ex = getattr(cost, "execution", None)
    dummy = cost.dummy_micro_batch_ms() if ex is not None else 0.0
    reduction_total = 0.0
    for w, wave in enumerate(plan.waves):
        if ex is not None and ex.waves_synchronise:  # the previous wave ended in a barrier
            top = max(clock)
            for r in range(W):
                idle[r] += top - clock[r]
                clock[r] = top
        worked = [False] * W
        slowest_compute = 0.0
        for g in wave.groups:
            costs = group_costs(lens, g, cost)
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
                tokens[r] += tk
                micro_batches[r] += 1
                occupied[r] += dur + (start - clock[r] if g.size > 1 else 0.0)
                worked[r] = True
                slowest_compute = max(slowest_compute, cm)
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
                    g.mode if g.distributed else None,
                    len(g.distributed),
                    sum(len(v) for v in g.local.values()),
                    [c[3] for c in costs],
                )
            )
        if ex is not None:
            for r in range(W):
                if not worked[r]:  # a zero-weight micro-batch keeps the backward count equal
                    idle[r] += dummy
                    clock[r] += dummy
            last = w == len(plan.waves) - 1
            if ex.waves_synchronise or last:
                # the backward share of the slowest rank's compute (about 2/3) can hide an
                # overlapping reduction
                red = cost.gradient_reduction_ms(W, hidden_behind_ms=slowest_compute * 2 / 3)
                top = max(clock) + red
                reduction_total += red
                for r in range(W):
                    idle[r] += top - clock[r]
                    clock[r] = top
    fixed = cost.profile.step_overhead_ms if ex is not None else 0.0
    makespan = (max(clock) if clock else 0.0) + fixed
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
        tokens=tokens,
        micro_batches=micro_batches,
        occupied_ms=occupied,
        reduction_ms=reduction_total,
        fixed_ms=fixed,
    )


def lower_bound_ms(lengths: Sequence[int], cluster: ClusterSpec, cost: CostModel) -> float:
    """No valid plan of these samples on this cluster can take less time in `simulate`.

    max( sum over samples of their cheapest rank-ms / world, the costliest sample at its best
    group size ). A sample's cheapest rank-ms is its whole-document compute on one rank:
    sharding only adds (shorter query chunks run at lower efficiency, head splitting costs
    extra, communication and per-micro-batch overheads are never negative). On a group of g
    ranks its slowest member carries at least 1/g of that, so its best wall time is bounded by
    that share at the largest registered group size.
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
        area = cost.sample_local_ms(n)
        total_area += area
        longest = max(longest, area / gmax)
    return max(total_area / cluster.world_size, longest)
