"""CPGRPOTrainer and CPRLOOTrainer resume only checkpoints CPTrainer would (issue 40): before TRL's
train loads anything, the checkpoint's pickles are walked for code and its engine checked. A
GRPO checkpoint whose optimizer state is replaced by a pickle calling os.system is refused, and
the payload never runs; the untouched checkpoint resumes."""

from __future__ import annotations

import pickle

import pytest
from test_checkpoint_trust import Payload

from hf_cp.train.checkpoint.trust import UntrustedCheckpointError

from helpers.grpo_runs import hf_cp_trainer, model_dir, prompt_rows


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """One GRPO step on the tiny chat model, saved (checkpoint-1)."""
    root = tmp_path_factory.mktemp("grpo_resume")
    path = model_dir(root / "model")
    out = root / "run"
    trainer = hf_cp_trainer(prompt_rows(), str(out), 1, path, save_strategy="steps", save_steps=1)
    trainer.train()
    return path, out


def test_a_grpo_checkpoint_with_code_in_its_optimizer_state_is_refused_before_loading(saved_run, tmp_path):
    path, out = saved_run
    checkpoint = out / "checkpoint-1"
    optimizer = checkpoint / "optimizer.pt"
    assert optimizer.exists(), sorted(p.name for p in checkpoint.iterdir())
    original = optimizer.read_bytes()
    marker = tmp_path / "payload-ran"
    optimizer.write_bytes(pickle.dumps(Payload(marker)))
    try:
        trainer = hf_cp_trainer(prompt_rows(), str(out), 2, path)
        with pytest.raises(UntrustedCheckpointError, match="optimizer.pt"):
            trainer.train(resume_from_checkpoint=str(checkpoint))
        assert not marker.exists(), "the payload ran"
    finally:
        optimizer.write_bytes(original)
    # the checkpoint as saved resumes, and training goes on to step 2
    trainer = hf_cp_trainer(prompt_rows(), str(out), 2, path)
    trainer.train(resume_from_checkpoint="latest")
    assert trainer.state.global_step == 2


def test_a_rollout_checkpoint_is_saved_atomically_with_the_calibrated_profile(tmp_path):
    """As CPTrainer's: the schedule file first, then TRL's files, then the completion mark; the
    run's calibrated cost model rides along (hf-cp plan --profile FILE); a folder without the mark
    (a save cut short) is not what `latest` resumes."""
    import json

    from hf_cp.train.checkpoint.marks import COMPLETE_FILE
    from hf_cp.train.checkpoint.resolve import resolve_resume
    from hf_cp.train.measure.online_calibration import CALIBRATED_PROFILE

    path = model_dir(tmp_path / "model")
    out = tmp_path / "run"
    trainer = hf_cp_trainer(
        prompt_rows(), str(out), 3, path, save_strategy="steps", save_steps=1, cp_calibrate_min_steps=1,
        cp_calibrate_every=1,
    )  # fmt: skip
    trainer.train()
    for step in (1, 2, 3):
        folder = out / f"checkpoint-{step}"
        mark = json.loads((folder / COMPLETE_FILE).read_text())
        assert mark["step"] == step and mark["world_size"] == 1, mark
    # calibrated from step 1 on: checkpoints 2 and 3 hold a fitted profile
    assert (out / "checkpoint-3" / CALIBRATED_PROFILE).is_file()
    (out / "checkpoint-3" / COMPLETE_FILE).unlink()  # checkpoint-3's save cut short before its mark
    assert resolve_resume("latest", str(out), []) == str(out / "checkpoint-2")
