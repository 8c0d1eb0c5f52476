"""Planning ahead of training: the balancer runs on a background thread, a few steps early.

Balancers are pure Python and hold the GIL only while planning; the training thread spends
its time in torch kernels that release it, so planning step k+1.. overlaps step k's compute.
Every plan is a pure function of (global batch, cluster, cost model, seed, step) and is
validated here, before the trainer issues any collective for it.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Optional

from ..balance import PlanRequest, get_balancer
from ..cluster import ClusterSpec
from ..cost import CostModel
from ..plan import StepPlan
from ..sim import SimResult, simulate
from .sampler import GlobalBatch, GlobalBatchSampler


@dataclass
class PlannedStep:
    batch: GlobalBatch
    plan: StepPlan
    predicted: SimResult
    planner_ms: float
    compare: Optional[SimResult] = None  # the comparison balancer's plan, simulated (never run)


class Planner:
    def __init__(self, sampler: GlobalBatchSampler, balancer, cluster: ClusterSpec, cost: CostModel,
                 seed: int = 0, lookahead: int = 2, compare_balancer: Optional[str] = None):
        self.sampler = sampler
        # a registered name, or a balancer object (anything with .plan(PlanRequest) -> StepPlan)
        self.balancer = get_balancer(balancer) if isinstance(balancer, str) else balancer
        self.balancer_name = balancer if isinstance(balancer, str) else getattr(balancer, "name", type(balancer).__name__)
        if not callable(getattr(self.balancer, "plan", None)):
            raise TypeError(f"balancer {self.balancer_name!r} has no plan(request) method")
        self.compare_name = (compare_balancer if compare_balancer and compare_balancer != self.balancer_name
                             else None)
        self.compare = get_balancer(self.compare_name) if self.compare_name else None
        self.cluster = cluster
        self.cost = cost
        self.seed = seed
        self.lookahead = lookahead
        self.dataset_max_length = max(sampler.lengths)
        if self.dataset_max_length > cluster.largest_capacity:
            i = sampler.lengths.index(self.dataset_max_length)
            raise ValueError(f"sample {i} has {self.dataset_max_length} tokens; the largest CP group "
                             f"({cluster.group_sizes[-1]} ranks x {cluster.max_tokens_per_rank}) holds "
                             f"{cluster.largest_capacity}. Raise cp_max_tokens_per_rank, or truncate/drop it")
        self._lock = threading.Lock()
        self._futures: Dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_cp-planner") if lookahead > 0 else None

    def request(self, batch: GlobalBatch) -> PlanRequest:
        return PlanRequest(sample_ids=batch.sample_ids, lengths=batch.lengths, cluster=self.cluster, cost=self.cost,
                           seed=self.seed, step=batch.index, dataset_max_length=self.dataset_max_length)

    def plan_now(self, index: int) -> PlannedStep:
        """Plan, validate and simulate global step `index` on the calling thread."""
        batch = self.sampler[index]
        req = self.request(batch)
        t0 = time.perf_counter()
        plan = self.balancer.plan(req)
        planner_ms = (time.perf_counter() - t0) * 1e3
        plan.validate(self.cluster)
        if list(plan.sample_ids) != list(batch.sample_ids):
            raise ValueError(f"step {index}: balancer {self.balancer_name!r} returned a plan for other samples")
        compare = None
        if self.compare is not None:
            cplan = self.compare.plan(req)
            cplan.validate(self.cluster)
            compare = simulate(cplan, self.cost)
        return PlannedStep(batch, plan, simulate(plan, self.cost), planner_ms, compare)

    def get(self, index: int) -> PlannedStep:
        """The planned step `index`; schedules the next `lookahead` steps in the background."""
        if self._pool is None:
            return self.plan_now(index)
        with self._lock:
            for k in range(index, min(index + 1 + self.lookahead, len(self.sampler))):
                if k not in self._futures:
                    self._futures[k] = self._pool.submit(self.plan_now, k)
            fut = self._futures.pop(index)
            for k in [k for k in self._futures if k < index]:  # skipped (resume): drop
                self._futures.pop(k).cancel()
        return fut.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
