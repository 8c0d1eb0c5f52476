"""Wall-clock deadlines for solvers, enforced from outside the solver.

A solver's own time limit is not enough: HiGHS (highspy 1.16) ignores it inside MIP presolve
and ran one FlexSP MILP for more than 4 minutes (ENVIRONMENT.md). `call_with_deadline` runs
the solve in a forked worker process and kills it when the deadline passes; the caller then
takes its greedy fallback and says so in the plan (StepPlan.notes).

Fork, not spawn: the worker inherits the problem as built (nothing to pickle on the way in,
only the answer on the way out) and starts in milliseconds. Where fork is unavailable the
call runs in-process without a deadline (`deadlines_enforceable` says which).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any, Callable, Tuple


class DeadlinePassed(TimeoutError):
    """The solve did not finish within its wall-clock deadline; its worker was killed."""


def deadlines_enforceable() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _run_child(conn, fn: Callable, args: Tuple) -> None:
    try:
        try:
            out = ("ok", fn(*args))
        except BaseException as e:  # the parent re-raises it
            out = ("error", e)
        try:
            conn.send(out)
        except Exception as e:  # an unpicklable answer or exception
            conn.send(("error", RuntimeError(f"solver worker could not send its answer back: {e!r}")))
    finally:
        conn.close()
        os._exit(0)  # no atexit handlers or buffered output of the parent's copy


def call_with_deadline(fn: Callable, args: Tuple = (), deadline_s: float = 1.0) -> Any:
    """fn(*args) in a forked worker; its return value, its exception re-raised, or
    DeadlinePassed once `deadline_s` seconds of wall clock have gone (the worker is killed).
    Without fork, fn runs in-process and the deadline is not enforced."""
    if deadline_s <= 0:
        raise ValueError(f"deadline_s {deadline_s} must be positive")
    if not deadlines_enforceable():
        return fn(*args)
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=_run_child, args=(send, fn, args), daemon=True, name="hf_cp-solver")
    start = time.monotonic()
    worker.start()
    send.close()
    try:
        if not receive.poll(max(0.0, deadline_s - (time.monotonic() - start))):
            raise DeadlinePassed(f"solver passed its {deadline_s:g} s deadline")
        try:
            status, value = receive.recv()
        except EOFError:
            raise RuntimeError(f"solver worker died (exit code {worker.exitcode}) before answering") from None
    finally:
        receive.close()
        if worker.is_alive():
            worker.kill()
        worker.join()
    if status == "error":
        raise value
    return value
