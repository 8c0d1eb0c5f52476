"""Faults in real multi-process runs: a killed rank restarts the job from its last checkpoint,
a stalled rank fails the others fast with the step, wave and group. Plus the restart helpers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_cp.planning import GlobalBatchSampler
from hf_cp.report.samples import audit_samples
from hf_cp.train.checkpoint.marks import SCHEDULE_FILE
from hf_cp.train.checkpoint.resolve import (
    SHARED_STORE_ADVICE,
    ReshardNeededError,
    check_zero_world_size,
    checkpoint_step,
    resolve_resume,
    restart_problems,
)
from hf_cp.train.checkpoint.schedule import (
    ScheduleChangedError,
    check_resumed_schedule,
    schedule_record,
    write_schedule,
)
from hf_cp.train.measure.step_record import truncate_history
from hf_cp.train.step.agreement import CollectiveStallError, collective_scope

from helpers.harness.job import STALL_STARTED, free_port, run_distributed
from helpers.harness.models import ROOT
from helpers.world2_job import (
    FIXTURE_TIMEOUT,
    JOB_TIMEOUT,
    LENGTHS,
    TOKENS_PER_STEP,
    assert_matches_reference,
    spec_for,
)


def _history_lines(out: Path):
    """Per rank: the cp_history records, in file order."""
    return {
        f.name: [json.loads(ln) for ln in f.read_text().splitlines()]
        for f in sorted((out / "cp_history").glob("rank*.jsonl"))
    }


# ------------------------------------------------------------------ kill one rank, restart, resume
# slow: three torchrun launches (~2 min on 2 cores); the fast suite checks the restart's parts
# without processes (test_resolve_resume, test_resume_checks_the_sample_schedule_of_the_checkpoint,
# test_truncate_history_keeps_the_checkpointed_steps, test_restart_problems_*)
@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_killed_rank_restarts_from_checkpoint_and_trains_every_sample_once(tmp_path):
    # one epoch of 4 steps; checkpoint after step 2; rank 1 is SIGKILLed inside step 4's
    # forward, so step 3 (trained but not saved) must be trained again, step 4 for the first time
    assert len(GlobalBatchSampler(LENGTHS, TOKENS_PER_STEP, shuffle=False).epoch_batches(0)) == 4
    spec = spec_for(
        tmp_path,
        "auto",
        steps=4,
        save_steps=2,
        tag="killed",
        resume_from="latest",
        fault=dict(kind="kill", rank=1, step=3, attempt=0),
    )
    run_distributed(spec, 2, timeout=JOB_TIMEOUT, max_restarts=1)
    out = Path(spec["out"])
    per_rank = _history_lines(out)
    assert sorted(per_rank) == ["rank0.jsonl", "rank1.jsonl"]
    for name, recs in per_rank.items():
        # the killed attempt's step 3 record was dropped at the resume; steps 3-4 come from the restart
        assert [r["index"] for r in recs] == [0, 1, 2, 3], name
        assert [r["attempt"] for r in recs] == [0, 0, 1, 1], f"{name}: the job did not restart"
    trained = [s for recs in per_rank.values() for r in recs for s in r["trained_sample_ids"]]
    assert sorted(trained) == list(range(len(LENGTHS))), "every sample of the epoch exactly once"
    # and the interrupted run's parameters are the single-process run's
    assert_matches_reference(spec)

    # every checkpoint holds its sample schedule; resuming on another one is refused on every
    # rank before any collective (here: a new global batch size), instead of skipping samples
    assert all((c / SCHEDULE_FILE).is_file() for c in out.glob("checkpoint-*"))
    changed = dict(spec, tokens_per_step=TOKENS_PER_STEP * 2, steps=6, fault=None)
    with pytest.raises(RuntimeError) as err:
        run_distributed(changed, 2, timeout=JOB_TIMEOUT)
    text = str(err.value)
    assert "ScheduleChangedError: resuming" in text and "checkpoint-4" in text, text[-3000:]
    assert f"tokens per step: {TOKENS_PER_STEP} in the checkpoint, {TOKENS_PER_STEP * 2} now" in text


# ------------------------------------------------------------------ a stop signal (preemption)
# slow: two torchrun launches, the second resuming the first's checkpoint (~1 min on 2 cores);
# the fast suite checks the signal flag (test_stop_signal_sets_a_flag_and_restores_the_handler)
@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT)
def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    # enable_jit_checkpoint, no periodic checkpoints. Rank 1 alone gets SIGTERM inside step 2;
    # the flag rides on step 3's plan agreement, so both ranks stop after step 3 and save it
    spec = spec_for(
        tmp_path,
        "auto",
        steps=4,
        tag="sigterm",
        jit_checkpoint=True,
        resume_from="latest",
        fault=dict(kind="sigterm", rank=1, step=1),
    )
    run_distributed(spec, 2, timeout=JOB_TIMEOUT)  # exits normally
    out = Path(spec["out"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert all([r["index"] for r in recs] == [0, 1, 2] for recs in _history_lines(out).values())
    # the scheduler starts the job again: it resumes after step 3 and trains step 4 only
    run_distributed(dict(spec, fault=None), 2, timeout=JOB_TIMEOUT)
    per_rank = _history_lines(out)
    for name, recs in per_rank.items():
        assert [r["index"] for r in recs] == [0, 1, 2, 3], name
    trained = [s for recs in per_rank.values() for r in recs for s in r["trained_sample_ids"]]
    assert sorted(trained) == list(range(len(LENGTHS))), "every sample of the epoch exactly once"
    audit = audit_samples(out)  # what `hf-cp report` tells the user
    assert audit.exactly_once and audit.per_epoch == {0: len(LENGTHS)} and audit.dataset_samples == len(LENGTHS)
    assert_matches_reference(spec)


def test_stop_signal_sets_a_flag_and_restores_the_handler():
    import os
    import signal

    from hf_cp.train.checkpoint.stop_signal import StopSignal

    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignal()
    assert stop.install() and not stop.requested
    os.kill(os.getpid(), signal.SIGTERM)  # handled: this test process lives on
    time.sleep(0.01)
    assert stop.requested and stop.name == "SIGTERM"
    stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before


# ------------------------------------------------------------------ non-finite gradients
# Both runs come from the session's world-2 job (helpers/world2_job.py: nan_spec); the first
# stops with an error on every rank, which the job records (error_rank<r>.txt) and goes on.
@pytest.mark.timeout(FIXTURE_TIMEOUT)
def test_nan_on_one_rank_stops_every_rank_before_that_steps_checkpoint(world2_job):
    # rank 1's hidden states turn NaN in step 2; DeepSpeed would skip the update and go on,
    # silently leaving step 2's samples unlearned. Both ranks stop, naming step and samples.
    spec = world2_job["nan-stop"]
    out = Path(spec["out"])
    errors = [out / f"error_rank{r}.txt" for r in range(2)]
    assert all(e.is_file() for e in errors), "a rank trained on past the non-finite step"
    text = "\n".join(e.read_text() for e in errors)
    assert "NonFiniteGradientError: step 2: the gradient norm is inf" in text, text[-3000:]
    assert "DeepSpeed skipped the update" in text and "its samples: [" in text
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]  # none of the bad step
    # with the check off the run goes on, as DeepSpeed alone would
    spec = world2_job["nan-warn"]
    assert sorted(p.name for p in Path(spec["out"]).glob("checkpoint-*")) == [
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-3",
    ]


# ------------------------------------------------------------------ resume on another world size
@pytest.mark.slow
@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_resume_on_more_ranks_through_a_universal_checkpoint(tmp_path):
    # steps 1-2 on one process, checkpoint; steps 3-4 on two: same batches (cp_tokens_per_step
    # fixed), new plans, ZeRO-2 state re-partitioned by DeepSpeed's universal checkpoint
    import subprocess
    import sys

    spec = spec_for(tmp_path, "auto", steps=2, save_steps=2, tag="elastic")
    run_distributed(spec, 1, timeout=JOB_TIMEOUT)
    ckpt = Path(spec["out"]) / "checkpoint-2"
    grown = dict(spec, steps=4, resume_from="latest")
    with pytest.raises(RuntimeError) as err:  # not converted yet: the error says how
        run_distributed(grown, 2, timeout=JOB_TIMEOUT)
    text = str(err.value)
    assert "ReshardNeededError" in text and "partitioned over 1 ranks and this job has 2" in text, text[-3000:]
    assert "deepspeed.checkpoint.ds_to_universal" in text and '"load_universal": true' in text
    convert = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(ckpt / "global_step2"),
            "--output_folder",
            str(ckpt / "global_step2_universal"),
            "--inject_missing_state",
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert convert.returncode == 0, convert.stderr[-3000:]
    resumed = dict(grown, load_universal=True)
    run_distributed(resumed, 2, timeout=JOB_TIMEOUT)
    recs = _history_lines(Path(spec["out"]))
    assert [r["index"] for r in recs["rank0.jsonl"]] == [0, 1, 2, 3]  # steps 1-2 by one rank, 3-4 by two
    assert [r["index"] for r in recs["rank1.jsonl"]] == [2, 3]
    # Adam's moments and the fp32 weights crossed the re-partitioning intact
    assert_matches_reference(resumed)


def test_zero_world_size_check_names_the_conversion(tmp_path):
    ckpt = tmp_path / "checkpoint-8"
    (ckpt / "global_step8").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step8")
    for r in range(2):
        (ckpt / "global_step8" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    zero2 = {"zero_optimization": {"stage": 2}}
    assert check_zero_world_size(str(ckpt), 2, zero2) is False  # same world: DeepSpeed's own path
    assert check_zero_world_size(str(ckpt), 4, None) is False  # no DeepSpeed: nothing partitioned
    with pytest.raises(ReshardNeededError, match="partitioned over 2 ranks and this job has 4") as err:
        check_zero_world_size(str(ckpt), 4, zero2)
    assert f"--input_folder {ckpt / 'global_step8'}" in str(err.value)
    universal = {"zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": True}}
    with pytest.raises(ReshardNeededError, match="no universal checkpoint"):
        check_zero_world_size(str(ckpt), 4, universal)
    (ckpt / "latest_universal").write_text("global_step8_universal")
    assert check_zero_world_size(str(ckpt), 4, universal) is True


# ------------------------------------------------------------------ a stalled rank
def _stalled_run(tmp_path, tag: str, **kw) -> tuple:
    """A world-2 job whose rank 1 sleeps 90 s at the first forward of step 2 (ddp_timeout 4 s):
    its error text and the seconds from the stall's start to the job's end."""
    spec = spec_for(
        tmp_path,
        "static",  # local documents: rank 0 waits in the gradient reduction, not in attention
        steps=3,
        tag=tag,
        ddp_timeout=4,
        fault=dict(kind="stall", rank=1, step=1, seconds=90),
        **kw,
    )
    with pytest.raises(RuntimeError) as err:
        run_distributed(spec, 2, timeout=JOB_TIMEOUT)
    ended = time.time()
    started = float((Path(spec["out"]) / STALL_STARTED).read_text())
    return str(err.value), ended - started


# DeepSpeed makes its data-parallel groups with torch's 30-minute default, not ddp_timeout: a
# rank stalled while the others waited in the ZeRO-2 gradient reduction held them for the whole
# stall (before: 90 s of stall, no error, rc 0). ~20 s on 2 cores.
@pytest.mark.timeout(JOB_TIMEOUT)
def test_a_stall_during_the_zero_gradient_reduction_fails_within_the_timeout(tmp_path):
    text, waited = _stalled_run(tmp_path, "stall-reduce")
    assert "CollectiveStallError: step 2, wave 0: the gradient reduction over all ranks" in text, text[-3000:]
    assert waited < 4 + 10, f"the stall surfaced {waited:.1f} s after it began, ddp_timeout is 4 s"


def test_groups_made_before_and_after_hf_cp_are_bounded_by_its_timeout():
    """bound_every_group, in a process of its own (it sets torch's defaults for the process):
    a group made before (as DeepSpeed's are when GRPO builds its CP groups at the first step)
    and one made after (CPTrainer builds its groups before DeepSpeed) get the timeout."""
    port = free_port()
    code = (
        "import torch, torch.distributed as dist; from datetime import timedelta;"
        "from hf_cp.train.step.groups import bound_every_group;"
        f"dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:{port}');"
        "before = dist.new_group([0]); bound_every_group(timedelta(seconds=3)); after = dist.new_group([0]);"
        "print([g._get_backend(torch.device('cpu')).options._timeout.total_seconds() for g in (before, after)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[3.0, 3.0]", out.stdout


# slow: a launch each (~20 s on 2 cores): the first step after a checkpoint, after an
# evaluation, and the gradient reduction of FSDP2
@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT)
@pytest.mark.parametrize(
    "tag, kw",
    [
        ("after-save", dict(save_steps=1)),
        ("after-eval", dict(eval_steps=1, eval_lengths=[60, 9, 200])),
        ("fsdp2", dict(engine="fsdp2")),
    ],
)
def test_a_stall_after_a_save_an_evaluation_or_under_fsdp2_fails_within_the_timeout(tmp_path, tag, kw):
    text, waited = _stalled_run(tmp_path, tag, **kw)
    assert "CollectiveStallError: step 2" in text, text[-3000:]
    assert waited < 4 + 10, f"the stall surfaced {waited:.1f} s after it began, ddp_timeout is 4 s"


# slow: a torchrun launch of its own whose collective must time out (~30 s on 2 cores); the
# fast suite checks the error's naming (test_collective_scope_names_step_wave_and_group)
@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT)
def test_stalled_rank_fails_the_job_within_the_timeout_naming_step_wave_and_group(tmp_path):
    # every sample is spread over the group [0, 1] with Ulysses: rank 0 waits in its all-to-all
    spec = spec_for(
        tmp_path,
        "fixed_ulysses",
        steps=3,
        tag="stall",
        ddp_timeout=4,
        fault=dict(kind="stall", rank=1, step=1, seconds=90),
    )
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError) as err:
        run_distributed(spec, 2, timeout=JOB_TIMEOUT)
    elapsed = time.perf_counter() - t0
    text = str(err.value)
    assert "CollectiveStallError: step 2, wave 0" in text, text[-3000:]  # the second step, as the Trainer counts
    assert "CP group [0, 1]" in text
    assert "ddp_timeout" in text
    assert elapsed < 60, f"the stall surfaced after {elapsed:.0f} s, not within the 4 s timeout (+ start-up)"


# ------------------------------------------------------------------ units
def test_collective_scope_names_step_wave_and_group():
    with pytest.raises(
        CollectiveStallError,
        match=r"step 7, wave 2: a collective of the micro-batch on CP "
        r"group \[0, 1, 2, 3\].*Connection reset by peer",
    ):
        with collective_scope(7, 2, (0, 1, 2, 3)):
            raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer\nmore")
    with pytest.raises(
        CollectiveStallError,
        match=r"step 3, wave 0: the gradient reduction over all ranks "
        r"during the local micro-batch of rank 5",
    ):
        with collective_scope(3, 0, (5,)):
            raise RuntimeError("Timed out waiting 4000ms for recv operation to complete")
    with pytest.raises(CollectiveStallError, match=r"^evaluation batch 4, wave 1: a collective of the evaluation"):
        with collective_scope(4, 1, (0, 1), "evaluation micro-batch", "evaluation batch"):
            raise RuntimeError("Connection closed by peer")
    with pytest.raises(RuntimeError, match="^shape mismatch$"):  # not a collective failure: untouched
        with collective_scope(3, 0, (5,)):
            raise RuntimeError("shape mismatch")


def _checkpoint(out: Path, step: int) -> Path:
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def test_resolve_resume(tmp_path):
    out = tmp_path / "run"
    assert resolve_resume(None, str(out)) is None
    assert resolve_resume("latest", str(out)) is None  # first attempt of a restartable job: fresh start
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        resolve_resume(True, str(out))
    _checkpoint(out, 2)
    newest = _checkpoint(out, 10)
    assert resolve_resume("latest", str(out)) == str(newest)
    assert resolve_resume(True, str(out)) == str(newest)
    assert checkpoint_step(resolve_resume("latest", str(out))) == 10
    with pytest.raises(FileNotFoundError, match="checkpoint-9.*not a checkpoint folder"):
        resolve_resume(str(out / "checkpoint-9"), str(out))
    (out / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match="no trainer_state.json"):
        checkpoint_step(str(out / "plain"))


def test_resume_checks_the_sample_schedule_of_the_checkpoint(tmp_path):
    lengths = [5, 9, 3, 7]
    saved = schedule_record(lengths, 1024, seed=42, shuffle=True, world_size=2)
    ckpt = tmp_path / "checkpoint-10"
    write_schedule(str(ckpt), saved)
    assert check_resumed_schedule(str(ckpt), saved) == []
    # more ranks, same batches: cp_tokens_per_step fixed, so any world size resumes
    assert check_resumed_schedule(str(ckpt), dict(saved, world_size=4)) == []
    # more ranks under cp_tokens_per_rank_per_step: the batches change; the error says how to keep them
    grown = schedule_record(lengths, 2048, seed=42, shuffle=True, world_size=4)
    with pytest.raises(ScheduleChangedError, match="tokens per step: 1024 in the checkpoint, 2048 now") as err:
        check_resumed_schedule(str(ckpt), grown)
    assert "world size went from 2 to 4" in str(err.value) and "cp_tokens_per_step: 1024" in str(err.value)
    assert "cp_allow_schedule_change" in str(err.value)
    # another dataset (one length differs), another seed
    with pytest.raises(ScheduleChangedError, match="sample lengths") as err:
        check_resumed_schedule(str(ckpt), schedule_record([5, 9, 3, 8], 1024, 42, True, 2))
    assert "training data is not the data" in str(err.value)
    with pytest.raises(ScheduleChangedError, match="seed: 42 in the checkpoint, 7 now"):
        check_resumed_schedule(str(ckpt), schedule_record(lengths, 1024, 7, True, 2))
    # same lengths, other targets (prompts re-masked): the data digest tells them apart
    with pytest.raises(ScheduleChangedError, match="tokens and loss targets") as err:
        check_resumed_schedule(str(ckpt), dict(saved, data_sha256="another"))
    assert "prompt masking" in str(err.value)
    # a record from before a field existed is compared on the fields it has
    write_schedule(str(ckpt), {k: v for k, v in saved.items() if k != "data_sha256"})
    assert check_resumed_schedule(str(ckpt), dict(saved, data_sha256="another")) == []
    write_schedule(str(ckpt), saved)
    # allowed: a warning that still says what changed
    (warning,) = check_resumed_schedule(str(ckpt), grown, allow_change=True)
    assert "tokens per step" in warning and "Continuing on the new schedule" in warning
    # a checkpoint of another tool: resumed with a warning; a damaged file: an error naming it
    (tmp_path / "checkpoint-3").mkdir()
    (warning,) = check_resumed_schedule(str(tmp_path / "checkpoint-3"), saved)
    assert SCHEDULE_FILE in warning
    (ckpt / SCHEDULE_FILE).write_text("{not json")
    with pytest.raises(ScheduleChangedError, match=f"{SCHEDULE_FILE} is not valid JSON"):
        check_resumed_schedule(str(ckpt), saved)


def test_truncate_history_keeps_the_checkpointed_steps(tmp_path):
    f = tmp_path / "rank0.jsonl"
    assert truncate_history(f, 3) == 0  # no history yet
    f.write_text("".join(json.dumps({"index": i, "attempt": 0}) + "\n" for i in range(5)))
    assert truncate_history(f, 3) == 2
    assert [json.loads(ln)["index"] for ln in f.read_text().splitlines()] == [0, 1, 2]
    assert truncate_history(f, 3) == 0


def test_restart_problems_name_what_would_break_a_restart():
    restarts = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert restart_problems("no", None, {}) == []  # not under torchrun: nothing to say
    assert restart_problems("no", None, dict(restarts, TORCHELASTIC_MAX_RESTARTS="0")) == []
    assert restart_problems("steps", "latest", restarts) == []
    (needs_latest,) = restart_problems("steps", True, restarts)  # True fails the first attempt: no checkpoint yet
    assert "resume_from_checkpoint is True" in needs_latest
    shared = restart_problems("steps", "latest", dict(restarts, TORCHELASTIC_USE_AGENT_STORE="True"))
    assert shared == [SHARED_STORE_ADVICE] and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared[0]
    (no_ckpt,) = restart_problems("no", "latest", restarts)
    assert "save_strategy is 'no'" in no_ckpt
    (no_resume,) = restart_problems("steps", None, restarts)
    assert "resume_from_checkpoint is None" in no_resume and "latest" in no_resume
