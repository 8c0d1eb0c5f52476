"""Online calibration, the trainer's side: observe every step, refit on schedule, adopt rank 0's fit.

The fitting itself is hf_cp.planning.calibration (pure, torch-free). Here it meets a run: every
step's record (identical on every rank) is one observation of the cost model the step was
planned with; a refit that is due is offered at the next plan agreement (the coefficients ride
on its exchange, train/step/agreement.py), and the fit every rank receives there, rank 0's, plans
the steps that no rank has planned yet (after the planner's lookahead), the same on every rank. The
latest fit is a profile YAML that each checkpoint and the end of training write
(`CALIBRATED_PROFILE`; `hf-cp plan --profile FILE` reads it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from hf_cp.cost.model import CostModel
from hf_cp.planning.calibration import (
    CalibrationFit,
    CalibrationSettings,
    Calibrator,
    Coefficients,
    calibrated_profile_yaml,
    observe_step,
)
from hf_cp.planning.worker import Planner
from hf_cp.train.measure.step_record import StepRecord

logger = logging.getLogger(__name__)

# the online calibration's profile, in each checkpoint and in output_dir at the end of training
CALIBRATED_PROFILE = "cp_profile_calibrated.yaml"

# a refit is said (a warning on rank 0) when a coefficient moved by more than this, relative, since
# the last fit said; a refit that only confirms it is logged at INFO
NOTE_CHANGE = 0.05


def moved(new: Coefficients, old: Coefficients, tolerance: float = NOTE_CHANGE) -> bool:
    """Whether any coefficient of `new` differs from `old`'s by more than `tolerance`, relative
    (an absolute difference for a coefficient that is 0 in `old`)."""
    for a, b in zip(new.to_list(), old.to_list()):
        if abs(a - b) > tolerance * (abs(b) if b else 1.0):
            return True
    return False


class OnlineCalibration:
    """Calibration versions of one run: version -> (coefficients, cost model); 0 is the profile
    as given. Without `settings` (calibration off) it observes nothing and offers no fit.

    `num_steps`: the run's steps (a fit that would apply to none is dropped); `rank`: rank 0 logs
    adoptions."""

    def __init__(self, cost: CostModel, settings: Optional[CalibrationSettings], num_steps: int, rank: int):
        self.cost = cost
        gradient_gb = cost.gradient_bytes() / 1e9
        self.calibrator: Optional[Calibrator] = (
            Calibrator(cost.profile, settings, gradient_gb=gradient_gb) if settings is not None else None
        )
        self.models: Dict[int, Tuple[Coefficients, CostModel]] = {0: (Coefficients.of(cost.profile, gradient_gb), cost)}
        self.pending_fit: Optional[CalibrationFit] = (
            None  # a fit made after the last step, offered at the next agreement
        )
        self.num_steps, self.rank = num_steps, rank
        self.said: Optional[Coefficients] = None  # the coefficients of the last fit the log said

    @classmethod
    def for_run(cls, args, cost: CostModel, num_steps: int, rank: int) -> OnlineCalibration:
        """As CPTrainingArguments ask (cp_calibrate*; off under full_determinism)."""
        settings = None
        if args.cp_calibrate and not args.full_determinism:
            settings = CalibrationSettings(
                args.cp_calibrate_min_steps,
                args.cp_calibrate_every,
                max(16, args.cp_calibrate_min_steps),
                args.cp_calibrate_scale_after,
            )
        return cls(cost, settings, num_steps, rank)

    def observe(self, rec: StepRecord, ps) -> None:
        """Observe a step (`ps`: its PlannedStep); when a refit is due, fit and keep the result
        for the next agreement."""
        cal = self.calibrator
        if cal is None or ps is None:
            return
        coefficients, cost = self.models[ps.cost_version]
        cal.add(
            observe_step(
                rec.index,
                ps.predicted,
                cost,
                coefficients.comm_scale,
                rec.measured_ms,
                # the fit is of the plan's training pass: the forward-only passes before it are
                # predicted from the same coefficients (SimResult.forward_only_ms), not fitted
                rec.step_wall_ms - rec.forward_only_ms,
                rec.wave_max_ms,
            )
        )
        if cal.due():
            self.pending_fit = cal.refit(prior=self.models[max(self.models)][0])

    def offer(self) -> List[float]:
        """The payload this rank brings to the next agreement (once): its pending fit, else zeros."""
        fit, self.pending_fit = self.pending_fit, None
        return fit.coefficients.to_payload(fit.version) if fit is not None else [0.0] * Coefficients.PAYLOAD_SIZE

    def adopt(self, payload: Sequence[float], index: int, planner: Planner) -> None:
        """The agreed payload (rank 0's), the same on every rank, at step `index`: a fit in it
        plans the steps not yet planned: those after `planner`'s lookahead (from the next step
        for a planner of batches made as training goes, whose lookahead is 0)."""
        version, coefficients = Coefficients.from_payload(payload)
        if coefficients is None:
            return
        cal = self.calibrator
        base = self.cost
        cost = base.with_profile(cal.profile(coefficients))
        first = index + planner.lookahead + 1
        if first >= self.num_steps:
            return  # no step left to plan with it
        self.models[version] = (coefficients, cost)
        planner.set_cost(first, version, cost)
        fit = cal.fits[version - 1]
        fit.applies_from = first
        if self.rank != 0:
            return
        if self.said is None or moved(coefficients, self.said):
            self.said = coefficients
            logger.warning(
                "hf_cp: %s; steps from %d on are planned with it", fit.describe(cal.base_coefficients), first + 1
            )
        else:  # a refit that confirms the last one said: not worth a paragraph
            logger.info(
                "hf_cp: calibration %d from %d steps: no coefficient moved by more than %.0f%% since the last one "
                "logged; steps from %d on are planned with it",
                version,
                fit.steps,
                100 * NOTE_CHANGE,
                first + 1,
            )

    def profile_yaml(self, profile: Union[str, object], run: str = "") -> Optional[str]:
        """The latest calibrated profile as YAML (None before the first calibration). `profile`:
        the run's profile setting (a name or path names the base; else the profile's own name)."""
        cal = self.calibrator
        latest = max(self.models)
        if cal is None or latest == 0:
            return None
        coefficients, _ = self.models[latest]
        base = profile if isinstance(profile, str) else cal.base.name
        return calibrated_profile_yaml(cal.profile(coefficients), cal.fits[latest - 1], base, run)


def write_calibrated_profile(folder: Path, text: Optional[str], name: str = CALIBRATED_PROFILE) -> Optional[Path]:
    """Write `text` (a calibrated profile; None: nothing yet) to folder/name; the path written."""
    if text is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def save_run_calibrated_profile(args, text: Optional[str]) -> Optional[Path]:
    """At the end of training, on the process that saves (args.should_save): the run's calibrated
    profile into args.output_dir, said once. Every trainer calls this one function."""
    if not args.should_save:
        return None
    path = write_calibrated_profile(Path(args.output_dir), text, CALIBRATED_PROFILE)
    if path is not None:
        logger.warning("hf_cp: calibrated cost profile written to %s (hf-cp plan --profile %s)", path, path)
    return path
