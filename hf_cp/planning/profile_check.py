"""Does the hardware profile describe this run? Start-up warnings when it does not.

A profile measured on another kind of device, or with other layer dimensions, predicts rank
times that can be several times off (a user's CPU run measured 2.4-4x the bundled profile's
predictions, and nothing told them). Planning still works with it, and online calibration
(cp_calibrate) corrects its coefficients during the run, but the user should know, and know
the command that measures their own machine.
"""

from __future__ import annotations

from typing import List, Optional

from ..cost import HardwareProfile, ModelDims

# The per-layer dimensions c1 and c2 are measured with; other values are scaled by FLOP ratios
# (CostModel), which a real kernel follows only roughly. Layers and vocabulary are exact.
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
