"""Online calibration: fit the cost model's coefficients to a run's measured times.

A profile measured on other hardware, under other load or for other dimensions predicts rank
times that can be several times off, and a balancer that trusts it balances the wrong thing.
During training every step records, per rank, the measured compute of its micro-batches and
the step's wall time (CPTrainer's StepRecord). This module turns those into a profile that
predicts them:

* **Compute** (per rank): the simulator's prediction of a rank is linear in the profile's
  per-token, per-pair and per-micro-batch coefficients (c1, c2, c0), plus the communication
  that attention does not hide. So every rank of every step is one row of features, the
  prediction decomposed through the cost model's own result (`rank_features`): what the rank's
  tokens, attention and micro-batches cost per unit of c1, c2 and c0, and its unhidden
  communication per unit of the link scale. `fit_compute` fits the four non-negative
  coefficients to the measured times, minimising relative error with Huber-weighted
  iteratively reweighted least squares; a weak prior keeps the profile's *shape* (the ratios
  between its coefficients) in directions the data cannot tell apart, and a coefficient whose
  feature is a negligible share of the predictions (communication hidden behind attention)
  keeps its value.
* **Wall clock** (per step): under an execution whose waves synchronise, a step's wall time is
  the sum over waves of the slowest rank's time in the wave, plus one gradient reduction per
  wave, plus a fixed cost per step (hf_cp/execution.py). `fit_wall` fits the fixed cost of a
  reduction and of a step to what the measured wall time leaves after the measured slowest
  ranks and the reductions' bytes over the link.

Every rank fits the same numbers from the same (all-gathered) records; CPTrainer still adopts
rank 0's through the plan-agreement exchange (`Coefficients.to_payload`), so that the last bits
of a floating-point fit can never make ranks plan differently. New coefficients apply from a
step not yet planned on any rank (the planner's lookahead), the same on every rank.
Pure functions on plain data: no torch.
"""

from __future__ import annotations

import datetime
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import yaml

from hf_cp.cost.fit import nonnegative_lstsq
from hf_cp.cost.hardware import HardwareProfile, Link
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import SimResult

COMPUTE_TERMS = ("c1_ms_per_token", "c2_ms_per_pair", "c0_ms", "comm_scale", "cp_attention_scale", "cp_message_ms")


class CalibrationError(ValueError):
    """Calibration settings or inputs are invalid."""


