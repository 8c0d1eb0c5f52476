"""`hierarchical`: a step planned host by host, so that a host's planning CPU does not grow
with the world (issue 39).

At 4096 ranks one host planning the whole step with `auto` took up to 30% of the step (1.8M
samples at 0.7 us each): no faster loop fixes that, the work has to be split. Here:

1. the first pass (toolkit/host_split.py) splits the step's samples over the hosts, priced
   by the cost model, samples that need more than a host placed first on aligned blocks of
   whole hosts;
2. each such block plans its samples with the member balancer on a cluster of its ranks;
3. each host plans its own samples with the member (default `auto`, with its early stop on
   however few samples a host holds) on a cluster of its `host_ranks` ranks: the request a
   flat plan of a world of one host would get, so every member works unchanged;
4. the plans are shifted to their ranks and merged: a block's waves after the waves of the
   blocks before it that share a host, a host's waves after the last block wave on it. The
   merge is a valid StepPlan of the whole world (the caller validates and simulates it as
   any other plan).

Everything is a pure function of the request (lengths, cluster, cost model, seed): every rank
that plans a host computes the same sub-plan. `plan_hierarchically` times each part (the
first pass, each block, each host) so that `hf-cp plan --hierarchical` and the benchmark
report what each host would spend: the first pass plus the blocks it belongs to plus its own
plan. In training (`cp_balancer: hierarchical`) the planner worker still computes every
host's sub-plan: the StepPlan the executor and the step agreement read is the whole world's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.balance.base import PlanRequest, warm_up_balancer
from hf_cp.balance.options import BalancerOptionError, BalancerOptions, option
from hf_cp.balance.registry import available_balancers, get_balancer, register_balancer
from hf_cp.balance.toolkit.host_split import HostSplit, split_over_hosts
from hf_cp.balance.toolkit.sample_limit import sample_token_limit, trains_length
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import StepPlan, Wave


@dataclass(frozen=True)
class HierarchicalOptions(BalancerOptions):
    BALANCER: ClassVar[str] = "hierarchical"

    member: str = option("auto", "the balancer each host (and each block of hosts) plans its samples with")
    member_options: Dict[str, Any] = option(
        {},
        "options of the member balancer, e.g. {stop_within: 0.003}; an `auto` member's exhaustive_below defaults "
        "to 0 here (a host's step is small by construction: planned by every member it cost 20-30x the CPU for "
        "0.2% on the traces)",
    )
    host_ranks: Optional[int] = option(
        None, "ranks each host plans (a power of two dividing the world; default: the cluster's gpus per node)"
    )
    min_samples_per_rank: float = option(
        4.0,
        "plan a step with fewer samples than this x the world flat (the member on the whole world): hosts of a "
        "few samples each pack less evenly than the world does (1.1% behind flat at 3 per rank), and such a "
        "step is cheap to plan flat",
    )

    def check(self) -> None:
        if self.member == "hierarchical":
            raise BalancerOptionError("hierarchical: cannot be its own member")
        if self.member not in available_balancers():
            raise BalancerOptionError(
                f"hierarchical: member {self.member!r} is not a balancer; available: {', '.join(available_balancers())}"
            )
        h = self.host_ranks
        if h is not None and (h <= 0 or h & (h - 1)):
            raise BalancerOptionError(f"hierarchical: host_ranks {h} must be a positive power of two")
        if not self.min_samples_per_rank >= 0:
            raise BalancerOptionError(f"hierarchical: min_samples_per_rank {self.min_samples_per_rank} must be >= 0")


@dataclass
class HierarchyReport:
    """What planning one step hierarchically cost, part by part (CPU ms of `clock`)."""

    hosts: int
    host_ranks: int
    first_pass_ms: float
    block_ms: List[Tuple[int, int, float]] = field(default_factory=list)  # (first host, hosts, ms)
    host_ms: List[float] = field(default_factory=list)
    merge_ms: float = 0.0
    host_imbalance: float = 1.0  # the first pass's estimate: busiest host / mean
    spread_samples: int = 0

    def host_total_ms(self) -> np.ndarray:
        """Per host, what it plans itself: the blocks it belongs to, then its own ranks."""
        out = np.asarray(self.host_ms, dtype=np.float64).copy()
        for first, k, ms in self.block_ms:
            out[first : first + k] += ms
        return out

    def slowest_host(self) -> Tuple[int, float]:
        """(host, CPU ms) of the host whose own share of the planning is the longest."""
        t = self.host_total_ms()
        h = int(np.argmax(t))
        return h, float(t[h])

    def layout(self) -> str:
        """What was planned where (no timings: the plan's notes must be the same on every rank)."""
        return (
            f"hierarchical: {self.hosts} hosts of {self.host_ranks} ranks, {self.spread_samples} samples on "
            f"{len(self.block_ms)} blocks of hosts, estimated host imbalance {self.host_imbalance:.4f}"
        )

    def cpu(self) -> str:
        """The CPU each part took, in words."""
        h, ms = self.slowest_host()
        return (
            f"first pass {self.first_pass_ms:.1f} ms CPU, slowest host {h} {ms:.1f} ms CPU (median "
            f"{float(np.median(self.host_total_ms())):.1f} ms), merge {self.merge_ms:.1f} ms"
        )


def host_cluster(cluster: ClusterSpec, ranks: int) -> ClusterSpec:
    """The cluster one host (or block of hosts) of `ranks` ranks plans on: the same cap, node
    size and group options, its largest group the host's."""
    top = cluster.max_group_size
    return ClusterSpec(
        ranks,
        cluster.max_tokens_per_rank,
        min(cluster.gpus_per_node, ranks),
        None if top is None or top >= ranks else top,
        any_size_groups=cluster.any_size_groups,
    )


def sub_request(req: PlanRequest, positions: np.ndarray, cluster: ClusterSpec) -> PlanRequest:
    """The request of the samples at `positions` on `cluster` (same cost model, seed, step and
    limits; the dataset's longest sample capped at what the cluster holds, since longer ones
    are placed elsewhere unless they run as chunks)."""
    # (the host's own ids from the tuple: no array of the whole step's ids is needed anywhere)
    ids = [req.sample_ids[i] for i in positions.tolist()]
    lens = req.length_array[positions].tolist()
    masks = {s: req.masks[s] for s in ids if s in req.masks} if req.masks else None
    vision = {s: req.vision[s] for s in ids if s in req.vision} if req.vision else None
    dml = req.dataset_max_length
    if dml is not None and dml > cluster.largest_capacity and (req.max_sample_tokens or 0) <= cluster.largest_capacity:
        dml = max(cluster.largest_capacity, max(lens))
    return replace(req, sample_ids=tuple(ids), lengths=tuple(lens), cluster=cluster, masks=masks,
                   vision=vision, dataset_max_length=dml)  # fmt: skip


def merge_plans(
    req: PlanRequest, parts: Sequence[Tuple[int, int, StepPlan]], host_ranks: int, balancer: str
) -> StepPlan:
    """One StepPlan of the whole world from sub-plans, each (first host, hosts, plan) on the
    ranks of those hosts: a part's waves start after the last wave of an earlier part on any
    of its hosts (module docstring)."""
    merged = req.empty_plan(balancer)
    waves: List[Wave] = merged.waves
    notes: List[str] = []
    next_wave: Dict[int, int] = {}  # host -> first wave free on it
    for first, k, plan in parts:
        start = max((next_wave.get(h, 0) for h in range(first, first + k)), default=0)
        for w, wave in enumerate(plan.waves):
            while len(waves) <= start + w:
                waves.append(Wave([]))
            waves[start + w].groups.extend(g.shifted(first * host_ranks) for g in wave.groups)
        for h in range(first, first + k):
            next_wave[h] = start + len(plan.waves)
        notes += [f"hosts {first}-{first + k - 1}: {n}" if k > 1 else f"host {first}: {n}" for n in plan.notes]
    merged.notes = notes
    return merged


def plan_hierarchically(
    req: PlanRequest,
    member: Callable[[PlanRequest], StepPlan],
    host_ranks: int,
    name: str = "hierarchical",
    clock: Callable[[], float] = time.process_time,
) -> Tuple[StepPlan, HierarchyReport, List[str]]:
    """The merged plan of `req` planned host by host with `member` (module docstring), the
    report of what each part cost (`clock`: seconds of CPU), and each part's winning balancer
    (its plan's `balancer` field)."""
    t0 = clock()
    _ = req.length_array  # every host reads the whole step's lengths: counted in the first pass
    split: HostSplit = split_over_hosts(req, host_ranks)
    report = HierarchyReport(split.hosts, host_ranks, 0.0, host_imbalance=split.imbalance())
    report.first_pass_ms = (clock() - t0) * 1e3
    report.spread_samples = sum(len(b.positions) for b in split.spread)
    parts = []
    winners = []
    for block in split.spread:
        t0 = clock()
        cluster = host_cluster(req.cluster, block.hosts * host_ranks)
        plan = member(sub_request(req, np.asarray(block.positions, dtype=np.int64), cluster))
        report.block_ms.append((block.first_host, block.hosts, (clock() - t0) * 1e3))
        parts.append((block.first_host, block.hosts, plan))
        winners.append(plan.balancer)
    one_host = host_cluster(req.cluster, host_ranks)
    for h, positions in enumerate(split.host_positions):
        t0 = clock()
        if len(positions):
            plan = member(sub_request(req, positions, one_host))
            parts.append((h, 1, plan))
            winners.append(plan.balancer)
        report.host_ms.append((clock() - t0) * 1e3)
    t0 = clock()
    merged = merge_plans(req, parts, host_ranks, name)
    report.merge_ms = (clock() - t0) * 1e3
    return merged, report, winners


@register_balancer("hierarchical")
class HierarchicalBalancer:
    """Plans each host's samples with its member balancer (module docstring); a world of one
    host, or a step of few samples per rank (min_samples_per_rank), is planned flat by the member."""

    name = "hierarchical"
    options_class = HierarchicalOptions
    handles_masks = True  # each host's request goes to the member, which refuses what it cannot plan

    def __init__(self, **options):
        self.options = o = HierarchicalOptions.from_dict(options)
        kwargs = dict(o.member_options)
        if o.member == "auto":
            kwargs.setdefault("exhaustive_below", 0)
        try:
            self.member = get_balancer(o.member, **kwargs)
        except BalancerOptionError as e:
            raise BalancerOptionError(f"hierarchical: member_options: {e}") from None
        self.handles_masks = getattr(self.member, "handles_masks", False)
        self.needs_any_size_groups = getattr(self.member, "needs_any_size_groups", False)
        self.timing_dependent = getattr(self.member, "timing_dependent", False)
        self.last_report: Optional[HierarchyReport] = None

    def warm_up(self) -> None:
        warm_up_balancer(self.member)

    def host_ranks_for(self, cluster: ClusterSpec) -> int:
        """The ranks of one host: the option, else the cluster's gpus per node (rounded down to
        a power of two), never more than the world."""
        h = self.options.host_ranks or 1 << (max(1, cluster.gpus_per_node).bit_length() - 1)
        if cluster.world_size % h and h < cluster.world_size:
            raise BalancerOptionError(
                f"hierarchical: host_ranks {h} does not divide the world of {cluster.world_size} ranks"
            )
        return min(h, cluster.world_size)

    def plan(self, req: PlanRequest) -> StepPlan:
        h = self.host_ranks_for(req.cluster)
        if (
            h >= req.cluster.world_size
            or len(req.sample_ids) < self.options.min_samples_per_rank * req.cluster.world_size
        ):
            self.last_report = None
            plan = self.member.plan(req)
            plan.balancer = f"{self.name}:{plan.balancer}"
            return plan
        plan, self.last_report, winners = plan_hierarchically(req, self.member.plan, h, self.name)
        counts: Dict[str, int] = {}
        for w in winners:
            counts[w] = counts.get(w, 0) + 1
        plan.balancer = f"{self.name}:" + ",".join(sorted(counts, key=lambda w: (-counts[w], w)))
        plan.notes.append(self.last_report.layout())
        return plan

    def max_sample_tokens(self, cluster, cost, masked: bool = False) -> int:
        """What the member trains on the whole cluster (a sample over a host spreads over a
        block of hosts; one over every group runs on one rank, as the member would run it)."""
        return sample_token_limit(self.member, cluster, cost, masked)

    def trains_length(self, n: int, cluster, cost) -> bool:
        return trains_length(self.member, n, cluster, cost)
