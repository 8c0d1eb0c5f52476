"""Restarts and resumption: which attempt this is, where to resume, whether the checkpoint fits
this run (its sample schedule, its ZeRO world size), and a launcher check.

`torchrun --max-restarts N` restarts every worker when one dies. A restarted job must resume
from the last checkpoint (`resume_from_checkpoint: latest`); the sampler and planner are pure
functions of the step index, so the resumed run trains exactly the steps that were not saved,
provided the sample schedule is the one the checkpoint was trained on. Each checkpoint holds
that schedule's definition (SCHEDULE_FILE) and a resume on another one is refused: a changed
world size under `cp_tokens_per_rank_per_step`, a new seed or a re-tokenised dataset would
otherwise skip and repeat samples of the interrupted epoch without a word.

Launcher pitfall (torch 2.13, gloo and NCCL alike): with the default *static* rendezvous, and
with c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the workers of every attempt share the
agent's key-value store. Process groups of the new attempt then read the addresses the dead
attempt published and fail with "connection refused" (pytorch/pytorch#135712, #167288). A
fresh store per attempt needs:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT --max-restarts 3 ...

Atomic checkpoints: a save killed halfway (a crashed rank, a full disk) leaves a checkpoint-N
folder with some of its files. A checkpoint is complete only once COMPLETE_FILE is in it: rank 0
writes it (atomically) last, after every rank has written its files. Resume ("latest", True)
takes the newest complete checkpoint and warns, naming each partial one it skips; a partial one
named explicitly is refused. The schedule file, written first, says that its checkpoint is
marked (MARKED_FIELD), so an unmarked folder holding it is partial whatever else it holds. A
checkpoint without either (saved before hf_cp marked them, or by another tool) counts as
complete when its trainer_state.json is readable (the Trainer writes it last), with a note.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from hf_cp.readers import load_json  # nesting bounded (readers.py)
from hf_cp.train.checkpoint_trust import (
    DIGEST,
    UntrustedCheckpointError,
    digest_mismatches,
    file_digests,
    refuse_code_in_pickles,
)
from hf_cp.train.history import HistoryError, history_lines

logger = logging.getLogger(__name__)

LATEST = ("latest", "last", "auto")
SHARED_STORE_ADVICE = (
    "restarts under torchrun's shared rendezvous store reconnect to the dead attempt's "
    "addresses (pytorch/pytorch#135712); launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
    "and torchrun --rdzv-backend c10d --rdzv-endpoint HOST:PORT (accelerate launch --rdzv_backend c10d)"
)


def restart_attempt() -> int:
    """0 for the first run of the workers, k after the k-th torchrun restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_problems(save_strategy: str, resume, env: Optional[dict] = None) -> List[str]:
    """Why a torchrun restart of this job would fail or lose work ([] when restarts are off or
    safe): a store shared across attempts, no checkpoints, or a resume setting other than latest."""
    env = os.environ if env is None else env
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0:
        return []
    problems = []
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        problems.append(SHARED_STORE_ADVICE)
    if str(getattr(save_strategy, "value", save_strategy)).lower() == "no":
        problems.append(
            "restarts are enabled but save_strategy is 'no': a restarted job starts again from step 0; "
            "set save_strategy: steps and save_steps"
        )
    # True needs a checkpoint to exist, which the first attempt does not have
    if not (isinstance(resume, str) and resume.lower() in LATEST):
        problems.append(
            f"restarts are enabled but resume_from_checkpoint is {resume!r}: a restarted job would not "
            f"continue from its newest checkpoint; set resume_from_checkpoint: latest"
        )
    return problems