# --------------------------------------------------------------------------- coefficients
@dataclass(frozen=True)
class Coefficients:
    """The fitted numbers: the profile's compute coefficients, a scale on its links' times, and
    the wall-clock terms. `apply` turns them into a profile; `comm_scale` divides the links'
    bandwidth and multiplies their latency (all communication times scale by it)."""

    c1_ms_per_token: float
    c2_ms_per_pair: float
    c0_ms: float
    comm_scale: float = 1.0
    reduction_overhead_ms: float = 0.0
    step_overhead_ms: float = 0.0
    cp_attention_scale: float = 1.0
    cp_message_ms: float = 0.0

    @classmethod
    def of(cls, profile: HardwareProfile, gradient_gb: float = 0.0) -> Coefficients:
        """`profile`'s coefficients; its engine cost per GB of gradients (`gradient_gb`: the run's
        model) folds into the fixed cost per reduction, the one number the wall fit refits."""
        return cls(
            profile.c1_ms_per_token,
            profile.c2_ms_per_pair,
            profile.c0_ms,
            1.0,
            profile.reduction_overhead_ms + profile.engine_reduction_ms_per_gb * gradient_gb,
            profile.step_overhead_ms,
            profile.cp_attention_scale,
            profile.cp_message_ms,
        )

    def to_list(self) -> List[float]:
        return [
            self.c1_ms_per_token,
            self.c2_ms_per_pair,
            self.c0_ms,
            self.comm_scale,
            self.reduction_overhead_ms,
            self.step_overhead_ms,
            self.cp_attention_scale,
            self.cp_message_ms,
        ]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> Coefficients:
        if len(values) != 8:
            raise CalibrationError(f"coefficients need 8 values, got {len(values)}")
        return cls(*(float(v) for v in values))

    def compute_theta(self) -> np.ndarray:
        """The compute fit's unknowns, one per rank_features column: c1, c2, c0, the link scale,
        c2 x cp_attention_scale (attention in a CP group) and the cost of an exchange message."""
        return np.asarray(
            [
                self.c1_ms_per_token,
                self.c2_ms_per_pair,
                self.c0_ms,
                self.comm_scale,
                self.c2_ms_per_pair * self.cp_attention_scale,
                self.cp_message_ms,
            ]
        )

    def rounded(self, digits: int = 6) -> Coefficients:
        """To `digits` significant digits: the numbers a profile YAML holds, so that a saved
        profile plans exactly the steps the run planned with it."""
        return Coefficients.from_list([float(f"{v:.{digits}g}") for v in self.to_list()])

    def apply(self, base: HardwareProfile, name: Optional[str] = None, description: Optional[str] = None):
        """`base` with these coefficients (its links scaled by comm_scale)."""
        s = self.comm_scale
        links = {k: Link(v.bandwidth_gbps / s, v.latency_us * s) for k, v in base.links.items()}
        return replace(
            base,
            name=name or base.name,
            description=base.description if description is None else description,
            c1_ms_per_token=self.c1_ms_per_token,
            # a hybrid's linear layers' rate moves with c1: the fit scales the per-token time as a
            # whole (rank_features' first feature is the whole per-token time over the profile's c1)
            linear_layer_ms_per_token=base.linear_layer_ms_per_token * self.c1_ms_per_token / base.c1_ms_per_token,
            c2_ms_per_pair=self.c2_ms_per_pair,
            c0_ms=self.c0_ms,
            links=links,
            reduction_overhead_ms=self.reduction_overhead_ms,
            # the fitted cost per reduction is all of it beyond the link's bytes, for this run's
            # model: the engine's per-GB prior is inside it (Coefficients.of)
            engine_reduction_ms_per_gb=0.0,
            step_overhead_ms=self.step_overhead_ms,
            cp_attention_scale=self.cp_attention_scale,
            cp_message_ms=self.cp_message_ms,
        )

    # the plan-agreement exchange carries [version, *coefficients]; version 0 = nothing new
    PAYLOAD_SIZE = 9

    def to_payload(self, version: int) -> List[float]:
        return [float(version)] + self.to_list()

    @staticmethod
    def from_payload(payload: Sequence[float]) -> Tuple[int, Optional[Coefficients]]:
        version = int(round(payload[0])) if payload else 0
        if version <= 0:
            return 0, None
        return version, Coefficients.from_list(payload[1:9])


