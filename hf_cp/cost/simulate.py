"""Simulate a StepPlan with the cost model: per-rank time, idle, memory, communication.

Timing rule: a group's members start a wave's micro-batch together (when the last of them is
free), the micro-batch takes as long as its slowest member (attention synchronises the group
every layer), and each rank runs its waves in order. The step ends when the last rank ends.

That is the plan's compute alone, what balancers are compared on by default. When the cost
model carries the run's execution (`CostModel.execution`, hf_cp/execution.py) the result is
the step's wall time instead: ranks without work in a wave run the dummy micro-batch; under
ZeRO-2 every wave ends in a world-wide gradient reduction (a barrier: the next wave starts
when the slowest rank of this one has finished and the reduction is done); under DDP one
reduction ends the step; and the profile's fixed cost per step is added. Under FSDP2 and ZeRO-3
(executions that shard the parameters) every wave runs as cost/sharded.py prices it
(ShardedPasses).

A one-rank group of chunked samples (ChunkFlow) runs them one after another, each priced by
chunks.chunked_sample_cost (its chunks' own micro-batch overheads and recomputes included);
its memory adds the samples' K/V state store to their activations. A blocks group's member
holds its rows plus the K/V and Q rows it receives, and a member that encodes images or clips
their activations (StepPlan.held_tokens, what validate bounds: the peak memory reported).
With a cluster, the result carries the plan's lower bounds (cost/bounds.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence

import numpy as np

from hf_cp.cost.blocks import block_group_costs, block_group_messages
from hf_cp.cost.bounds import charged_lower_bound_ms, lower_bound_ms, samples_local_ms
from hf_cp.cost.model import CostModel, RankCost
from hf_cp.cost.sharded import ShardedPasses
from hf_cp.cost.vision import VisionGrids, group_vision, step_vision
from hf_cp.modes.registry import mode_spec
from hf_cp.plan.chunks import chunked_sample_cost, chunked_vision_bytes, chunked_vision_ms, dependent_chunk_sizes
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan
from hf_cp.plan.vision_encoders import grid_patches


def max_over_mean(values: Sequence[float]) -> float:
    """max / mean of per-rank times (1.0 = perfectly balanced; 1.0 for no work). Not a quality
    signal on its own: compare a plan's makespan with the lower bound too (SimResult.flags)."""
    m = sum(values) / len(values) if len(values) else 0.0
    return max(values) / m if m > 0 else 1.0


# A plan is flagged when its predicted time is at least this many times the charged bound:
# balanced or not, it leaves most of the hardware's time on the table.
FAR_ABOVE_BOUND = 1.5


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
    chunked: bool = False  # a one-rank group of chunked samples (priced as a whole, not by c1/c2/c0)
    messages: int = 0  # its exchange's messages per member, all layers (HardwareProfile.cp_message_ms each)


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
    micro_batches: List[int] = field(default_factory=list)  # per rank: micro-batches with work
    # per rank: time inside its micro-batches, what CPTrainer measures of it: a group's members
    # wait for each other at every layer, so each spends the group's duration (and, when the
    # group starts later than the member is free, the wait in its first collective)
    occupied_ms: List[float] = field(default_factory=list)
    # wall time in gradient reductions (with an execution); under FSDP2/ZeRO-3 only their fixed
    # cost (reduction_overhead_ms): their bytes travel within the backward passes (parameter_comm_ms)
    reduction_ms: float = 0.0
    reductions: int = 0  # how many (with an execution): one per backward pass of a wave under ZeRO-2
    # wall time the parameter communication of FSDP2/ZeRO-3 adds beyond the passes' compute
    parameter_comm_ms: float = 0.0
    fixed_ms: float = 0.0  # the step's fixed cost (with an execution)
    lower_bound_ms: Optional[float] = None  # lower_bound_ms of the plan's samples (simulate with a cluster)
    charged_bound_ms: Optional[float] = None  # charged_lower_bound_ms of the same

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

    def forward_only_ms(self, passes: int, forward_share: float) -> float:
        """Wall time of `passes` more forward-only passes over the same plan (a sequence
        objective's log-prob and reference passes): the busiest rank's micro-batch time and the
        parameter gathers again, at the forward's share of a forward+backward, without the
        gradient reductions. A step's prediction is makespan_ms plus this."""
        if passes <= 0:
            return 0.0
        busiest = max(self.occupied_ms or self.busy_ms or [0.0])
        return passes * forward_share * (busiest + self.parameter_comm_ms)

    @property
    def ratio_to_bound(self) -> float:
        """Predicted time over the charged bound (nan without bounds)."""
        b = self.charged_bound_ms
        return self.makespan_ms / b if b else float("nan")

    @property
    def far_above_bound(self) -> bool:
        """At least FAR_ABOVE_BOUND times the charged bound, balanced or not."""
        return bool(self.charged_bound_ms) and self.makespan_ms >= FAR_ABOVE_BOUND * self.charged_bound_ms

    @property
    def flags(self) -> List[str]:
        """Warnings for the plan summary: a plan far above the bound is flagged even when its
        ranks are balanced (max/mean alone is not a quality signal)."""
        if not self.far_above_bound:
            return []
        return [
            f"far above the bound: predicted {self.makespan_ms:.1f} ms is {self.ratio_to_bound:.2f}x the charged "
            f"lower bound {self.charged_bound_ms:.1f} ms (max/mean {self.imbalance:.3f})"
        ]


