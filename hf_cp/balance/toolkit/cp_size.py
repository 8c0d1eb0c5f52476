"""The one CP size of a fixed-size balancer's step (wlb, skrull, libra), and its options' checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

import numpy as np

from hf_cp.balance.options import BalancerOptionError
from hf_cp.balance.toolkit.bounds import BoundCache
from hf_cp.balance.toolkit.costs import cost_memo

if TYPE_CHECKING:
    from hf_cp.balance.base import PlanRequest


CP_SCOPES = ("balanced", "step", "dataset")


def fixed_cp_size(req: PlanRequest, cp_size: Optional[int], balancer: str, scope: str = "balanced") -> int:
    """The one CP size of a step's plan.

    `cp_size` if given (checked against the cluster and the step's samples). Otherwise the
    smallest registered group whose combined cap holds the longest sample: of the step
    (scope "step": every group is pre-built, so the size may change between steps at no
    cost) or of the whole dataset (scope "dataset": one size for the run, as `static`).
    Scope "balanced" goes on doubling the step's size while the longest sample alone on such
    a group (CostModel.distributed_rank_cost, one micro-batch overhead included) outlasts
    the world's share of the step's work at that size (bounds.fixed_size_area_ms: ring
    traffic and overheads charged), and only while doubling lowers the larger of that
    sample's time and the bound on any plan with groups of that size
    (bounds.BoundCache.fixed_size, which also counts samples piling onto too few blocks). A
    sample that long is the straggler whatever else is balanced; but spreading every short
    document of a small step over hundreds of ranks costs more in traffic and queueing than
    it saves (WLB-LLM's degenerate 512-rank plans, 19-65x the bound at max/mean 1.000).
    """
    cl = req.cluster
    if cp_size is None:
        if scope not in CP_SCOPES:
            raise ValueError(f"{balancer}: cp_scope {scope!r} must be one of {CP_SCOPES}")
        longest = max(req.lengths) if scope != "dataset" else max(req.dataset_max_length or 0, max(req.lengths))
        g = cl.smallest_group_for(longest)
        if scope == "balanced":
            memo = cost_memo(req.cost)
            bounds = BoundCache(req)

            def estimate(size: int) -> float:
                return max(memo.doc_on_group_ms(longest, size) + memo.overhead_ms, bounds.fixed_size(size))

            est = estimate(g)
            while g < cl.group_sizes[-1] and memo.doc_on_group_ms(longest, g) + memo.overhead_ms > bounds.area(g):
                est2 = estimate(2 * g)
                if est2 >= est:
                    break
                g, est = 2 * g, est2
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
