"""The one CP size of a fixed-size balancer's step (wlb, skrull, libra), and its options' checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import numpy as np

from .costs import cost_memo
from .options import BalancerOptionError

if TYPE_CHECKING:
    from .base import PlanRequest


CP_SCOPES = ("balanced", "step", "dataset")


def fixed_cp_size(req: PlanRequest, cp_size: Optional[int], balancer: str, scope: str = "balanced") -> int:
    """The one CP size of a step's plan.

    `cp_size` if given (checked against the cluster and the step's samples). Otherwise the
    smallest registered group whose combined cap holds the longest sample: of the step
    (scope "step": every group is pre-built, so the size may change between steps at no
    cost) or of the whole dataset (scope "dataset": one size for the run, as `static`).
    Scope "balanced" goes on doubling the step's size while the longest sample alone on
    such a group would still outlast the mean rank's share of the step's work (its
    predicted time, CostModel.distributed_rank_cost, against the sum of
    CostModel.sample_local_ms over the world): a sample that long is the straggler
    whatever else is balanced.
    """
    cl = req.cluster
    if cp_size is None:
        if scope not in CP_SCOPES:
            raise ValueError(f"{balancer}: cp_scope {scope!r} must be one of {CP_SCOPES}")
        longest = max(req.lengths) if scope != "dataset" else max(req.dataset_max_length or 0, max(req.lengths))
        g = cl.smallest_group_for(longest)
        if scope == "balanced":
            memo = cost_memo(req.cost)
            mean_rank_ms = float(memo.local_ms_array(np.asarray(req.lengths, dtype=np.int64)).sum()) / cl.world_size
            while g < cl.group_sizes[-1] and memo.doc_on_group_ms(longest, g) > mean_rank_ms:
                g *= 2
        return g
    if cp_size not in cl.group_sizes:
        raise ValueError(f"{balancer}: cp_size {cp_size} is not a registered group size {cl.group_sizes}")
    i = int(np.argmax(req.lengths))
    if cp_size * cl.max_tokens_per_rank < req.lengths[i]:
        raise ValueError(
            f"{balancer}: sample {req.sample_ids[i]} ({req.lengths[i]} tokens) does not fit "
            f"cp_size {cp_size} x {cl.max_tokens_per_rank} tokens per rank"
        )
    return cp_size


def check_cp_options(cp_size: Optional[int], scope: str, balancer: str, scopes: Tuple[str, ...] = CP_SCOPES) -> None:
    """Raise BalancerOptionError unless `cp_size` is None or a power of two and `scope` is one of `scopes`."""
    if cp_size is not None and (not isinstance(cp_size, int) or cp_size <= 0 or cp_size & (cp_size - 1)):
        raise BalancerOptionError(f"{balancer}: cp_size {cp_size!r} must be a power of two")
    if scope not in scopes:
        raise BalancerOptionError(f"{balancer}: cp_scope {scope!r} must be one of {scopes}")