# a member with neither distributed nor local samples in a group's micro-batch
IDLE_MEMBER = RankCost(compute_ms=0.0, comm_ms=0.0, comm_bytes=0, tokens=0)


def group_costs(
    plan_lens: Dict[int, int],
    group: Group,
    cost: CostModel,
    masks: Optional[Dict] = None,
    vision: Optional[VisionGrids] = None,
) -> List[RankCost]:
    """Per member: the RankCost (compute_ms, comm_ms, comm_bytes, tokens) of one group's
    micro-batch; `masks` (sample id -> SampleMask) prices masked samples by their masked area;
    `vision` (sample id -> patch grids) adds each member's vision tower work (cost/vision.py)."""
    costs = _text_group_costs(plan_lens, group, cost, masks)
    if not vision:
        return costs
    return [
        replace(c, compute_ms=c.compute_ms + v.ms) if v.ms else c
        for c, v in zip(costs, group_vision(group, vision, cost))
    ]


def _text_group_costs(
    plan_lens: Dict[int, int], group: Group, cost: CostModel, masks: Optional[Dict] = None
) -> List[RankCost]:
    masks = masks or {}
    dist = [plan_lens[s] for s in group.distributed]
    dist_masks = [masks.get(s) for s in group.distributed] if masks else None
    if group.distributed and mode_spec(group.mode).priced_per_group:  # from its placement
        local = {m: [plan_lens[s] for s in group.local.get(r, [])] for m, r in enumerate(group.ranks)}
        local_masks = {m: [masks.get(s) for s in group.local.get(r, [])] for m, r in enumerate(group.ranks)}
        return block_group_costs(group.blocks, dist, group.ranks, cost, dist_masks, local, local_masks)
    out: List[RankCost] = []
    for m, r in enumerate(group.ranks):
        local = [plan_lens[s] for s in group.local.get(r, [])]
        if not dist and not local:
            out.append(IDLE_MEMBER)
            continue
        local_masks = [masks.get(s) for s in group.local.get(r, [])] if masks else None
        if any(x is not None for x in (dist_masks or []) + (local_masks or [])):
            rc = cost.distributed_rank_cost(
                dist, group.mode, group.ranks, m, local, masks=dist_masks, local_masks=local_masks
            )
        else:  # the causal call (cost models that balancers wrap keep this signature)
            rc = cost.distributed_rank_cost(dist, group.mode, group.ranks, m, local)
        out.append(rc)
    return out


def group_messages(plan_lens: Dict[int, int], group: Group, cost: CostModel, masks: Optional[Dict] = None) -> int:
    """Messages each member of a group sends in its micro-batch's exchange, all layers (what the
    profile's cp_message_ms is charged for): none without distributed documents or alone."""
    if not group.distributed or group.size == 1:
        return 0
    L = cost.dims.num_layers
    if mode_spec(group.mode).priced_per_group:  # the messages its placement sends
        dist = [plan_lens[s] for s in group.distributed]
        dist_masks = [(masks or {}).get(s) for s in group.distributed] if masks else None
        return L * block_group_messages(group.blocks, dist, group.size, cost, dist_masks)
    return L * mode_spec(group.mode).comm_messages(group.size)


