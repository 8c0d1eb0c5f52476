"""hf_cp: load-balanced context parallelism for long-context training with Hugging Face.

Importing it loads only the torch-free planning half, and makes `attn_implementation="hf_cp"`
available to transformers as soon as transformers is loaded (registration.py).
"""

from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.cost.model import CostModel
from hf_cp.modes.segments import ShardMode
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import Group, StepPlan, Wave
from hf_cp.registration import register_with_transformers

register_with_transformers()

__version__ = "0.1.0"
__all__ = ["ClusterSpec", "CostModel", "Group", "HardwareProfile", "ModelDims", "ShardMode", "StepPlan", "Wave"]
