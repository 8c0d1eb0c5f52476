"""The pipeline bubble of one step's micro-batches under 1F1B (planner side; issue 17).

hf_cp does not run pipeline parallelism. This prices what a pipeline would lose to unequal
micro-batches, next to ChunkFlow's equal chunks: every stage holds 1/P of the layers, so a
micro-batch's forward takes the same time on every stage, proportional to its cost, and its
backward twice that. The 1F1B schedule (PipeDream-Flush, as Megatron-LM runs it) is simulated
event by event: stage s first runs min(P-1-s, M) warm-up forwards, then alternates one forward
and one backward, then drains the remaining backwards. An operation starts when its stage is
free and its input is ready (a forward after the same micro-batch's forward on the previous
stage; a backward after its backward on the next stage). Pure Python, torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

BACKWARD_OVER_FORWARD = 2  # an int: exact with int or Fraction costs


@dataclass(frozen=True)
class PipelineRun:
    """The simulated schedule: per stage, (kind 'F'/'B', micro-batch, start, end) in order."""

    stages: int
    makespan: float
    work: float  # busy time summed over stages
    ops: Tuple[Tuple[Tuple[str, int, float, float], ...], ...]

    @property
    def bubble(self) -> float:
        """Share of stage-time idle: 1 - work / (stages * makespan)."""
        return 1 - self.work / (self.stages * self.makespan)


def one_f_one_b_order(stages: int, micro_batches: int, stage: int) -> List[Tuple[str, int]]:
    """The order in which `stage` runs its forwards ('F', m) and backwards ('B', m) under 1F1B."""
    warmup = min(stages - 1 - stage, micro_batches)
    order = [("F", m) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
    return order


def simulate_1f1b(costs: Sequence[float], stages: int) -> PipelineRun:
    """Run the 1F1B schedule of micro-batches with forward times `costs` (per stage) on `stages`
    stages; backward takes BACKWARD_OVER_FORWARD times the forward. Costs keep their number
    type (ints or fractions.Fraction give an exact bubble)."""
    if stages <= 0:
        raise ValueError(f"stages must be positive, got {stages}")
    costs = list(costs)
    if not costs:
        raise ValueError("no micro-batches to schedule")
    for m, c in enumerate(costs):
        if not c > 0:
            raise ValueError(f"micro-batch {m} has cost {c}; costs must be positive")
    M, P = len(costs), stages
    orders = [one_f_one_b_order(P, M, s) for s in range(P)]
    done = {}  # (kind, micro-batch, stage) -> end time
    nxt = [0] * P  # index of each stage's next operation
    free = [0] * P  # when each stage finishes its last operation
    ops: List[List[Tuple[str, int, float, float]]] = [[] for _ in range(P)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(P):
            while nxt[s] < len(orders[s]):
                kind, m = orders[s][nxt[s]]
                if kind == "F":
                    dep = (("F", m, s - 1),) if s > 0 else ()
                    dur = costs[m]
                else:  # the backward of m on this stage needs its forward here and its backward downstream
                    dep = (("F", m, s),) + ((("B", m, s + 1),) if s < P - 1 else ())
                    dur = BACKWARD_OVER_FORWARD * costs[m]
                if any(d not in done for d in dep):
                    break
                start = max([free[s]] + [done[d] for d in dep])
                end = start + dur
                done[(kind, m, s)] = end
                free[s] = end
                ops[s].append((kind, m, start, end))
                nxt[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen with the 1F1B order; guards the loop all the same
            raise RuntimeError("1F1B schedule deadlocked")
    work = P * (1 + BACKWARD_OVER_FORWARD) * sum(costs)
    return PipelineRun(stages=P, makespan=max(free), work=work, ops=tuple(tuple(o) for o in ops))


def bubble_share(costs: Sequence[float], stages: int) -> float:
    """1F1B bubble share (idle over stages x makespan) of a step's micro-batch costs."""
    return simulate_1f1b(costs, stages).bubble
