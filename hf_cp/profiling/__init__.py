"""Measuring the cost model on this device (`hf-cp profile`) and running plans' compute on it
(`hf-cp replay`): decoder layers built from a model config, shard attention, timing, fits."""

from hf_cp.cost.fit import FitQuality, fit_quality, nonnegative_lstsq
from hf_cp.profiling.layers import DecoderStack, RankWork
from hf_cp.profiling.measure import ProfileError, ProfileResult, run_profile
from hf_cp.profiling.profile_file import profile_yaml, write_profile

__all__ = [
    "DecoderStack",
    "FitQuality",
    "ProfileError",
    "ProfileResult",
    "RankWork",
    "fit_quality",
    "nonnegative_lstsq",
    "profile_yaml",
    "run_profile",
    "write_profile",
]
