"""The run's lock on its output_dir.

Two runs on one output_dir overwrite each other's checkpoints and interleave the per-rank
history files, after which `hf-cp report` still counts every sample once. A run therefore
holds `output_dir/hf_cp_run.lock` while it trains: a JSON file that global rank 0 creates
atomically (O_CREAT | O_EXCL) naming the host, pid, start time, command line and a run id. A
second run is refused with `OutputDirLockedError` naming the holder. A lock whose holder is a
dead process of this host is stale and taken over with a warning; on another host liveness
cannot be seen, so that is refused unless `cp_break_lock` is set. An earlier attempt of the same
torchelastic job (a restart) is taken over too. The lock is removed when training ends (also by
an exception) and at interpreter exit, only by the run that holds it (its run id).

Rank 0's outcome reaches every rank through one broadcast over the world group, before any other
collective of train(), so every rank raises the same error and none is left waiting.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shlex
import socket
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

from hf_cp.readers import load_json  # nesting bounded (readers.py)

logger = logging.getLogger(__name__)

LOCK_FILE = "hf_cp_run.lock"
BREAK_SETTING = "cp_break_lock"
# torchelastic's job id and attempt: a restarted attempt takes over the lock of the one it replaces
_JOB_ENV, _ATTEMPT_ENV = "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"
_READ_WAIT_S = 2.0  # a lock file just created (O_EXCL) may not hold its JSON yet


class OutputDirLockedError(RuntimeError):
    """Another training run holds the output_dir's lock; the message names it and how to break it."""


def lock_path(output_dir) -> Path:
    return Path(str(output_dir)).expanduser() / LOCK_FILE


def _job() -> Optional[str]:
    job = os.environ.get(_JOB_ENV, "")
    return None if job in ("", "none") else job  # torchrun's default rdzv id "none" names no job


def _attempt() -> int:
    try:
        return int(os.environ.get(_ATTEMPT_ENV, "0") or 0)
    except ValueError:
        return 0


def lock_record(run_id: str) -> dict:
    """What the lock file holds for this process."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "command": shlex.join(sys.argv) or sys.executable,
        "run_id": run_id,
        "job": _job(),
        "attempt": _attempt(),
    }


def read_lock(path: Path, wait_s: float = _READ_WAIT_S) -> Optional[dict]:
    """The lock's record; None when there is no lock; {"unreadable": why} when it holds no valid
    record (a file younger than `wait_s` gets that long: its writer may be between its O_EXCL
    create and its write)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = path.read_text()
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None
        except OSError as err:
            return {"unreadable": str(err)}
        try:
            record = load_json(text)
            if isinstance(record, dict):
                return record
            why = "not a JSON object"
        except ValueError as err:
            why = f"not JSON ({err})" if text else "empty"
        if age >= wait_s or time.monotonic() >= deadline:
            return {"unreadable": why}
        time.sleep(0.05)


