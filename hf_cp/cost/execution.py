"""How a step's waves run against each other: what the wall clock adds to the plan's compute.

CPTrainer runs every wave on every rank (a rank without work runs a zero-weight dummy
micro-batch) and ends the step in a data-parallel gradient reduction. When that reduction
happens decides the step's wall time:

* DeepSpeed ZeRO-2 and ZeRO-3 reduce gradients inside *every* backward (no no_sync; DeepSpeed's
  engine communicates at every micro-batch once gradients are partitioned). Every wave then
  ends in a world-wide synchronisation: a step takes the sum over waves of the slowest rank's
  work in that wave, plus one reduction per wave. Measured on the main job (2 processes, gloo):
  the ranks' wave ends lie 1 ms apart (median) while their compute in the wave differs by
  hundreds of ms.
* DDP with no_sync on all but the last wave (CPTrainer), and DeepSpeed ZeRO-0/1, reduce once,
  at the end: the ranks' waves flow freely (the simulator's original timing rule), then one
  reduction.

`StepExecution` names the rule; `simulate` (hf_cp/sim.py) follows it when the cost model carries
one (`CostModel.execution`). Without one, the simulator prices compute alone, as before: plain
compute comparisons of balancers keep their numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class StepExecution:
    """The timing rule of a step beyond its ranks' compute."""

    name: str
    waves_synchronise: bool  # every wave ends in a world-wide gradient reduction
    all_reduce: bool  # the reduction is an all-reduce (DDP) rather than a reduce-scatter (ZeRO)
    overlaps_backward: bool  # the reduction runs in buckets during the backward (overlap_comm, DDP)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "waves_synchronise": self.waves_synchronise,
            "all_reduce": self.all_reduce,
            "overlaps_backward": self.overlaps_backward,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> StepExecution:
        return cls(str(d["name"]), bool(d["waves_synchronise"]), bool(d["all_reduce"]), bool(d["overlaps_backward"]))


# The names hf-cp plan's --execution and PlanningSettings.execution accept.
EXECUTIONS = {
    "zero2": StepExecution("zero2", waves_synchronise=True, all_reduce=False, overlaps_backward=False),
    "zero2-overlap": StepExecution("zero2-overlap", waves_synchronise=True, all_reduce=False, overlaps_backward=True),
    "ddp": StepExecution("ddp", waves_synchronise=False, all_reduce=True, overlaps_backward=True),
}


def execution_named(name: Optional[str]) -> Optional[StepExecution]:
    """The execution for a name; None (or "compute") prices compute alone."""
    if name is None or name == "compute":
        return None
    try:
        return EXECUTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown execution {name!r}; one of: compute (the plan's compute alone), {', '.join(EXECUTIONS)}"
        ) from None


def zero_stage_of(deepspeed_config: Optional[Mapping]) -> int:
    """The ZeRO stage of a DeepSpeed config (0 when it names none or an unreadable one)."""
    zero = (deepspeed_config or {}).get("zero_optimization") or {}
    try:
        return int(zero.get("stage", 0))
    except (TypeError, ValueError):
        return 0


def model_state_bytes_per_parameter(
    deepspeed: bool, zero_stage: int, half_precision: bool, world_size: int, param_bytes: int = 4
) -> float:
    """Bytes of model states per parameter on one rank, with an Adam-type optimizer (two
    moments). Without DeepSpeed (one process or DDP) the parameters stay in the dtype the model
    was built in (`param_bytes`: fp32 under autocast, 4 + 4 + 8), and the gradients and torch
    Adam's moments take the same dtype. DeepSpeed in bf16/fp16 keeps half-precision parameters
    and gradients plus fp32 master weights and moments (2 + 2 + 12; in fp32, 4 + 4 + 8), and ZeRO
    stage 1 partitions the optimizer states over the ranks, 2 the gradients too, 3 everything."""
    if not deepspeed:
        return 4.0 * param_bytes
    w = max(1, int(world_size))
    p, g, o = (2.0, 2.0, 12.0) if half_precision else (4.0, 4.0, 8.0)
    if zero_stage >= 3:
        return (p + g + o) / w
    if zero_stage == 2:
        return p + (g + o) / w
    if zero_stage == 1:
        return p + g + o / w
    return p + g + o


def execution_for_run(deepspeed_config: Optional[Mapping]) -> str:
    """The execution name of a CPTrainer run: from its DeepSpeed config, else DDP."""
    if deepspeed_config is None:
        return "ddp"
    stage = zero_stage_of(deepspeed_config)
    if stage >= 2:  # gradients partitioned: DeepSpeed reduces at every micro-batch
        zero = deepspeed_config.get("zero_optimization") or {}
        return "zero2-overlap" if bool(zero.get("overlap_comm", False)) else "zero2"
    return "ddp"  # ZeRO-0/1 reduce at the accumulation boundary only, as DDP with no_sync
