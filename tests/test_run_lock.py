"""output_dir's lock (hf_cp/train/checkpoint/run_lock.py): a second run on one output_dir is refused naming
the first, stale locks of dead processes are taken over, and a run never leaves its lock behind."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_cp.train.checkpoint.run_lock import (
    LOCK_FILE,
    OutputDirLockedError,
    RunLock,
    hold_run_lock,
    lock_path,
    lock_status,
    read_lock,
    take_run_lock,
)

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")

# a process that holds the lock through the public API until it is killed
HOLDER = (
    "import sys, time\n"
    "from hf_cp.train.checkpoint.run_lock import RunLock\n"
    "lock = RunLock(sys.argv[1]).acquire()\n"
    "print('held', lock.run_id, flush=True)\n"
    "if sys.argv[2] == 'sleep':\n"
    "    time.sleep(600)\n"
)


def _holder(out: Path, mode: str = "sleep") -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out), mode], stdout=subprocess.PIPE, text=True, cwd=str(ROOT)
    )
    line = proc.stdout.readline()
    assert line.startswith("held"), line
    return proc


# a real training run (world 1) that pauses after saving checkpoint-2 until told to go on
TRAINING_HOLDER = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from transformers import TrainerCallback\n"
    "from helpers.checkpoint_runs import train_with_checkpoints\n"
    "out, held, go = (Path(a) for a in sys.argv[1:4])\n"
    "class Pause(TrainerCallback):\n"
    "    def on_save(self, args, state, control, **kwargs):\n"
    "        if state.global_step == 2:\n"
    "            held.write_text('held')\n"
    "            deadline = time.monotonic() + 300\n"
    "            while not go.exists() and time.monotonic() < deadline:\n"
    "                time.sleep(0.1)\n"
    "trainer = train_with_checkpoints(out, steps=4, callbacks=[Pause()])\n"
    "print('trained', trainer.state.global_step, flush=True)\n"
)


def _dead_pid() -> int:
    """The pid of a process of this host that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(out: Path, **fields) -> Path:
    record = dict(
        host=socket.gethostname(), pid=os.getpid(), started=time.time() - 300, command="train.py a", run_id="r0"
    )
    record.update(fields)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    path.write_text(json.dumps(record))
    return path


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ the module