def resolve_resume(resume: Union[None, bool, str], output_dir: str, notes: Optional[List[str]] = None) -> Optional[str]:
    """The checkpoint to resume from.

    None/False: start fresh. "latest": the newest complete checkpoint-N of `output_dir`, or a
    fresh start when there is none yet (the first attempt of a restartable job). True: the
    newest complete checkpoint, which must exist (the Trainer's meaning). A path must exist and
    be complete: a typo must not silently restart training from scratch, nor a half-written
    checkpoint fail every restart. Partial checkpoints skipped and checkpoints without a
    completion mark resumed are described in `notes` (None: logged as warnings).
    """
    said: List[str] = []
    try:
        if resume is None or resume is False or resume == "":
            return None
        if resume is True or (isinstance(resume, str) and resume.lower() in LATEST):
            found = scan_checkpoints(output_dir)
            complete = [c for c in found if c.complete]
            newest = complete[-1] if complete else None
            said += [
                f"{c.path} is a partial checkpoint ({c.problem}): skipped"
                + (f", resuming from {newest.name}" if newest is not None else ", no complete checkpoint to resume")
                for c in found
                if not c.complete
            ]
            if newest is None and resume is True:
                raise FileNotFoundError(
                    f"resume_from_checkpoint=True but {output_dir} holds no checkpoint-N folder"
                    + (f" that is complete ({len(found)} partial: {', '.join(c.name for c in found)})" if found else "")
                    + "; use 'latest' to start fresh when there is none"
                )
            if newest is not None and newest.legacy:
                said.append(legacy_note(newest.path))
            return newest.path if newest is not None else None
        p = Path(str(resume))
        if not p.is_dir():
            raise FileNotFoundError(
                f"resume_from_checkpoint {resume!r} is not a checkpoint folder; use 'latest' to "
                f"resume from the newest checkpoint of output_dir (or start fresh if none)"
            )
        status = checkpoint_status(p)
        if not status.complete:
            kept = last_complete(p.parent)
            raise PartialCheckpointError(
                f"resume_from_checkpoint {resume!r} is a partial checkpoint: {status.problem}. "
                + (
                    f"The newest complete checkpoint beside it is {kept}"
                    if kept is not None
                    else f"{p.parent} holds no complete checkpoint"
                )
                + " (resume_from_checkpoint: latest takes the newest complete one)"
            )
        if status.legacy:
            said.append(legacy_note(str(p)))
        return str(p)
    finally:
        if notes is None:
            for note in said:
                logger.warning("hf_cp: %s", note)
        else:
            notes.extend(said)


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer steps a checkpoint folder has completed (its trainer_state.json)."""
    state = Path(checkpoint) / "trainer_state.json"
    if not state.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} has no trainer_state.json; is it a Trainer checkpoint?")
    try:
        step = load_json(state.read_text())["global_step"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{state}: no readable global_step ({type(e).__name__}: {e})") from None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CorruptCheckpointError(f"{state}: global_step must be a whole number >= 0, got {step!r}")
    return step


def truncate_history(path: Path, steps_done: int) -> int:
    """Keep the history lines of steps below `steps_done` (those the checkpoint holds); steps
    after it are trained again by the resumed run. A last line torn by the kill is dropped too
    (history_lines warns), so the resumed run appends to whole lines. Returns the number of
    lines dropped."""
    if not path.is_file():
        return 0
    text = path.read_text()
    raw = text.splitlines()
    lines = [ln for ln in raw if ln.strip()]
    kept = [raw[n - 1] for n, d in history_lines(path) if _line_index(path, n, d) < steps_done]
    if len(kept) != len(lines) or (text and not text.endswith("\n")):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(path)
    return len(lines) - len(kept)


def _line_index(path: Path, lineno: int, d) -> int:
    index = d.get("index") if isinstance(d, dict) else None
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise HistoryError(f"{path}, line {lineno}: not a step record (its 'index' is {index!r}, not a step number)")
    return index


class ReshardNeededError(ValueError):
    """A DeepSpeed ZeRO checkpoint saved by another number of ranks, not yet made universal."""


def zero_checkpoint_world_size(checkpoint: str) -> Optional[int]:
    """The data-parallel size that wrote the DeepSpeed ZeRO state of a Trainer checkpoint
    (its zero_pp_rank_<r> optimizer shards), or None when it holds no ZeRO state."""
    ckpt = Path(checkpoint)
    latest = ckpt / "latest"
    if not latest.is_file():
        return None
    shards = list((ckpt / latest.read_text().strip()).glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    return len(shards) or None


def check_zero_world_size(checkpoint: str, world_size: int, deepspeed_config: Optional[dict]) -> bool:
    """Whether `checkpoint` may be resumed by `world_size` ranks under `deepspeed_config`.

    ZeRO partitions the optimizer state by rank: DeepSpeed loads it only on the world size that
    saved it, unless it was converted to a *universal* checkpoint (DeepSpeed's ds_to_universal)
    and the config sets checkpoint.load_universal. hf_cp's batches do not depend on the world
    size (with cp_tokens_per_step fixed), so with that conversion a job may resume on more or
    fewer ranks. Returns True when the universal checkpoint is used; raises ReshardNeededError
    with the commands when the conversion or the setting is missing."""
    if not deepspeed_config:
        return False
    stage = int((deepspeed_config.get("zero_optimization") or {}).get("stage", 0) or 0)
    universal = bool((deepspeed_config.get("checkpoint") or {}).get("load_universal", False))
    ckpt = Path(checkpoint)
    saved = zero_checkpoint_world_size(checkpoint)
    if stage == 0 or saved is None:
        return False
    has_universal = (ckpt / "latest_universal").is_file()
    if universal and has_universal:
        return True
    if saved == world_size and not universal:
        return False
    tag = (ckpt / "latest").read_text().strip()
    convert = (
        f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {ckpt / tag} "
        f"--output_folder {ckpt / (tag + '_universal')} --inject_missing_state"
    )
    if universal:
        raise ReshardNeededError(
            f"the DeepSpeed config sets checkpoint.load_universal but {checkpoint} has no "
            f"universal checkpoint (no latest_universal file); make it with:\n  {convert}"
        )
    raise ReshardNeededError(
        f"{checkpoint} holds ZeRO-{stage} optimizer state partitioned over {saved} ranks and this job has "
        f"{world_size}. DeepSpeed resumes it on another number of ranks only as a universal checkpoint:\n"
        f'  {convert}\nthen set "checkpoint": {{"load_universal": true}} in the DeepSpeed config '
        f"(the batches stay the same when cp_tokens_per_step is fixed; the plans adapt to the new world)"
    )


SCHEDULE_FILE = "hf_cp_schedule.json"
# what decides which samples form step k (GlobalBatchSampler); the run's length (max_steps,
# epochs) may change on resume, since it only adds or removes steps at the end
SCHEDULE_FIELDS = ("num_samples", "lengths_sha256", "data_sha256", "tokens_per_step", "seed", "shuffle")


class ScheduleChangedError(ValueError):
    """Resuming a checkpoint on a sample schedule other than the one it was trained on."""


def schedule_record(
    lengths: Sequence[int], tokens_per_step: int, seed: int, shuffle: bool, world_size: int, data_digest: str = ""
) -> dict:
    """`data_digest`: TokenColumns.digest() of the training data (tokens and targets, sampled)."""
    digest = hashlib.sha256(",".join(str(int(n)) for n in lengths).encode()).hexdigest()
    return {
        "num_samples": len(lengths),
        "lengths_sha256": digest,
        "data_sha256": data_digest,
        "tokens_per_step": int(tokens_per_step),
        "seed": int(seed),
        "shuffle": bool(shuffle),
        "world_size": int(world_size),
    }


def write_schedule(checkpoint: str, record: dict, marked: bool = False) -> None:
    """`marked`: the checkpoint will be complete only once marked (COMPLETE_FILE): CPTrainer's
    saves, which write this file first."""
    path = Path(checkpoint)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (SCHEDULE_FILE + ".tmp")
    tmp.write_text(json.dumps(dict(record, **{MARKED_FIELD: COMPLETE_FILE}) if marked else record, indent=1) + "\n")
    tmp.replace(path / SCHEDULE_FILE)  # never a half-written file, even if killed here


def check_resumed_schedule(checkpoint: str, now: dict, allow_change: bool = False) -> List[str]:
    """Warnings for resuming `checkpoint` on the schedule `now`; raises ScheduleChangedError when
    the schedule differs and `allow_change` is off. A checkpoint without the file (written by
    another tool) is resumed with a warning."""
    path = Path(checkpoint) / SCHEDULE_FILE
    if not path.is_file():
        return [f"{checkpoint} has no {SCHEDULE_FILE}: cannot check that the resumed run keeps the sample schedule"]
    try:
        saved = load_json(path.read_text())
    except ValueError as err:
        raise ScheduleChangedError(f"{path} is not valid JSON ({err}); delete it to resume without the check") from err
    if not isinstance(saved, dict):
        raise ScheduleChangedError(f"{path} does not hold a JSON object; delete it to resume without the check")
    # a field the saved record lacks (written by an older hf_cp) cannot be compared
    changed = [k for k in SCHEDULE_FIELDS if k in saved and saved[k] != now[k]]
    if not changed:
        return []
    names = {
        "num_samples": "samples in the training set",
        "lengths_sha256": "sample lengths (digest)",
        "data_sha256": "tokens and loss targets (digest)",
        "tokens_per_step": "tokens per step",
        "seed": "seed",
        "shuffle": "cp_shuffle",
    }

    def shown(k, v):  # digests: their first 12 hex digits tell them apart
        return repr(v[:12]) if k.endswith("sha256") and isinstance(v, str) else repr(v)

    what = "; ".join(f"{names[k]}: {shown(k, saved[k])} in the checkpoint, {shown(k, now[k])} now" for k in changed)
    hints = []
    if "tokens_per_step" in changed and saved.get("world_size") != now["world_size"]:
        hints.append(
            f"the world size went from {saved.get('world_size')} to {now['world_size']} and the global batch "
            f"is cp_tokens_per_rank_per_step x world size: set cp_tokens_per_step: "
            f"{saved.get('tokens_per_step')} to keep the batches (any world size can run them)"
        )
    if {"num_samples", "lengths_sha256", "data_sha256"} & set(changed):
        hints.append(
            "the training data is not the data the checkpoint was trained on (another file, filter, "
            "tokeniser, prompt masking or max length)"
        )
    message = " ".join(
        [
            f"resuming {checkpoint} on another sample schedule ({what}). Steps after the checkpoint "
            f"would skip and repeat samples of the interrupted epoch."
        ]
        + [h[0].upper() + h[1:] + "." for h in hints]
    )
    if not allow_change:
        raise ScheduleChangedError(
            message + " To continue on the new schedule anyway, set cp_allow_schedule_change: true"
        )
    return [message + " Continuing on the new schedule (cp_allow_schedule_change)"]


def check_resume(
    checkpoint: str,
    schedule_now: dict,
    world_size: int,
    deepspeed_config: Optional[dict],
    allow_schedule_change: bool = False,
    allowed_globals: Sequence[str] = (),
) -> List[str]:
    """Everything that decides whether `checkpoint` may be resumed by this run: its files (each
    readable, as saved, and with no code in its pickles beyond `allowed_globals`:
    check_checkpoint_files), its sample schedule and its ZeRO world size. Raises
    CorruptCheckpointError / UntrustedCheckpointError / ScheduleChangedError /
    ReshardNeededError, the same on every rank
    (each checks every file), before any collective; returns notes worth a warning. Used by
    CPTrainer.train and by the dry run alike."""
    notes = check_checkpoint_files(checkpoint, allowed_globals)
    notes += check_resumed_schedule(checkpoint, schedule_now, allow_schedule_change)
    if check_zero_world_size(checkpoint, world_size, deepspeed_config):
        notes.append(f"resuming {checkpoint} from its universal checkpoint on {world_size} ranks")
    return notes


# ------------------------------------------------------------------ atomic checkpoints
COMPLETE_FILE = "hf_cp_complete.json"
DIGESTS_FIELD = DIGEST  # in COMPLETE_FILE: {file: its sha256 at the save}
# in SCHEDULE_FILE (written first): this checkpoint is complete only with COMPLETE_FILE
MARKED_FIELD = "completion_marker"
CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
_TMP_SUFFIX = ".tmp"
# disk space errors: the OSError of a write, or its text where a library re-raised it
SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SPACE_TEXTS = ("No space left on device", "Disk quota exceeded")
# torch's zip writer reports a short write without errno ("[enforce fail at inline_container.cc]
# . unexpected pos 128 vs 0", "PytorchStreamWriter failed writing file ..."), or the C++ stream's
# "basic_ios::clear: iostream error" (rank 0 of a ZeRO-2 save on a full disk); on a filesystem
# with less than LOW_SPACE_BYTES left, space running out is taken for the cause
TORCH_WRITE_TEXTS = ("unexpected pos", "failed writing file", "file write failed", "iostream error")
LOW_SPACE_BYTES = 64 << 20


class PartialCheckpointError(FileNotFoundError):
    """Resuming a checkpoint whose save did not finish."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (errno ENOSPC when space ran out); it is left unmarked."""


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
    match = _CHECKPOINT_NAME.match(p.name)
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
    found = [checkpoint_status(c) for c in d.iterdir() if _CHECKPOINT_NAME.match(c.name) and c.is_dir()]
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
        if f.is_file() and f.name != COMPLETE_FILE and not f.name.endswith(_TMP_SUFFIX):
            _fsync(f)
            files[f.relative_to(p).as_posix()] = f.stat().st_size
    # checksums, checked before a resume loads anything (checkpoint_trust.py); the files were
    # just written, so they are read back from the page cache
    digests = file_digests(p, list(files))
    record = {"step": int(step), "world_size": int(world_size), "files": files, DIGESTS_FIELD: digests}
    tmp = p / (COMPLETE_FILE + _TMP_SUFFIX)
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


@dataclass(frozen=True)
class StorageFailure:
    """A checkpoint write that failed on the storage: `space` when the disk (or quota) ran out."""

    space: bool
    cause: str
    free_bytes: Optional[int]


def free_bytes(path: Union[str, Path]) -> Optional[int]:
    """Bytes free to this user on the filesystem of `path` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return int(shutil.disk_usage(p).free)
    except OSError:
        return None


def _chain(err: Optional[BaseException]):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def storage_failure(err: BaseException, checkpoint: Union[str, Path]) -> Optional[StorageFailure]:
    """Whether `err`, raised while writing `checkpoint`, is a failed write (None: another error),
    and whether space ran out: an errno of ENOSPC / EDQUOT or their text anywhere in the chain of
    exceptions, or torch's short-write error on a filesystem with under LOW_SPACE_BYTES left."""
    chain = list(_chain(err))
    free = free_bytes(checkpoint)
    for e in chain:
        if (isinstance(e, OSError) and e.errno in SPACE_ERRNOS) or any(t in str(e) for t in SPACE_TEXTS):
            return StorageFailure(True, f"{type(e).__name__}: {e}", free)
    for e in chain:
        if isinstance(e, RuntimeError) and any(t in str(e) for t in TORCH_WRITE_TEXTS):
            cause = f"{type(e).__name__}: {str(e).strip()}"
            return StorageFailure(free is not None and free < LOW_SPACE_BYTES, cause, free)
    if isinstance(err, OSError) and not isinstance(err, CheckpointSaveError):
        return StorageFailure(False, f"{type(err).__name__}: {err}", free)
    return None


def _size(n: Optional[int]) -> str:
    if n is None:
        return "an unknown amount"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


def save_failure_error(
    failure: StorageFailure, checkpoint: Union[str, Path], kept: Optional[str], removed: bool
) -> CheckpointSaveError:
    """The error of a failed checkpoint write: the folder, whether space ran out, and what a
    restart resumes from (`kept`: the last complete checkpoint, None when there is none)."""
    name = Path(checkpoint).name
    free = f"{_size(failure.free_bytes)} free on its filesystem"
    if failure.space:
        what = (
            f"saving checkpoint {checkpoint} failed: No space left on device (space ran out: {free}; {failure.cause})"
        )
    else:
        what = f"saving checkpoint {checkpoint} failed ({failure.cause}; {free})"
    partial = f"The partial {name} was removed" if removed else f"The partial {name} is left without {COMPLETE_FILE}"
    if kept is not None:
        after = f"; {kept}, the last complete checkpoint, is kept: a restart (resume_from_checkpoint: latest) resumes from it"
    else:
        after = "; there is no complete checkpoint yet: a restart starts from step 0"
    advice = ". Free space (or lower save_total_limit) before restarting" if failure.space else ""
    error = CheckpointSaveError(what + ". " + partial + after + advice)
    error.errno = errno.ENOSPC if failure.space else None
    return error


def peer_save_failure_error(
    err: BaseException, checkpoint: Union[str, Path], kept: Optional[str]
) -> CheckpointSaveError:
    """The error of a rank whose own files were written but whose wait for the other ranks inside
    the save of `checkpoint` failed: another rank's save failed (its own error says why, a full
    disk for example) or it stopped."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    resumes = (
        f"{kept}, the last complete checkpoint, is kept: a restart (resume_from_checkpoint: latest) resumes from it"
        if kept is not None
        else "there is no complete checkpoint yet: a restart starts from step 0"
    )
    return CheckpointSaveError(
        f"saving checkpoint {checkpoint} failed on another rank: this rank wrote its files, then its wait "
        f"for the others failed ({type(err).__name__}: {first}); the failing rank's log says why (a full "
        f"disk, a crash). {Path(checkpoint).name} is left without {COMPLETE_FILE}, which resume skips; {resumes}"
    )


# ------------------------------------------------------------------ readable checkpoint files
# Before a resume loads anything, every file of the checkpoint that the Trainer or DeepSpeed
# reads is checked cheaply: JSON files parse (trainer_state.json with the fields and types the
# Trainer uses), a safetensors header covers the file exactly, a torch.save archive has its zip
# directory and each entry's header where the directory says. Every rank checks every file, so
# all raise the same error, naming the file, before any collective (a corrupt shard would else
# fail one rank inside DeepSpeed's load with "failed finding central directory" and no path).
# Flipped bits inside tensor data are not found: torch.load does not see them either.
TORCH_SUFFIXES = (".pt", ".pth", ".bin")  # torch.save archives: optimizer, scheduler, RNG, ZeRO shards
SAFETENSORS_SUFFIX = ".safetensors"
# a torch.save archive up to this size has every entry's CRC-32 checked, smallest first until
# TORCH_CHECKSUM_TOTAL bytes of a checkpoint are read (RNG, scheduler, small models); a larger
# one only its pickle and metadata (the tensors' bytes, most of it, are read by the load itself;
# every rank checks every file, so a universal checkpoint's thousands of files are not read whole)
TORCH_CHECKSUM_BYTES = 64 << 20
TORCH_CHECKSUM_TOTAL = 256 << 20
# safetensors' own limit on the JSON header; a larger length is a damaged first 8 bytes
SAFETENSORS_MAX_HEADER = 100_000_000
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "C64": 8,
}
SAFETENSORS_PACKED_DTYPES = ("F4", "F6_E2M3", "F6_E3M2")  # sub-byte: their sizes are not checked
_ZIP_LOCAL_HEADER = b"PK\x03\x04"
# trainer_state.json: TrainerState's fields and what the Trainer needs of them on resume
# (None allowed where the field is optional)
_COUNT, _NUMBER, _TEXT, _FLAG = "a whole number >= 0", "a finite number", "text", "true or false"
TRAINER_STATE_FIELDS = {
    "global_step": (_COUNT, False),
    "epoch": (_NUMBER, True),
    "max_steps": (_COUNT, False),
    "logging_steps": (_NUMBER, True),
    "eval_steps": (_NUMBER, True),
    "save_steps": (_NUMBER, True),
    "train_batch_size": (_COUNT, True),
    "num_train_epochs": (_NUMBER, False),
    "num_input_tokens_seen": (_COUNT, False),
    "total_flos": (_NUMBER, False),
    "log_history": ("a list of objects", False),
    "best_metric": (_NUMBER, True),
    "best_global_step": (_COUNT, True),
    "best_model_checkpoint": (_TEXT, True),
    "is_local_process_zero": (_FLAG, False),
    "is_world_process_zero": (_FLAG, False),
    "is_hyper_param_search": (_FLAG, False),
    "trial_name": (_TEXT, True),
    "trial_params": ("an object", True),
    "stateful_callbacks": ("an object of callback states", True),
}


class CorruptCheckpointError(ValueError):
    """A checkpoint file that a resume cannot load (cut short, damaged, not its format); the
    message names the file, what is wrong and what to resume instead."""


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fits(kind: str, v) -> bool:
    if kind == _COUNT:
        return _is_count(v)
    if kind == _NUMBER:
        return _is_number(v)
    if kind == _TEXT:
        return isinstance(v, str)
    if kind == _FLAG:
        return isinstance(v, bool)
    if kind == "a list of objects":
        return isinstance(v, list) and all(isinstance(e, dict) for e in v)
    if kind == "an object":
        return isinstance(v, dict)
    # stateful_callbacks: name -> {"args": {...}, "attributes": {...}}, or a list of them
    return isinstance(v, dict) and all(
        all(isinstance(c, dict) and all(isinstance(c.get(k, {}), dict) for k in ("args", "attributes")) for c in cs)
        for cs in (x if isinstance(x, list) else [x] for x in v.values())
    )


def _trainer_state_fields() -> set:
    try:  # the installed transformers' fields: TrainerState(**state) refuses any other key
        from dataclasses import fields

        from transformers import TrainerState  # transformers
    except ImportError:  # pragma: no cover
        return set(TRAINER_STATE_FIELDS)
    return {f.name for f in fields(TrainerState)}


def _json_problem(path: Path) -> Optional[str]:
    try:
        data = load_json(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return f"is not valid JSON ({e})"
    if path.name != "trainer_state.json":
        return None
    if not isinstance(data, dict):
        return f"must hold a JSON object (the Trainer's state), got {type(data).__name__}"
    known = _trainer_state_fields()
    for k, v in data.items():
        if k not in known:
            return f"field {k!r} is not one of transformers' TrainerState (saved by another transformers version?)"
        if k in TRAINER_STATE_FIELDS:
            kind, optional = TRAINER_STATE_FIELDS[k]
            if not (v is None and optional) and not _fits(kind, v):
                return f"field {k!r} must be {kind}{' or null' if optional else ''}, got {v!r:.80}"
    if "global_step" not in data:
        return "has no global_step: the Trainer cannot tell where to resume"
    return None


def _safetensors_problem(path: Path, size: int) -> Optional[str]:
    if size < 8:
        return f"is cut short: {size} bytes, less than the 8-byte header length a safetensors file starts with"
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > SAFETENSORS_MAX_HEADER:
            return f"is damaged: its first 8 bytes give a header of {n} bytes, not a safetensors header length"
        if 8 + n > size:
            return f"is cut short: its header needs {n} bytes after the first 8, the file has {size} bytes in all"
        raw = fh.read(n)
    try:
        header = load_json(raw)
    except ValueError as e:
        return f"is damaged: its header is not valid JSON ({e})"
    if not isinstance(header, dict):
        return "is damaged: its header is not a JSON object"
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = t["dtype"], list(t["shape"]), t["data_offsets"]
            ok = all(_is_count(x) for x in [start, end, *shape]) and start <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            return f"is damaged: tensor {name!r} has no valid dtype, shape and data_offsets in the header"
        elems = 1
        for x in shape:
            elems *= x
        width = SAFETENSORS_DTYPE_BYTES.get(dtype)
        if width is None and dtype not in SAFETENSORS_PACKED_DTYPES:
            return f"is damaged: tensor {name!r} has dtype {dtype!r}, which is no safetensors dtype"
        if width is not None and elems * width != end - start:
            return f"is damaged: tensor {name!r} ({dtype}, shape {shape}) does not span {end - start} bytes"
        spans.append((start, end, name))
    data = size - 8 - n
    at = 0
    for start, end, name in sorted(spans):
        if start != at:
            return f"is damaged: tensor {name!r} starts at byte {start} of the data, where {at} was expected"
        at = end
    if at > data:
        return f"is cut short: its tensors need {at} bytes of data, the file holds {data} ({size} bytes in all)"
    if at < data:
        return f"is damaged: {data - at} bytes follow its last tensor"
    return None


def _torch_problem(path: Path, size: int, whole: bool) -> Optional[str]:
    """`whole`: check the CRC-32 of every entry, not only of the pickle and metadata."""
    import zipfile

    if size == 0:
        return "is empty"
    with open(path, "rb") as fh:
        magic = fh.read(4)
        if magic != _ZIP_LOCAL_HEADER:
            if magic[:1] == b"\x80":  # torch.save's legacy pickle format: nothing cheap to check
                return None
            return "is not a torch.save archive (no zip signature at its start): damaged or another kind of file"
        try:
            z = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            return f"is cut short or damaged: its zip directory cannot be read ({e})"
        with z:
            entries = z.infolist()
            if not any(e.filename == "data.pkl" or e.filename.endswith("/data.pkl") for e in entries):
                return "is not a torch.save archive: it holds no data.pkl"
            for e in entries:
                if e.header_offset + 30 + e.compress_size > size:
                    return f"is cut short: its entry {e.filename} reaches past the end of the file ({size} bytes)"
                fh.seek(e.header_offset)
                if fh.read(4) != _ZIP_LOCAL_HEADER:
                    return f"is damaged: its entry {e.filename} has no zip header where the directory places it"
                if whole or "/data/" not in "/" + e.filename:  # the pickle and its metadata; tensors of small files
                    try:
                        with z.open(e) as r:
                            while r.read(1 << 20):
                                pass
                    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
                        return f"is damaged: its entry {e.filename} does not match its checksum ({err})"
    return None


def _deepspeed_problem(checkpoint: Path) -> Optional[Tuple[Path, str]]:
    """The DeepSpeed folder named by `latest`: present, with its model states and a ZeRO
    optimizer shard for every rank 0..N-1."""
    latest = checkpoint / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_bytes().decode("utf-8", "replace").strip()
    folder = checkpoint / tag
    if not tag or "/" in tag or not folder.is_dir():
        return latest, f"names the DeepSpeed folder {tag!r}, which {checkpoint} does not hold"
    if not any(folder.glob("*model_states.pt")):
        return folder, "holds no mp_rank_00_model_states.pt (DeepSpeed's model states)"
    ranks = sorted(
        int(m.group(1))
        for f in folder.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt")
        if (m := re.match(r"zero_pp_rank_(\d+)_", f.name))
    )
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks)) if ranks else []
    if missing:
        return folder / f"zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt", (
            f"is missing: the ZeRO optimizer state of rank {missing[0]} (ranks {ranks} are there)"
        )
    return None


def _bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # gone since it was listed: read below, which names it
        return 0


def _completion_record(ckpt: Path) -> Tuple[dict, dict]:
    """The sizes and digests COMPLETE_FILE recorded at the save ({} for what it lacks)."""
    try:
        record = load_json((ckpt / COMPLETE_FILE).read_text())
        sizes = dict(record["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}, {}
    digests = record.get(DIGESTS_FIELD)
    if not (isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())):
        digests = {}
    return sizes, digests


def check_checkpoint_files(checkpoint: Union[str, Path], allowed_globals: Sequence[str] = ()) -> List[str]:
    """Raise CorruptCheckpointError naming the first file of `checkpoint` that a resume could not
    load: trainer_state.json (missing, not JSON, a field the Trainer cannot use), any other JSON
    file, a safetensors file (header, coverage), a torch.save archive (.pt, .pth, .bin: optimizer,
    scheduler, RNG state, DeepSpeed model states and ZeRO shards) or DeepSpeed's `latest` folder.
    Then UntrustedCheckpointError (checkpoint_trust.py) for a file whose SHA-256 differs from
    the one COMPLETE_FILE recorded, or a pickle that would import anything beyond what the
    Trainer's, DeepSpeed's and torch distributed checkpoint's states need (and
    `allowed_globals`). Returns notes: a record without digests (an older hf_cp), and there
    files whose size differs from the recorded one."""
    ckpt = Path(checkpoint)
    recorded, digests = _completion_record(ckpt)
    notes: List[str] = []

    def refuse(path: Path, problem: str, size: Optional[int] = None):
        saved = recorded.get(path.relative_to(ckpt).as_posix()) if path.is_relative_to(ckpt) else None
        if size is not None and isinstance(saved, int) and saved != size:
            problem += f" ({size} bytes; {saved} when it was saved)"
        step = _CHECKPOINT_NAME.match(ckpt.name)
        older = last_complete(ckpt.parent, before=int(step.group(1))) if step else None
        instead = (
            f"resume {older}, the complete checkpoint before it, or delete {ckpt.name} ('latest' then resumes it)"
            if older is not None
            else f"no complete checkpoint precedes it in {ckpt.parent} (delete {ckpt.name} to start afresh)"
        )
        raise CorruptCheckpointError(f"checkpoint file {path} {problem}. {ckpt} cannot be resumed: {instead}")

    state = ckpt / "trainer_state.json"
    if not state.is_file():
        refuse(state, "is missing: a Trainer checkpoint holds its training state there")
    files = sorted(f for f in ckpt.rglob("*") if f.is_file())
    # the small files first: trainer_state.json names the step before the weights are looked at
    budget = TORCH_CHECKSUM_TOTAL
    sizes = {f: _bytes(f) for f in files}
    for f in sorted(files, key=lambda f: (f != state, f.suffix != ".json", sizes[f], str(f))):
        if f.name in (COMPLETE_FILE, SCHEDULE_FILE) or f.name.endswith(_TMP_SUFFIX):
            continue  # checked by checkpoint_status and check_resumed_schedule
        suffix = f.suffix.lower()
        if suffix not in (".json", SAFETENSORS_SUFFIX) + TORCH_SUFFIXES:
            continue
        try:
            size = f.stat().st_size
            if suffix == ".json":
                problem = _json_problem(f)
            elif suffix == SAFETENSORS_SUFFIX:
                problem = _safetensors_problem(f, size)
            else:
                # the recorded SHA-256 reads every byte below: CRC-32s of the pickles suffice
                whole = not digests and size <= min(TORCH_CHECKSUM_BYTES, budget)
                budget -= size if whole else 0
                problem = _torch_problem(f, size, whole)
        except OSError as e:
            problem, size = f"cannot be read ({e.strerror or e})", None
        if problem is not None:
            refuse(f, problem, size)
        saved = recorded.get(f.relative_to(ckpt).as_posix())
        if not digests and isinstance(saved, int) and saved != size and suffix != ".json":
            notes.append(f"checkpoint file {f} has {size} bytes, {saved} when it was saved; it reads fine")
    found = _deepspeed_problem(ckpt)
    if found is not None:
        refuse(*found)
    named = _CHECKPOINT_NAME.match(ckpt.name)
    if named:  # the Trainer resumes at trainer_state's step; the folder's name is what resume chose it by
        saved_step = load_json(state.read_text()).get("global_step")
        if saved_step != int(named.group(1)):
            refuse(
                state,
                f"says global_step {saved_step}, but its folder is {ckpt.name}: it belongs to another checkpoint "
                f"(copied or renamed by hand)",
            )
    if digests:
        changed = digest_mismatches(ckpt, digests, files)
        if changed is not None:
            f, now = changed
            name = f.relative_to(ckpt).as_posix()
            size, saved = _bytes(f), recorded.get(name)
            sizes = f"{size} bytes" + (f", {saved} when it was saved" if isinstance(saved, int) else "")
            raise UntrustedCheckpointError(
                f"checkpoint file {f} is not the file its save wrote: its {DIGEST} is {now[:16]}..., "
                f"{COMPLETE_FILE} recorded {digests[name][:16]}... ({sizes}). Nothing of {ckpt} was "
                f"loaded: copy the checkpoint again, or resume an earlier one"
            )
    elif recorded:
        notes.append(
            f"{ckpt} records no {DIGEST} checksums (saved by an hf_cp before they were recorded): "
            f"its files were checked for their format and for code in their pickles only"
        )
    refuse_code_in_pickles(ckpt, files, allowed_globals)
    return notes
