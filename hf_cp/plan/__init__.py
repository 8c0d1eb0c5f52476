"""The plan contract: what every rank runs in one optimizer step.

`step_plan.StepPlan` (waves of disjoint CP groups, validated), `cluster.ClusterSpec` (world,
memory cap, the registry of groups), `block_layout` (the blocks mode's placed chunks and
compute blocks), `chunks` (ChunkFlow's dependent chunks), `bins` (first-fit packing) and
`sorting` (fast stable orders of integer keys).
Plain data and pure functions: a plan never prices itself (cost/ does).
"""

from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import ChunkedSample, Group, PlanError, StepPlan, Wave

__all__ = ["ChunkedSample", "ClusterSpec", "Group", "PlanError", "StepPlan", "Wave"]
