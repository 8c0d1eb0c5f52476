"""The passes of a wave when the parameters are sharded (FSDP2, ZeRO-3): every rank runs the wave's
pass sequence (StepPlan.wave_passes), each pass a chain of world-wide collectives, so a pass lasts
as long as the slowest rank's compute in it or its parameter communication, whichever is longer
(sharded_wave_ms); dummy passes cost their communication. The simulator (cost/simulate.py) and the
balancers' pricer (balance/toolkit/pricing.py) price such waves through ShardedPasses. Also the
compute of each pass of a chunked sample (chunked_pass_ms). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from hf_cp.cost.model import CostModel
from hf_cp.plan.chunks import chunk_starts, dependent_chunk_layers_ms, dependent_chunk_sizes, recomputed_chunks
from hf_cp.plan.passes import BACKWARD, FORWARD, FORWARD_NO_GRAPH
from hf_cp.plan.step_plan import Group, StepPlan


def chunked_pass_ms(cost: CostModel, sizes: Sequence[int], keep: int) -> List[float]:
    """The compute of each pass of one chunked sample, in plan/passes.chunked_passes order (N-K
    forwards without a graph, K with one, then the chunks last first: a kept chunk's backward,
    or a recomputed chunk's forward and backward), summing to chunked_sample_cost's compute_ms.
    A chunk's fwd+bwd and its micro-batch overhead split by profile.forward_share; the first
    forward of a recomputed chunk runs its decoder layers only (it fills the K/V store)."""
    fs = cost.profile.forward_share
    overhead = cost.micro_batch_overhead_ms()
    layers_ms = [dependent_chunk_layers_ms(cost, s, n) for s, n in zip(chunk_starts(sizes), sizes)]
    whole = [ms + cost.head_ms_per_token * n + overhead for ms, n in zip(layers_ms, sizes)]
    n_re = recomputed_chunks(len(sizes), keep)
    out = [fs * (layers_ms[i] + overhead) for i in range(n_re)]
    out += [fs * whole[i] for i in range(n_re, len(sizes))]
    for i in reversed(range(len(sizes))):
        if i < n_re:
            out.append(fs * whole[i])
        out.append((1 - fs) * whole[i])
    return out


def place_compute_ms(
    passes: str, own_passes: Sequence[str], own_ms: Sequence[Sequence[float]], dummy_ms: Dict[str, float]
) -> List[float]:
    """Per place of a wave's pass sequence, the slowest rank's compute there. A rank runs each of
    its own passes (`own_passes[r]`, taking `own_ms[r]`) at the next place of its kind, as
    plan/passes.PassCursor does, and a zero-weight dummy pass (`dummy_ms` by kind) elsewhere."""
    out = [dummy_ms[kind] for kind in passes]
    for r, (own, ms) in enumerate(zip(own_passes, own_ms)):
        if len(own) != len(ms):
            raise ValueError(f"rank {r}: {len(ms)} pass times for its passes {own!r}")
        place = 0
        for kind, t in zip(own, ms):
            place = passes.find(kind, place)
            if place < 0:
                raise ValueError(f"rank {r}'s passes {own!r} do not fit the wave's {passes!r}")
            out[place] = max(out[place], t)
            place += 1
    return out


def sharded_wave_ms(passes: str, place_ms: Sequence[float], forward_comm_ms: float, backward_comm_ms: float) -> float:
    """Wall time of a wave's passes when the parameters are sharded (FSDP2, ZeRO-3). Each pass is
    a chain of world-wide collectives (one per layer), so every rank meets the others in it; on
    a GPU the engines run them on their own streams, the next layer's all-gather (and the
    previous layer's reduce-scatter) beside the current layer's compute, so a pass lasts
    max(its slowest rank's compute `place_ms`, its communication): communication shows only
    where it outlasts compute, as in a dummy pass. A forward (f or F) costs
    `forward_comm_ms`, a backward `backward_comm_ms` (CostModel.parameter_pass_comm_ms)."""
    return sum(max(ms, backward_comm_ms if kind == BACKWARD else forward_comm_ms) for kind, ms in zip(passes, place_ms))


@dataclass(frozen=True)
class ShardedWave:
    """One wave's wall time when the parameters are sharded (ShardedPasses.wave)."""

    place_ms: List[float]  # per place of the wave's passes, the slowest rank's compute (place_compute_ms)
    passes_ms: float  # the passes' wall time, communication where it outlasts compute (sharded_wave_ms)
    reductions: int  # one per backward place: each reduce-scatters the gradients
    reduction_ms: float  # their fixed cost (profile.reduction_overhead_ms each); their bytes are in passes_ms

    @property
    def wall_ms(self) -> float:
        """From the wave's start (every rank at the previous wave's barrier) to its end."""
        return self.passes_ms + self.reduction_ms


class ShardedPasses:
    """The wave rule of a plan under a parameter-sharding execution (FSDP2, ZeRO-3): every rank
    runs each wave's pass sequence (StepPlan.wave_passes), its own passes at the places of their
    kind and a dummy pass (a one-token micro-batch's share of its kind) elsewhere; the wave lasts
    sharded_wave_ms plus one fixed reduction cost per backward place. `simulate` and the
    balancers' pricer (balance/toolkit/pricing.PlanPricer) both price waves through this, so
    what a balancer compares is what the simulator predicts."""

    def __init__(self, plan: StepPlan, cost: CostModel, lens: Optional[Dict[int, int]] = None):
        W = plan.world_size
        self.plan, self.cost = plan, cost
        self.lens = lens if lens is not None else plan.length_of()
        self.passes_of_wave = plan.wave_passes()
        self.forward_comm_ms = cost.parameter_pass_comm_ms(W, backward=False)
        self.backward_comm_ms = cost.parameter_pass_comm_ms(W, backward=True)
        self.forward_share = fs = cost.profile.forward_share
        dummy = cost.dummy_micro_batch_ms()
        self.dummy_pass_ms = {FORWARD_NO_GRAPH: fs * dummy, FORWARD: fs * dummy, BACKWARD: (1 - fs) * dummy}

    def micro_batch_ms(self, duration_ms: float) -> List[float]:
        """A member's own passes (F, B) in a group's micro-batch of `duration_ms` (overhead
        included): the members meet at every layer, so each spends the group's time, split
        by the profile's forward share."""
        fs = self.forward_share
        return [fs * duration_ms, (1 - fs) * duration_ms]

    def chunked_ms(self, group: Group, rank: int) -> List[float]:
        """`rank`'s own passes in a one-rank group of chunked samples, in the order it runs them."""
        return [
            t
            for c in group.chunked.get(rank, [])
            for t in chunked_pass_ms(self.cost, dependent_chunk_sizes(self.lens[c.sample], c.chunk_size), c.keep)
        ]

    def wave(self, w: int, own_ms: Sequence[Sequence[float]]) -> ShardedWave:
        """Wave `w`'s wall time, given every rank's own passes' compute (`own_ms[r]`: [] for a
        rank without work, micro_batch_ms or chunked_ms otherwise)."""
        passes = self.passes_of_wave[w]
        places = place_compute_ms(passes, self.plan.rank_passes(w, self.lens), own_ms, self.dummy_pass_ms)
        k = passes.count(BACKWARD)
        return ShardedWave(
            places,
            sharded_wave_ms(passes, places, self.forward_comm_ms, self.backward_comm_ms),
            k,
            k * self.cost.profile.reduction_overhead_ms,
        )
