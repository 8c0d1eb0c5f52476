"""Pricing: one cost model for every balancer, the simulator and the reports.

`model` (CostModel: compute, communication and memory per rank from a hardware profile and the
model's dimensions), `execution` (what the wall clock adds to a plan: overlap, reductions),
`blocks` (block layouts priced from masked areas), `pipeline` (the 1F1B bubble), `simulate`
(a plan's per-rank time, idle, memory and bytes; lower bounds), `exchange` (bytes against ring
zigzag), `fit` (the least-squares fits behind profiles and online calibration). Torch-free.
"""

from hf_cp.cost.model import CostModel, HardwareProfile, ModelDims, RankCost

__all__ = ["CostModel", "HardwareProfile", "ModelDims", "RankCost"]