def chunked_group_cost(plan_lens: Dict[int, int], group: Group, cost: CostModel, vision: Optional[VisionGrids] = None):
    """(compute_ms, activation tokens, peak bytes) of a one-rank group of chunked samples: their
    times add up; memory is the largest sample's (one runs at a time, its store freed after).
    `vision`: its samples' items are encoded on the rank too (their time added, chunked_vision_ms:
    one more forward than a standalone item's); each sample's
    tower activations and held rows count beside its chunks while it runs (train/step/chunk_vision.py:
    its items are encoded before its first chunk and released after its last backward)."""
    ms, tokens, peak = 0.0, 0, 0.0
    for cs in group.chunked.values():
        for c in cs:
            cc = chunked_sample_cost(cost, dependent_chunk_sizes(plan_lens[c.sample], c.chunk_size), c.keep)
            grids = (vision or {}).get(c.sample, ())
            patches = sum(map(grid_patches, grids))
            ms += cc.compute_ms + chunked_vision_ms(cost, grids)
            tokens = max(tokens, cc.activation_tokens + cost.vision_tokens(patches))
            peak = max(
                peak, cost.memory_bytes(cc.activation_tokens) + cc.state_bytes + chunked_vision_bytes(cost, patches)
            )
    return ms, tokens, peak


def chunked_group_calls(plan_lens: Dict[int, int], group: Group) -> int:
    """Backward passes of a one-rank group of chunked samples: one per dependent chunk
    (StepPlan.backward_calls); under ZeRO-2 each ends in a gradient reduction over the world."""
    return sum(
        len(dependent_chunk_sizes(plan_lens[c.sample], c.chunk_size)) for cs in group.chunked.values() for c in cs
    )


def wave_reductions(calls: int, synchronise: bool, last: bool) -> int:
    """Gradient reductions at a wave's end, when it runs `calls` backward passes per rank
    (StepPlan.wave_backward_calls): every backward reduces when waves synchronise (ZeRO-2);
    otherwise one reduction ends the step."""
    if synchronise:
        return calls
    return 1 if last else 0


