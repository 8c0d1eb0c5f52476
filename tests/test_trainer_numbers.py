"""The Trainer's own progress numbers under token-budget steps, checked against the data: `epoch`
is the share of the dataset's samples trained, `train_samples_per_second` counts the samples
trained (not world x steps), `train_steps_per_second` the steps."""

from __future__ import annotations

import numpy as np
import pytest

from hf_cp.planning import GlobalBatchSampler

from helpers.harness.models import synthetic_rows, tiny_model

LENGTHS = [200, 150, 130, 250, 255, 90, 7, 33, 60, 40, 120, 100, 18, 5, 64, 21, 77]


def test_epoch_and_speed_metrics_count_the_samples_trained(tmp_path):
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        seed=3,
        cp_balancer="static",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        num_train_epochs=2,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        cp_compare_balancer=None,
        cp_profile="cpu",
    )
    trainer = CPTrainer(model=tiny_model(0), args=args, train_dataset=Dataset.from_list(synthetic_rows(LENGTHS)))
    out = trainer.train()
    # the batches, cut from the data by the sampler (seeded shuffle, 500 tokens per step)
    sampler = GlobalBatchSampler(LENGTHS, 500, seed=3, num_epochs=2)
    batches = [sampler[k] for k in range(len(sampler))]
    expected_epoch = []
    for b in batches:
        before = sum(len(x.sample_ids) for x in batches if x.epoch == b.epoch and x.step_in_epoch <= b.step_in_epoch)
        expected_epoch.append(b.epoch + before / len(LENGTHS))
    steps = [h for h in trainer.state.log_history if "loss" in h and "epoch" in h]
    assert [h["step"] for h in steps] == list(range(1, len(batches) + 1))
    assert [h["epoch"] for h in steps] == pytest.approx(expected_epoch, abs=1e-9)
    assert steps[-1]["epoch"] == pytest.approx(2.0) and trainer.state.epoch == pytest.approx(2.0)
    samples = sum(len(b.sample_ids) for b in batches)
    assert samples == 2 * len(LENGTHS) != len(batches)  # samples, not world x steps
    m = out.metrics
    runtime = m["train_runtime"]
    assert m["train_samples_per_second"] == pytest.approx(samples / runtime, abs=2e-3)
    assert m["train_steps_per_second"] == pytest.approx(len(batches) / runtime, abs=2e-3)
    assert m["train_tokens_per_second"] == pytest.approx(2 * sum(LENGTHS) / runtime, rel=1e-3)
    final = next(h for h in trainer.state.log_history if "train_runtime" in h)
    assert final["train_samples_per_second"] == m["train_samples_per_second"] and final["epoch"] == pytest.approx(2.0)
    assert np.isfinite(m["train_loss"])
