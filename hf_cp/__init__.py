"""hf_cp: load-balanced context parallelism for long-context training with Hugging Face."""

from .cluster import ClusterSpec
from .cost import CostModel, HardwareProfile, ModelDims
from .plan import Group, StepPlan, Wave
from .shard import ShardMode

__version__ = "0.1.0"
__all__ = ["ClusterSpec", "CostModel", "Group", "HardwareProfile", "ModelDims", "ShardMode", "StepPlan", "Wave"]
