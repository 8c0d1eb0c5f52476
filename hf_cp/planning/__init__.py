"""Planning ahead of training, torch-free: the global batch sampler, the planning setup shared
by the trainer, the dry run and `hf-cp plan`, plan prediction, and the planner worker."""

from hf_cp.planning.predict import PredictedPlan, plan_and_predict, predict
from hf_cp.planning.sampler import GlobalBatch, GlobalBatchSampler
from hf_cp.planning.setup import PlanningSettings, PlanningSetup, planning_setup
from hf_cp.planning.worker import PlannedStep, Planner

__all__ = [
    "GlobalBatch",
    "GlobalBatchSampler",
    "PlannedStep",
    "Planner",
    "PlanningSettings",
    "PlanningSetup",
    "PredictedPlan",
    "plan_and_predict",
    "planning_setup",
    "predict",
]
