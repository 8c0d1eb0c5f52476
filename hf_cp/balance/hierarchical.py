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

Everything is a pure function of the request (lengths, cluster, cost model, seed), and so is
the split of the work by host: `plan_host_parts(req, member, host_ranks, h)` is what host h
computes (the first pass, which every host computes alike; the blocks of hosts it owns,
block_owners: one host per block, the least loaded of its hosts; its own samples), and
`merge_host_parts` of every host's parts is `plan_hierarchically`'s plan byte for byte (which
computes the first pass once and every host's parts, then merges them the same way). Each part
times itself (`clock`), so that `hf-cp plan --hierarchical` and the benchmark report what each
host spends: the first pass plus the blocks it owns plus its own plan.

In training over several hosts (`cp_balancer: hierarchical`, plan_own_host true, the default)
the first rank of each host plans only its host's parts in its planner worker, ahead of
training; the other ranks of the host plan nothing (they receive them). Every rank exchanges
every host's parts (one all_gather_object over the control group, train/runtime/host_parts.py)
in the training process, when the step before is taken (or the step itself, the first one or
without lookahead), and merges them (Planner.merge, on the worker while the step before
trains); the merged plan is fitted, validated and simulated as any plan, and the step's plan
agreement follows. plan_own_host false, a world of one host, or a step planned flat (few
samples per rank): every rank plans every step whole, as before.
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
    plan_own_host: bool = option(
        True,
        "in training over several hosts, each rank's planner plans only its host's parts (the first pass, the "
        "blocks of hosts it owns, its own samples) and the ranks exchange them; false: every rank plans every "
        "host (the same plan, at the world's planning CPU on every rank)",
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
    block_owner: List[int] = field(default_factory=list)  # per block: the host that plans it (block_owners)

    def host_total_ms(self) -> np.ndarray:
        """Per host, what it plans itself: the blocks it owns, then its own ranks (the first
        pass, which every host makes, apart)."""
        out = np.asarray(self.host_ms, dtype=np.float64).copy()
        for (_, _, ms), owner in zip(self.block_ms, self.block_owner or [b[0] for b in self.block_ms]):
            out[owner] += ms
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


@dataclass
class PlanPart:
    """One sub-plan of a hierarchical step: the waves of `hosts` hosts from `first_host` on, on
    their own ranks (rank 0 is the first host's first rank), as the member planned them. Only
    what the merge reads: the request's samples, masks and grids are every rank's already."""

    first_host: int
    hosts: int
    block: bool  # a block of hosts (spread samples), else one host's own samples
    waves: List[Wave]
    notes: List[str]
    balancer: str  # the member's plan's `balancer` (its winning member under `auto`)
    ms: float  # CPU ms of `clock` it took


@dataclass
class HostParts:
    """What one host plans of a hierarchical step (plan_host_parts): the first pass's layout
    (the same on every host), the blocks of hosts it owns (block_owners) and its own samples.
    `error`: why it could not plan them (every rank then raises it, naming the host)."""

    step: int
    host: int
    hosts: int
    host_ranks: int
    blocks: Tuple[Tuple[int, int, int], ...]  # every block of the step: (first host, hosts, owner host)
    spread_samples: int
    host_imbalance: float
    first_pass_ms: float
    host_ms: float = 0.0  # CPU ms of its own plan (0 without samples)
    parts: List[PlanPart] = field(default_factory=list)
    error: Optional[str] = None

    def layout(self) -> tuple:
        """What every host must agree on (the first pass's outcome)."""
        return (self.step, self.hosts, self.host_ranks, self.blocks, self.spread_samples, self.host_imbalance)


def block_owners(split: HostSplit) -> List[int]:
    """The host that plans each block of `split.spread` (in its order): of the block's hosts,
    the one with the fewest samples to plan so far (its own, then the blocks given to it), the
    lowest on ties. Any host of a block has the request and the first pass; only one needs to
    plan it, since every rank receives it. The first host of every block would be host 0 for
    each block that starts there (a 1M-token outlier on 4 hosts and a 300K one on 2 both
    start at host 0 when the first pass puts them there); the least loaded one is usually a
    host the block itself keeps busy, which the first pass gave few samples of its own."""
    load = [len(p) for p in split.host_positions]
    owners = []
    for b in split.spread:
        owner = min(range(b.first_host, b.first_host + b.hosts), key=lambda h: (load[h], h))
        load[owner] += len(b.positions)
        owners.append(owner)
    return owners


def _parts_of_host(
    req: PlanRequest,
    split: HostSplit,
    owners: Sequence[int],
    member: Callable[[PlanRequest], StepPlan],
    host: int,
    first_pass_ms: float,
    clock: Callable[[], float],
) -> HostParts:
    """`host`'s parts of the step `split` splits: the blocks it owns, then its own samples."""
    h_ranks = split.host_ranks
    out = HostParts(
        req.step,
        host,
        split.hosts,
        h_ranks,
        tuple((b.first_host, b.hosts, o) for b, o in zip(split.spread, owners)),
        sum(len(b.positions) for b in split.spread),
        split.imbalance(),
        first_pass_ms,
    )
    for block, owner in zip(split.spread, owners):
        if owner != host:
            continue
        t0 = clock()
        cluster = host_cluster(req.cluster, block.hosts * h_ranks)
        plan = member(sub_request(req, np.asarray(block.positions, dtype=np.int64), cluster))
        ms = (clock() - t0) * 1e3
        out.parts.append(PlanPart(block.first_host, block.hosts, True, plan.waves, plan.notes, plan.balancer, ms))
    positions = split.host_positions[host]
    t0 = clock()
    if len(positions):
        plan = member(sub_request(req, positions, host_cluster(req.cluster, h_ranks)))
        out.host_ms = (clock() - t0) * 1e3
        out.parts.append(PlanPart(host, 1, False, plan.waves, plan.notes, plan.balancer, out.host_ms))
    else:
        out.host_ms = (clock() - t0) * 1e3
    return out


def plan_host_parts(
    req: PlanRequest,
    member: Callable[[PlanRequest], StepPlan],
    host_ranks: int,
    host: int,
    clock: Callable[[], float] = time.process_time,
) -> HostParts:
    """What host `host` plans of `req` (module docstring): the first pass (every host computes
    it, with the same result), the blocks of hosts it owns (block_owners) and its own samples.
    merge_host_parts of every host's parts is plan_hierarchically's plan, byte for byte."""
    t0 = clock()
    _ = req.length_array  # every host reads the whole step's lengths: counted in the first pass
    split = split_over_hosts(req, host_ranks)
    if not 0 <= host < split.hosts:
        raise ValueError(f"step {req.step}: host {host} is not one of the {split.hosts} hosts")
    first_pass_ms = (clock() - t0) * 1e3
    return _parts_of_host(req, split, block_owners(split), member, host, first_pass_ms, clock)


def merge_plans(req: PlanRequest, parts: Sequence[Tuple[int, int, Any]], host_ranks: int, balancer: str) -> StepPlan:
    """One StepPlan of the whole world from sub-plans, each (first host, hosts, plan: a
    StepPlan or a PlanPart, read for its waves and notes) on the ranks of those hosts: a part's
    waves start after the last wave of an earlier part on any of its hosts (module docstring)."""
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


class HostPartsError(ValueError):
    """The hosts' parts of a step do not make one plan (a host failed, or hosts disagree)."""


def merge_host_parts(
    req: PlanRequest,
    every_host: Sequence[HostParts],
    name: str = "hierarchical",
    clock: Callable[[], float] = time.process_time,
) -> Tuple[StepPlan, HierarchyReport, List[str]]:
    """The whole world's plan from every host's parts (one HostParts per host, any order), its
    report and each part's winning balancer, as plan_hierarchically returns them. Raises
    HostPartsError naming the step and the host when a host failed, a host is missing, or the
    hosts disagree about the first pass."""
    t0 = clock()
    step = req.step
    by_host: Dict[int, HostParts] = {}
    for hp in every_host:
        if hp.error is not None:
            raise HostPartsError(f"step {step}: host {hp.host} could not plan its parts: {hp.error}")
        if hp.host in by_host:
            raise HostPartsError(f"step {step}: host {hp.host}'s parts came twice")
        by_host[hp.host] = hp
    if not by_host:
        raise HostPartsError(f"step {step}: no host's parts to merge")
    first = by_host[min(by_host)]
    missing = sorted(set(range(first.hosts)) - set(by_host))
    if missing or len(by_host) != first.hosts:
        raise HostPartsError(
            f"step {step}: the parts of hosts {missing or sorted(by_host)} of {first.hosts} are missing"
        )
    for hp in by_host.values():
        if hp.layout() != first.layout():
            raise HostPartsError(
                f"step {step}: host {hp.host} split the step otherwise than host {first.host} (step, hosts, host "
                f"ranks, blocks, spread samples, imbalance {hp.layout()} != {first.layout()}): every rank must plan "
                "from the same lengths, cluster, cost model and seed"
            )
    hosts = [by_host[h] for h in range(first.hosts)]
    blocks = {(p.first_host, p.hosts): p for hp in hosts for p in hp.parts if p.block}
    owned = {(f, k): o for f, k, o in first.blocks}
    if set(blocks) != set(owned):
        lost = sorted(set(owned) - set(blocks))
        raise HostPartsError(
            f"step {step}: blocks of hosts {lost} came from no host (owners {[owned[b] for b in lost]})"
            if lost
            else f"step {step}: blocks {sorted(set(blocks) - set(owned))} are not the first pass's"
        )
    own = [p for hp in hosts for p in hp.parts if not p.block]
    if any(p.first_host != hp.host for hp in hosts for p in hp.parts if not p.block):
        raise HostPartsError(f"step {step}: a host sent another host's own plan")
    parts = [blocks[f, k] for f, k, _ in first.blocks] + own  # (the first pass's blocks are sorted)
    report = HierarchyReport(
        first.hosts,
        first.host_ranks,
        max(hp.first_pass_ms for hp in hosts),
        block_ms=[(f, k, blocks[f, k].ms) for f, k, _ in first.blocks],
        host_ms=[hp.host_ms for hp in hosts],
        host_imbalance=first.host_imbalance,
        spread_samples=first.spread_samples,
        block_owner=[o for _, _, o in first.blocks],
    )
    merged = merge_plans(req, [(p.first_host, p.hosts, p) for p in parts], first.host_ranks, name)
    report.merge_ms = (clock() - t0) * 1e3
    return merged, report, [p.balancer for p in parts]


def plan_hierarchically(
    req: PlanRequest,
    member: Callable[[PlanRequest], StepPlan],
    host_ranks: int,
    name: str = "hierarchical",
    clock: Callable[[], float] = time.process_time,
) -> Tuple[StepPlan, HierarchyReport, List[str]]:
    """The merged plan of `req` planned host by host with `member` (module docstring), the
    report of what each part cost (`clock`: seconds of CPU), and each part's winning balancer
    (its plan's `balancer` field): every host's parts (plan_host_parts, the first pass made
    once) merged by merge_host_parts, as the trainer merges the parts its hosts exchange."""
    t0 = clock()
    _ = req.length_array  # every host reads the whole step's lengths: counted in the first pass
    split: HostSplit = split_over_hosts(req, host_ranks)
    first_pass_ms = (clock() - t0) * 1e3
    owners = block_owners(split)
    every_host = [_parts_of_host(req, split, owners, member, h, first_pass_ms, clock) for h in range(split.hosts)]
    return merge_host_parts(req, every_host, name, clock)


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

    def hosts_of(self, req: PlanRequest) -> Optional[int]:
        """The ranks of one host when `req` is planned host by host, else None (a world of one
        host, or a step of few samples per rank: planned flat by the member)."""
        h = self.host_ranks_for(req.cluster)
        if (
            h >= req.cluster.world_size
            or len(req.sample_ids) < self.options.min_samples_per_rank * req.cluster.world_size
        ):
            return None
        return h

    def plan(self, req: PlanRequest) -> StepPlan:
        h = self.hosts_of(req)
        if h is None:
            self.last_report = None
            plan = self.member.plan(req)
            plan.balancer = f"{self.name}:{plan.balancer}"
            return plan
        return self._named(*plan_hierarchically(req, self.member.plan, h, self.name))

    def plan_host_parts(self, req: PlanRequest, host: int) -> Optional[HostParts]:
        """Host `host`'s parts of `req` (plan_host_parts), or None when `req` is planned flat
        (hosts_of): then every rank plans it whole with `plan`."""
        h = self.hosts_of(req)
        return None if h is None else plan_host_parts(req, self.member.plan, h, host)

    def merge_host_parts(self, req: PlanRequest, every_host: Sequence[HostParts]) -> StepPlan:
        """The plan `plan` makes of `req`, byte for byte, from every host's plan_host_parts."""
        return self._named(*merge_host_parts(req, every_host, self.name))

    def _named(self, plan: StepPlan, report: HierarchyReport, winners: List[str]) -> StepPlan:
        self.last_report = report
        counts: Dict[str, int] = {}
        for w in winners:
            counts[w] = counts.get(w, 0) + 1
        plan.balancer = f"{self.name}:" + ",".join(sorted(counts, key=lambda w: (-counts[w], w)))
        plan.notes.append(report.layout())
        return plan

    def max_sample_tokens(self, cluster, cost, masked: bool = False) -> int:
        """What the member trains on the whole cluster (a sample over a host spreads over a
        block of hosts; one over every group runs on one rank, as the member would run it)."""
        return sample_token_limit(self.member, cluster, cost, masked)

    def trains_length(self, n: int, cluster, cost) -> bool:
        return trains_length(self.member, n, cluster, cost)
