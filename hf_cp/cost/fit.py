"""Least-squares fits of measured times and how well they fit."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np

# the smallest magnitude a relative error divides by: a measured time of 0 gives a huge but
# finite relative error instead of a division by zero
MIN_RELATIVE_DENOMINATOR = 1e-300
# a support replaces the best fit so far only when its squared residual is smaller by more than
# this (on unit-norm columns): a fit equal up to rounding keeps the larger support tried first
RESIDUAL_IMPROVEMENT = 1e-15


@dataclass(frozen=True)
class FitQuality:
    r2: float
    max_rel_err: float
    median_rel_err: float

    def to_dict(self) -> dict:
        return {
            "r2": round(self.r2, 6),
            "max_rel_err": round(self.max_rel_err, 6),
            "median_rel_err": round(self.median_rel_err, 6),
        }


def fit_quality(measured: Sequence[float], predicted: Sequence[float]) -> FitQuality:
    y = np.asarray(measured, dtype=np.float64)
    p = np.asarray(predicted, dtype=np.float64)
    if y.shape != p.shape or y.size == 0:
        raise ValueError(f"need equally many measured and predicted values, got {y.size} and {p.size}")
    ss_res = float(((y - p) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel = np.abs(p - y) / np.maximum(np.abs(y), MIN_RELATIVE_DENOMINATOR)
    return FitQuality(r2=r2, max_rel_err=float(rel.max()), median_rel_err=float(np.median(rel)))


def nonnegative_lstsq(X: Sequence[Sequence[float]], y: Sequence[float]) -> List[float]:
    """min |X b - y| subject to b >= 0, exactly, by trying every support (few columns only).

    Times are sums of non-negative costs; an unconstrained fit on noisy data can return a
    negative per-token or fixed cost, which the cost model must never use.

    Columns are scaled to unit norm before solving: regressors differ by orders of magnitude
    (tokens vs causal pairs).
    """
    A = np.asarray(X, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    if A.ndim != 2 or A.shape[0] != b.shape[0]:
        raise ValueError(f"design matrix {A.shape} does not match {b.shape[0]} measurements")
    n = A.shape[1]
    if n > 6:
        raise ValueError("nonnegative_lstsq enumerates supports; use at most 6 columns")
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    As = A / norms
    best, best_res = np.zeros(n), float(np.sum(b**2))
    for k in range(n, 0, -1):
        for support in itertools.combinations(range(n), k):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(As[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((As[:, cols] @ sol - b) ** 2))
            if res < best_res - RESIDUAL_IMPROVEMENT:
                best_res = res
                best = np.zeros(n)
                best[cols] = sol
    return [float(v) for v in best / norms]
