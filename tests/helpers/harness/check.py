"""The trainer exactness check: every step of a distributed run against the single-process
reference (reference.py).

For each step the run recorded, it compares
- the loss CPTrainer recorded (history.json) and the loss the Trainer logged,
- the global gradient norm before clipping (the Trainer's grad_norm),
- each parameter's gradient before clipping and the optimizer step,
- each parameter after the optimizer step,
and then the final parameters. Losses and norms are compared as |run - ref| / |ref|, tensors
as ||run - ref|| / ||ref|| per tensor.

Why per step and before the optimizer: AdamW divides each update by the gradient's running
magnitude, so a loss scaled by 1.001 moves the parameters almost exactly as the right loss does
(7.9e-7 relative after 2 steps on the world-2 balancer data, far under a 1e-5 tolerance on
parameters). The loss and the gradients carry such a scale whole: 1e-3 relative.

Tolerances, against the largest errors of the correct world-2 runs of the fast suite (float32
sums in another order; tests/helpers/world2_job.py, measured at the commit that set them): loss and
grad_norm 1e-5 (runs: <= 1.3e-7), gradients 1e-4 (runs: <= 4.1e-6), parameters 1e-5 (runs:
<= 2.7e-6). A 0.1% loss or gradient scale is 1e-3 on the loss or the gradients: 10 to 100
times the tolerance (tests/test_trainer_exactness.py shows the check failing on it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .reference import initial_params, reference_steps

LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5
GRAD_RTOL = 1e-4
PARAM_RTOL = 1e-5
# AdamW moves an entry by lr * m / (sqrt(v) + eps), eps 1e-8: where the reference gradient is
# within a few eps of zero, fp32 noise in it moves the update by ~lr * noise / eps. Measured: one
# entry of Qwen3-Next's o_proj (4096 entries, median |gradient| 6e-4) had 9.77e-9 in the
# reference and 1.04e-8 over a CP group, and its parameter moved 1.5e-5 apart, 1.15e-5 of the
# tensor. Such entries are checked through their gradients (GRAD_RTOL), not their parameters,
# from the first step their reference gradient is that small on.
EPS_DOMINATED = 1e-7


class ExactnessMismatch(AssertionError):
    """A run differs from the single-process reference; `failures` names each quantity."""

    def __init__(self, failures: List[str], report: ExactnessReport):
        super().__init__("run differs from the single-process reference:\n  " + "\n  ".join(failures))
        self.failures = failures
        self.report = report


@dataclass
class ExactnessReport:
    steps: List[int]  # 0-based global steps compared
    worst: Dict[str, float] = field(default_factory=dict)  # quantity -> largest relative error
    failures: List[str] = field(default_factory=list)

    def note(self, quantity: str, err: float, tol: float, what: str) -> None:
        self.worst[quantity] = max(self.worst.get(quantity, 0.0), err)
        if not err <= tol:  # NaN fails too
            self.failures.append(f"{what}: relative error {err:.3g} > {tol:g}")


def relative_errors(
    got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], skip: Optional[Dict[str, torch.Tensor]] = None
) -> Dict[str, float]:
    """Per tensor: ||got - want|| / ||want||, over the entries `skip` (a mask per tensor) leaves."""
    if set(got) != set(want):
        raise AssertionError(f"different parameter names: {sorted(set(got) ^ set(want))}")
    out = {}
    for k in want:
        gap = got[k].float() - want[k]
        if skip is not None and k in skip:
            gap = gap.masked_fill(skip[k], 0.0)
        out[k] = float(gap.norm() / want[k].norm().clamp_min(1e-30))
    return out


def eps_dominated(ref, upto: int) -> Dict[str, torch.Tensor]:
    """Per tensor, the entries whose reference gradient was below EPS_DOMINATED at some step up
    to `upto` (0-based)."""
    out: Dict[str, torch.Tensor] = {}
    for r in ref[: upto + 1]:
        for name, g in r.grads.items():
            small = g.abs() < EPS_DOMINATED
            out[name] = out[name] | small if name in out else small
    return out


def _scalar_error(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def load_run(out: Path) -> dict:
    """What harness.job saved for one run (rank 0), in the form compare_with_reference takes."""
    out = Path(out)
    return {
        "history": json.loads((out / "history.json").read_text()),
        "log_history": json.loads((out / "log_history.json").read_text()),
        "steps": torch.load(out / "steps.pt"),
        "final": torch.load(out / "params.pt"),
    }


def check_run(spec: dict) -> ExactnessReport:
    """compare_with_reference for the run harness.job trained into spec['out']."""
    return compare_with_reference(spec, **load_run(spec["out"]))


def compare_with_reference(
    spec: dict, history: List[dict], log_history: List[dict], steps: Dict[int, dict], final: Dict[str, torch.Tensor]
) -> ExactnessReport:
    """Compare a run with the reference, step by step; raise ExactnessMismatch listing every
    quantity out of tolerance, else return the worst errors.

    history: CPTrainer.cp_history; log_history: the Trainer's state.log_history (logging_steps=1);
    steps: capture.capture_steps' records; final: the final parameters. A run resumed from a
    checkpoint (spec resume_from) is compared from its first step on."""
    ref = reference_steps(spec)
    recorded = {r["index"]: r for r in history}
    # the Trainer logs a training record per step, `step` counted from 1
    logged = {r["step"] - 1: r for r in log_history if "loss" in r and "grad_norm" in r}
    indices = sorted(recorded)
    expected = list(range(indices[0] if spec.get("resume_from") and indices else 0, spec["steps"]))
    if indices != expected or sorted(steps) != expected:
        raise AssertionError(
            f"the run recorded steps {indices} (history) and {sorted(steps)} (gradients), expected {expected}"
        )
    report = ExactnessReport(steps=indices)
    for k in indices:
        r, got = ref[k], steps[k]
        report.note("loss", _scalar_error(recorded[k]["loss"], r.loss), LOSS_RTOL, f"step {k + 1} loss")
        if k not in logged:
            report.failures.append(f"step {k + 1}: the Trainer logged no loss and grad_norm")
        else:
            log = logged[k]
            report.note("logged_loss", _scalar_error(log["loss"], r.loss), LOSS_RTOL, f"step {k + 1} logged loss")
            report.note(
                "grad_norm", _scalar_error(log["grad_norm"], r.grad_norm), GRAD_NORM_RTOL, f"step {k + 1} grad_norm"
            )
        for name, err in relative_errors(got["grads"], r.grads).items():
            report.note("grads", err, GRAD_RTOL, f"step {k + 1} gradient of {name}")
        for name, err in relative_errors(got["params"], r.params, eps_dominated(ref, k)).items():
            report.note("params", err, PARAM_RTOL, f"step {k + 1} {name} after the optimizer step")
    for name, err in relative_errors(final, ref[-1].params, eps_dominated(ref, len(ref) - 1)).items():
        report.note("final", err, PARAM_RTOL, f"final {name}")
    # not vacuous: the reference trained (gradients and updates are not zero)
    init = initial_params(spec)
    moved = sum(float((ref[-1].params[n] - init[n]).norm()) for n in init)
    if not (moved > 0 and any(s.grad_norm > 0 for s in ref)):
        raise AssertionError("the reference did not train: the comparison would be vacuous")
    if report.failures:
        raise ExactnessMismatch(report.failures, report)
    return report
