"""Atomic checkpoints: the completion mark, the status of a checkpoint folder, and rotation over
complete checkpoints only.

A save killed halfway (a crashed rank, a full disk) leaves a checkpoint-N
folder with some of its files. A checkpoint is complete only once COMPLETE_FILE is in it: rank 0
writes it (atomically) last, after every rank has written its files. Resume ("latest", True)
takes the newest complete checkpoint and warns, naming each partial one it skips; a partial one
named explicitly is refused. The schedule file, written first, says that its checkpoint is
marked (MARKED_FIELD), so an unmarked folder holding it is partial whatever else it holds. A
checkpoint without either (saved before hf_cp marked them, or by another tool) counts as
complete when its trainer_state.json is readable (the Trainer writes it last), with a note.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Union

from hf_cp.readers import load_json  # nesting bounded (readers.py)
from hf_cp.train.checkpoint.trust import (
    DIGEST,
    file_digests,
)

# ------------------------------------------------------------------ atomic checkpoints
COMPLETE_FILE = "hf_cp_complete.json"
SCHEDULE_FILE = "hf_cp_schedule.json"  # written first by every save (schedule.py)
DIGESTS_FIELD = DIGEST  # in COMPLETE_FILE: {file: its sha256 at the save}
# in SCHEDULE_FILE (written first): this checkpoint is complete only with COMPLETE_FILE
MARKED_FIELD = "completion_marker"
CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
TMP_SUFFIX = ".tmp"


# disk space errors: the OSError of a write, or its text where a library re-raised it
class PartialCheckpointError(FileNotFoundError):
    """Resuming a checkpoint whose save did not finish."""


@dataclass(frozen=True)
class CheckpointStatus:
    """What a checkpoint folder holds. `legacy`: complete without COMPLETE_FILE (saved before
    hf_cp marked checkpoints, or by another tool); `problem`: why it is partial."""

    path: str
    step: int
    complete: bool
    legacy: bool = False
    problem: str = ""

    @property
    def name(self) -> str:
        return Path(self.path).name


def legacy_note(checkpoint: str) -> str:
    return (
        f"{checkpoint} has no {COMPLETE_FILE} (saved before hf_cp marked complete checkpoints, or by "
        f"another tool): resumed as complete since its trainer_state.json is readable"
    )


def _held(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "it is empty"
    return "it holds " + ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def checkpoint_status(folder: Union[str, Path]) -> CheckpointStatus:
    """Whether `folder` is a complete checkpoint (see the module's docstring)."""
    p = Path(folder)
    match = CHECKPOINT_NAME.match(p.name)
    step = int(match.group(1)) if match else -1

    def partial(problem: str) -> CheckpointStatus:
        return CheckpointStatus(str(p), step, False, problem=problem)

    try:
        marker = p / COMPLETE_FILE
        if marker.is_file():
            try:
                files = dict(load_json(marker.read_text())["files"])
            except (ValueError, KeyError, TypeError):
                return partial(f"{COMPLETE_FILE} is not a valid completion record")
            missing = sorted(f for f in files if not (p / f).is_file())
            if missing:
                shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                return partial(f"files its {COMPLETE_FILE} lists are missing: {shown}")
            return CheckpointStatus(str(p), step, True)
        try:
            schedule = load_json((p / SCHEDULE_FILE).read_text())
        except (OSError, ValueError):
            schedule = None
        if isinstance(schedule, dict) and schedule.get(MARKED_FIELD):
            return partial(f"no {COMPLETE_FILE}: its save did not finish; {_held(p)}")
        state = p / "trainer_state.json"
        if not state.is_file():
            return partial(f"no trainer_state.json and no {COMPLETE_FILE}: its save did not finish; {_held(p)}")
        try:
            int(load_json(state.read_text())["global_step"])
        except (ValueError, KeyError, TypeError):
            return partial(f"its trainer_state.json is unreadable (cut short?) and it has no {COMPLETE_FILE}")
        return CheckpointStatus(str(p), step, True, legacy=True)
    except FileNotFoundError:  # removed while being looked at (rotation)
        return partial("it was removed while being read")


def scan_checkpoints(output_dir: Union[str, Path]) -> List[CheckpointStatus]:
    """Every checkpoint-N folder of `output_dir`, oldest step first."""
    d = Path(output_dir)
    if not d.is_dir():
        return []
    found = [checkpoint_status(c) for c in d.iterdir() if CHECKPOINT_NAME.match(c.name) and c.is_dir()]
    return sorted(found, key=lambda c: c.step)


def last_complete(output_dir: Union[str, Path], before: Optional[int] = None) -> Optional[str]:
    """The newest complete checkpoint of `output_dir` (below step `before`), or None."""
    complete = [c for c in scan_checkpoints(output_dir) if c.complete and (before is None or c.step < before)]
    return complete[-1].path if complete else None


def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mark_complete(checkpoint: Union[str, Path], step: int, world_size: int) -> Path:
    """Mark `checkpoint` complete, once every rank has written its files. They are flushed to
    disk first (a write error that a filesystem reports late, a quota on NFS, surfaces here,
    before the mark); then COMPLETE_FILE lists them with their sizes and SHA-256 digests,
    written atomically."""
    p = Path(checkpoint)
    files = {}
    for f in sorted(p.rglob("*")):
        if f.is_file() and f.name != COMPLETE_FILE and not f.name.endswith(TMP_SUFFIX):
            _fsync(f)
            files[f.relative_to(p).as_posix()] = f.stat().st_size
    # checksums, checked before a resume loads anything (checkpoint/trust.py); the files were
    # just written, so they are read back from the page cache
    digests = file_digests(p, list(files))
    record = {"step": int(step), "world_size": int(world_size), "files": files, DIGESTS_FIELD: digests}
    tmp = p / (COMPLETE_FILE + TMP_SUFFIX)
    with open(tmp, "w") as fh:
        fh.write(json.dumps(record, indent=1) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(p / COMPLETE_FILE)
    _fsync(p, directory=True)
    return p / COMPLETE_FILE


def clear_for_save(checkpoint: Union[str, Path]) -> Optional[str]:
    """Before saving into `checkpoint` (rank 0, before any rank writes there): a partial folder of
    an earlier attempt is removed, a complete one loses its mark until the new save completes.
    A note when there was something, else None."""
    p = Path(checkpoint)
    if not p.is_dir():
        return None
    status = checkpoint_status(p)
    if status.complete:
        (p / COMPLETE_FILE).unlink(missing_ok=True)
        _fsync(p, directory=True)
        return f"saving {p} again: it is partial until this save completes"
    shutil.rmtree(p)
    return f"removed the partial {p} of an earlier attempt ({status.problem}) before saving it again"


def rotate_checkpoints(
    output_dir: Union[str, Path], limit: Optional[int], keep: Iterable[Optional[str]] = ()
) -> List[str]:
    """transformers' rotation (save_total_limit) over complete checkpoints only: the oldest are
    deleted until `limit` are left, never the newest complete one nor those in `keep` (the one
    just saved, the best model). A partial checkpoint is never counted, so it cannot push out
    the last complete one; partial ones older than the newest complete one (left by failed
    saves, resumed by nothing) go too. Returns the paths deleted."""
    if limit is None or limit <= 0:
        return []
    found = scan_checkpoints(output_dir)
    complete = [c for c in found if c.complete]
    if not complete:
        return []
    protected = {os.path.realpath(k) for k in keep if k} | {os.path.realpath(complete[-1].path)}
    kept = sum(os.path.realpath(c.path) in protected for c in complete)
    remaining, deleted = len(complete), []
    for c in complete:
        if remaining <= max(limit, kept):
            break
        if os.path.realpath(c.path) not in protected:
            shutil.rmtree(c.path, ignore_errors=True)
            deleted.append(c.path)
            remaining -= 1
    for c in found:
        if not c.complete and c.step < complete[-1].step and os.path.realpath(c.path) not in protected:
            shutil.rmtree(c.path, ignore_errors=True)
            deleted.append(c.path)
    return deleted
