"""The sample schedule a checkpoint was trained on (SCHEDULE_FILE), and the check that a resumed
run trains the same one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import List, Sequence

from hf_cp.readers import load_json  # nesting bounded (readers.py)
from hf_cp.train.checkpoint.marks import COMPLETE_FILE, MARKED_FIELD, SCHEDULE_FILE

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