# --------------------------------------------------------------------------- observations
def rank_features(
    sim: SimResult, cost: CostModel, comm_scale: float = 1.0
) -> List[Tuple[float, float, float, float, float, float]]:
    """Per rank: its predicted time inside its micro-batches (SimResult.occupied_ms, what CPTrainer
    measures) decomposed per unit of the compute fit's unknowns (Coefficients.compute_theta):
    the profile's c1, c2 (attention alone), c0, the link scale (`comm_scale`: the scale the
    prediction was made with, relative to the reference links), c2 x cp_attention_scale
    (attention in a CP group) and cp_message_ms (the group's exchange messages, GroupRun.messages),
    so that occupied = features . theta (+ any wait for a group's late member).

    A micro-batch lasts as long as its group's slowest member: its compute is L*(c1'*tokens +
    attention) + head*tokens + L*c0, with c1' and the LM head's per-token time proportional to
    the profile's c1 and attention proportional to its c2 (times cp_attention_scale in a group
    with distributed documents; hf_cp/cost.py), plus the communication attention does not hide
    and cp_message_ms per message. Tokens come from the simulation; attention is what remains of
    the member's compute. Every active member of the group is charged the slowest member's
    features."""
    if not sim.micro_batches:
        raise CalibrationError(
            "rank_features needs a SimResult with per-rank micro-batches (hf_cp.cost.simulate.simulate)"
        )
    p = cost.profile
    L = cost.dims.num_layers
    per_token = L * cost.c1 + cost.head_ms_per_token  # ms per token at the profile's c1
    out = [[0.0] * 6 for _ in range(sim.world_size)]
    for run in sim.runs:
        if getattr(run, "chunked", False):  # priced as a whole (ChunkFlow): observe_step leaves the rank out
            continue
        totals = [c + m for c, m in zip(run.member_compute_ms, run.member_comm_ms)]
        slowest = max(range(len(totals)), key=lambda m: totals[m])
        t1 = per_token * run.member_tokens[slowest]
        attn = max(0.0, run.member_compute_ms[slowest] - t1)
        in_group = bool(run.n_distributed) and len(run.ranks) > 1
        messages = float(getattr(run, "messages", 0))
        f = [
            t1 / p.c1_ms_per_token,
            0.0 if in_group else attn / p.c2_ms_per_pair,
            float(L),
            max(0.0, run.member_comm_ms[slowest] - messages * p.cp_message_ms) / comm_scale,
            attn / (p.c2_ms_per_pair * p.cp_attention_scale) if in_group else 0.0,
            messages,
        ]
        for m, r in enumerate(run.ranks):
            if run.member_tokens[m] or run.n_distributed:  # the members that run the micro-batch
                out[r] = [a + b for a, b in zip(out[r], f)]
    return [tuple(x) for x in out]


@dataclass(frozen=True)
class StepObservation:
    """What one step says about the cost model: per-rank features and measured compute, and the
    step's measured wall time with what the execution explains of it."""

    step: int
    features: Tuple[Tuple[float, ...], ...]  # per rank (rank_features)
    measured_ms: Tuple[float, ...]  # per rank: compute of its micro-batches
    wall_ms: float  # the step's wall time (slowest rank)
    critical_ms: (
        float  # measured: sum over waves of the slowest rank's time (synchronised waves), else the slowest rank
    )
    reductions: int  # gradient reductions in the step
    reduction_bytes_ms: float  # the reductions' bytes over the link (model), excluding fixed costs


def observe_step(
    step: int,
    sim: SimResult,
    cost: CostModel,
    comm_scale: float,
    measured_ms: Sequence[float],
    wall_ms: float,
    wave_max_ms: Sequence[float],
) -> StepObservation:
    """One step's observation: `sim` is its plan as predicted with `cost` (whose links are
    `comm_scale` times the reference's); `wave_max_ms` per wave, the slowest rank's measured time
    in it (dummy micro-batches included)."""
    ex = cost.execution
    n_waves = len(wave_max_ms)
    sync = ex is None or ex.waves_synchronise
    # one per backward pass of a wave under ZeRO-2 (a chunked sample's chunks each reduce)
    reductions = sim.reductions or (n_waves if sync else 1)
    critical = float(sum(wave_max_ms)) if sync else float(max(measured_ms, default=0.0))
    bytes_ms = max(0.0, cost.gradient_reduction_ms(sim.world_size) - cost.reduction_fixed_ms())
    # a rank that ran chunked samples (ChunkFlow: recomputes, state) is not c1/c2/c0 work alone
    unmodelled = {r for run in sim.runs if getattr(run, "chunked", False) for r in run.ranks}
    return StepObservation(
        step=step,
        features=tuple(rank_features(sim, cost, comm_scale)),
        measured_ms=tuple(0.0 if r in unmodelled else float(m) for r, m in enumerate(measured_ms)),
        wall_ms=float(wall_ms),
        critical_ms=critical,
        reductions=reductions,
        reduction_bytes_ms=reductions * bytes_ms,
    )


