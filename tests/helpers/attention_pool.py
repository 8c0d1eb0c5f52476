"""A pool of long-lived gloo processes for the attention and consistency tests.

Spawning and importing torch costs seconds per process on the CI's two cores, so each world
size gets one process group for the whole session and every hypothesis example is a task
sent to it. Every rank runs the same task function with the same arguments; results come
back per rank. A task that hangs (a collective mismatch) hits the collective timeout in the
workers or the task timeout here; the pool is then restarted for the next task.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import time
import traceback

import pytest
import torch.multiprocessing as mp

from helpers.dist_utils import free_port


def _pool_main(rank, world, port, inbox, outbox, collective_timeout_s):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=collective_timeout_s)
    )
    try:
        while True:
            task = inbox.get()
            if task is None:
                break
            task_id, fn, args = task
            try:
                outbox.put((task_id, rank, "ok", fn(rank, world, *args)))
            except BaseException as e:  # report everything to the parent
                outbox.put((task_id, rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def _reported(rank, world, fn, args):
    try:
        return ("ok", fn(rank, world, *args))
    except Exception as e:
        return ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


class GlooPool:
    def __init__(self, world: int, collective_timeout_s: float = 60):
        self.world, self.collective_timeout_s = world, collective_timeout_s
        self.procs = []
        self._task = 0

    def _start(self):
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_pool_main,
                args=(r, self.world, port, self.inboxes[r], self.outbox, self.collective_timeout_s),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout_s: float = 90):
        """fn(rank, world, *args) on every rank; returns the ranks' results concatenated in rank
        order when they are lists, else a list of them; raises if any rank failed."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        self._task += 1
        for box in self.inboxes:
            box.put((self._task, fn, args))
        results, deadline = {}, time.monotonic() + timeout_s
        while len(results) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise TimeoutError(
                    f"ranks {sorted(set(range(self.world)) - set(results))} of {self.world} "
                    f"did not finish {fn.__name__} in {timeout_s} s"
                )
            try:
                task_id, rank, status, value = self.outbox.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                if not all(p.is_alive() for p in self.procs):
                    self.close()
                    raise RuntimeError(f"a pool process died while running {fn.__name__}") from None
                continue
            if task_id == self._task:
                results[rank] = (status, value)
        errors = {r: v for r, (s, v) in results.items() if s != "ok"}
        if errors:
            self.close()  # ranks may be out of step now
            raise AssertionError(
                f"{fn.__name__} failed on ranks {sorted(errors)}:\n"
                + "\n".join(f"[rank {r}] {v}" for r, v in sorted(errors.items()))
            )
        out = []
        for r in range(self.world):
            v = results[r][1]
            out.extend(v) if isinstance(v, list) else out.append(v)
        return out

    def outcomes(self, fn, *args, timeout_s: float = 90) -> dict:
        """fn(rank, world, *args) on every rank, each rank's exception caught and reported:
        {rank: ("ok", result) | ("error", "Type: message\ntraceback")}, like
        dist_utils.run_distributed but on the session's processes. For tasks whose errors
        leave the ranks in step (every rank raises after the same collectives)."""
        return dict(enumerate(self.run(_reported, fn, args, timeout_s=timeout_s)))

    def close(self):
        for p, box in zip(self.procs, getattr(self, "inboxes", [])):
            if p.is_alive():
                box.put(None)
        deadline = time.monotonic() + 3
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        self.procs = []


_POOLS = {}


@pytest.fixture(scope="session")
def pools():
    """pools(world) -> the session's GlooPool of that size."""

    def get(world: int) -> GlooPool:
        if world not in _POOLS:
            _POOLS[world] = GlooPool(world)
        return _POOLS[world]

    yield get
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


# ----------------------------------------------------------------------------- worker-side helpers
_GROUPS = {}
_SPY = []


def process_group(ranks):
    """The process group of `ranks` (None for one rank), created once per worker; every rank
    must ask for the same groups in the same order."""
    import torch.distributed as dist

    key = tuple(ranks)
    if len(key) == 1:
        return None
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key))
    return _GROUPS[key]


# isend / irecv stay unwrapped: P2POp checks the op's identity; batch_isend_irecv is counted.
_SPIED = (
    "all_to_all_single",
    "all_to_all",
    "batch_isend_irecv",
    "send",
    "recv",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "reduce",
    "gather",
    "scatter",
)


class CollectiveSpy:
    """Counts every call into torch.distributed's communication functions in this process."""

    def __init__(self):
        import torch.distributed as dist

        self.calls = 0
        for name in _SPIED:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name)))

    def _wrap(self, fn):
        def counted(*a, **kw):
            self.calls += 1
            return fn(*a, **kw)

        return counted


def collective_spy() -> CollectiveSpy:
    if not _SPY:
        _SPY.append(CollectiveSpy())
    return _SPY[0]
