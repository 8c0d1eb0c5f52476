"""How a step's waves run against each other: what the wall clock adds to the plan's compute,
and what the run's engine keeps in memory.

CPTrainer runs every wave on every rank (a rank without work runs a zero-weight dummy
micro-batch) and ends the step in a data-parallel gradient reduction. When that reduction
happens decides the step's wall time:

* DeepSpeed ZeRO-2 reduces gradients inside *every* backward (no no_sync; DeepSpeed's engine
  communicates at every micro-batch once gradients are partitioned). Every wave then ends in a
  world-wide synchronisation: a step takes the sum over waves of the slowest rank's work in
  that wave, plus one reduction per wave. Measured on the main job (2 processes, gloo): the
  ranks' wave ends lie 1 ms apart (median) while their compute in the wave differs by hundreds
  of ms.
* FSDP2 (torch fully_shard per decoder layer and on the root) and DeepSpeed ZeRO-3 shard the
  parameters too: waves synchronise as under ZeRO-2 (gradients reduce-scattered in every
  backward), and every pass is itself a chain of world-wide collectives: a forward all-gathers
  every layer's parameters, a backward all-gathers them again (reshard_after_forward, the
  default) and reduce-scatters their gradients. Every rank runs the same passes
  (StepPlan.wave_passes), dummies where it has no work of its own, and each pass costs at
  least its communication.
* DDP with no_sync on all but the last wave (CPTrainer), and DeepSpeed ZeRO-0/1, reduce once,
  at the end: the ranks' waves flow freely (the simulator's original timing rule), then one
  reduction.

`StepExecution` names the rule; `simulate` (hf_cp/cost/simulate.py) follows it when the cost
model carries one (`CostModel.execution`). Without one, the simulator prices compute alone, as
before: plain compute comparisons of balancers keep their numbers.

The memory side (`model_state_bytes_per_parameter`, `gathered_working_set_bytes`): what one
rank holds of the model's parameters, gradients and Adam states under each engine, and the
unsharded parameters a parameter-sharding engine gathers while it computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from hf_cp.cost.dims import ModelDims


@dataclass(frozen=True)
class StepExecution:
    """The timing rule of a step beyond its ranks' compute."""

    name: str
    waves_synchronise: bool  # every wave ends in a world-wide gradient reduction
    all_reduce: bool  # the reduction is an all-reduce (DDP) rather than a reduce-scatter (ZeRO)
    overlaps_backward: bool  # the reduction runs in buckets during the backward (overlap_comm, DDP)
    # FSDP2, ZeRO-3: every forward pass all-gathers the parameters, every backward all-gathers them
    # again and reduce-scatters the gradients (CostModel.parameter_pass_comm_ms)
    shards_parameters: bool = False
    # FSDP2: fully_shard keeps the root's parameters (embedding, final norm, LM head) unsharded
    # from forward to backward, so a backward gathers only the decoder layers again
    keeps_root_gathered: bool = False

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "waves_synchronise": self.waves_synchronise,
            "all_reduce": self.all_reduce,
            "overlaps_backward": self.overlaps_backward,
            "shards_parameters": self.shards_parameters,
            "keeps_root_gathered": self.keeps_root_gathered,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> StepExecution:
        return cls(
            str(d["name"]),
            bool(d["waves_synchronise"]),
            bool(d["all_reduce"]),
            bool(d["overlaps_backward"]),
            # dicts written before parameter sharding lack these: replicated parameters
            shards_parameters=bool(d.get("shards_parameters", False)),
            keeps_root_gathered=bool(d.get("keeps_root_gathered", False)),
        )


