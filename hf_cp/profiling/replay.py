"""Replay a plan's compute on one device: is the predicted balance the real balance?

Each rank's assigned work of a StepPlan (for every micro-batch it takes part in: forward and
backward of the model's decoder layers on its local documents and its shards of the
distributed ones) runs one rank after the other on this device; communication is left out.
The measured time per rank is set beside the simulator's compute time for the same rank
(hf_cp.cost.simulate.simulate with the cost model restricted to the layers replayed: no LM head).

A rank's distributed shard compute is its query segments (registry.rank_segments) attending
causally to the keys of their own documents; under a mode whose spec splits the heads (Ulysses)
it is the whole distributed documents on heads/group-size heads (hf_cp.profiling.layers.RankWork).
A mode whose geometry is the plan's block layout (its spec's carries_layout: blocks) is refused
by name: a member runs the compute blocks it executes, not the rows it holds.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

from hf_cp.cost.dims import ModelDims
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import max_over_mean, simulate
from hf_cp.modes.registry import mode_spec, rank_segments
from hf_cp.modes.segments import segment_tokens
from hf_cp.plan.step_plan import PlanError, StepPlan
from hf_cp.profiling.layers import DecoderStack, RankWork
from hf_cp.profiling.timing import time_each


def load_plans(path: Union[str, Path]) -> List[StepPlan]:
    """Plans from `hf-cp plan --json` ({"plans": [...], ...}), a list of plans, or one plan, each
    checked; errors name the file and the plan ("plans.json[1]: step 1, wave 0: ...")."""
    return StepPlan.load_file(path)


def select_plan(plans: Sequence[StepPlan], step: Optional[int], source: str = "plans") -> StepPlan:
    if step is None:
        return plans[0]
    for p in plans:
        if p.step == step:
            return p
    raise PlanError(f"{source}: no plan for step {step}; steps present: {sorted({p.step for p in plans})}")


def rank_micro_batches(plan: StepPlan, rank: int) -> List[RankWork]:
    """The work of `rank` in each micro-batch (wave) it takes part in, in execution order."""
    lens = plan.length_of()
    out: List[RankWork] = []
    for w, group in plan.rank_waves(rank):
        if group.chunked.get(rank):
            raise PlanError(
                f"step {plan.step}, wave {w}: rank {rank} runs chunked samples "
                f"{[c.sample for c in group.chunked[rank]]} (ChunkFlow); replay does not time dependent chunks"
            )
        segments = [(0, lens[s]) for s in group.local.get(rank, [])]
        split_docs, split_tokens = (), 0
        if group.distributed:
            dist = [lens[s] for s in group.distributed]
            member = group.ranks.index(rank)
            spec = mode_spec(group.mode)
            if spec.carries_layout:
                raise PlanError(
                    f"step {plan.step}, wave {w}: group {list(group.ranks)} runs shard mode {spec.name!r}, whose "
                    "compute blocks are the plan's block layout; replay times modes whose shards follow from the lengths"
                )
            segs = rank_segments(group.mode, dist, group.size, member)
            if spec.splits_heads and group.size > 1:
                split_docs, split_tokens = tuple(dist), segment_tokens(segs)
            else:
                segments += [(s.start, s.length) for s in segs]
        work = RankWork(
            segments=tuple(segments),
            head_split_docs=split_docs,
            head_split_ways=group.size if split_docs else 1,
            head_split_tokens=split_tokens,
        )
        if not work.is_empty:
            out.append(work)
    return out


def replay_cost_model(dims: ModelDims, cost: CostModel, layers: int) -> CostModel:
    """The cost model of exactly what replay runs: `layers` decoder layers, no embedding or LM head."""
    return CostModel(dims.with_layers(layers, vocab_size=0), cost.profile)


@dataclass
class RankReplay:
    rank: int
    micro_batches: int
    tokens: int
    predicted_ms: float
    measured_ms: float

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted; 0 for a rank with nothing to do."""
        return self.measured_ms / self.predicted_ms - 1.0 if self.predicted_ms > 0 else 0.0


