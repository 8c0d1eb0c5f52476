"""What a failed checkpoint write raises: storage failures (a full disk, a quota), named with the
folder, the space left and the complete checkpoint kept, on the failing rank and on its peers.
"""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from hf_cp.train.checkpoint.marks import COMPLETE_FILE

SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SPACE_TEXTS = ("No space left on device", "Disk quota exceeded")
# torch's zip writer reports a short write without errno ("[enforce fail at inline_container.cc]
# . unexpected pos 128 vs 0", "PytorchStreamWriter failed writing file ..."), or the C++ stream's
# "basic_ios::clear: iostream error" (rank 0 of a ZeRO-2 save on a full disk); on a filesystem
# with less than LOW_SPACE_BYTES left, space running out is taken for the cause
TORCH_WRITE_TEXTS = ("unexpected pos", "failed writing file", "file write failed", "iostream error")
LOW_SPACE_BYTES = 64 << 20


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (errno ENOSPC when space ran out); it is left unmarked."""


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
    failure: StorageFailure,
    checkpoint: Union[str, Path],
    kept: Optional[str],
    removed: bool,
    saving_rank_removes: bool = False,
) -> CheckpointSaveError:
    """The error of a failed checkpoint write: the folder, whether space ran out, and what a
    restart resumes from (`kept`: the last complete checkpoint, None when there is none).
    `saving_rank_removes`: this rank does not save the checkpoint's shared files, and rank 0
    removes the partial folder once its wait for this rank fails."""
    name = Path(checkpoint).name
    free = f"{_size(failure.free_bytes)} free on its filesystem"
    if failure.space:
        what = (
            f"saving checkpoint {checkpoint} failed: No space left on device (space ran out: {free}; {failure.cause})"
        )
    else:
        what = f"saving checkpoint {checkpoint} failed ({failure.cause}; {free})"
    if removed:
        partial = f"The partial {name} was removed"
    elif saving_rank_removes:
        partial = f"rank 0, which saves the checkpoint, removes the partial {name} when its wait for this rank fails"
    else:
        partial = f"The partial {name} is left without {COMPLETE_FILE}"
    if kept is not None:
        after = f"; {kept}, the last complete checkpoint, is kept: a restart (resume_from_checkpoint: latest) resumes from it"
    else:
        after = "; there is no complete checkpoint yet: a restart starts from step 0"
    advice = ". Free space (or lower save_total_limit) before restarting" if failure.space else ""
    error = CheckpointSaveError(what + ". " + partial + after + advice)
    error.errno = errno.ENOSPC if failure.space else None
    return error


def peer_save_failure_error(
    err: BaseException, checkpoint: Union[str, Path], kept: Optional[str], removed: bool = False, saves: bool = True
) -> CheckpointSaveError:
    """The error of a rank whose own files were written but whose wait for the other ranks inside
    the save of `checkpoint` failed: another rank's save failed (its own error says why, a full
    disk for example) or it stopped. `removed`: this rank removed the partial folder; `saves`:
    this rank is the one that saves the checkpoint's shared files (rank 0), which removes it."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    resumes = (
        f"{kept}, the last complete checkpoint, is kept: a restart (resume_from_checkpoint: latest) resumes from it"
        if kept is not None
        else "there is no complete checkpoint yet: a restart starts from step 0"
    )
    return CheckpointSaveError(
        f"saving checkpoint {checkpoint} failed on another rank: this rank wrote its files, then its wait "
        f"for the others failed ({type(err).__name__}: {first}); the failing rank's log says why (a full "
        f"disk, a crash). "
        + (
            f"The partial {Path(checkpoint).name} was removed"
            if removed
            else f"{Path(checkpoint).name} is left without {COMPLETE_FILE}, which resume skips"
            + ("" if saves else " (rank 0, which saves the checkpoint, removes it unless its own write failed)")
        )
        + f"; {resumes}"
    )
