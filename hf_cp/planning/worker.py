"""Planning ahead of training: the balancer runs a few steps early, off the training thread.

Balancers are pure Python. On a background *thread* they hold the GIL against the training
thread, whose job on a GPU is to launch thousands of small kernels per step: measured with
scripts/bench_planner_gil.py, 30k small torch ops took 10-15x longer while `auto` planned on
a thread (0.07 s alone, 0.9-1.1 s beside it). So by default (`in_subprocess=True`) the planner
runs in a forked worker process with its own GIL, as DataLoader workers do; the thread is the
fallback where fork is unavailable, and `lookahead=0` plans inline. A worker that dies (the
kernel's OOM killer picks the process with a large heap) is replaced and its steps planned
again, so a multi-day run neither hangs nor stops for it; one that gives no plan within
Planner.PLAN_TIMEOUT_S (a fork that deadlocked) is killed and the planner goes on on a thread.
Every plan is a pure function of (global batch, cluster, cost model, seed, step) and is
validated here, before the trainer issues any collective for it.

A streaming sampler (stream_sampler.py) learns a step's batch only when it reads the stream, on
the training process: a forked worker never sees what was read after the fork. For one, `get`
reads each batch here and hands it, with its samples' masks, to the worker (or thread) with the
request; a map-style sampler's batches are computed where the plan is made, as before. A
stream's steps before the one asked for are released (the trainer has collated them), and its
samples are checked against the balancer's limit step by step (there are no lengths up front).

Planned host by host (plan_own_host: `hierarchical` over several hosts), the worker of each
host's first rank plans only that host's parts of a step (HostPlanned; the other ranks' workers
plan none), and `get` (or `plan_now`), on the training process, exchanges every host's parts
with the collective the trainer gives (train/runtime/host_parts.py), merges, validates and
simulates them (`finish`): every rank gets the same whole-world plan, as if it had planned it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import warnings
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from hf_cp.balance.base import PlanRequest, check_mask_support, warm_up_balancer
from hf_cp.balance.hierarchical import HostParts
from hf_cp.balance.registry import get_balancer
from hf_cp.balance.toolkit.sample_limit import check_request_lengths, check_sample_lengths, sample_token_limit
from hf_cp.balance.toolkit.vision_memory import fit_vision_memory
from hf_cp.cost.model import CostModel
from hf_cp.cost.simulate import SimResult
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.plan.step_plan import StepPlan
from hf_cp.planning.predict import fitted_plan, plan_and_predict, predict
from hf_cp.planning.sampler import GlobalBatch, GlobalBatchSampler
from hf_cp.planning.setup import PlanningSetup
from hf_cp.planning.stream_sampler import StreamEnded
from hf_cp.samples.masks import SampleMask
from hf_cp.samples.vision_grids import SampleGrids


@dataclass
class PlannedStep:
    batch: GlobalBatch
    plan: StepPlan
    predicted: SimResult
    planner_ms: float
    compare: Optional[SimResult] = None  # the other balancer's plan of the step, simulated (not run)
    cost_version: int = 0  # the cost model it was planned with: 0 the setup's, k the k-th set_cost
    planner_cpu_ms: float = 0.0  # the planning process's CPU time over the balancer's plan()
    # compare_measured: this step runs the comparison balancer's plan, and `compare` is the
    # run's own balancer's plan of it, simulated
    ran_compare: bool = False


@dataclass
class HostPlanned:
    """A step planned host by host, before the exchange (Planner.plan_own_host): what this
    rank's host planned (None on a rank that only receives its host's parts), and what
    Planner.finish needs to merge every host's parts into the step's plan."""

    batch: GlobalBatch
    masks: Optional[Mapping[int, SampleMask]]  # as given with the batch (a stream's); None: the planner's
    parts: Optional[HostParts]
    planner_ms: float
    planner_cpu_ms: float
    compare: Optional[SimResult]
    cost_version: int
    cost: Optional[CostModel] = None  # the model it was planned with, in this process (not sent back by a worker)


# (step index, this rank's host's parts or None) -> every rank's, in rank order: a collective
# of every rank, issued where the step's plan is taken (StepRuntime gives it; planning stays torch-free)
PartsExchange = Callable[[int, Optional[HostParts]], List[Optional[HostParts]]]


_FORKED_PLANNER: Optional[Planner] = None  # in a planner worker process: the Planner it serves
# How much nicer than the training process a planner worker runs (os.nice): on 2 CPU ranks
# sharing 2 cores, every rank's planner (auto plans 10-40 ms of a ~230 ms step) took its
# cycles from the training processes; a planner that falls behind makes training wait for
# its plan, and then has the cores to itself.
PLANNER_NICENESS = 10


def _adopt_planner(planner: Planner, parent_pid: int) -> None:
    """Worker initialiser: a forked worker inherits the Planner (nothing is pickled), and
    exits when the training process dies. A forked child holds copies of its parent's pipes
    (the launcher's stdout too), so an orphan would wait on its queue forever and keep the
    launcher's logs open: after a SIGKILLed rank, a restarted job would never finish."""
    global _FORKED_PLANNER
    _FORKED_PLANNER = planner
    # the training process's stop handler (enable_jit_checkpoint) came along with the fork: a
    # SIGTERM must end this worker, not set a flag nobody reads here
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # planning is background work: where the planner shares cores with training (CPU training)
    # the scheduler serves the training processes first, and the planner the idle time
    os.nice(PLANNER_NICENESS)
    planner.warm_up_balancers()  # before its first plan: see Planner.start

    def exit_with_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=exit_with_parent, name="hf_cp-planner-parent-watch", daemon=True).start()


