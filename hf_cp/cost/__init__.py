"""Pricing: one cost model for every balancer, the simulator and the reports.

`config_files` (reading a model config or profile by name, ConfigError), `dims` (ModelDims: a
model's dimensions from its config.json), `hardware` (HardwareProfile and its Links; transfer_ms,
the time to move bytes over a link), `model` (CostModel: compute, communication and memory per
rank), `execution` (what the wall clock adds to a plan: overlap, reductions), `blocks` (block
layouts priced from masked areas), `pipeline` (the 1F1B bubble), `simulate` (a plan's per-rank
time, idle, memory and bytes), `sharded` (waves under FSDP2/ZeRO-3), `bounds` (lower bounds on a
plan's time), `exchange` (bytes against ring zigzag), `fit` (the least-squares fits behind
profiles and online calibration). Torch-free.
"""

from hf_cp.cost.config_files import ConfigError
from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile, Link, transfer_ms
from hf_cp.cost.model import CostModel, RankCost

__all__ = ["ConfigError", "CostModel", "HardwareProfile", "Link", "ModelDims", "RankCost", "transfer_ms"]
