"""Training with per-step load-balanced context parallelism on the Hugging Face Trainer."""
from .args import CPTrainingArguments
from .collator import MicroBatch, PlanCollator, RankStep
from .groups import CPGroups
from .planner import PlannedStep, Planner
from .sampler import GlobalBatch, GlobalBatchSampler
from .trainer import CPTrainer

__all__ = ["CPGroups", "CPTrainer", "CPTrainingArguments", "GlobalBatch", "GlobalBatchSampler", "MicroBatch",
           "PlanCollator", "PlannedStep", "Planner", "RankStep"]
