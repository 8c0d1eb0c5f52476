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