def test_a_lock_holds_who_took_it_and_release_removes_it(tmp_path):
    lock = RunLock(tmp_path / "out").acquire()
    record = json.loads((tmp_path / "out" / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert record["run_id"] == lock.run_id and record["command"] and record["started"] <= time.time()
    assert lock.release() is True
    assert not lock_path(tmp_path / "out").exists()
    assert lock.release() is False  # once


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(OutputDirLockedError) as err:
        RunLock(tmp_path).acquire()
    text = str(err.value)
    assert isinstance(err.value, RuntimeError)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in text and "started " in text and "ago)" in text
    assert first.run_id in text and "command: " in text and "still running on this host" in text
    assert "cp_break_lock: true" in text and f"delete {tmp_path / LOCK_FILE}" in text
    assert read_lock(tmp_path / LOCK_FILE)["run_id"] == first.run_id  # the refused lock left it alone
    first.release()


def test_a_stale_lock_of_a_dead_process_of_this_host_is_taken_over_with_a_warning(tmp_path):
    dead = _dead_pid()
    _write_lock(tmp_path, pid=dead, command="python old_run.py")
    warnings = []
    lock = RunLock(tmp_path, warn=warnings.append).acquire()
    assert len(warnings) == 1 and "stale" in warnings[0]
    assert f"pid {dead} on host" in warnings[0] and "old_run.py" in warnings[0]
    assert read_lock(tmp_path / LOCK_FILE)["run_id"] == lock.run_id
    lock.release()
    assert lock_status(tmp_path) is None


def test_a_lock_from_another_host_is_refused_and_cp_break_lock_breaks_it(tmp_path):
    _write_lock(tmp_path, host="node-7", pid=_dead_pid())  # a dead pid here says nothing about node-7
    with pytest.raises(OutputDirLockedError) as err:
        RunLock(tmp_path).acquire()
    text = str(err.value)
    assert "on host node-7" in text and "another host (node-7" in text
    assert "cp_break_lock: true" in text and "delete" in text
    warnings = []
    lock = RunLock(tmp_path, break_lock=True, warn=warnings.append).acquire()
    assert "cp_break_lock: breaking the lock of" in warnings[0] and "node-7" in warnings[0]
    assert lock.release() and not (tmp_path / LOCK_FILE).exists()


def test_an_unreadable_lock_is_refused_until_broken(tmp_path):
    path = tmp_path / LOCK_FILE
    path.write_text("")
    os.utime(path, (time.time() - 60, time.time() - 60))  # not a writer between create and write
    with pytest.raises(OutputDirLockedError, match="unreadable lock"):
        RunLock(tmp_path).acquire()
    with RunLock(tmp_path, break_lock=True, warn=lambda m: None):
        assert read_lock(path)["pid"] == os.getpid()
    assert not path.exists()


def test_an_earlier_attempt_of_the_same_elastic_job_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _write_lock(tmp_path, host="node-7", job="job-1", attempt=0)
    warnings = []
    RunLock(tmp_path, warn=warnings.append).acquire().release()
    assert "attempt 0 of this job" in warnings[0]
    _write_lock(tmp_path, host="node-7", job="job-2", attempt=0)  # another job: refused
    with pytest.raises(OutputDirLockedError, match="job-2"):
        RunLock(tmp_path).acquire()


def test_the_lock_is_released_when_the_run_raises(tmp_path):
    with pytest.raises(ValueError, match="boom"):
        with hold_run_lock(tmp_path, rank=0, world=1) as lock:
            assert read_lock(tmp_path / LOCK_FILE)["run_id"] == lock.run_id
            raise ValueError("boom")
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_nested_hold_takes_the_lock_once_and_the_outer_one_releases_it(tmp_path):
    with hold_run_lock(tmp_path, 0, 1) as outer:
        with hold_run_lock(tmp_path, 0, 1) as inner:  # hf-cp train around CPTrainer.train
            assert inner is outer
        assert read_lock(tmp_path / LOCK_FILE)["run_id"] == outer.run_id
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_process_that_does_not_hold_the_lock_does_not_release_it(tmp_path):
    path = _write_lock(tmp_path, run_id="theirs")
    assert RunLock(tmp_path).release() is False  # never acquired
    assert path.exists()
    mine = RunLock(tmp_path, break_lock=True, warn=lambda m: None).acquire()
    _write_lock(tmp_path, run_id="theirs-again")  # another run broke it meanwhile
    warnings = []
    mine._warn = warnings.append
    assert mine.release() is False
    assert read_lock(path)["run_id"] == "theirs-again" and "taken over by" in warnings[0]


def test_interpreter_exit_releases_a_lock_never_released(tmp_path):
    proc = _holder(tmp_path, mode="exit")  # acquires and returns without release()
    assert proc.wait(timeout=60) == 0
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_killed_holder_leaves_a_stale_lock_that_the_next_run_takes_over(tmp_path):
    proc = _holder(tmp_path)
    proc.send_signal(signal.SIGKILL)  # no atexit: the lock stays
    proc.wait(timeout=30)
    assert read_lock(tmp_path / LOCK_FILE)["pid"] == proc.pid
    assert lock_status(tmp_path)[0] == "note"
    warnings = []
    RunLock(tmp_path, warn=warnings.append).acquire().release()
    assert f"pid {proc.pid}" in warnings[0] and "stale" in warnings[0]


def _take_on_every_rank(rank, world, out):
    try:
        lock = take_run_lock(out, rank, world)
    except OutputDirLockedError as err:
        return ("refused", str(err))
    return ("took", lock.run_id if lock is not None else None)


def test_every_rank_of_a_world_raises_rank_0s_refusal(tmp_path):
    from helpers.dist_utils import run_distributed

    path = _write_lock(tmp_path, host="node-7")
    out = run_distributed(_take_on_every_rank, 2, str(tmp_path), timeout_s=120, collective_timeout_s=30)
    assert out[0][0] == out[1][0] == "ok", out
    assert out[0][1][0] == out[1][1][0] == "refused"
    assert out[0][1][1] == out[1][1][1] and "node-7" in out[0][1][1]
    assert read_lock(path)["run_id"] == "r0"


def test_the_dry_run_reports_a_live_lock_without_taking_it(tmp_path, capsys):
    from hf_cp.cli import main as cli_main

    path = _write_lock(tmp_path, host="node-7")
    before = path.read_bytes()
    assert lock_status(tmp_path)[0] == "error"
    assert lock_status(tmp_path, break_lock=True)[0] == "note"
    argv = ["train", TINY, "--dry-run", "--dry-run-steps", "1", "--set", f"training.output_dir={tmp_path}"]
    assert cli_main(argv) == 2
    printed = capsys.readouterr().out
    assert "error: output_dir" in printed and "node-7" in printed and "dry run failed" in printed
    assert path.read_bytes() == before


def test_cpgrpotrainer_train_holds_the_lock(tmp_path):
    from hf_cp.train.objectives.grpo import CPGRPOTrainer

    _write_lock(tmp_path, host="node-7")
    fake = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path), cp_break_lock=False), cp_rank=0, cp_world=1)
    with pytest.raises(OutputDirLockedError, match="node-7"):
        CPGRPOTrainer.train(fake)  # refused before GRPOTrainer.train


