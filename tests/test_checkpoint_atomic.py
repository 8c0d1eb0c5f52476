"""Atomic checkpoints (hf_cp/train/checkpoint/marks.py, CPTrainer._save_checkpoint): a save killed or
failing halfway leaves a partial checkpoint-N that resume skips, naming it, for the last complete
one; rotation never deletes that one; a full disk says so, naming the folder and the checkpoint
kept; the dry run reports partial checkpoints.

Run as a module (`-m test_checkpoint_atomic SPEC.json` under torchrun), this file is the job of
the kill test: helpers.harness.job with every rank killed inside a checkpoint save."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from hf_cp.report.samples import audit_samples
from hf_cp.train.checkpoint.marks import (
    COMPLETE_FILE,
    MARKED_FIELD,
    SCHEDULE_FILE,
    PartialCheckpointError,
    checkpoint_status,
    clear_for_save,
    mark_complete,
    rotate_checkpoints,
    scan_checkpoints,
)
from hf_cp.train.checkpoint.resolve import resolve_resume, restart_attempt
from hf_cp.train.checkpoint.save_errors import CheckpointSaveError, save_failure_error, storage_failure
from hf_cp.train.checkpoint.schedule import schedule_record, write_schedule

from helpers.checkpoint_runs import train_with_checkpoints
from helpers.harness.job import run_distributed
from helpers.harness.models import ROOT
from helpers.world2_job import JOB_TIMEOUT, LENGTHS, assert_matches_reference, spec_for

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
SCHEDULE = schedule_record([5, 9, 3], 1024, seed=0, shuffle=True, world_size=2)


# ------------------------------------------------------------------ checkpoint folders, no training
def _complete(out: Path, step: int) -> Path:
    """A checkpoint as CPTrainer leaves it: schedule first, trainer state, then the mark."""
    d = out / f"checkpoint-{step}"
    write_schedule(str(d), SCHEDULE, marked=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (d / "global_step" / "shard.pt").parent.mkdir()
    (d / "global_step" / "shard.pt").write_bytes(b"x" * 10)
    mark_complete(d, step, 2)
    return d


def _partial(out: Path, step: int, state: bool = False) -> Path:
    """A save killed after the schedule file (and, with `state`, after trainer_state.json)."""
    d = out / f"checkpoint-{step}"
    write_schedule(str(d), SCHEDULE, marked=True)
    if state:
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def _legacy(out: Path, step: int) -> Path:
    """A checkpoint of an hf_cp from before the mark: an unmarked schedule and trainer state."""
    d = out / f"checkpoint-{step}"
    write_schedule(str(d), SCHEDULE)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def test_latest_skips_partial_checkpoints_naming_them(tmp_path, caplog):
    out = tmp_path / "run"
    two = _complete(out, 2)
    _partial(out, 4)  # the folder: only hf_cp_schedule.json
    _partial(out, 6, state=True)  # every file but the mark: still partial
    notes = []
    assert resolve_resume("latest", str(out), notes) == str(two)
    assert resolve_resume(True, str(out), []) == str(two)
    assert len(notes) == 2
    assert f"{out / 'checkpoint-4'} is a partial checkpoint (no {COMPLETE_FILE}" in notes[0]
    assert "it holds hf_cp_schedule.json" in notes[0] and "resuming from checkpoint-2" in notes[0]
    assert "checkpoint-6 is a partial checkpoint" in notes[1]
    with caplog.at_level(logging.WARNING, logger="hf_cp.train.checkpoint.resolve"):  # no list: logged
        resolve_resume("latest", str(out))
    assert "checkpoint-4 is a partial checkpoint" in caplog.text
    # only partial ones: latest starts fresh, True fails naming them
    shutil.rmtree(two)
    assert resolve_resume("latest", str(out), notes) is None
    with pytest.raises(FileNotFoundError, match="holds no checkpoint-N folder that is complete .*checkpoint-4"):
        resolve_resume(True, str(out))


def test_an_explicit_partial_checkpoint_is_refused_naming_the_newest_complete_one(tmp_path):
    out = tmp_path / "run"
    _complete(out, 2)
    partial = _partial(out, 4)
    with pytest.raises(
        PartialCheckpointError, match=f"checkpoint-4'? is a partial checkpoint: no {COMPLETE_FILE}"
    ) as e:
        resolve_resume(str(partial), str(out))
    assert f"newest complete checkpoint beside it is {out / 'checkpoint-2'}" in str(e.value)
    # a mark listing a file that is gone: partial too, naming the file
    four = _complete(out, 4)
    (four / "global_step" / "shard.pt").unlink()
    with pytest.raises(PartialCheckpointError, match="lists are missing: global_step/shard.pt"):
        resolve_resume(str(four), str(out))


def test_unmarked_checkpoints_of_an_older_hf_cp_are_resumed_with_a_note(tmp_path):
    out = tmp_path / "run"
    old = _legacy(out, 2)
    (out / "checkpoint-4").mkdir()  # the old partial: only an unmarked schedule
    write_schedule(str(out / "checkpoint-4"), SCHEDULE)
    notes = []
    assert resolve_resume("latest", str(out), notes) == str(old)
    assert "checkpoint-4 is a partial checkpoint (no trainer_state.json" in notes[0]
    assert f"{old} has no {COMPLETE_FILE}" in notes[1] and "readable" in notes[1]
    assert checkpoint_status(old).legacy and checkpoint_status(old).complete
    # cut short: not resumed
    (old / "trainer_state.json").write_text('{"global_st')
    assert not checkpoint_status(old).complete and "unreadable" in checkpoint_status(old).problem
    # the schedule record itself is unchanged by the mark, apart from its own field
    assert json.loads((_partial(out, 8) / SCHEDULE_FILE).read_text()) == dict(SCHEDULE, **{MARKED_FIELD: COMPLETE_FILE})


def test_rotation_never_deletes_the_last_complete_checkpoint(tmp_path):
    out = tmp_path / "run"
    _complete(out, 2)
    stale = _partial(out, 3)  # a failed save nothing resumes from
    four = _complete(out, 4)
    six = _partial(out, 6, state=True)  # being written (or killed while written)
    # save_total_limit 1 with checkpoint-6 unmarked: checkpoint-4 stays; only older ones go
    assert rotate_checkpoints(out, 1, keep=[str(six)]) == [str(out / "checkpoint-2"), str(stale)]
    assert [c.name for c in scan_checkpoints(out)] == ["checkpoint-4", "checkpoint-6"]
    assert rotate_checkpoints(out, 1, keep=[str(six)]) == []
    mark_complete(six, 6, 2)
    assert rotate_checkpoints(out, 1, keep=[str(six)]) == [str(four)]
    assert rotate_checkpoints(out, None) == [] and rotate_checkpoints(out, 0) == []
    # the best model is kept beside the newest
    for step in (8, 10):
        _complete(out, step)
    assert rotate_checkpoints(out, 1, keep=[str(six)]) == [str(out / "checkpoint-8")]


def test_saving_again_into_a_checkpoint_folder_clears_it_first(tmp_path):
    out = tmp_path / "run"
    assert clear_for_save(out / "checkpoint-2") is None
    partial = _partial(out, 4, state=True)
    assert "removed the partial" in clear_for_save(partial) and not partial.exists()
    done = _complete(out, 6)
    assert "partial until this save completes" in clear_for_save(done)
    assert not (done / COMPLETE_FILE).exists() and not checkpoint_status(done).complete


def test_full_disk_errors_name_the_folder_and_say_space_ran_out(tmp_path, monkeypatch):
    ckpt = tmp_path / "run" / "checkpoint-4"
    kept = str(tmp_path / "run" / "checkpoint-2")
    failure = storage_failure(OSError(errno.ENOSPC, "No space left on device"), ckpt)
    assert failure.space
    error = save_failure_error(failure, ckpt, kept, removed=True)
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    text = str(error)
    assert f"saving checkpoint {ckpt} failed: No space left on device (space ran out" in text
    assert f"{kept}, the last complete checkpoint, is kept" in text and "The partial checkpoint-4 was removed" in text
    # a quota, and the errno carried only as text by a library that re-raised it
    assert storage_failure(OSError(errno.EDQUOT, "Disk quota exceeded"), ckpt).space
    assert storage_failure(RuntimeError("write failed: [Errno 28] No space left on device"), ckpt).space
    # torch's short write carries no errno: a full filesystem decides
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))
    failure = storage_failure(torch_error, ckpt)
    assert failure.space and "unexpected pos 128 vs 0" in failure.cause and failure.free_bytes == 4096
    assert "4.0 KiB free" in str(save_failure_error(failure, ckpt, None, removed=False))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10 << 30))
    failure = storage_failure(torch_error, ckpt)
    assert not failure.space
    text = str(save_failure_error(failure, ckpt, None, removed=False))
    assert "No space" not in text and "unexpected pos" in text and "no complete checkpoint yet" in text
    # the C++ stream's error, what rank 0 of a ZeRO-2 save on a full disk raised
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=0))
    assert storage_failure(RuntimeError("basic_ios::clear: iostream error"), ckpt).space
    assert storage_failure(PermissionError(errno.EACCES, "Permission denied"), ckpt).space is False
    assert storage_failure(RuntimeError("shape mismatch"), ckpt) is None  # not a write: re-raised as is


# ------------------------------------------------------------------ CPTrainer, one process
def _train(out: Path, resume=None, steps: int = 4):
    """A world-1 CPTrainer on LENGTHS (4 steps an epoch at 500 tokens), a checkpoint every 2 steps."""
    # save_total_limit 1: the Trainer's own rotation would delete checkpoint-2 before the mark
    return train_with_checkpoints(out, steps, resume, save_total_limit=1)


def _history(out: Path):
    return [json.loads(ln) for ln in (out / "cp_history" / "rank0.jsonl").read_text().splitlines()]


def _assert_every_sample_once(out: Path, indices=(0, 1, 2, 3)):
    recs = _history(out)
    assert [r["index"] for r in recs] == list(indices)
    assert sorted(s for r in recs for s in r["trained_sample_ids"]) == list(range(len(LENGTHS)))
    audit = audit_samples(out)
    assert audit.exactly_once and audit.per_epoch == {0: len(LENGTHS)}


def test_a_full_disk_during_a_save_keeps_and_resumes_the_last_complete_checkpoint(tmp_path, monkeypatch):
    import torch

    out = tmp_path / "run"
    save = torch.save

    def full_disk(obj, f, *args, **kwargs):  # checkpoint-4's first torch.save (the optimizer) fails
        if "checkpoint-4" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointSaveError) as err:
        _train(out)
    text = str(err.value)
    assert err.value.errno == errno.ENOSPC and isinstance(err.value.__cause__, OSError)
    assert f"saving checkpoint {out / 'checkpoint-4'} failed: No space left on device (space ran out" in text
    assert f"{out / 'checkpoint-2'}, the last complete checkpoint, is kept" in text
    assert "The partial checkpoint-4 was removed" in text  # the space it took is given back
    assert [(c.name, c.complete) for c in scan_checkpoints(out)] == [("checkpoint-2", True)]
    monkeypatch.setattr(torch, "save", save)
    # the restart resumes from checkpoint-2: steps 3-4 are trained again, every sample once
    trainer = _train(out, resume="latest")
    assert trainer._cp_resumed_from == 2
    assert [(c.name, c.complete) for c in scan_checkpoints(out)] == [("checkpoint-4", True)]  # limit 1
    _assert_every_sample_once(out)


@pytest.mark.timeout(JOB_TIMEOUT)
def test_a_full_disk_on_rank_0_names_the_folder_on_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    """World 2, ZeRO-2: every torch.save of rank 0 into checkpoint-4 fails with ENOSPC (~20 s).
    Rank 0 says space ran out and removes the partial folder; rank 1, whose files went through,
    names the folder and says another rank failed (before: rank 0 'basic_ios::clear: iostream
    error', the partial checkpoint left on the full disk)."""
    spec = spec_for(tmp_path, "static", steps=4, save_steps=2, tag="full", fault=dict(kind="full_disk", rank=0, step=3))
    with pytest.raises(RuntimeError) as err:
        run_distributed(spec, 2, timeout=JOB_TIMEOUT)
    out = Path(spec["out"])
    text = str(err.value)
    folder, kept = out / "checkpoint-4", out / "checkpoint-2"
    assert (
        f"[rank0]: hf_cp.train.checkpoint.save_errors.CheckpointSaveError: saving checkpoint {folder} failed: No space left"
        in text
    )
    assert f"{kept}, the last complete checkpoint, is kept" in text and "The partial checkpoint-4 was removed" in text
    assert (
        f"[rank1]: hf_cp.train.checkpoint.save_errors.CheckpointSaveError: saving checkpoint {folder} failed on another rank"
        in text
    )
    assert [(c.name, c.complete) for c in scan_checkpoints(out)] == [("checkpoint-2", True)]
    assert not folder.exists()


@pytest.mark.timeout(JOB_TIMEOUT)
def test_a_full_disk_on_rank_1_is_cleaned_up_by_rank_0_and_keeps_the_last_checkpoint(tmp_path):
    """World 2, ZeRO-2: every torch.save of rank 1 into checkpoint-4 fails with ENOSPC, rank 0's
    own writes go through (~20 s). Rank 0, whose wait for rank 1 fails, removes the partial
    folder (before: only a full disk on rank 0 itself removed it, so the partial checkpoint
    stayed on the disk that was full); both ranks' errors name the folder."""
    spec = spec_for(
        tmp_path, "static", steps=4, save_steps=2, tag="full1", fault=dict(kind="full_disk", rank=1, step=3)
    )
    with pytest.raises(RuntimeError) as err:
        run_distributed(spec, 2, timeout=JOB_TIMEOUT)
    out = Path(spec["out"])
    text = str(err.value)
    folder, kept = out / "checkpoint-4", out / "checkpoint-2"
    assert (
        f"[rank1]: hf_cp.train.checkpoint.save_errors.CheckpointSaveError: saving checkpoint {folder} failed: No space left"
        in text
    ), text[-4000:]
    assert "rank 0, which saves the checkpoint, removes the partial checkpoint-4" in text
    assert (
        f"[rank0]: hf_cp.train.checkpoint.save_errors.CheckpointSaveError: saving checkpoint {folder} failed on another rank"
        in text
    ), text[-4000:]
    assert "The partial checkpoint-4 was removed" in text and f"{kept}, the last complete checkpoint, is kept" in text
    assert [(c.name, c.complete) for c in scan_checkpoints(out)] == [("checkpoint-2", True)]
    assert not folder.exists()


def test_a_save_stopped_before_the_mark_leaves_a_partial_checkpoint_that_resume_skips(tmp_path, monkeypatch, caplog):
    import hf_cp.train.runtime.checkpoints as trainer_module

    out = tmp_path / "run"
    mark = trainer_module.mark_complete

    def stopped(folder, step, world):  # every file written, the process stops before the mark
        if step == 4:
            raise RuntimeError("stopped before the mark")
        return mark(folder, step, world)

    monkeypatch.setattr(trainer_module, "mark_complete", stopped)
    with pytest.raises(RuntimeError, match="^stopped before the mark") as err:  # not a write error: as it was
        _train(out)
    (note,) = err.value.__notes__
    assert f"{out / 'checkpoint-4'} is left partial" in note and f"resumes from {out / 'checkpoint-2'}" in note
    four = checkpoint_status(out / "checkpoint-4")
    assert not four.complete and (out / "checkpoint-4" / "trainer_state.json").is_file()
    # the Trainer's rotation (save_total_limit 1) would have deleted checkpoint-2 by now
    assert checkpoint_status(out / "checkpoint-2").complete
    monkeypatch.setattr(trainer_module, "mark_complete", mark)
    with caplog.at_level(logging.WARNING):
        trainer = _train(out, resume="latest")
    assert trainer._cp_resumed_from == 2
    assert "checkpoint-4 is a partial checkpoint" in caplog.text and "removed the partial" in caplog.text
    assert checkpoint_status(out / "checkpoint-4").complete
    _assert_every_sample_once(out)


# ------------------------------------------------------------------ the dry run
def test_the_dry_run_reports_partial_checkpoints_and_what_a_restart_resumes(tmp_path):
    from hf_cp.train.launch.dry_run import dry_run

    out = tmp_path / "run"
    two = out / "checkpoint-2"
    two.mkdir(parents=True)
    (two / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    mark_complete(two, 2, 2)  # no schedule file: resumed with a note
    _partial(out, 4)
    overrides = [f"training.output_dir={out}"]
    text = "\n".join(dry_run(TINY, overrides + ["training.resume_from_checkpoint=latest"], world_size=2, steps=1))
    assert f"warning: {out / 'checkpoint-4'} is a partial checkpoint (no {COMPLETE_FILE}" in text
    assert "a resume or restart skips it" in text
    assert f"resume: a launch or restart resumes from {two} (the newest complete checkpoint)" in text
    text = "\n".join(dry_run(TINY, overrides, world_size=2, steps=1))  # resume off: still named
    assert "checkpoint-4 is a partial checkpoint" in text and "resume_from_checkpoint is off" in text
    with pytest.raises(PartialCheckpointError, match="checkpoint-4'? is a partial checkpoint"):
        dry_run(TINY, overrides + [f"training.resume_from_checkpoint={out / 'checkpoint-4'}"], world_size=2, steps=1)


# ------------------------------------------------------------------ both ranks killed inside a save
def _launch_killing_in_save(spec: dict, nproc: int = 2, max_restarts: int = 1):
    """helpers.harness.job's run_distributed, with this module as the job (see __main__ below)."""
    return run_distributed(spec, nproc, JOB_TIMEOUT, max_restarts, module="test_checkpoint_atomic")


def _kill_inside_save(step: int, attempt: int) -> None:
    """Every rank SIGKILLs itself when it starts saving the optimizer state of checkpoint-`step`
    (schedule, profile and model weights written; ZeRO shards, RNG and trainer state not), in
    torchrun attempt `attempt` only."""
    from hf_cp.train.trainer import CPTrainer

    if restart_attempt() != attempt:
        return
    save = CPTrainer._save_optimizer_and_scheduler

    def killed(self, output_dir):
        if self.state.global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return save(self, output_dir)

    CPTrainer._save_optimizer_and_scheduler = killed


# slow: one torchrun job that restarts once, and the single-process reference (~1-2 min on 2
# cores); the fast suite checks the same path in one process (the two CPTrainer tests above)
@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 120)
def test_ranks_killed_during_a_save_restart_from_the_last_complete_checkpoint(tmp_path):
    # 4 steps, a checkpoint every 2: checkpoint-2 complete; both ranks die inside checkpoint-4's
    # save. The restart must skip the partial checkpoint-4 (before: "checkpoint-4 has no
    # trainer_state.json" on every attempt) and train steps 3-4 again from checkpoint-2.
    spec = spec_for(
        tmp_path, "auto", steps=4, save_steps=2, tag="killed-in-save", resume_from="latest", kill_in_save=[4, 0]
    )
    proc = _launch_killing_in_save(spec)
    out = Path(spec["out"])
    log = proc.stdout + proc.stderr
    assert "checkpoint-4 is a partial checkpoint" in log and "resuming from checkpoint-2" in log, log[-4000:]
    per_rank = {
        f.name: [json.loads(ln) for ln in f.read_text().splitlines()]
        for f in sorted((out / "cp_history").glob("rank*.jsonl"))
    }
    assert sorted(per_rank) == ["rank0.jsonl", "rank1.jsonl"]
    for name, recs in per_rank.items():
        assert [r["index"] for r in recs] == [0, 1, 2, 3], name
        assert [r["attempt"] for r in recs] == [0, 0, 1, 1], f"{name}: the job did not restart"
    trained = [s for recs in per_rank.values() for r in recs for s in r["trained_sample_ids"]]
    assert sorted(trained) == list(range(len(LENGTHS))), "every sample of the epoch exactly once"
    assert audit_samples(out).exactly_once
    assert [(c.name, c.complete) for c in scan_checkpoints(out)] == [("checkpoint-2", True), ("checkpoint-4", True)]
    assert json.loads((out / "checkpoint-4" / COMPLETE_FILE).read_text())["world_size"] == 2
    assert_matches_reference(spec)


if __name__ == "__main__":  # the kill test's torchrun job
    from helpers.harness.job import run_job

    job = json.loads(Path(sys.argv[1]).read_text())
    _kill_inside_save(*job["kill_in_save"])
    run_job(job)
