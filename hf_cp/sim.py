"""Simulate a StepPlan with the cost model: per-rank time, idle, memory, communication.

Timing rule: a group's members start a wave's micro-batch together (when the last of them is
free), the micro-batch takes as long as its slowest member (attention synchronises the group
every layer), and each rank runs its waves in order. The step ends when the last rank ends
(the ZeRO-2 gradient reduction that follows is the same for every plan and left out).

A one-rank group of chunked samples (ChunkFlow) runs them one after another, each priced by
chunking.chunked_sample_cost (its chunks' own micro-batch overheads and recomputes included);
its memory adds the samples' K/V state store to their activations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .chunking import chunked_sample_cost, dependent_chunk_sizes
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


def chunked_group_cost(plan_lens: Dict[int, int], group: Group, cost: CostModel):
    """(compute_ms, activation tokens, peak bytes) of a one-rank group of chunked samples: their
    times add up; memory is the largest sample's (one runs at a time, its store freed after)."""
    ms, tokens, peak = 0.0, 0, 0.0
    for cs in group.chunked.values():
        for c in cs:
            cc = chunked_sample_cost(cost, dependent_chunk_sizes(plan_lens[c.sample], c.chunk_size), c.keep)
            ms += cc.compute_ms
            tokens = max(tokens, cc.activation_tokens)
            peak = max(peak, cost.memory_bytes(cc.activation_tokens) + cc.state_bytes)
    return ms, tokens, peak


def simulate(plan: StepPlan, cost: CostModel) -> SimResult:
    W = plan.world_size
    lens = plan.length_of()
    clock = [0.0] * W
    compute = [0.0] * W
    comm = [0.0] * W
    idle = [0.0] * W
    peak_tokens = [0] * W
    peak_bytes = [cost.memory_bytes(0)] * W
    comm_bytes = 0
    runs: List[GroupRun] = []
    cp_samples: Counter = Counter()
    cp_tokens: Counter = Counter()
    overhead = cost.micro_batch_overhead_ms()
    for w, wave in enumerate(plan.waves):
        for g in wave.groups:
            if any(g.chunked.values()):  # plan.validate: one rank running only chunked samples
                ms, tk, mem = chunked_group_cost(lens, g, cost)
                r = g.ranks[0]
                runs.append(GroupRun(w, g.ranks, clock[r], ms, [ms], [0.0], None, 0, 0))
                compute[r] += ms
                clock[r] += ms
                peak_tokens[r] = max(peak_tokens[r], tk)
                peak_bytes[r] = max(peak_bytes[r], mem)
                cp_samples[1] += sum(len(cs) for cs in g.chunked.values())
                cp_tokens[1] += sum(lens[c.sample] for cs in g.chunked.values() for c in cs)
                continue
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
                peak_bytes[r] = max(peak_bytes[r], cost.memory_bytes(tk))
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
        peak_memory_bytes=peak_bytes,
        comm_bytes=comm_bytes,
        makespan_ms=makespan,
        runs=runs,
        cp_size_samples=dict(sorted(cp_samples.items())),
        cp_size_tokens=dict(sorted(cp_tokens.items())),
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
