"""Planner (hf_cp/planning/worker.py): plans made ahead by a background thread or worker
processes equal those made inline; warm-up, dead workers and an orphaned worker."""

from __future__ import annotations

import os
import time

import pytest

from hf_cp.cost.model import CostModel
from hf_cp.plan.cluster import ClusterSpec
from hf_cp.planning import GlobalBatchSampler, Planner

from helpers.world2_job import LENGTHS


@pytest.mark.parametrize("in_subprocess", [False, True])
def test_background_planner_matches_inline_planning_and_validates(in_subprocess):
    from concurrent.futures import ProcessPoolExecutor

    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=2)
    cl = ClusterSpec(4, 256)
    bg = Planner(sampler, "auto", cl, cost, lookahead=3, compare_balancer="static", in_subprocess=in_subprocess)
    inline = Planner(sampler, "auto", cl, cost, lookahead=0, compare_balancer="static")
    assert bg.in_subprocess == in_subprocess and isinstance(bg._pool, ProcessPoolExecutor) == in_subprocess
    try:
        order = [0, 1, 2, 5, 6, len(sampler) - 1]  # includes a jump, as after a resume
        for k in order:
            a, b = bg.get(k), inline.get(k)
            assert a.plan.to_json() == b.plan.to_json() and a.plan.step == k
            assert a.predicted.makespan_ms == pytest.approx(b.predicted.makespan_ms)
            assert a.compare.makespan_ms == pytest.approx(b.compare.makespan_ms)
            assert a.batch.sample_ids == b.batch.sample_ids
    finally:
        bg.close()

    class Broken:
        name = "broken"

        def plan(self, req):
            return req.empty_plan("broken")  # schedules nothing

    with pytest.raises(ValueError, match="never scheduled"):
        Planner(sampler, Broken(), cl, cost, lookahead=0).get(0)

    class WhereAmI:
        name = "where"

        def plan(self, req):
            import dataclasses
            import os

            from hf_cp.balance import get_balancer

            return dataclasses.replace(get_balancer("static").plan(req), balancer=f"pid {os.getpid()}")

    where = Planner(sampler, WhereAmI(), cl, cost, lookahead=1, in_subprocess=in_subprocess)
    try:  # in_subprocess: planned by another process, off this one's GIL
        import os

        assert (where.get(0).plan.balancer != f"pid {os.getpid()}") == in_subprocess
    finally:
        where.close()
    broken_bg = Planner(sampler, Broken(), cl, cost, lookahead=1, in_subprocess=in_subprocess)
    try:  # an invalid plan made in the worker reaches the trainer as the same error
        with pytest.raises(ValueError, match="never scheduled"):
            broken_bg.get(0)
    finally:
        broken_bg.close()


def test_several_planner_workers_plan_the_same_steps():
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=3)
    cl = ClusterSpec(4, 256)
    inline = Planner(sampler, "auto", cl, cost, lookahead=0)
    bg = Planner(sampler, "auto", cl, cost, lookahead=4, in_subprocess=True, workers=3)
    try:
        for k in [0, 1, 2, 3, 7, 8, 9, len(sampler) - 1]:
            assert bg.get(k).plan.to_json() == inline.get(k).plan.to_json(), k
        assert len(bg._pool._processes) == 3
        # planning is background work: the workers run nicer than the training process
        from hf_cp.planning.worker import PLANNER_NICENESS

        mine = os.getpriority(os.PRIO_PROCESS, 0)
        for pid in bg._pool._processes:
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, mine + PLANNER_NICENESS)
    finally:
        bg.close()
    with pytest.raises(ValueError, match="planner workers must be >= 1"):
        Planner(sampler, "auto", cl, cost, workers=0)


class _WarmUpRecorder:
    """static's plans; warm_up() appends "<pid> <thread name>" to a file (it may run in a worker process)."""

    name = "warm-up-recorder"

    def __init__(self, path, fail=False):
        from hf_cp.balance import get_balancer

        self.static, self.path, self.fail = get_balancer("static"), path, fail

    def plan(self, req):
        return self.static.plan(req)

    def warm_up(self):
        import threading

        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {threading.current_thread().name}\n")
        if self.fail:
            raise RuntimeError("warm-up failed")


def _wait_for_lines(path, n, timeout_s=20.0):
    import time

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return path.read_text().splitlines()
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {n} warm-up lines after {timeout_s} s")


@pytest.mark.parametrize("in_subprocess", [True, False])
def test_planner_start_warms_the_balancer_up_in_the_background_before_any_plan(tmp_path, in_subprocess):
    """Planner.start: the worker starts and pays the balancer's one-time start-up (warm_up) at
    once, in the worker that will plan (each process of the pool, or the planner thread), not
    in the step that first needs it; the plans stay those planned inline."""
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=3)
    cl = ClusterSpec(4, 256)
    inline = Planner(sampler, "static", cl, cost, lookahead=0)
    record = tmp_path / "warm.txt"
    bg = Planner(sampler, _WarmUpRecorder(record), cl, cost, lookahead=3, in_subprocess=in_subprocess, workers=2)
    try:
        assert not record.exists()  # nothing runs before start()
        bg.start()
        bg.start()  # once only
        lines = _wait_for_lines(record, 2 if in_subprocess else 1)  # before any get()
        pids = {int(line.split()[0]) for line in lines}
        if in_subprocess:
            assert pids == set(bg._pool._processes) and os.getpid() not in pids  # each worker process, once
        else:
            assert pids == {os.getpid()} and lines[0].split()[1].startswith("hf_cp-planner")
        for k in [0, 1, 5]:
            assert bg.get(k).plan.to_json() == inline.get(k).plan.to_json()
        assert len(record.read_text().splitlines()) == len(lines)  # planning warmed nothing up again
    finally:
        bg.close()
    # without a background worker there is nothing to start: plans are made on the caller's thread
    Planner(sampler, _WarmUpRecorder(record), cl, cost, lookahead=0).start()
    assert len(record.read_text().splitlines()) == len(lines)