@dataclass
class ReplayResult:
    step: int
    balancer: str
    layers: int
    device: str
    ranks: List[RankReplay]

    @property
    def measured_max_over_mean(self) -> float:
        return max_over_mean([r.measured_ms for r in self.ranks])

    @property
    def predicted_max_over_mean(self) -> float:
        return max_over_mean([r.predicted_ms for r in self.ranks])

    @property
    def abs_errors(self) -> List[float]:
        return [abs(r.error) for r in self.ranks if r.predicted_ms > 0]

    @property
    def median_abs_error(self) -> float:
        return statistics.median(self.abs_errors) if self.abs_errors else 0.0

    @property
    def max_abs_error(self) -> float:
        return max(self.abs_errors, default=0.0)

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "balancer": self.balancer,
            "layers": self.layers,
            "device": self.device,
            "ranks": [dataclasses.asdict(r) | {"error": r.error} for r in self.ranks],
            "measured_max_over_mean": self.measured_max_over_mean,
            "predicted_max_over_mean": self.predicted_max_over_mean,
            "median_abs_error": self.median_abs_error,
            "max_abs_error": self.max_abs_error,
        }


def replay_plan(
    plan: StepPlan,
    stack: DecoderStack,
    cost: CostModel,
    warmup: int = 1,
    repeats: int = 3,
    log: Optional[Callable[[str], None]] = None,
) -> ReplayResult:
    """Run every rank's micro-batches of `plan` on `stack` and compare with the cost model's prediction.

    `cost` is the cost model of the full model; the prediction uses it restricted to the
    stack's layers. Identical micro-batches (common in symmetric plans) are timed once. On CPU,
    run with the torch thread count the profile was measured with (hf-cp uses 1 on both sides).
    """
    plan.validate()
    layers = len(stack.layers)
    predicted = simulate(plan, replay_cost_model(cost.dims, cost, layers)).compute_ms
    works = {r: rank_micro_batches(plan, r) for r in range(plan.world_size)}
    unique = list(dict.fromkeys(w for ws in works.values() for w in ws))
    if log:
        log(
            f"replaying step {plan.step} ({plan.balancer or 'plan'}): {plan.world_size} ranks, "
            f"{sum(len(w) for w in works.values())} micro-batches ({len(unique)} distinct), {layers} layer(s) "
            f"on {stack.device}"
        )
    timing = dict(device=stack.device, warmup=warmup, repeats=repeats)
    ms: Dict[RankWork, float] = {}
    if stack.device.type == "cuda":
        # one micro-batch's inputs at a time: real sizes do not all fit at once
        for w in unique:
            prepared = stack.prepare(w)
            ms[w] = time_each([lambda prepared=prepared: stack.forward_backward(prepared)], **timing)[0]
            del prepared
    else:
        prepared = [stack.prepare(w) for w in unique]
        for w, t in zip(unique, time_each([(lambda p=p: stack.forward_backward(p)) for p in prepared], **timing)):
            ms[w] = t
        del prepared
    stack.zero_grad()
    ranks = [
        RankReplay(
            rank=r,
            micro_batches=len(works[r]),
            tokens=sum(w.tokens for w in works[r]),
            predicted_ms=predicted[r],
            measured_ms=sum(ms[w] for w in works[r]),
        )
        for r in range(plan.world_size)
    ]
    return ReplayResult(step=plan.step, balancer=plan.balancer, layers=layers, device=str(stack.device), ranks=ranks)


def format_replay(result: ReplayResult) -> str:
    head = f"{'rank':>5} {'mbs':>4} {'tokens':>8} {'predicted ms':>13} {'measured ms':>12} {'error':>7}"
    lines = [
        f"step {result.step} ({result.balancer or 'plan'}), {result.layers} layer(s) fwd+bwd on {result.device}, "
        f"communication excluded",
        head,
        "-" * len(head),
    ]
    for r in result.ranks:
        err = f"{100 * r.error:+6.1f}%" if r.predicted_ms > 0 else f"{'-':>7}"
        lines.append(
            f"{r.rank:>5} {r.micro_batches:>4} {r.tokens:>8} {r.predicted_ms:>13.3f} {r.measured_ms:>12.3f} {err}"
        )
    lines.append("-" * len(head))
    lines.append(
        f"max/mean: measured {result.measured_max_over_mean:.3f}, predicted {result.predicted_max_over_mean:.3f}; "
        f"prediction error per rank: median {100 * result.median_abs_error:.1f}%, "
        f"max {100 * result.max_abs_error:.1f}%"
    )
    return "\n".join(lines)
