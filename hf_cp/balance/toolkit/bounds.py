"""Cheap lower bounds on a step's predicted time, from the request alone (no plan built).

`auto` uses them to skip members that cannot win, and fixed-CP-size balancers to choose
their size. Each is a true bound on `hf_cp.cost.simulate.simulate`'s makespan for the plans it names.

The fixed-size bound. When every sample runs distributed over aligned groups of N > 1 ranks
with a ring mode (static, wlb and libra plans), a micro-batch of T tokens costs its members
together at least

    sum_m total_m = sum_m (L c1 + head) t_m + L max(a_m, c_m)
                 >= (L c1 + head) T + L max(A, C),

where a_m is member m's attention (its query chunks are no longer than their documents, so
A, every document's attention at full efficiency, is at most sum_m a_m) and c_m its ring
traffic time: member m sends (3T - 2 t_{m+1}) tokens' K/V per layer, so the members send
(3N - 2) T together, over the link of a block of N ranks. Every member is held for the
micro-batch's duration (its slowest member plus one overhead), and ranks work at most the
makespan, so the world's busy time over the world size bounds the step. Summed over the
micro-batches, max(A, C) >= max of the sums; a step holds at least ceil(T / (N cap))
micro-batches, each charging N overheads. Sharding short documents over many ranks makes C
grow with N while the work does not shrink: this is the term that shows a 512-rank group
of short documents for what it is, however balanced.

Masked samples (shared prompts, windows) count by their masked area, as the simulator prices
them (request_local_ms): a member's attention is its segments' masked pairs, which sum to the
sample's, at no better kernel efficiency than the whole sample's; ring traffic does not
depend on the mask. Priced as causal documents instead, the bounds sat above what plans of
masked samples reach (the charged bound 3-21% above the bound with masks on shared-prompt
steps, static's fixed-size bound above static's own plans), and `auto` stopped at plans that
only looked within `stop_within` of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional

import numpy as np

from hf_cp.balance.toolkit.costs import CostMemo, cost_memo
from hf_cp.balance.toolkit.placement import masks_of
from hf_cp.cost.bounds import charged_lower_bound_ms
from hf_cp.cost.hardware import transfer_ms
from hf_cp.cost.vision import distributed_vision_ms, samples_vision_ms, step_vision

if TYPE_CHECKING:
    from hf_cp.balance.base import PlanRequest


def request_local_ms(req: PlanRequest, memo: Optional[CostMemo] = None) -> np.ndarray:
    """Every sample's single-rank compute, a masked sample's by its masked area
    (CostModel.local_ms with its mask, what the simulator and its bounds charge it); without
    masks the memo's shared per-length array (do not modify it)."""
    memo = memo or cost_memo(req.cost)
    local = memo.step_local_ms(req.lengths, req.length_array)
    if not req.masks:
        return local
    local = local.copy()
    for i, (n, mask) in enumerate(zip(req.lengths, masks_of(req.sample_ids, req.masks))):
        if mask is not None:
            local[i] = memo.doc_on_group_ms(n, 1, mask)  # CostModel.local_ms([n], [mask]), kept per mask
    return local


def request_sample_ms(req: PlanRequest, memo: Optional[CostMemo] = None) -> np.ndarray:
    """Every sample's single-rank work as a balancer places it: request_local_ms plus its
    images' and clips' vision tower time (cost/vision.py), which runs where the sample runs
    (spread over its group's members when it is distributed). The memo's shared array when
    the step has no vision work (do not modify it)."""
    local = request_local_ms(req, memo)
    if not req.vision:
        return local
    return local + samples_vision_ms(req.sample_ids, req.vision, req.cost)


def request_distributed_vision_ms(req: PlanRequest, sizes: np.ndarray) -> Optional[np.ndarray]:
    """Per sample of the request, the vision time every member of its group waits for when it
    runs distributed on `sizes[i]` ranks (cost/vision.distributed_vision_ms; 0 when local or
    text only). None when the step has no vision work."""
    if not req.vision:
        return None
    out = np.zeros(len(req.sample_ids), dtype=np.float64)
    for i, s in enumerate(req.sample_ids):
        g = int(sizes[i])
        if g > 1 and s in req.vision:
            out[i] = distributed_vision_ms(req.vision[s], g, req.cost)
    return out


@dataclass(frozen=True)
class StepTotals:
    """What the bounds need of a step: totals over its samples, computed once."""

    tokens: int
    local_ms_sum: float  # sum of request_local_ms (masked samples by their masked area)
    local_ms_max: float
    attention_ms_per_layer: float  # every document's attention (masked area) at full efficiency, per layer

    @classmethod
    def of(cls, req: PlanRequest, memo: Optional[CostMemo] = None, local: Optional[np.ndarray] = None) -> StepTotals:
        memo = memo or cost_memo(req.cost)
        local = request_local_ms(req, memo) if local is None else local
        cost = memo.cost
        tokens = int(sum(req.lengths))
        local_sum = float(local.sum())
        linear = (cost.dims.num_layers * cost.c1 + cost.head_ms_per_token) * tokens
        return cls(
            tokens=tokens,
            local_ms_sum=local_sum,
            local_ms_max=float(local.max()),
            attention_ms_per_layer=max(0.0, (local_sum - linear) / cost.dims.num_layers),
        )