def test_a_failed_warm_up_is_left_to_the_plan_that_needs_it(tmp_path):
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=3)
    bg = Planner(sampler, _WarmUpRecorder(tmp_path / "w.txt", fail=True), ClusterSpec(4, 256), cost, lookahead=1)
    try:
        bg.warm_up_balancers()  # does not raise: the first plan that needs what failed raises it, with its step
        bg.start()
        assert bg.get(0).plan.waves
    finally:
        bg.close()


def _inline_and_worker_planners():
    """(a planner planning on the caller's thread, one planning 2 steps ahead in a forked worker)
    of the same steps, whose plans must be equal."""
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler(LENGTHS * 3, 900, seed=5, num_epochs=3)
    cl = ClusterSpec(4, 256)
    return (
        Planner(sampler, "auto", cl, cost, lookahead=0),
        Planner(sampler, "auto", cl, cost, lookahead=2, in_subprocess=True),
    )


def test_planner_replaces_a_worker_process_that_dies():
    """An OOM-killed planner worker costs a warning and a re-plan, never a hang or a wrong plan."""
    import os
    import signal

    inline, bg = _inline_and_worker_planners()
    try:
        assert bg.get(0).plan.to_json() == inline.get(0).plan.to_json()
        for death in range(1, Planner.MAX_WORKER_RESTARTS + 2):
            (pid,) = list(bg._pool._processes)
            os.kill(pid, signal.SIGKILL)
            step = 3 * death  # not planned ahead yet: the dead worker would have had to plan it
            if death <= Planner.MAX_WORKER_RESTARTS:
                with pytest.warns(RuntimeWarning, match=f"step {step}: the planner worker process died"):
                    got = bg.get(step)
                assert got.plan.to_json() == inline.get(step).plan.to_json()
                assert bg.worker_restarts == death
            else:  # something kills every worker: an error naming the step, not an endless loop
                with pytest.raises(RuntimeError, match=f"step {step}: the planner worker process died 4 times"):
                    bg.get(step)
    finally:
        bg.close()


def test_a_hung_planner_worker_costs_a_warning_and_an_inline_plan_never_a_hang(monkeypatch):
    """A forked worker that hangs (stopped here with SIGSTOP, as a fork that deadlocked on a lock
    would sit) gives no plan: after PLAN_TIMEOUT_S the step is planned in this process, the same
    plan, and the planner goes on on a thread (a later step needs no worker)."""
    import signal

    monkeypatch.setattr(Planner, "PLAN_TIMEOUT_S", 2.0)
    inline, bg = _inline_and_worker_planners()
    try:
        assert bg.get(0).plan.to_json() == inline.get(0).plan.to_json()
        (pid,) = list(bg._pool._processes)
        os.kill(pid, signal.SIGSTOP)
        with pytest.warns(RuntimeWarning, match="step 4: the planner worker process gave no plan in 2 s"):
            got = bg.get(4)  # not planned ahead: the stopped worker would have had to plan it
        assert got.plan.to_json() == inline.get(4).plan.to_json()
        assert not bg.in_subprocess
        assert bg.get(5).plan.to_json() == inline.get(5).plan.to_json()
        with pytest.raises(ProcessLookupError):  # the hung worker was killed (and reaped), not left behind
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
    finally:
        bg.close()


def test_planner_names_a_sample_too_long_for_any_group():
    cost = CostModel.load("tiny-llama", "h200-qwen2.5-7b")
    sampler = GlobalBatchSampler([10, 3000, 20], 5000)
    with pytest.raises(ValueError, match="sample 1 has 3000 tokens"):
        Planner(sampler, "static", ClusterSpec(2, 1000), cost)


def test_planner_worker_exits_when_its_training_process_is_killed():
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = (
        "import os\n"
        "from hf_cp.plan.cluster import ClusterSpec\n"
        "from hf_cp.cost.model import CostModel\n"
        "from hf_cp.planning import Planner\n"
        "from hf_cp.planning import GlobalBatchSampler\n"
        "p = Planner(GlobalBatchSampler([10] * 40, 100), 'static', ClusterSpec(2, 256),\n"
        "            CostModel.load('tiny-llama', 'h200-qwen2.5-7b'), lookahead=1, in_subprocess=True)\n"
        "p.get(0)\n"
        "print(*p._pool._processes, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    # the forked worker holds this pipe too: run() returns only once the worker is gone as well
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr[-2000:]
    worker = int(proc.stdout.split()[0])
    assert time.perf_counter() - t0 < 30
    status = Path(f"/proc/{worker}/status")

    def gone():
        try:  # exited: reaped, or a zombie until reaped
            return "\nState:\tZ" in status.read_text()
        except FileNotFoundError:
            return True

    # a dying process closes its files before it turns zombie, so the pipe may close while
    # /proc still shows it running: give the exit a moment to finish
    deadline = time.perf_counter() + 10
    while not gone() and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert gone(), f"planner worker {worker} outlived its training process"
