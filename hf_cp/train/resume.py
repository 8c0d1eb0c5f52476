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
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import List, Optional, Sequence, Union

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


def resolve_resume(resume: Union[None, bool, str], output_dir: str) -> Optional[str]:
    """The checkpoint to resume from.

    None/False: start fresh. "latest": the newest checkpoint-N of `output_dir`, or a fresh
    start when there is none yet (the first attempt of a restartable job). True: the newest
    checkpoint, which must exist (the Trainer's meaning). A path must exist: a typo must not
    silently restart training from scratch.
    """
    if resume is None or resume is False or resume == "":
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in LATEST):
        from transformers.trainer_utils import get_last_checkpoint

        found = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        if found is None and resume is True:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {output_dir} holds no checkpoint-N folder; "
                f"use 'latest' to start fresh when there is none"
            )
        return found
    p = Path(str(resume))
    if not p.is_dir():
        raise FileNotFoundError(
            f"resume_from_checkpoint {resume!r} is not a checkpoint folder; use 'latest' to "
            f"resume from the newest checkpoint of output_dir (or start fresh if none)"
        )
    return str(p)


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer steps a checkpoint folder has completed (its trainer_state.json)."""
    state = Path(checkpoint) / "trainer_state.json"
    if not state.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} has no trainer_state.json; is it a Trainer checkpoint?")
    return int(json.loads(state.read_text())["global_step"])


def truncate_history(path: Path, steps_done: int) -> int:
    """Keep the history lines of steps below `steps_done` (those the checkpoint holds); steps
    after it are trained again by the resumed run. Returns the number of lines dropped."""
    if not path.is_file():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln)["index"] < steps_done]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(path)
    return len(lines) - len(kept)


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


def write_schedule(checkpoint: str, record: dict) -> None:
    path = Path(checkpoint)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (SCHEDULE_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path / SCHEDULE_FILE)  # never a half-written file, even if killed here


def check_resumed_schedule(checkpoint: str, now: dict, allow_change: bool = False) -> List[str]:
    """Warnings for resuming `checkpoint` on the schedule `now`; raises ScheduleChangedError when
    the schedule differs and `allow_change` is off. A checkpoint without the file (written by
    another tool) is resumed with a warning."""
    path = Path(checkpoint) / SCHEDULE_FILE
    if not path.is_file():
        return [f"{checkpoint} has no {SCHEDULE_FILE}: cannot check that the resumed run keeps the sample schedule"]
    try:
        saved = json.loads(path.read_text())
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
) -> List[str]:
    """Everything that decides whether `checkpoint` may be resumed by this run: its sample
    schedule and its ZeRO world size. Raises ScheduleChangedError / ReshardNeededError; returns
    notes worth a warning. Used by CPTrainer.train and by the dry run alike."""
    notes = check_resumed_schedule(checkpoint, schedule_now, allow_schedule_change)
    if check_zero_world_size(checkpoint, world_size, deepspeed_config):
        notes.append(f"resuming {checkpoint} from its universal checkpoint on {world_size} ranks")
    return notes