def simulate(plan: StepPlan, cost: CostModel, cluster: Optional[ClusterSpec] = None) -> SimResult:
    """Per-rank times of the plan by the timing rule of the module docstring. With the
    cluster, the result also carries the plan's lower bounds and flags."""
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
    tokens = [0] * W
    micro_batches = [0] * W
    occupied = [0.0] * W
    overhead = cost.micro_batch_overhead_ms()
    ex = getattr(cost, "execution", None)
    dummy = cost.dummy_micro_batch_ms() if ex is not None else 0.0
    reduction_total = 0.0
    reduction_count = 0
    # every rank runs each wave's pass sequence (ShardedPasses)
    sharded = ShardedPasses(plan, cost, lens) if ex is not None and ex.shards_parameters else None
    parameter_comm_total = 0.0
    for w, wave in enumerate(plan.waves):
        if ex is not None and ex.waves_synchronise:  # the previous wave ended in a barrier
            top = max(clock)
            for r in range(W):
                idle[r] += top - clock[r]
                clock[r] = top
        wave_start = max(clock) if clock else 0.0
        own_ms: List[List[float]] = [[] for _ in range(W)]  # per rank, its own passes' compute (sharded)
        calls = [0] * W  # backward passes per rank in this wave
        chunked_wave = False
        slowest_compute = 0.0
        for g in wave.groups:
            if any(g.chunked.values()):  # plan.validate: one rank running only chunked samples
                ms, tk, mem = chunked_group_cost(lens, g, cost, plan.vision)
                r = g.ranks[0]
                if sharded is not None:
                    own_ms[r] = sharded.chunked_ms(g, r)
                runs.append(GroupRun(w, g.ranks, clock[r], ms, [ms], [0.0], None, 0, 0, [tk], True))
                compute[r] += ms
                clock[r] += ms
                tokens[r] += tk
                micro_batches[r] += 1
                occupied[r] += ms
                calls[r] += chunked_group_calls(lens, g)
                chunked_wave = True
                slowest_compute = max(slowest_compute, ms)
                peak_tokens[r] = max(peak_tokens[r], tk)
                peak_bytes[r] = max(peak_bytes[r], mem)
                cp_samples[1] += sum(len(cs) for cs in g.chunked.values())
                cp_tokens[1] += sum(lens[c.sample] for cs in g.chunked.values() for c in cs)
                continue
            costs = group_costs(lens, g, cost, plan.masks, plan.vision)
            if all(c.tokens == 0 for c in costs):
                continue  # an empty group issues nothing
            start = max(clock[r] for r in g.ranks)
            # members with no tokens still join the group's collectives when it has distributed work
            active = [bool(c.tokens) or bool(g.distributed) for c in costs]
            dur = max(c.total_ms for c in costs) + overhead
            # memory: what StepPlan.validate bounds (a blocks group's members add the rows they
            # receive, the encoding members their items' activations)
            held = plan.held_tokens(g, lens, cost) if plan.vision or (g.blocks is not None and g.distributed) else None
            for m, (c, r, act) in enumerate(zip(costs, g.ranks, active)):
                if not act:
                    continue
                cm, cc, cb, tk = c.compute_ms, c.comm_ms, c.comm_bytes, c.tokens
                idle[r] += start - clock[r] + (dur - overhead - cm - cc)
                compute[r] += cm + overhead
                comm[r] += cc
                comm_bytes += cb
                mem = held[m] if held is not None else tk
                peak_tokens[r] = max(peak_tokens[r], mem)
                peak_bytes[r] = max(peak_bytes[r], cost.memory_bytes(mem))
                tokens[r] += tk
                micro_batches[r] += 1
                occupied[r] += dur + (start - clock[r] if g.size > 1 else 0.0)
                calls[r] = max(calls[r], 1)
                slowest_compute = max(slowest_compute, cm)
                clock[r] = start + dur
                if sharded is not None:
                    own_ms[r] = sharded.micro_batch_ms(dur)
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
                    [c.compute_ms for c in costs],
                    [c.comm_ms for c in costs],
                    g.mode if g.distributed else None,
                    len(g.distributed),
                    sum(len(v) for v in g.local.values()),
                    [c.tokens for c in costs],
                    messages=group_messages(lens, g, cost, plan.masks),
                )
            )
        if sharded is not None:
            sw = sharded.wave(w, own_ms)
            # every backward reduce-scatters the gradients (their bytes are in the passes' time);
            # the profile's fixed cost per reduction comes on top
            parameter_comm_total += sw.passes_ms - sum(sw.place_ms)
            reduction_total += sw.reduction_ms
            reduction_count += sw.reductions
            end = wave_start + sw.passes_ms + sw.reduction_ms
            for r in range(W):
                idle[r] += end - clock[r]
                clock[r] = end
        elif ex is not None:
            last = w == len(plan.waves) - 1
            # every rank runs the wave's backward count (StepPlan.wave_backward_calls), padding
            # with zero-weight micro-batches: one per dependent chunk of the wave's longest chain
            n_calls = max(1, max(calls)) + (1 if last and chunked_wave else 0)
            for r in range(W):
                pads = n_calls - calls[r]
                idle[r] += pads * dummy
                clock[r] += pads * dummy
            k = wave_reductions(n_calls, ex.waves_synchronise, last)
            if k:
                # the backward share of the slowest rank's compute (about 2/3), spread over the
                # wave's backward passes, can hide an overlapping reduction
                red = k * cost.gradient_reduction_ms(W, hidden_behind_ms=slowest_compute * 2 / 3 / k)
                top = max(clock) + red
                reduction_total += red
                reduction_count += k
                for r in range(W):
                    idle[r] += top - clock[r]
                    clock[r] = top
    fixed = cost.profile.step_overhead_ms if ex is not None else 0.0
    makespan = (max(clock) if clock else 0.0) + fixed
    for r in range(W):
        idle[r] += makespan - clock[r]
    bounds = {}
    if cluster is not None:
        masks = [plan.masks.get(sid) for sid in plan.sample_ids] if plan.masks else None
        local = samples_local_ms(np.asarray(plan.lengths, dtype=np.int64), cost, masks)
        vision = step_vision(plan.sample_ids, plan.vision, cost)
        bounds = {
            "lower_bound_ms": lower_bound_ms(plan.lengths, cluster, cost, masks, local_ms=local, vision=vision),
            "charged_bound_ms": charged_lower_bound_ms(plan.lengths, cluster, cost, local, masks=masks, vision=vision),
        }
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
        tokens=tokens,
        micro_batches=micro_batches,
        occupied_ms=occupied,
        reduction_ms=reduction_total,
        reductions=reduction_count,
        parameter_comm_ms=parameter_comm_total,
        fixed_ms=fixed,
        **bounds,
    )


def forward_only_share(forward_share: float, recomputes_forward: bool) -> float:
    """A forward-only pass (a sequence objective's log-prob or reference pass) relative to the
    training pass it repeats: the profile's forward share of a forward+backward, or, when the
    training pass recomputes its forward (activation checkpointing: forward, forward again,
    backward), forward_share / (1 + forward_share). Measured on SmolLM2 DPO with checkpointing,
    2 CPU ranks: 0.22 (1/4 by this; 1/3 overshot the step's forward passes by half)."""
    return forward_share / (1.0 + forward_share) if recomputes_forward else forward_share