def step_lower_bound_ms(req: PlanRequest, totals: Optional[StepTotals] = None) -> float:
    """cost.bounds.lower_bound_ms of the request: max(work / world, costliest sample / largest group)."""
    t = totals or StepTotals.of(req)
    cl = req.cluster
    return max(t.local_ms_sum / cl.world_size, t.local_ms_max / cl.group_sizes[-1])


def fixed_size_area_ms(req: PlanRequest, group_size: int, totals: Optional[StepTotals] = None) -> float:
    """The world's busy time / world size when every sample of the request runs in a group
    of exactly `group_size` ranks (distributed with a ring mode above size 1, local at 1):
    the area term of the module docstring."""
    t = totals or StepTotals.of(req)
    cl = req.cluster
    cost = req.cost
    L = cost.dims.num_layers
    overhead = cost.micro_batch_overhead_ms()
    n = group_size
    micro_batches = -(-t.tokens // (n * cl.max_tokens_per_rank))
    if n == 1:
        return (t.local_ms_sum + micro_batches * overhead) / cl.world_size
    p = cost.profile
    kv_bytes = 2 * cost.dims.num_kv_heads * cost.dims.head_dim * p.bytes_per_element * cost.dims.softmax_share
    link = cost.link_for(range(n))  # an aligned block: one node while it fits in one
    # the bytes alone: a lower bound may leave out the latency of each member's 3(n-1) messages a
    # micro-batch, which only adds to the time
    traffic_ms = transfer_ms((3 * n - 2) * t.tokens * kv_bytes, link, messages=0)
    linear = (L * cost.c1 + cost.head_ms_per_token) * t.tokens
    area = linear + L * max(t.attention_ms_per_layer, traffic_ms) + n * micro_batches * overhead
    return area / cl.world_size


def fixed_size_bound_ms(req: PlanRequest, group_size: int, totals: Optional[StepTotals] = None) -> float:
    """No plan that runs every sample of the request in a group of exactly `group_size` ranks
    (distributed with a ring mode when the size is above 1; local when it is 1) is faster than
    this (module docstring). Never below step_lower_bound_ms."""
    t = totals or StepTotals.of(req)
    bound = max(fixed_size_area_ms(req, group_size, t), step_lower_bound_ms(req, t))
    if group_size == 1:
        bound = max(bound, t.local_ms_max + req.cost.micro_batch_overhead_ms())
    return bound


def blocks_bound_ms(local_ms_desc: np.ndarray, world_size: int, group_size: int) -> float:
    """No plan that runs every sample inside one aligned block of `group_size` ranks (as a
    distributed or a local document of that block's groups) is faster than this.

    A block runs its micro-batches one after another, each lasting at least its mean
    member's compute, so it is busy for at least the sum of its samples' single-rank
    compute / group size, p_i. With B blocks, the t*B + 1 samples of largest p (sorted
    descending: local_ms_desc) put t + 1 of them on one block (pigeonhole): max over t of
    (t + 1) p_{tB+1}."""
    blocks = world_size // group_size
    p = local_ms_desc / group_size
    idx = np.arange(0, len(p), blocks)
    if not len(idx):
        return 0.0
    return float(np.max(p[idx] * np.arange(1, len(idx) + 1)))


class BoundCache:
    """fixed_size_bound_ms per group size for one request (the totals computed once); every
    bound prices masked samples by their masked area (request_local_ms)."""

    def __init__(self, req: PlanRequest):
        self.req = req
        memo = cost_memo(req.cost)
        self.local_ms = request_local_ms(req, memo)
        self.totals = StepTotals.of(req, memo, self.local_ms)
        self._by_size: Dict[int, float] = {}
        self._charged: Optional[float] = None
        self._blocks: Dict[int, float] = {}
        self._desc: Optional[np.ndarray] = None

    def step(self) -> float:
        return step_lower_bound_ms(self.req, self.totals)

    def charged(self) -> float:
        """cost.bounds.charged_lower_bound_ms of the request (its masks included: the bound the
        simulator reports for its plans), from the shared per-length caches."""
        if self._charged is None:
            memo = cost_memo(self.req.cost)
            self._charged = charged_lower_bound_ms(
                self.req.length_array,
                self.req.cluster,
                self.req.cost,
                local_ms=self.local_ms,
                alone_ms=memo.doc_on_group_ms,
                masks=masks_of(self.req.sample_ids, self.req.masks) if self.req.masks else None,
                vision=step_vision(self.req.sample_ids, self.req.vision, self.req.cost),
            )
        return self._charged

    def fixed_size(self, group_size: int) -> float:
        """fixed_size_bound_ms and blocks_bound_ms of one group size (ring modes above 1)."""
        v = self._by_size.get(group_size)
        if v is None:
            v = self._by_size[group_size] = max(
                fixed_size_bound_ms(self.req, group_size, self.totals), self.blocks(group_size)
            )
        return v

    def area(self, group_size: int) -> float:
        """fixed_size_area_ms of one group size."""
        return fixed_size_area_ms(self.req, group_size, self.totals)

    def blocks(self, group_size: int) -> float:
        """blocks_bound_ms of one group size."""
        v = self._blocks.get(group_size)
        if v is None:
            if self._desc is None:
                self._desc = np.sort(self.local_ms)[::-1]
            v = self._blocks[group_size] = blocks_bound_ms(self._desc, self.req.cluster.world_size, group_size)
        return v