# --------------------------------------------------------------------------- the fits
def robust_nonnegative_fit(
    X: np.ndarray,
    y: np.ndarray,
    relative: bool = True,
    prior_X: Optional[np.ndarray] = None,
    prior_y: Optional[np.ndarray] = None,
    huber: float = 1.5,
    iterations: int = 30,
    row_scale: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Non-negative b minimising the Huber loss of the residuals X b - y (relative to y when
    `relative`), by iteratively reweighted least squares; `prior_X b = prior_y` rows (already
    weighted) join every iteration unweighted by Huber. Outliers (a step slowed by another
    process) get weight k*scale/|residual| beyond k = `huber` robust standard deviations."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise CalibrationError(f"fit needs a design matrix matching its measurements, got {X.shape} and {y.shape}")
    # relative: each row divided by its measurement (`row_scale` when y is already shifted)
    denom = np.abs(np.asarray(row_scale, dtype=np.float64) if row_scale is not None else y)
    scale_rows = 1.0 / np.maximum(denom, 1e-9) if relative else np.ones_like(y)
    Xr, yr = X * scale_rows[:, None], y * scale_rows
    w = np.ones_like(yr)
    b = np.zeros(X.shape[1])
    for _ in range(iterations):
        A, t = Xr * w[:, None], yr * w
        if prior_X is not None:
            A, t = np.vstack([A, prior_X]), np.concatenate([t, prior_y])
        new = np.asarray(nonnegative_lstsq(A, t))
        res = Xr @ new - yr
        mad = float(np.median(np.abs(res - np.median(res)))) * 1.4826
        scale = max(mad, 1e-3 if relative else 1e-6)
        a = np.abs(res) / scale
        w = np.sqrt(np.where(a <= huber, 1.0, huber / np.maximum(a, 1e-12)))
        if np.allclose(new, b, rtol=1e-9, atol=0.0):
            b = new
            break
        b = new
    return b


def median_relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Median over pairs with a measurement of |predicted - measured| / measured."""
    errs = [abs(p - m) / m for p, m in zip(predicted, measured) if m > 0]
    return statistics.median(errs) if errs else float("nan")


# A coefficient is fitted only when its feature carries at least this share of the predictions.
MIN_FEATURE_SHARE = 0.005
# The shape prior's weight, in relative observations: it decides only what the data cannot
# (c1 against c2 when every micro-batch holds a similar mix of tokens and attention).
PRIOR_WEIGHT = 0.3
# c1, c2 and attention in CP groups stay above this fraction of the reference profile's value at
# the data's overall scale: a noisy fit of collinear features must not price attention at zero.
COEFFICIENT_FLOOR = 0.1
# A term the reference profile prices at zero (cp_message_ms unless measured) has no shape to
# keep: it is fitted freely (non-negative) once its feature is in at least this share of the rows.
MIN_ROW_SHARE = 0.05


def fit_compute(
    observations: Sequence[StepObservation], prior: Coefficients, reference: Optional[Coefficients] = None
) -> Tuple[Coefficients, Dict[str, bool]]:
    """c1, c2, c0, the link scale, the CP-group attention scale and the cost of an exchange message
    fitted to the per-rank compute of `observations` (ranks without work left out); the wall-clock
    terms are `prior`'s. Returns the coefficients and, per term, whether the data determined it
    (the CP-group scale needs attention both alone and in groups); undetermined terms keep
    `prior`'s values.

    `reference` (default `prior`): the profile the run started from. Which terms the data
    determines, the shape prior (its ratios between coefficients, at the data's overall scale)
    and the floors are taken from it, so that no fit depends on an earlier fit's noise. A term
    the reference prices at zero has no shape: it is fitted freely when its feature is common
    enough (MIN_ROW_SHARE)."""
    reference = reference or prior
    rows, ys = [], []
    for o in observations:
        for f, m in zip(o.features, o.measured_ms):
            if m > 0 and any(f):
                rows.append(f)
                ys.append(m)
    if not rows:
        raise CalibrationError("no rank with measured work in the observations")
    X, y = np.asarray(rows, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    ref, theta_prior = reference.compute_theta(), prior.compute_theta()
    pred_ref = X @ ref
    share = (X * ref).sum(axis=0) / max(float(pred_ref.sum()), 1e-12)
    row_share = (X > 0).mean(axis=0)
    names = list(COMPUTE_TERMS)
    fit_cp = bool(share[1] >= MIN_FEATURE_SHARE and share[4] >= MIN_FEATURE_SHARE)
    if not fit_cp:  # attention of one kind only: the groups' factor keeps its value, c2 serves both
        keep = [i for i in range(len(names)) if names[i] != "cp_attention_scale"]
        X = X.copy()
        X[:, 1] += X[:, 4] * prior.cp_attention_scale
        share = share.copy()
        share[1] += share[4]
        X, share, row_share, ref, theta_prior = X[:, keep], share[keep], row_share[keep], ref[keep], theta_prior[keep]
        names = [names[i] for i in keep]
    n = X.shape[1]
    free = [ref[i] == 0 for i in range(n)]  # no reference value: no shape prior, no floor
    fitted = [bool(row_share[i] >= MIN_ROW_SHARE) if free[i] else bool(share[i] >= MIN_FEATURE_SHARE) for i in range(n)]
    determined = {k: False for k in COMPUTE_TERMS}
    determined.update(zip(names, fitted))
    ok = pred_ref > 0
    scale = float(np.median(y[ok] / pred_ref[ok])) if ok.any() else 1.0  # the data's overall scale
    cols = [i for i in range(n) if fitted[i]]
    fixed = [i for i in range(n) if not fitted[i]]
    if not cols:
        return prior, determined
    floor = np.zeros(n)
    for i, name in enumerate(names):
        if name in ("c1_ms_per_token", "c2_ms_per_pair", "cp_attention_scale"):
            floor[i] = COEFFICIENT_FLOOR * scale * ref[i]
    # theta = floor + phi, phi >= 0: the floors move to the measurements' side
    y_fit = y - X[:, fixed] @ theta_prior[fixed] - X[:, cols] @ floor[cols]
    k = math.sqrt(PRIOR_WEIGHT)
    shaped = [j for j, i in enumerate(cols) if not free[i]]
    prior_X = np.zeros((len(shaped), len(cols)))
    prior_y = np.zeros(len(shaped))
    for row, j in enumerate(shaped):  # k * theta_i / (scale * ref_i) = k
        i = cols[j]
        prior_X[row, j] = k / (scale * ref[i])
        prior_y[row] = k * (1.0 - floor[i] / (scale * ref[i]))
    phi = robust_nonnegative_fit(
        X[:, cols], np.maximum(y_fit, 1e-9), relative=True, prior_X=prior_X, prior_y=prior_y, row_scale=y
    )
    theta = theta_prior.copy()
    theta[cols] = floor[cols] + phi
    got = dict(zip(names, theta.tolist()))
    cp_scale = float(got["cp_attention_scale"] / got["c2_ms_per_pair"]) if fit_cp else prior.cp_attention_scale
    new = Coefficients(
        got["c1_ms_per_token"],
        got["c2_ms_per_pair"],
        got["c0_ms"],
        got["comm_scale"],
        prior.reduction_overhead_ms,
        prior.step_overhead_ms,
        cp_attention_scale=cp_scale,
        cp_message_ms=got["cp_message_ms"],
    )
    return new, determined


def fit_wall(observations: Sequence[StepObservation], prior: Coefficients) -> Tuple[float, float]:
    """(reduction_overhead_ms, step_overhead_ms): what each step's measured wall time leaves
    after its measured critical path and its reductions' bytes, as a fixed cost per reduction
    plus one per step (non-negative, Huber-robust). When every step has as many reductions, the
    two cannot be told apart: the per-reduction share keeps the prior's split (all of it per
    reduction without a prior)."""
    if not observations:
        raise CalibrationError("no observations")
    n = np.asarray([o.reductions for o in observations], dtype=np.float64)
    y = np.asarray([o.wall_ms - o.critical_ms - o.reduction_bytes_ms for o in observations], dtype=np.float64)
    if np.ptp(n) == 0:
        per_step = max(0.0, float(np.median(y)))
        r0, s0 = prior.reduction_overhead_ms, prior.step_overhead_ms
        per_red_share = r0 * n[0] / (r0 * n[0] + s0) if (r0 + s0) > 0 and n[0] > 0 else 1.0
        if n[0] == 0:
            return 0.0, per_step
        return per_step * per_red_share / n[0], per_step * (1 - per_red_share)
    X = np.stack([n, np.ones_like(n)], axis=1)
    b = robust_nonnegative_fit(X, y, relative=False)
    return float(b[0]), float(b[1])


def scale_fit(
    observations: Sequence[StepObservation], prior: Coefficients
) -> Optional[Tuple[Coefficients, Dict[str, bool], float]]:
    """The early scale: `prior` with its CPU work (c1, c2, c0, the fixed cost per reduction, which
    holds the engine's per-GB cost, and per step) times one factor, the median over the
    observed ranks of measured / predicted compute. Links, the CP-group attention scale and the
    exchange message cost are kept: the factor is the machine's speed, and one step cannot tell
    them apart. The first observation is left out when there are others. Returns the
    coefficients, the terms scaled, and the factor; None when no rank has both a measured and a
    predicted compute (every rank ran dummies or chunked samples)."""
    theta = prior.compute_theta()
    # the run's first step pays its start-up (allocations, the engine's first pass: 2.3x a later
    # step of a SmolLM2 GRPO run, 1.1x of its DPO run): left out when there is another
    steps = observations[1:] if len(observations) > 1 else observations
    ratios = [
        m / p for o in steps for f, m in zip(o.features, o.measured_ms) if m > 0 and (p := float(np.dot(f, theta))) > 0
    ]
    if not ratios:
        return None
    k = float(statistics.median(ratios))
    scaled = ("c1_ms_per_token", "c2_ms_per_pair", "c0_ms", "reduction_overhead_ms", "step_overhead_ms")
    new = replace(prior, **{name: getattr(prior, name) * k for name in scaled}).rounded()
    return new, {name: name in scaled for name in COMPUTE_TERMS}, k


# --------------------------------------------------------------------------- the calibrator
@dataclass(frozen=True)
class CalibrationSettings:
    """When to refit."""

    min_steps: int = 8
    """Steps observed before the first fit."""
    refit_every: int = 4
    """Steps between fits."""
    window: int = 16
    """A fit uses at most this many most recent steps: the machine's speed drifts (on a shared
    2-core machine by +-40% within a minute), and older steps describe a different machine."""
    scale_after: int = 0
    """Steps after which, before the first fit, the profile's CPU work is scaled by one factor
    (scale_fit, from these steps but the first when N > 1); 0, or at least min_steps (the fit
    comes first): no early scale. One number is determined by one step, where c1, c2 and c0
    apart need several: a profile measured on another machine (2x off on a SmolLM2 DPO run) is
    then right from the steps planned after the first."""

    def __post_init__(self):
        for k in ("min_steps", "refit_every", "window"):
            if int(getattr(self, k)) < 1:
                raise CalibrationError(f"calibration {k} must be at least 1, got {getattr(self, k)!r}")
        if self.window < self.min_steps:
            raise CalibrationError(f"calibration window {self.window} is smaller than min_steps {self.min_steps}")
        if int(self.scale_after) < 0:
            raise CalibrationError(f"calibration scale_after must be at least 0 (0: off), got {self.scale_after!r}")


@dataclass
class CalibrationFit:
    """One refit: its coefficients, in-sample errors before and after, the step it used data up to."""

    version: int
    step: int  # the last observed step (global index)
    steps: int  # steps used
    coefficients: Coefficients
    fitted: Dict[str, bool]
    error_before: float  # median per-rank relative compute error with the previous coefficients
    error_after: float
    wall_error_before: float  # median relative error of the step's wall time (critical path model)
    wall_error_after: float
    applies_from: Optional[int] = None  # the first step planned with it (set when adopted)
    scale: Optional[float] = None  # an early scale (scale_fit): the factor; None: a fit

    def describe(self, base: Coefficients) -> str:
        c = self.coefficients
        if self.scale is not None:
            return (
                f"calibration {self.version} from {self.steps} step{'s' if self.steps > 1 else ''}: the profile's CPU "
                f"work (c1, c2, c0, {c.reduction_overhead_ms:.1f} ms per gradient reduction, {c.step_overhead_ms:.1f} "
                f"ms per step) scaled x{self.scale:.3g}, the median measured / predicted per-rank compute; in-sample "
                f"median error: per-rank compute {_pct(self.error_before)} -> {_pct(self.error_after)}, step wall "
                f"given the measured slowest ranks {_pct(self.wall_error_before)} -> {_pct(self.wall_error_after)}"
            )
        parts = []
        for name, short, v, b in (
            ("c1_ms_per_token", "c1", c.c1_ms_per_token, base.c1_ms_per_token),
            ("c2_ms_per_pair", "c2", c.c2_ms_per_pair, base.c2_ms_per_pair),
            ("c0_ms", "c0", c.c0_ms, base.c0_ms),
            ("comm_scale", "comm", c.comm_scale, base.comm_scale),
            ("cp_attention_scale", "attention in CP groups", c.cp_attention_scale, base.cp_attention_scale),
            ("cp_message_ms", "CP exchange message", c.cp_message_ms, base.cp_message_ms),
        ):
            ratio = f"x{v / b:.3g}" if b > 0 else f"{v:.3g} ms"
            parts.append(f"{short} {ratio}" + ("" if self.fitted.get(name) else " (kept: not determined)"))
        return (
            f"calibration {self.version} from {self.steps} steps: "
            + ", ".join(parts)
            + f", {c.reduction_overhead_ms:.1f} ms per gradient reduction, {c.step_overhead_ms:.1f} ms per step; "
            f"in-sample median error: per-rank compute {_pct(self.error_before)} -> {_pct(self.error_after)}, "
            f"step wall given the measured slowest ranks {_pct(self.wall_error_before)} -> "
            f"{_pct(self.wall_error_after)}"
        )


def _pct(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:.1f}%"


@dataclass
class Calibrator:
    """Collects step observations and refits the coefficients on schedule (every rank the same)."""

    base: HardwareProfile
    settings: CalibrationSettings = field(default_factory=CalibrationSettings)
    gradient_gb: float = 0.0  # the run's gradients, GB (the base profile's engine cost per GB applies to them)
    observations: List[StepObservation] = field(default_factory=list)
    fits: List[CalibrationFit] = field(default_factory=list)
    _since_fit: int = 0

    @property
    def base_coefficients(self) -> Coefficients:
        return Coefficients.of(self.base, self.gradient_gb)

    @property
    def current(self) -> Coefficients:
        return self.fits[-1].coefficients if self.fits else self.base_coefficients

    def add(self, obs: StepObservation) -> None:
        self.observations.append(obs)
        del self.observations[: -self.settings.window]
        self._since_fit += 1

    def _fitted(self) -> bool:
        """Whether a fit (not an early scale) was made."""
        return any(f.scale is None for f in self.fits)

    def _scale_now(self) -> bool:
        """Whether the next refit is the early scale: asked for, not made yet, before min_steps."""
        n, st = len(self.observations), self.settings
        return 0 < st.scale_after < st.min_steps and not self.fits and st.scale_after <= n < st.min_steps

    def due(self) -> bool:
        if self._scale_now():
            return True
        if len(self.observations) < self.settings.min_steps:
            return False
        return not self._fitted() or self._since_fit >= self.settings.refit_every

    def refit(self, prior: Optional[Coefficients] = None) -> Optional[CalibrationFit]:
        """Fit the observations (before min_steps: the early scale, scale_fit; None when it has
        nothing to scale by); the fit keeps the coefficients in force (`prior`, default the
        latest fit) where it would not lower their in-sample error."""
        self._since_fit = 0
        obs = list(self.observations)
        prior = prior or self.current
        if self._scale_now():
            made = scale_fit(obs, prior)
            return None if made is None else self._keep(made, obs, prior)
        compute, fitted = fit_compute(obs, prior, self.base_coefficients)
        before = _compute_error(obs, prior)
        after = _compute_error(obs, compute)
        if not after <= before:
            compute, after = prior, before
        red, step = fit_wall(obs, prior)
        new = replace(compute, reduction_overhead_ms=red, step_overhead_ms=step).rounded()
        return self._keep((new, fitted, None), obs, prior)

    def _keep(self, made, obs: Sequence[StepObservation], prior: Coefficients) -> CalibrationFit:
        """The fit of (coefficients, determined terms, early scale) made from `obs`, recorded."""
        new, fitted, scale = made
        fit = CalibrationFit(
            version=len(self.fits) + 1,
            step=obs[-1].step,
            steps=len(obs),
            coefficients=new,
            fitted=fitted,
            error_before=_compute_error(obs, prior),
            error_after=_compute_error(obs, new),
            wall_error_before=_wall_error(obs, prior),
            wall_error_after=_wall_error(obs, new),
            scale=scale,
        )
        self.fits.append(fit)
        return fit

    def profile(self, coefficients: Optional[Coefficients] = None) -> HardwareProfile:
        """The base profile with `coefficients` (default: the latest fit's), named as calibrated."""
        c = coefficients or self.current
        if c == self.base_coefficients:
            return self.base
        return c.apply(
            self.base,
            name=f"{self.base.name}-calibrated",
            description=f"{self.base.description} Calibrated online from measured step times.".strip(),
        )


def _compute_error(obs: Sequence[StepObservation], c: Coefficients) -> float:
    theta = c.compute_theta()
    pred, meas = [], []
    for o in obs:
        for f, m in zip(o.features, o.measured_ms):
            if m > 0:
                pred.append(float(np.dot(f, theta)))
                meas.append(m)
    return median_relative_error(pred, meas)


def _wall_error(obs: Sequence[StepObservation], c: Coefficients) -> float:
    """The wall model on the measured critical path: critical + reductions x (bytes + fixed) +
    per-step fixed, against the measured wall time."""
    pred = [
        o.critical_ms + o.reduction_bytes_ms + o.reductions * c.reduction_overhead_ms + c.step_overhead_ms for o in obs
    ]
    return median_relative_error(pred, [o.wall_ms for o in obs])


# --------------------------------------------------------------------------- the profile file
def calibrated_profile_yaml(profile: HardwareProfile, fit: CalibrationFit, base_name: str, run: str = "") -> str:
    """A profile YAML (HardwareProfile.load / `hf-cp plan --profile FILE` read it) saying how it
    was made."""
    d = profile.to_dict()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        f"# Hardware profile calibrated online by hf_cp training ({now}){': ' + run if run else ''}.",
        f"# Started from profile {base_name!r}; fitted to the measured per-rank compute and step wall time",
        f"# of {fit.steps} steps up to step {fit.step + 1} (calibration {fit.version}).",
        f"# Median per-rank compute error {_pct(fit.error_before)} before, {_pct(fit.error_after)} after;",
        f"# step wall time {_pct(fit.wall_error_before)} before, {_pct(fit.wall_error_after)} after.",
        "# Coefficients the data did not determine kept their previous values: "
        + (", ".join(k for k, v in fit.fitted.items() if not v) or "none")
        + ".",
        f"# links: the base profile's, scaled by the fitted communication scale ({fit.coefficients.comm_scale:.4g}).",
    ]
    return "\n".join(head) + "\n" + yaml.safe_dump(d, sort_keys=False, default_flow_style=False, width=110)
