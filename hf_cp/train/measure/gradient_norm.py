"""A step whose global gradient norm is not finite: stopped (cp_stop_on_nonfinite_grad) or
named in a warning, with the step's samples."""

from __future__ import annotations

from typing import Sequence


class NonFiniteGradientError(RuntimeError):
    """A step's global gradient norm was NaN or infinite."""


def nonfinite_gradients(norm: float, global_step: int, sample_ids: Sequence[int], deepspeed: bool, stop: bool) -> str:
    """Raise NonFiniteGradientError for step `global_step` (whose samples are `sample_ids`) when
    `stop`; else return the warning to log. `deepspeed`: DeepSpeed skipped the update."""
    ids = list(sample_ids)
    shown = ", ".join(map(str, ids[:20])) + (f", ... ({len(ids)} in all)" if len(ids) > 20 else "")
    what = (
        f"step {global_step}: the gradient norm is {norm} (non-finite gradients on some rank). "
        + (
            "DeepSpeed skipped the update, so the step's samples were not learned"
            if deepspeed
            else "the parameters may no longer be finite"
        )
        + f"; its samples: [{shown}]"
    )
    if stop:
        raise NonFiniteGradientError(
            f"{what}. Stopped before this step's checkpoint: the newest checkpoint holds the last good state. "
            f"Common causes: a learning rate too high, fp16 overflow, a corrupt sample. "
            f"cp_stop_on_nonfinite_grad: false skips such steps with a warning instead"
        )
    return f"{what}; continuing (cp_stop_on_nonfinite_grad is false)"