# ------------------------------------------------------------------ a real second run


def test_a_second_training_run_on_a_held_output_dir_is_refused_and_touches_nothing(tmp_path, caplog):
    from helpers.checkpoint_runs import train_with_checkpoints

    out = tmp_path / "out"
    (out / "cp_history").mkdir(parents=True)
    (out / "cp_history" / "rank0.jsonl").write_text('{"step": 1}\n')  # the holder's history
    proc = _holder(out)
    try:
        before = _files(out)
        with pytest.raises(OutputDirLockedError) as err:
            train_with_checkpoints(out, steps=2)
        assert f"pid {proc.pid} on host" in str(err.value) and "cp_break_lock" in str(err.value)
        assert _files(out) == before  # no checkpoint, the history not cut back
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # the holder died without releasing: the next run takes the stale lock over, trains, and leaves none
    with caplog.at_level(logging.WARNING, logger="hf_cp.train.checkpoint.run_lock"):
        trainer = train_with_checkpoints(out, steps=2)
    assert f"stale lock of a run that is gone: pid {proc.pid}" in caplog.text
    assert trainer.state.global_step == 2 and (out / "checkpoint-2").is_dir()
    assert not (out / LOCK_FILE).exists()


def test_a_run_held_mid_training_refuses_a_second_run_which_touches_nothing(tmp_path):
    from helpers.checkpoint_runs import train_with_checkpoints

    out, held, go = tmp_path / "out", tmp_path / "held", tmp_path / "go"  # the signals outside out
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINING_HOLDER, str(out), str(held), str(go)],
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not held.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held.exists(), proc.communicate(timeout=30)[0][-3000:] if proc.poll() is not None else "no pause"
        assert read_lock(out / LOCK_FILE)["pid"] == proc.pid
        before = _files(out)
        assert "checkpoint-2/model.safetensors" in before and "cp_history/rank0.jsonl" in before
        with pytest.raises(OutputDirLockedError) as err:
            train_with_checkpoints(out, steps=4)
        assert f"pid {proc.pid} on host {socket.gethostname()}" in str(err.value)
        assert _files(out) == before  # the holder's checkpoint and history byte for byte
    finally:
        go.write_text("go")
        printed = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0 and "trained 4" in printed, printed[-3000:]
    # the holder's run ended cleanly: its lock is gone, its history has each step once
    assert not (out / LOCK_FILE).exists()
    assert (out / "checkpoint-4").is_dir()
    steps = [json.loads(line)["global_step"] for line in (out / "cp_history" / "rank0.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