def _done(result) -> Future:
    """A future that already holds `result`."""
    fut: Future = Future()
    fut.set_result(result)
    return fut


def _worker_pid() -> int:
    """A task that only makes the pool start its workers (Planner.start)."""
    return os.getpid()


def _plan_in_worker(index: int, version: int = 0, profile=None, batch=None, masks=None) -> PlannedStep:
    # the worker was forked with the setup's cost model; a later one comes with the request, and
    # so does a stream's batch (read after the fork)
    planner = _FORKED_PLANNER
    cost = planner._cost_of_version(version, profile)
    planned = planner.plan_part(index, cost=cost, version=version, batch=batch, masks=masks)
    if isinstance(planned, HostPlanned):
        planned.cost = None  # the training process has it: only the parts travel
    return planned


def _merge_in_worker(version: int, profile, planned: HostPlanned, every_rank) -> PlannedStep:
    # the exchanged parts of a step planned ahead, merged, validated and simulated off the
    # training process (Planner._prefetch)
    planner = _FORKED_PLANNER
    return planner.merge(replace(planned, cost=planner._cost_of_version(version, profile)), every_rank)


class Planner:
    def __init__(
        self,
        sampler: Optional[GlobalBatchSampler],
        balancer,
        cluster: ClusterSpec,
        cost: CostModel,
        seed: int = 0,
        lookahead: int = 2,
        compare_balancer: Optional[str] = None,
        in_subprocess: bool = False,
        workers: int = 1,
        balancer_name: Optional[str] = None,
        masks: Optional[Mapping[int, SampleMask]] = None,
        vision: Optional[Mapping[int, SampleGrids]] = None,
        compare_measured: bool = False,
    ):
        self.sampler = sampler
        self.masks = dict(masks or {})  # sample id -> non-causal mask; the others are causal
        self.vision = dict(vision or {})  # sample id -> its images' and clips' patch grids; the others text only
        # a registered name, or a balancer object (anything with .plan(PlanRequest) -> StepPlan)
        self.balancer = get_balancer(balancer) if isinstance(balancer, str) else balancer
        self.balancer_name = balancer_name or (
            balancer if isinstance(balancer, str) else getattr(balancer, "name", type(balancer).__name__)
        )
        if not callable(getattr(self.balancer, "plan", None)):
            raise TypeError(f"balancer {self.balancer_name!r} has no plan(request) method")
        self.compare_name = compare_balancer if compare_balancer and compare_balancer != self.balancer_name else None
        self.compare = get_balancer(self.compare_name) if self.compare_name else None
        if compare_measured and self.compare is None:
            raise ValueError(
                f"compare_measured runs the comparison balancer on every other step: it needs a comparison "
                f"balancer other than {self.balancer_name!r} (got {compare_balancer!r})"
            )
        # the comparison balancer's plan runs on the odd steps (compare_runs): both measured in one run
        self.compare_measured = bool(compare_measured)
        self.cluster = cluster
        self.cost = cost
        # (first step, version, cost model): steps from `first step` on are planned with it
        self._costs: List[Tuple[int, int, CostModel]] = [(0, 0, cost)]
        self._version_costs: Dict[int, CostModel] = {0: cost}  # in a forked worker: models received
        self.seed = seed
        self.lookahead = lookahead
        # no sampler: every step's batch comes with plan_now (GRPO's rollouts), checked like a stream's
        self.given_batches = sampler is None
        self.streaming = self.given_batches or bool(getattr(sampler, "streaming", False))
        if self.given_batches and lookahead > 0:
            raise ValueError("a planner without a sampler plans the batches it is given: lookahead must be 0")
        if self.streaming:
            # a stream's lengths come with its steps: no dataset-wide longest sample, and each
            # step's samples are checked when it is planned
            self.dataset_max_length = None
            self.max_sample_tokens = sample_token_limit(self.balancer, cluster, cost)
            self.masks = {}  # a stream's masks come with each batch (batch_masks), never from here
        else:
            self.dataset_max_length = max(sampler.lengths)
            # the longest sample the balancer trains: what the largest CP group holds, or longer
            # under chunkflow (dependent chunks on one rank); every sample is checked up front
            self.max_sample_tokens = check_sample_lengths(
                self.balancer,
                range(len(sampler.lengths)),
                sampler.lengths,
                cluster,
                cost,
                self.balancer_name,
                self.masks,
            )
        # the comparison balancer is only reported: it skips the steps whose samples it cannot train
        self.compare_limit = sample_token_limit(self.compare, cluster, cost) if self.compare is not None else None
        if self.compare_limit is not None and (self.dataset_max_length or 0) > self.compare_limit:
            warnings.warn(
                f"the comparison balancer {self.compare_name!r} trains samples up to {self.compare_limit} tokens; "
                f"steps with longer samples (sample {sampler.lengths.index(self.dataset_max_length)} has "
                f"{self.dataset_max_length}) are not compared",
                RuntimeWarning,
                stacklevel=2,
            )
        self._lock = threading.Lock()
        self._futures: Dict[int, Future] = {}
        self._reads: Dict[int, tuple] = {}  # a stream's batch and masks, read when its plan was asked for
        self._pool = None
        self.in_subprocess = False
        self.worker_restarts = 0
        self._started: Optional[Future] = None  # Planner.start's task
        # plan_own_host: this rank's host, whether this rank plans its parts, and the exchange
        self.host: Optional[int] = None
        self.plans_host = False
        self._exchange: Optional[PartsExchange] = None
        # steps whose parts every rank has exchanged ahead (_prefetch), and their merges under way
        self._gathered: Dict[int, Tuple[HostPlanned, list]] = {}
        self._merging: Dict[int, Future] = {}
        self.merged_ahead = 0  # steps taken merged by the background (_prefetch), for tests and reports
        if workers < 1:
            raise ValueError(f"planner workers must be >= 1, got {workers}")
        # steps are planned independently: up to `workers` of the `lookahead` steps at once
        self.workers = min(workers, max(lookahead, 1))
        if lookahead > 0 and in_subprocess and "fork" in multiprocessing.get_all_start_methods():
            self._pool = self._new_worker_pool()
            self.in_subprocess = True
        elif lookahead > 0:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_cp-planner")

    MAX_WORKER_RESTARTS = 3
    # A plan takes milliseconds to a few seconds (auto at 4096 ranks: ~1 s; the solvers have their
    # own deadlines). One that has not come after this long is from a worker that hangs (a fork
    # taken while another thread of the training process held a lock deadlocks the child): the
    # step is planned here instead, which gives the same plan (a pure function of the step), and
    # the planner goes on on a thread, never forking again. Below the collectives' timeout.
    PLAN_TIMEOUT_S = 60.0

    def start(self) -> None:
        """Start the background planner now, so that its start-up overlaps what the caller does
        next (the trainer's model and optimizer set-up): the worker process forks (or the thread
        starts) and pays its balancers' one-time start-up (Balancer.warm_up; Mt-KaHyPar's
        initialisation alone takes 0.1-0.3 s of CPU). Otherwise the first plan that needs it pays
        it, in the background during some training step: on CPU training, 4 ranks sharing 2 cores
        measured that step at 2.1x its time. Nothing to do without lookahead (plans are made on
        the caller's thread) or when already started."""
        if self._pool is None or self._started is not None:
            return
        with self._lock:
            self._started = self._pool.submit(_worker_pid if self.in_subprocess else self.warm_up_balancers)

    def warm_up_balancers(self) -> None:
        """The balancer's and the comparison balancer's one-time start-up, on this process. A
        failure is not raised here: the first plan that needs what failed raises it, naming its
        step."""
        for balancer in (self.balancer, self.compare):
            if balancer is not None:
                try:
                    warm_up_balancer(balancer)
                except Exception:  # noqa: BLE001 - raised again, with its step, by the plan that needs it
                    pass

    def _new_worker_pool(self) -> ProcessPoolExecutor:
        # forked at the first submit; the worker only runs Python planning (no CUDA, no collectives)
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_adopt_planner,
            initargs=(self, os.getpid()),
        )

    # ------------------------------------------------------------------ cost models over the run
    def cost_for(self, index: int) -> Tuple[int, CostModel]:
        """(version, cost model) that plans step `index`."""
        for first, version, cost in reversed(self._costs):
            if index >= first:
                return version, cost
        return self._costs[0][1], self._costs[0][2]  # pragma: no cover - the first entry starts at 0

    def set_cost(self, first_step: int, version: int, cost: CostModel) -> None:
        """Plan steps from `first_step` on with `cost` (online calibration). Plans of later steps
        already made or under way with the previous model are dropped and made again: a plan is a
        pure function of its step and cost model, so every rank that sets the same model from
        the same step plans the same steps."""
        if version <= self._costs[-1][1] or first_step < self._costs[-1][0]:
            raise ValueError(
                f"set_cost: version {version} from step {first_step} does not follow version "
                f"{self._costs[-1][1]} from step {self._costs[-1][0]}"
            )
        with self._lock:
            self._costs.append((first_step, version, cost))
            for k in [k for k in self._futures if k >= first_step]:
                self._futures.pop(k).cancel()
                self._reads.pop(k, None)
            for k in [k for k in self._gathered if k >= first_step]:  # exchanged again when taken
                self._gathered.pop(k)
                fut = self._merging.pop(k, None)
                if fut is not None:
                    fut.cancel()

    def _cost_of_version(self, version: int, profile) -> CostModel:
        if version not in self._version_costs:
            self._version_costs[version] = self.cost.with_profile(profile)
        return self._version_costs[version]

    def request(
        self, batch: GlobalBatch, cost: Optional[CostModel] = None, masks: Optional[Mapping[int, SampleMask]] = None
    ) -> PlanRequest:
        """`masks`: the batch's masks (a stream's, read with it); default: from the planner's."""
        if masks is None and self.masks:
            masks = {s: self.masks[s] for s in batch.sample_ids if s in self.masks}
        vision = {s: self.vision[s] for s in batch.sample_ids if s in self.vision} if self.vision else None
        return PlanRequest(
            sample_ids=batch.sample_ids,
            lengths=batch.lengths,
            cluster=self.cluster,
            cost=cost if cost is not None else self.cost,
            seed=self.seed,
            step=batch.index,
            dataset_max_length=self.dataset_max_length,
            max_sample_tokens=self.max_sample_tokens,
            masks=masks,
            vision=vision,
        )

    def plan_own_host(self, rank: int, exchange: PartsExchange) -> bool:
        """Plan only this rank's host's parts of each step a hierarchical balancer plans host by
        host (its option plan_own_host, on a world of several hosts): the first rank of each
        host plans them (the first pass, the blocks of hosts it owns, its own samples: the
        balancer's plan_host_parts), the other ranks of the host plan nothing, and `exchange`
        (a collective of every rank, called where the step's plan is taken) brings every
        host's parts, which finish merges. Call it on every rank before `start`, since a forked
        worker keeps what it was forked with. Returns whether it applies (otherwise every rank
        plans every step whole, as before)."""
        b = self.balancer
        if not callable(getattr(b, "plan_host_parts", None)) or not getattr(b.options, "plan_own_host", False):
            return False
        h = b.host_ranks_for(self.cluster)
        if h >= self.cluster.world_size:
            return False
        if not 0 <= rank < self.cluster.world_size:
            raise ValueError(f"plan_own_host: rank {rank} is not one of the {self.cluster.world_size} ranks")
        if self._started is not None or self._futures:
            raise RuntimeError(
                "plan_own_host must be called before the planner starts (a forked worker keeps its state)"
            )
        self.host, self.plans_host, self._exchange = rank // h, rank % h == 0, exchange
        return True

    def plan_now(
        self,
        index: int,
        cost: Optional[CostModel] = None,
        version: Optional[int] = None,
        batch: Optional[GlobalBatch] = None,
        masks: Optional[Mapping[int, SampleMask]] = None,
        label: Optional[Callable[[int], str]] = None,
        where: str = "",
    ) -> PlannedStep:
        """Plan, validate and simulate global step `index` on the calling thread, with `cost`
        (default: the model set for that step). `batch` (and its `masks`): a stream's step as
        read on the training process, or the step of a planner without a sampler (default: the
        sampler's). `label` names a sample, and `where` prefixes the error, of one too long to
        train. Planned host by host (plan_own_host), it exchanges the hosts' parts here."""
        return self.finish(index, self.plan_part(index, cost, version, batch, masks, label, where))

    def plan_part(
        self,
        index: int,
        cost: Optional[CostModel] = None,
        version: Optional[int] = None,
        batch: Optional[GlobalBatch] = None,
        masks: Optional[Mapping[int, SampleMask]] = None,
        label: Optional[Callable[[int], str]] = None,
        where: str = "",
    ):
        """What the planner worker computes of step `index` (plan_now's arguments): the planned
        step, or, planned host by host (plan_own_host), this rank's host's parts (HostPlanned),
        which `finish` completes on the training process."""
        if cost is None:
            version, cost = self.cost_for(index)
        if batch is None and self.given_batches:
            raise ValueError(f"step {index}: this planner has no sampler; pass the step's batch")
        if batch is None:
            batch = self.sampler[index]
            if self.streaming:
                masks = self.sampler.batch_masks(batch)
        if self.streaming:
            check_sample_lengths(
                self.balancer,
                batch.sample_ids,
                batch.lengths,
                self.cluster,
                cost,
                self.balancer_name,
                masks or (),
                where=where,
                label=label or (lambda s: f"stream sample {s}"),
            )
        req = self.request(batch, cost, masks)
        check_mask_support(self.balancer, req, self.balancer_name)
        if self.compare_runs(batch):
            return self._plan_compare_run(batch, req, version or 0)
        host_by_host = self._exchange is not None and self.balancer.hosts_of(req) is not None
        if host_by_host:
            check_request_lengths(self.balancer, req)
            t0, c0 = time.perf_counter(), time.process_time()
            parts = self._plan_host_parts(req) if self.plans_host else None
            planner_ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        else:
            planned = plan_and_predict(self.balancer, req)
        compare = None
        if self.compare is not None and max(batch.lengths) <= self.compare_limit:
            compare_req = self._compare_request(req)
            compare = predict(fitted_plan(self.compare, compare_req), compare_req)
        if host_by_host:
            return HostPlanned(batch, masks, parts, planner_ms, cpu_ms, compare, version or 0, cost)
        return PlannedStep(
            batch, planned.plan, planned.predicted, planned.planner_ms, compare, version or 0, planned.planner_cpu_ms
        )

    def compare_runs(self, batch: GlobalBatch) -> bool:
        """Whether step `batch` runs the comparison balancer's plan (compare_measured): the odd
        steps, the two balancers then alternating under the same load, each step's loss and
        gradients the same whichever plans it. A step with a sample longer than the comparison
        balancer trains runs the run's own balancer. The same on every rank (a pure function of
        the step)."""
        return self.compare_measured and batch.index % 2 == 1 and max(batch.lengths) <= self.compare_limit

    def _plan_compare_run(self, batch: GlobalBatch, req: PlanRequest, version: int) -> PlannedStep:
        """Step `batch` planned to run the comparison balancer's plan (compare_runs), beside the
        run's own balancer's plan of it, simulated only. Planned flat: a host-by-host balancer's
        whole plan is its hosts' parts merged (plan_hierarchically), so no parts are exchanged."""
        ran = plan_and_predict(self.compare, self._compare_request(req))
        own = predict(fitted_plan(self.balancer, req), req)
        return PlannedStep(
            batch, ran.plan, ran.predicted, ran.planner_ms, own, version, ran.planner_cpu_ms, ran_compare=True
        )

    def _compare_request(self, req: PlanRequest) -> PlanRequest:
        """`req` as the comparison balancer plans it: its masks checked, its run-wide choices
        sized for the longest sample it trains."""
        check_mask_support(self.compare, req, f"{self.compare_name} (the comparison balancer)")
        if (req.dataset_max_length or 0) > self.compare_limit:
            return replace(req, dataset_max_length=self.compare_limit)
        return req

    def _plan_host_parts(self, req: PlanRequest) -> HostParts:
        """This host's parts of `req`; a failure travels in them (HostParts.error), so that every
        rank raises it, naming the host, instead of waiting in the exchange for parts that never come."""
        try:
            return self.balancer.plan_host_parts(req, self.host)
        except Exception as e:  # noqa: BLE001 - raised on every rank by finish (merge_host_parts)
            return HostParts(req.step, self.host, 0, 0, (), 0, 0.0, 0.0, error=f"{type(e).__name__}: {e}")

    def finish(self, index: int, planned) -> PlannedStep:
        """The planned step from what plan_part gave: as it is, or, planned host by host, every
        host's parts exchanged (a collective of every rank), merged, fitted to the vision
        memory, validated and simulated as any plan is (plan_and_predict)."""
        if not isinstance(planned, HostPlanned):
            return planned
        return self.merge(planned, self._exchange(index, planned.parts))

    def merge(self, planned: HostPlanned, every_rank) -> PlannedStep:
        """The planned step from every rank's parts (`finish` after the exchange)."""
        cost = planned.cost if planned.cost is not None else self._cost_by_version(planned.cost_version)
        req = self.request(planned.batch, cost, planned.masks)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = fit_vision_memory(self.balancer.merge_host_parts(req, [p for p in every_rank if p is not None]), req)
        planner_ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        return PlannedStep(
            planned.batch,
            plan,
            predict(plan, req),
            planned.planner_ms + planner_ms,
            planned.compare,
            planned.cost_version,
            planned.planner_cpu_ms + cpu_ms,
        )

    def _cost_by_version(self, version: int) -> CostModel:
        for _, v, cost in self._costs:
            if v == version:
                return cost
        return self._version_costs[version]

    @classmethod
    def from_setup(cls, setup: PlanningSetup, balancer=None, **kwargs) -> Planner:
        """A planner for a PlanningSetup: its balancer (with its options) unless `balancer` (an
        object with .plan(PlanRequest)) replaces it, and its comparison balancer. kwargs:
        lookahead, in_subprocess, workers, masks, vision (default: the setup's grids)."""
        s = setup.settings
        kwargs.setdefault("vision", setup.vision)
        return cls(
            setup.sampler,
            balancer if balancer is not None else setup.balancer(),
            setup.cluster,
            setup.cost,
            seed=s.seed,
            compare_balancer=s.compare_balancer,
            balancer_name=s.balancer if balancer is None else None,
            **kwargs,
        )

    def get(self, index: int) -> PlannedStep:
        """The planned step `index`; schedules the next `lookahead` steps in the background.
        Planned host by host (plan_own_host), the next step's parts are exchanged here too, and
        merged in the background while this step trains (_prefetch)."""
        if not 0 <= index < len(self.sampler):
            raise IndexError(f"step {index}: the run has steps 0..{len(self.sampler) - 1}")
        if self.streaming:  # the trainer has collated every step before this one
            self.sampler.release(index)
        if self._pool is None:
            return self.plan_now(index)
        planned = self._take(index)
        self._prefetch(index + 1)
        return planned

    def _take(self, index: int) -> PlannedStep:
        """Step `index` from the background (get): its plan, or its parts exchanged ahead and
        their merge; the next `lookahead` steps scheduled either way."""
        read, gathered, merging = (), None, None
        with self._lock:
            for k in [k for k in self._gathered if k < index]:  # skipped (resume): drop
                self._gathered.pop(k)
                fut = self._merging.pop(k, None)
                if fut is not None:
                    fut.cancel()
        try:  # a dead worker surfaces at submit or at result, whichever comes first
            with self._lock:
                for k in range(index, min(index + 1 + self.lookahead, len(self.sampler))):
                    if k not in self._futures and k not in self._gathered:
                        version, cost = self.cost_for(k)
                        read = ()  # a stream's batch is read here, on the training process
                        if self.streaming:
                            try:
                                batch = self.sampler[k]
                            except StreamEnded:
                                if k == index:
                                    raise
                                break  # nothing to plan ahead past the stream's end
                            read = (batch, self.sampler.batch_masks(batch))
                        self._futures[k] = (
                            self._pool.submit(_plan_in_worker, k, version, cost.profile if version else None, *read)
                            if self.in_subprocess
                            else self._pool.submit(self.plan_part, k, cost, version, *read)
                        )
                        self._reads[k] = read
                for k in [k for k in self._futures if k < index]:  # skipped (resume): drop
                    self._futures.pop(k).cancel()
                    self._reads.pop(k, None)
                # (taken only once scheduling succeeded: a dead worker's replacement takes it again)
                gathered = self._gathered.pop(index, None)
                merging = self._merging.pop(index, None)
                if gathered is None:
                    fut = self._futures.pop(index)
                    read = self._reads.pop(index, ())
            if gathered is None:
                planned = fut.result() if not self.in_subprocess else fut.result(timeout=self.PLAN_TIMEOUT_S)
        except BrokenProcessPool as err:
            return self._replace_dead_worker(index, err)
        except FutureTimeout:
            return self._plan_past_a_hung_worker(index, read)
        if gathered is None:
            return self.finish(index, planned)
        # exchanged when the step before was taken: merged by the worker meanwhile
        if merging is not None:
            try:
                got = merging.result() if not self.in_subprocess else merging.result(timeout=self.PLAN_TIMEOUT_S)
                self.merged_ahead += 1
                return got
            except (BrokenProcessPool, FutureTimeout, CancelledError):
                pass  # the worker died or hangs (the next submit finds out): merged here instead
        return self.merge(*gathered)

    def _prefetch(self, index: int) -> None:
        """Planned host by host on a worker, step `index`'s parts are exchanged now, when the
        step before it is taken, and merged, validated and simulated by the worker while that
        step trains: at 512 ranks validating and simulating the merged plan takes 40-80 ms of
        CPU, which the training process would otherwise spend before each step. Every rank
        exchanges the same steps in the same order: this depends only on the steps taken (and
        on set_cost, called alike on every rank), never on what a worker has finished."""
        if (
            self._exchange is None
            or self.lookahead < 1
            or self.streaming
            or index >= len(self.sampler)
            or index in self._gathered
        ):
            return
        with self._lock:
            fut = self._futures.pop(index, None)
            self._reads.pop(index, None)
        planned = None
        if fut is not None:
            try:
                planned = fut.result() if not self.in_subprocess else fut.result(timeout=self.PLAN_TIMEOUT_S)
            except (BrokenProcessPool, FutureTimeout, CancelledError):
                pass  # planned here (the next submit replaces a dead worker)
            except Exception:  # noqa: BLE001 - a plan that fails (alike on every rank) fails when its step is taken
                with self._lock:
                    self._futures[index] = fut
                return
        if planned is None:
            version, cost = self.cost_for(index)
            planned = self.plan_part(index, cost, version)
        if not isinstance(planned, HostPlanned):  # planned flat: nothing to exchange
            with self._lock:
                self._futures[index] = _done(planned)
            return
        every_rank = self._exchange(index, planned.parts)
        with self._lock:
            self._gathered[index] = (planned, every_rank)
            try:
                self._merging[index] = (
                    self._pool.submit(
                        _merge_in_worker,
                        planned.cost_version,
                        self._cost_by_version(planned.cost_version).profile if planned.cost_version else None,
                        replace(planned, cost=None),
                        every_rank,
                    )
                    if self.in_subprocess
                    else self._pool.submit(self.merge, planned, every_rank)
                )
            except (BrokenProcessPool, RuntimeError):
                pass  # merged when taken

    def _plan_past_a_hung_worker(self, index: int, read: tuple) -> PlannedStep:
        """The worker process gave no plan within PLAN_TIMEOUT_S: kill it, plan `index` here and
        plan later steps on a thread (warned once, naming the step)."""
        warnings.warn(
            f"step {index}: the planner worker process gave no plan in {self.PLAN_TIMEOUT_S:g} s (a forked worker "
            "that hangs); planning this step here and the next ones on a thread of this process",
            RuntimeWarning,
            stacklevel=3,
        )
        with self._lock:
            pool = self._pool
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)
            self._futures.clear()
            self._reads.clear()
            self._merging.clear()  # (the exchanged parts are kept: merged when taken)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_cp-planner")
            self.in_subprocess = False
        version, cost = self.cost_for(index)
        return self.plan_now(index, cost, version, *read)

    def _replace_dead_worker(self, index: int, err: BaseException) -> PlannedStep:
        """The worker process died (killed, out of memory): its pending plans are lost, not
        wrong, since every plan is a pure function of the step. Fork a new worker and plan again;
        give up after a few deaths, when something kills every worker."""
        self.worker_restarts += 1
        if self.worker_restarts > self.MAX_WORKER_RESTARTS:
            raise RuntimeError(
                f"step {index}: the planner worker process died {self.worker_restarts} times (last: {err}). "
                "Check the kernel log for the OOM killer, or set cp_plan_in_subprocess: false to plan on a thread"
            ) from err
        warnings.warn(
            f"step {index}: the planner worker process died ({err}); starting a new one "
            f"({self.worker_restarts}/{self.MAX_WORKER_RESTARTS}) and planning again",
            RuntimeWarning,
            stacklevel=2,
        )
        with self._lock:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._futures.clear()
            self._reads.clear()
            self._merging.clear()  # (the exchanged parts are kept: merged when taken)
            self._pool = self._new_worker_pool()
        return self._take(index)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