# The names hf-cp plan's --execution and PlanningSettings.execution accept. FSDP2 and ZeRO-3
# overlap their collectives with compute (FSDP2 on its own streams with one layer prefetched;
# ZeRO-3's overlap_comm defaults to true), hence overlaps_backward.
EXECUTIONS = {
    "zero2": StepExecution("zero2", waves_synchronise=True, all_reduce=False, overlaps_backward=False),
    "zero2-overlap": StepExecution("zero2-overlap", waves_synchronise=True, all_reduce=False, overlaps_backward=True),
    "zero3": StepExecution(
        "zero3", waves_synchronise=True, all_reduce=False, overlaps_backward=True, shards_parameters=True
    ),
    "fsdp2": StepExecution(
        "fsdp2",
        waves_synchronise=True,
        all_reduce=False,
        overlaps_backward=True,
        shards_parameters=True,
        keeps_root_gathered=True,
    ),
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


def execution_for_run(deepspeed_config: Optional[Mapping], fsdp_version: Optional[int] = None) -> str:
    """The execution name of a CPTrainer run: FSDP2 when it asks for FSDP version 2, else from its
    DeepSpeed config (ZeRO-3, ZeRO-2), else DDP."""
    if fsdp_version == 2:
        return "fsdp2"
    if deepspeed_config is None:
        return "ddp"
    stage = zero_stage_of(deepspeed_config)
    if stage >= 3:
        return "zero3"
    if stage == 2:  # gradients partitioned: DeepSpeed reduces at every micro-batch
        zero = deepspeed_config.get("zero_optimization") or {}
        return "zero2-overlap" if bool(zero.get("overlap_comm", False)) else "zero2"
    return "ddp"  # ZeRO-0/1 reduce at the accumulation boundary only, as DDP with no_sync


# --------------------------------------------------------------------------- memory of model states
# The engines whose memory `hf-cp plan` and the dry run compare, and the parameter shardings.
MEMORY_ENGINES = ("zero2", "zero3", "fsdp2")
SHARDINGS = ("fsdp2", "zero3")

# FSDP2 holds one more decoder layer gathered than it computes: in forward the next layer's
# all-gather runs on its own stream while the current layer computes (implicit prefetch), in
# backward it prefetches the next layer explicitly (the default, one layer).
FSDP2_PREFETCHED_LAYERS = 1
# DeepSpeed ZeRO-3 prefetches parameters up to stage3_prefetch_bucket_size elements; transformers
# fills its "auto" with 0.9 x hidden^2 (what the Trainer integration sets, and our recipes use).
ZERO3_PREFETCH_BUCKET_PER_HIDDEN_SQUARED = 0.9


def model_states_of_run(
    deepspeed_config: Optional[Mapping], fsdp_version: Optional[int], half_precision: bool
) -> Dict[str, object]:
    """PlanningSettings.model_states of a run: its engine (DeepSpeed and its ZeRO stage, or
    FSDP2) and precision, the keys model_state_bytes_per_parameter takes."""
    if fsdp_version == 2:
        return {"deepspeed": False, "zero_stage": 0, "half_precision": half_precision, "sharding": "fsdp2"}
    stage = zero_stage_of(deepspeed_config)
    return {
        "deepspeed": deepspeed_config is not None,
        "zero_stage": stage,
        "half_precision": half_precision,
        "sharding": "zero3" if deepspeed_config is not None and stage >= 3 else None,
    }


def engine_model_states(engine: str, half_precision: bool) -> Dict[str, object]:
    """The model_states of a run under one of MEMORY_ENGINES (for comparing them)."""
    if engine == "fsdp2":
        return model_states_of_run(None, 2, half_precision)
    zero_stages = {"zero2": 2, "zero3": 3}
    if engine not in zero_stages:
        raise ValueError(f"unknown engine {engine!r}; one of: {', '.join(MEMORY_ENGINES)}")
    return model_states_of_run({"zero_optimization": {"stage": zero_stages[engine]}}, None, half_precision)


def sharding_of(deepspeed: bool, zero_stage: int, sharding: Optional[str]) -> Optional[str]:
    """The run's parameter sharding: the named one, else ZeRO-3 for DeepSpeed at stage 3 (model
    states written before the sharding key), else None (parameters replicated)."""
    if sharding is not None and sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; one of: {', '.join(SHARDINGS)} (or None)")
    if sharding is None and deepspeed and zero_stage >= 3:
        return "zero3"
    return sharding


def model_state_bytes_per_parameter(
    deepspeed: bool,
    zero_stage: int,
    half_precision: bool,
    world_size: int,
    param_bytes: int = 4,
    sharding: Optional[str] = None,
) -> float:
    """Bytes of model states per parameter on one rank, with an Adam-type optimizer (two
    moments). Without DeepSpeed (one process or DDP) the parameters stay in the dtype the model
    was built in (`param_bytes`: fp32 under autocast, 4 + 4 + 8), and the gradients and torch
    Adam's moments take the same dtype. DeepSpeed in bf16/fp16 keeps half-precision parameters
    and gradients plus fp32 master weights and moments (2 + 2 + 12; in fp32, 4 + 4 + 8), and ZeRO
    stage 1 partitions the optimizer states over the ranks, 2 the gradients too, 3 (`sharding`
    "zero3") everything. FSDP2 (`sharding` "fsdp2") shards the parameters as built, their
    gradients and torch Adam's moments over the world: 4 x param_bytes / world (a bf16
    MixedPrecisionPolicy casts only the gathered copy, gathered_working_set_bytes)."""
    w = max(1, int(world_size))
    sharding = sharding_of(deepspeed, zero_stage, sharding)
    if sharding == "fsdp2":
        return 4.0 * param_bytes / w
    if not deepspeed and sharding is None:
        return 4.0 * param_bytes
    p, g, o = (2.0, 2.0, 12.0) if half_precision else (4.0, 4.0, 8.0)
    if sharding == "zero3":
        return (p + g + o) / w
    if zero_stage == 2:
        return p + (g + o) / w
    if zero_stage == 1:
        return p + g + o / w
    return p + g + o


def gathered_bytes_per_element(half_precision: bool, param_bytes: int = 4) -> int:
    """The dtype a sharding engine gathers parameters (and computes their unsharded gradients)
    in: bf16/fp16 in a half-precision run (FSDP2's MixedPrecisionPolicy param_dtype, ZeRO-3's
    half-precision parameters), else the parameters' own."""
    return 2 if half_precision else int(param_bytes)


def gathered_working_set_bytes(dims: ModelDims, sharding: Optional[str], gather_bytes: int) -> float:
    """Unsharded parameters and gradients a parameter-sharding engine holds at once, beyond its
    sharded model states (0 without sharding: replicated parameters are model states already).

    FSDP2 (fully_shard per decoder layer, then the root): the root's parameters (embedding and
    LM head, the root stays gathered from forward to backward) and their unsharded gradients
    (the LM head's from the start of the backward, the embedding's at its end), plus the decoder
    layer that computes, the one prefetched after it (FSDP2_PREFETCHED_LAYERS) and the computing
    layer's unsharded gradient before its reduce-scatter.
    ZeRO-3 gathers module by module: the largest module (the embedding or LM head matrix, or an
    MLP matrix) with its gradient, plus the prefetch bucket (0.9 x hidden^2 parameters, the
    transformers "auto"). Parameters stage3_max_live_parameters / stage3_max_reuse_distance
    keep gathered for reuse are not counted; lower those if a run measures more."""
    if sharding is None:
        return 0.0
    layer = dims.linear_params_per_layer
    if sharding == "fsdp2":
        root = dims.embedding_parameters
        return float(gather_bytes) * (2 * root + (1 + FSDP2_PREFETCHED_LAYERS) * layer + layer)
    if sharding == "zero3":
        largest = max(
            dims.vocab_size * dims.hidden,
            dims.hidden * dims.intermediate,
            dims.hidden * dims.num_heads * dims.head_dim,
        )
        prefetch = ZERO3_PREFETCH_BUCKET_PER_HIDDEN_SQUARED * dims.hidden**2
        return float(gather_bytes) * (2 * largest + prefetch)
    raise ValueError(f"unknown sharding {sharding!r}; one of: {', '.join(SHARDINGS)} (or None)")
