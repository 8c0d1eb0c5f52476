"""A world-1 CPTrainer run that saves checkpoints, for the tests of checkpoint files (atomic
saves, load errors, the fuzz test's damaged checkpoints)."""

from __future__ import annotations

from pathlib import Path

from helpers.harness.models import synthetic_rows, tiny_model
from helpers.world2_job import LENGTHS


def train_with_checkpoints(out: Path, steps: int = 4, resume=None, callbacks=None, **overrides):
    """CPTrainer without DeepSpeed on world2_job.LENGTHS (4 steps an epoch at 500 tokens), a
    checkpoint every 2 steps (~5 s); `overrides` replace CPTrainingArguments' settings, `callbacks`
    go to the trainer. Returns the trainer."""
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    settings = dict(
        output_dir=str(out),
        use_cpu=True,
        seed=42,
        cp_balancer="static",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        cp_shuffle=False,
        max_steps=steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        report_to="none",
        save_strategy="steps",
        save_steps=2,
        disable_tqdm=True,
        logging_steps=1,
        cp_compare_balancer=None,
    )
    args = CPTrainingArguments(**dict(settings, **overrides))
    trainer = CPTrainer(
        model=tiny_model(0), args=args, train_dataset=Dataset.from_list(synthetic_rows(LENGTHS)), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer
