"""From training arguments, model config and sample lengths to what planning needs: the cost
model, the cluster and the global batch sampler. One function, shared by CPTrainer and by the
dry run (`hf-cp train --dry-run`), so that both plan exactly the same steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..cluster import ClusterSpec
from ..cost import CostModel, HardwareProfile, ModelDims
from .sampler import GlobalBatchSampler


@dataclass
class PlanningSetup:
    cost: CostModel
    cluster: ClusterSpec
    sampler: GlobalBatchSampler


def planning_setup(args, model_config: dict, lengths: Sequence[int], world_size: int) -> PlanningSetup:
    """`args`: CPTrainingArguments; `model_config`: the model's config as a dict."""
    dims = (
        ModelDims.load(args.cp_model_dims)
        if args.cp_model_dims
        else ModelDims.from_hf_config(model_config, source="model config")
    )
    profile = (
        HardwareProfile.from_dict(args.cp_profile, source="cp_profile")
        if isinstance(args.cp_profile, dict)
        else HardwareProfile.load(args.cp_profile)
    )
    cluster = ClusterSpec(
        world_size, args.cp_max_tokens_per_rank, args.cp_gpus_per_node or profile.gpus_per_node, args.cp_max_group_size
    )
    sampler = GlobalBatchSampler(
        lengths,
        args.tokens_per_step(world_size),
        seed=args.seed,
        num_epochs=args.num_train_epochs,
        max_steps=args.max_steps if args.max_steps and args.max_steps > 0 else None,
        shuffle=args.cp_shuffle,
    )
    return PlanningSetup(CostModel(dims, profile), cluster, sampler)
