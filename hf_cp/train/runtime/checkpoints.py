"""What CPTrainer's checkpoint hooks call: the resume point of a run (restart checks, the newest
complete checkpoint, its schedule and files checked, the history files cut back to it), the
atomic save, and the error a failed save raises. The rules themselves (completion marks, partial folders,
rotation, full disks) are checkpoint/'s."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable, List, Optional

from hf_cp.train.checkpoint.fit import check_checkpoint_fits
from hf_cp.train.checkpoint.marks import (
    CHECKPOINT_PREFIX,
    clear_for_save,
    last_complete,
    mark_complete,
    rotate_checkpoints,
)
from hf_cp.train.checkpoint.resolve import check_resume, checkpoint_step, resolve_resume, restart_problems
from hf_cp.train.checkpoint.save_errors import (
    CheckpointSaveError,
    peer_save_failure_error,
    save_failure_error,
    storage_failure,
)
from hf_cp.train.checkpoint.schedule import write_schedule
from hf_cp.train.measure.online_calibration import CALIBRATED_PROFILE, write_calibrated_profile
from hf_cp.train.measure.step_record import history_path, truncate_history
from hf_cp.train.step.agreement import is_collective_failure

logger = logging.getLogger(__name__)


def resume_point(
    resume_from_checkpoint,
    args,
    rank: int,
    schedule: dict,
    world: int,
    deepspeed_config: Optional[dict],
    warn: Callable[[str], None],
    engine: Optional[str] = None,
    model_config=None,
) -> Optional[str]:
    """The checkpoint `train(resume_from_checkpoint)` resumes from, or None; `warn` gets each
    warning as it is found (a restart that would lose work, partial checkpoints skipped, notes
    on the checkpoint resumed). Every rank checks the same things before any collective, so all
    raise or none (a changed schedule, a damaged file, another engine's or model's checkpoint). The rank's history file starts afresh,
    or is cut back to the checkpoint's steps."""
    for problem in restart_problems(args.save_strategy, resume_from_checkpoint):
        warn(problem)
    notes: List[str] = []  # partial checkpoints skipped, an unmarked one resumed
    resume = resolve_resume(resume_from_checkpoint, args.output_dir, notes)
    for note in notes:
        warn(note)
    if resume is not None:
        allowed = args.cp_checkpoint_allowed_globals
        if engine is not None:  # `engine` (checkpoint_fit.run_engine) loads only its own layout
            check_checkpoint_fits(resume, engine, model_config)
        for note in check_resume(resume, schedule, world, deepspeed_config, args.cp_allow_schedule_change, allowed):
            warn(note)
    if args.cp_record_history:
        hist = history_path(args.output_dir, rank)
        if resume is None:
            hist.unlink(missing_ok=True)  # a fresh run starts a fresh history
        else:
            # a resumed one continues it from the checkpoint: steps after it run again
            truncate_history(hist, checkpoint_step(resume))
    return resume


def save_failure(
    err: Exception, folder: Path, run_dir: Path, global_step: int, should_save: bool
) -> Optional[CheckpointSaveError]:
    """The error to raise for `err`, raised while saving `folder`: a CheckpointSaveError for a
    failed write, None to re-raise `err` itself (with a note saying what a restart resumes from).
    The saving rank (`should_save`, rank 0) removes the partial folder when space ran out on it,
    and when another rank's write failed (its full disk is as likely to be the shared one), to
    give the space back; the last complete checkpoint is kept."""
    kept = last_complete(run_dir, before=global_step)
    failure = storage_failure(err, folder)
    if failure is None and is_collective_failure(err):
        # this rank's write went through, another rank's did not (it stopped, or a full disk
        # made it leave): this rank's wait for it inside the save failed
        return peer_save_failure_error(err, folder, kept, should_save and _remove(folder), should_save)
    if failure is None:
        if hasattr(err, "add_note"):  # Python 3.11+
            err.add_note(
                f"hf_cp: {folder} is left partial (not marked complete); a restart resumes from "
                + (kept if kept is not None else "step 0 (no complete checkpoint yet)")
            )
        return None
    removed = failure.space and should_save and _remove(folder)
    # another rank's space ran out: rank 0, whose wait for it then fails, removes the folder (above)
    return save_failure_error(failure, folder, kept, removed, saving_rank_removes=failure.space and not should_save)


def _remove(folder: Path) -> bool:
    """Remove a partial checkpoint folder; whether it is gone."""
    shutil.rmtree(folder, ignore_errors=True)
    return not folder.exists()


def atomic_save(trainer, trial, trainer_save: Callable[[], None]) -> None:
    """`trainer_save` (the Trainer's _save_checkpoint) made atomic: a checkpoint is complete once
    every rank has written its files and rank 0 has then marked it; resume skips unmarked ones.
    The Trainer's rotation (save_total_limit) would count the unmarked checkpoint and could
    delete the last complete one before the mark: it runs here, after the mark, over complete
    checkpoints only. A failed write (a full disk) raises CheckpointSaveError naming the folder,
    whether space ran out, and the complete checkpoint kept. `trainer`: a CPTrainer, or a
    rollout trainer (objectives/rollout.py): cp_schedule, cp_calibrated_profile, cp_runtime, cp_world."""
    args, step = trainer.args, trainer.state.global_step
    run_dir = Path(trainer._get_output_dir(trial=trial))
    folder = run_dir / f"{CHECKPOINT_PREFIX}-{step}"
    save = args.should_save
    if save:
        note = clear_for_save(folder)  # a partial folder of an earlier attempt
        if note:
            logger.warning("hf_cp: %s", note)
    trainer.cp_runtime.barrier()  # no rank writes into the folder before it is cleared
    limit = args.save_total_limit
    args.save_total_limit = None  # no rotation inside the Trainer's save (see above)
    try:
        if save:  # first, so a checkpoint folder never lacks it; it also says "complete once marked"
            write_schedule(str(folder), trainer.cp_schedule(), marked=True)
            # the calibrated cost model (hf-cp plan --profile FILE reads it)
            write_calibrated_profile(folder, trainer.cp_calibrated_profile(), CALIBRATED_PROFILE)
        trainer_save()
        trainer.cp_runtime.barrier()  # every rank has written its files
        if save:
            mark_complete(folder, step, trainer.cp_world)
    except Exception as err:
        error = save_failure(err, folder, run_dir, step, save)
        if error is None:
            raise
        raise error from err
    finally:
        args.save_total_limit = limit
    if save:
        for path in rotate_checkpoints(run_dir, limit, keep=(str(folder), trainer.state.best_model_checkpoint)):
            logger.info("hf_cp: deleted %s (save_total_limit %s)", path, limit)