def pid_alive(pid) -> Optional[bool]:
    """Whether process `pid` of this host runs; None when the pid is not a valid one."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    except OSError:
        return None
    return True


def describe(holder: dict) -> str:
    """`pid 123 on host a, started 2025-01-02 10:00:00 UTC (5 min ago), command: ...`."""
    if "unreadable" in holder:
        return f"an unreadable lock ({holder['unreadable']})"
    started = holder.get("started")
    when = "at an unknown time"
    if isinstance(started, (int, float)):
        stamp = datetime.fromtimestamp(started, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        ago = max(0.0, time.time() - started)
        span = f"{ago:.0f} s" if ago < 120 else f"{ago / 60:.0f} min" if ago < 7200 else f"{ago / 3600:.1f} h"
        when = f"started {stamp} ({span} ago)"
    job = f", torchelastic job {holder['job']} attempt {holder.get('attempt', 0)}" if holder.get("job") else ""
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')}, {when}, command: {holder.get('command')!r}"
        f" (run id {holder.get('run_id')}{job})"
    )


def takeover_reason(holder: dict, break_lock: bool = False) -> Optional[str]:
    """Why the lock `holder` may be taken over (a warning naming the old run), or None: refuse."""
    if break_lock:
        return f"{BREAK_SETTING}: breaking the lock of {describe(holder)}"
    if "unreadable" in holder:
        return None  # no holder to judge
    if holder.get("host") == socket.gethostname() and pid_alive(holder.get("pid")) is False:
        return f"taking over the stale lock of a run that is gone: {describe(holder)}"
    job = _job()
    attempt = holder.get("attempt")
    if job is not None and holder.get("job") == job and isinstance(attempt, int) and attempt < _attempt():
        # the elastic agent stops every worker of an attempt before it starts the next one
        return f"taking over the lock of attempt {attempt} of this job (restarted): {describe(holder)}"
    return None


def refusal(path: Path, holder: dict) -> str:
    """The OutputDirLockedError message: who holds the lock and how to break a stale one."""
    here = socket.gethostname()
    if "unreadable" in holder:
        where = ""
    elif holder.get("host") != here:
        where = f" It is held from another host ({holder.get('host')}; this is {here}), whose processes this host cannot see."
    else:
        where = " That process is still running on this host."
    return (
        f"output_dir {str(path.parent)!r} is in use by another training run: {describe(holder)} holds {path}.{where} "
        "Two runs on one output_dir overwrite each other's checkpoints and history. Wait for it to end or use "
        f"another output_dir; if that run is gone, set {BREAK_SETTING}: true (--set training.{BREAK_SETTING}=true) "
        f"or delete {path}"
    )


class RunLock:
    """This process's lock on `output_dir`: acquire() takes it or raises OutputDirLockedError;
    release() removes the file only while it still holds this lock's run id."""

    def __init__(self, output_dir, break_lock: bool = False, warn: Optional[Callable[[str], None]] = None):
        self.path = lock_path(output_dir)
        self.break_lock = bool(break_lock)
        self.run_id = uuid.uuid4().hex
        self.held = False
        self._warn = warn or (lambda message: logger.warning("hf_cp: %s", message))

    def acquire(self) -> RunLock:
        if self.held:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # a stale lock removed, or a lock that went, between two tries
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = read_lock(self.path)
                if holder is None:
                    continue
                why = takeover_reason(holder, self.break_lock)
                if why is None:
                    raise OutputDirLockedError(refusal(self.path, holder)) from None
                self._warn(why)
                _remove_if_holder(self.path, holder)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(lock_record(self.run_id), f)
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            atexit.register(self.release)  # a run that never reaches its `finally`
            return self
        holder = read_lock(self.path) or {"unreadable": "it keeps changing"}
        raise OutputDirLockedError(refusal(self.path, holder))

    def release(self) -> bool:
        """Remove the lock file if this lock holds it; True when removed."""
        if not self.held:
            return False
        self.held = False
        atexit.unregister(self.release)
        holder = read_lock(self.path, wait_s=0)
        if holder is None or holder.get("run_id") != self.run_id:  # broken and taken by another run
            if holder is not None:
                self._warn(f"{self.path} was taken over by {describe(holder)} during this run; left in place")
            return False
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        return True

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _remove_if_holder(path: Path, holder: dict) -> None:
    """Remove the lock judged stale, not one another run created meanwhile (same run id)."""
    again = read_lock(path, wait_s=0)
    if again is not None and again.get("run_id") == holder.get("run_id"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def lock_status(output_dir, break_lock: bool = False) -> Optional[Tuple[str, str]]:
    """What a launch would find, without taking the lock (the dry run): None (no lock),
    ("error", the refusal) or ("note", the takeover it would make)."""
    path = lock_path(output_dir)
    holder = read_lock(path, wait_s=0)
    if holder is None:
        return None
    why = takeover_reason(holder, break_lock)
    if why is None:
        return "error", refusal(path, holder)
    return "note", f"{path}: a launch would be {why}"


# output_dir -> (lock or None on ranks > 0, depth): a hold nested in another (hf-cp train around
# CPTrainer.train) neither takes the lock again nor exchanges anything; the same on every rank
_HELD: Dict[str, list] = {}


def _share(outcome: Optional[dict], world: int) -> Optional[dict]:
    if world <= 1:
        return outcome
    import torch.distributed as dist  # torch, only where there is a world to tell

    if not (dist.is_available() and dist.is_initialized()):
        return outcome
    box = [outcome]
    dist.broadcast_object_list(box, src=0)  # the world group, bounded by ddp_timeout
    return box[0]


def take_run_lock(output_dir, rank: int, world: int, break_lock: bool = False) -> Optional[RunLock]:
    """Global rank 0 takes the lock; every rank of the world then gets its outcome and raises the
    same OutputDirLockedError if it was refused. Returns the lock on rank 0, None elsewhere."""
    lock, outcome, failure = None, None, None
    if rank == 0:
        try:
            lock = RunLock(output_dir, break_lock).acquire()
            outcome = {"run_id": lock.run_id}
        except OutputDirLockedError as err:
            outcome = {"refused": str(err)}
        except Exception as err:  # still tell the other ranks, then raise it here
            failure = err
            outcome = {"failed": f"{type(err).__name__}: {err}"}
    try:
        outcome = _share(outcome, world)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if failure is not None:
        raise failure
    if "refused" in outcome:
        raise OutputDirLockedError(outcome["refused"])
    if "failed" in outcome:
        raise RuntimeError(f"rank 0 could not take the lock of output_dir {str(output_dir)!r}: {outcome['failed']}")
    return lock


@contextlib.contextmanager
def hold_run_lock(output_dir, rank: int, world: int, break_lock: bool = False) -> Iterator[Optional[RunLock]]:
    """Hold output_dir's lock around a run (every rank enters it); released however it ends."""
    key = str(lock_path(output_dir).resolve())
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield _HELD[key][0]
        finally:
            _HELD[key][1] -= 1
        return
    lock = take_run_lock(output_dir, rank, world, break_lock)
    _HELD[key] = [lock, 1]
    try:
        yield lock
    finally:
        del _HELD[key]
        if lock is not None:
            lock.release()
