"""Restarts and resumption: which attempt this is, where a run resumes from, and whether the
checkpoint fits this run (check_resume: its files, its schedule, its ZeRO world size).

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

import logging
import os
from pathlib import Path
from typing import List, Optional, Sequence, Union

from hf_cp.readers import load_json  # nesting bounded (readers.py)
from hf_cp.train.checkpoint.integrity import CorruptCheckpointError, check_checkpoint_files
from hf_cp.train.checkpoint.marks import (
    PartialCheckpointError,
    checkpoint_status,
    last_complete,
    legacy_note,
    scan_checkpoints,
)
from hf_cp.train.checkpoint.schedule import check_resumed_schedule

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


def check_resume(
    checkpoint: str,
    schedule_now: Optional[dict],
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
    if schedule_now is not None:  # None: the dry run of a TRL trainer, whose rows TRL tokenises when built
        notes += check_resumed_schedule(checkpoint, schedule_now, allow_schedule_change)
    if check_zero_world_size(checkpoint, world_size, deepspeed_config):
        notes.append(f"resuming {checkpoint} from its universal checkpoint on {world_size} ranks")
    return notes
