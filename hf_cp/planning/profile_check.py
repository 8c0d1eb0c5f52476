"""Does the hardware profile describe this run? Start-up warnings when it does not.

A profile measured on another kind of device, or with other layer dimensions, predicts rank
times that can be several times off (a user's CPU run measured 2.4-4x the bundled profile's
predictions, and nothing told them). Planning still works with it, and online calibration
(cp_calibrate) corrects its coefficients during the run, but the user should know, and know
the command that measures their own machine.
"""

from __future__ import annotations

import os
from typing import List, Optional

from hf_cp.cost.dims import ModelDims
from hf_cp.cost.hardware import HardwareProfile

# The per-layer dimensions c1 and c2 are measured with; other values are scaled by FLOP ratios
# (CostModel), which a real kernel follows only roughly. The number of layers scales exactly.
# The vocabulary sets the LM head's and the loss's share of a token's time, which a profile fitted
# on another vocabulary mispredicts (a 49K-vocabulary model on a 151K-vocabulary profile: 7x).
_LAYER_DIMS = ("hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate")


def profile_mismatches(profile: HardwareProfile, dims: ModelDims, device_type: Optional[str]) -> List[str]:
    """What about `profile` does not match a run of a model with `dims` on `device_type`
    ("cuda", "cpu", ...; None: unknown): one sentence each, empty when it matches."""
    out = []
    measured_on = (profile.device or "").lower()
    if device_type and measured_on and measured_on != device_type.lower():
        out.append(f"it was measured on {measured_on}, this run is on {device_type}")
    fd = profile.fitted_dims
    differ = [f"{k} {getattr(fd, k)} vs {getattr(dims, k)}" for k in _LAYER_DIMS if getattr(fd, k) != getattr(dims, k)]
    if differ:
        out.append(
            "its coefficients were fitted on other layer dimensions (profile vs model: "
            + ", ".join(differ)
            + "); they are scaled by FLOP ratios, which kernels follow only roughly"
        )
    if fd.vocab_size != dims.vocab_size:
        out.append(
            f"it was fitted with a vocabulary of {fd.vocab_size} tokens, the model has {dims.vocab_size}: the LM head "
            "and the loss take another share of each token's time"
        )
    return out


def profile_warning(
    profile: HardwareProfile, profile_source: str, dims: ModelDims, device_type: Optional[str], model_name: str = ""
) -> Optional[str]:
    """One warning naming the mismatches and the `hf-cp profile` command that fixes them; None
    when the profile matches."""
    problems = profile_mismatches(profile, dims, device_type)
    if not problems:
        return None
    device = device_type or "cuda"
    model = model_name or "<your model config>"
    return (
        f"the cost profile {profile_source!r} may not describe this run: "
        + "; ".join(problems)
        + ". Predicted times (and so the plans' balance) can be several times off. Measure this machine with "
        f"`hf-cp profile --model {model} --device {device} --out configs/profiles/mine.yaml` and set "
        "cp_profile: mine (online calibration, cp_calibrate, also corrects the coefficients during the run)"
    )


def shared_cores_warning(local_ranks: int, threads_per_rank: int, cores: int) -> Optional[str]:
    """A warning when the ranks of one node need more cores than it has (CPU training: every
    rank's torch threads), None otherwise. The cost model prices each rank on a device of its
    own; ranks that time-share cores hand an early finisher's core to the others, so imbalance
    costs less wall time, and CP groups and extra waves cost more, than it predicts. Measured:
    4 processes on 2 cores, auto 0.95-0.98x static's tokens/s although far better balanced;
    2 processes on 2 cores, 1.10x (benchmarks/wallclock.md)."""
    need = local_ranks * max(1, threads_per_rank)
    if cores <= 0 or need <= cores:
        return None
    return (
        f"{local_ranks} ranks x {threads_per_rank} torch thread(s) share {cores} CPU core(s) on this node: ranks "
        f"time-share cores, which the cost model does not price (one device per rank). Predicted balance gains "
        f"will mostly not show in wall time; run at most {max(1, cores // max(1, threads_per_rank))} ranks per "
        f"node at this thread count (OMP_NUM_THREADS) to measure them"
    )


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask: what a container or taskset grants)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (macOS)
        return os.cpu_count() or 1
