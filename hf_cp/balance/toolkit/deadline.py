"""Wall-clock deadlines for solvers, enforced from outside the solver.

A solver's own time limit is not enough: HiGHS (highspy 1.16) ignores it inside MIP presolve
and ran one FlexSP MILP for more than 4 minutes (ENVIRONMENT.md). `SolverWorker` runs the solve
in a forked worker process and kills it when the deadline passes; the caller then takes its
greedy fallback and says so in the plan (StepPlan.notes). Where fork is unavailable the call
runs in-process without a deadline (`deadlines_enforceable` says which).

One long-lived worker, not a fork per solve: a fork is cheap only in a small process. The
planner runs in a fork of the training process (torch, the model, DeepSpeed: about 470 MB
resident), and forking that and exiting costs 27-37 ms of CPU (measured: page tables,
copy-on-write faults, exit), more than a small MILP. On a machine whose cores also train (CPU
training, 2 ranks on 2 cores) every rank's planner paid it per flexsp plan: `auto` planned 38 ms
per step instead of 10, and its steps took 242 ms against 216 with the same plans
(benchmarks/wallclock.md). `SolverWorker` serves every solve (the function and its arguments
are pickled to it) and is replaced only when a deadline kills it; `solver_worker()` is the
process's shared one.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
import time
from typing import Any, Callable, Optional, Tuple


class DeadlinePassed(TimeoutError):
    """The solve did not finish within its wall-clock deadline; its worker was killed."""


def deadlines_enforceable() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _answer(conn, fn: Callable, args: Tuple) -> None:
    """Send ("ok", fn(*args)) or ("error", its exception) down `conn`; the caller re-raises it."""
    try:
        out = ("ok", fn(*args))
    except BaseException as e:
        out = ("error", e)
    try:
        conn.send(out)
    except Exception as e:  # an unpicklable answer or exception
        conn.send(("error", RuntimeError(f"solver worker could not send its answer back: {e!r}")))


def _serve(conn, parent_pid: int) -> None:
    """The solver worker's loop: (fn, args) in, ("ok", value) or ("error", exception) out, until
    its caller closes the pipe or dies (a forked child would otherwise outlive it)."""
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent_pid:
                    break
                continue
            try:
                fn, args = conn.recv()
            except EOFError:
                break
            _answer(conn, fn, args)
    finally:
        conn.close()
        os._exit(0)  # no atexit handlers or buffered output of the parent's copy


class SolverWorker:
    """One long-lived worker process that runs solves under a wall-clock deadline.

    `call(fn, args, deadline_s)` sends fn and args (pickled: a module-level function and plain
    data) to the worker and returns fn(*args), re-raises its exception, or kills the worker and
    raises DeadlinePassed once `deadline_s` seconds have gone; the next call starts a new worker.
    The worker is forked on first use, from the calling process. Thread-safe (one solve at a
    time). Without fork, fn runs in-process and the deadline is not enforced."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._owner: Optional[int] = None  # the pid that started the worker (a fork must not use it)
        self.started = 0  # workers started so far

    @property
    def pid(self) -> Optional[int]:
        """The live worker's process id (None before the first call or after a kill)."""
        return self._proc.pid if self._proc is not None and self._owner == os.getpid() else None

    def start(self) -> None:
        """Start the worker process now, unless this process already runs one (a solver's
        warm_up: forking is then paid before the first solve, not during it)."""
        if not deadlines_enforceable():
            return
        with self._lock:
            self._ensure_running()

    def _ensure_running(self) -> None:
        """A live worker of this process's own (the lock held)."""
        if self._owner != os.getpid():  # inherited through a fork: that worker is not ours to use
            self._proc = self._conn = None
        if self._proc is None or not self._proc.is_alive():
            self._stop()
            self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("fork")
        ours, theirs = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_serve, args=(theirs, os.getpid()), daemon=True, name="hf_cp-solver")
        proc.start()
        theirs.close()
        self._proc, self._conn, self._owner = proc, ours, os.getpid()
        self.started += 1

    def _stop(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join()

    def close(self) -> None:
        with self._lock:
            if self._owner == os.getpid():
                self._stop()
            self._proc = self._conn = None

    def call(self, fn: Callable, args: Tuple = (), deadline_s: float = 1.0) -> Any:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s {deadline_s} must be positive")
        if not deadlines_enforceable():
            return fn(*args)
        try:
            message = pickle.dumps((fn, args))
        except Exception as e:
            raise TypeError(
                f"a solve sent to the solver worker must pickle (a module-level function and plain data): {e!r}"
            ) from None
        with self._lock:
            self._ensure_running()
            start = time.monotonic()
            try:
                self._conn.send_bytes(message)
            except (BrokenPipeError, OSError):  # the worker died since the last solve: one new try
                self._stop()
                self._start()
                self._conn.send_bytes(message)
            if not self._conn.poll(max(0.0, deadline_s - (time.monotonic() - start))):
                self._stop()
                raise DeadlinePassed(f"solver passed its {deadline_s:g} s deadline")
            try:
                status, value = self._conn.recv()
            except EOFError:
                code = self._proc.exitcode if self._proc is not None else None
                self._stop()
                raise RuntimeError(f"solver worker died (exit code {code}) before answering") from None
        if status == "error":
            raise value
        return value


_SHARED: Optional[SolverWorker] = None


def solver_worker() -> SolverWorker:
    """This process's shared solver worker (a forked child gets its own on first use)."""
    global _SHARED
    if _SHARED is None:
        _SHARED = SolverWorker()
    return _SHARED
