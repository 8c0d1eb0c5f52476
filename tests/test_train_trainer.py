"""CPTrainer (hf_cp/train/trainer.py) in one process: training and evaluation against the
sample-by-sample reference, and the datasets it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from hf_cp.planning import GlobalBatchSampler

from helpers.harness.models import synthetic_rows
from helpers.world2_job import LENGTHS


def test_single_process_trainer_matches_reference(tmp_path):
    """World of one, no DeepSpeed: the CPTrainer path against the sample-by-sample reference,
    every step (loss, gradients before clipping, parameters after the optimizer)."""
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    from helpers.harness.capture import capture_steps
    from helpers.harness.check import compare_with_reference
    from helpers.harness.models import tiny_model

    spec = dict(lengths=LENGTHS, tokens_per_step=500, max_tokens_per_rank=256, steps=3, balancer="static")
    rows = synthetic_rows(LENGTHS)
    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        seed=42,
        cp_balancer="static",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        cp_shuffle=False,
        max_steps=3,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        cp_compare_balancer=None,
    )
    trainer = CPTrainer(model=tiny_model(0), args=args, train_dataset=Dataset.from_list(rows))
    records, stop = capture_steps(trainer)
    try:
        trainer.train()
    finally:
        stop()
    final = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    history = [r.to_dict() for r in trainer.cp_history]
    report = compare_with_reference(spec, history, trainer.state.log_history, records, final)
    assert report.steps == [0, 1, 2]
    assert [r.index for r in trainer.cp_history] == [0, 1, 2]
    logged = [h for h in trainer.state.log_history if "cp/measured_max_over_mean" in h]
    assert len(logged) == 3 and all(h["cp/tokens_per_s"] > 0 and "cp/predicted_max_ms" in h for h in logged)
    # epochs of data: the share of the dataset's samples trained after each step
    batches = GlobalBatchSampler(LENGTHS, 500, seed=42, shuffle=False)
    seen = np.cumsum([len(batches[k].sample_ids) for k in range(3)]) / len(LENGTHS)
    assert [h["cp/data_epoch"] for h in logged] == pytest.approx(list(seen))


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "train_dataset is empty"),
        (
            [{"input_ids": [1, 2, 3], "length": 3}, {"input_ids": [4, 5], "length": 7}],
            "train_dataset sample 1 has length column 7 but 2 input_ids",
        ),
        ([{"text": "not tokenised"}], "no 'input_ids' column"),
    ],
)
def test_trainer_rejects_bad_datasets_by_name(tmp_path, rows, message):
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    from helpers.harness.models import tiny_model

    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        cp_compare_balancer=None,
    )
    ds = Dataset.from_list(rows) if rows else Dataset.from_dict({"input_ids": []})
    with pytest.raises(ValueError, match=message):
        CPTrainer(model=tiny_model(0), args=args, train_dataset=ds)


def test_a_streaming_dataset_without_max_steps_is_refused_by_name(tmp_path):
    """A stream trains (tests/test_streaming.py) but has no length: max_steps must say how long."""
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    from helpers.harness.models import tiny_model

    args = CPTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", cp_tokens_per_step=500
    )
    stream = Dataset.from_list([{"input_ids": [1, 2, 3]}] * 4).to_iterable_dataset()
    with pytest.raises(
        ValueError, match=r"train_dataset is a streaming IterableDataset, which has no length: set max_steps"
    ):
        CPTrainer(model=tiny_model(0), args=args, train_dataset=stream)


def test_evaluate_on_one_process_matches_reference_and_refuses_what_it_cannot_do(tmp_path):
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    from helpers.harness.models import eval_rows, synthetic_rows, tiny_model
    from helpers.harness.reference import reference_eval_loss

    spec = dict(lengths=[40, 30], eval_lengths=[60, 9, 200], steps=0, tokens_per_step=300)
    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=300,
        cp_compare_balancer=None,
        cp_loss_chunk_tokens=16,
    )
    trainer = CPTrainer(
        model=tiny_model(0, attn="hf_cp"), args=args, train_dataset=Dataset.from_list(synthetic_rows(spec["lengths"]))
    )
    with pytest.raises(ValueError, match="no eval_dataset"):
        trainer.evaluate()
    chat = Dataset.from_list(eval_rows(spec))
    metrics = trainer.evaluate({"chat": chat})
    assert metrics["eval_chat_loss"] == pytest.approx(reference_eval_loss(spec, 0), rel=1e-5)
    assert metrics["eval_chat_samples"] == 3 and metrics["eval_chat_tokens"] == 269
    unlabeled = Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}])
    with pytest.raises(ValueError, match="'eval' has no target tokens"):
        trainer.evaluate(unlabeled)
    with pytest.raises(ValueError, match="eval dataset 'eval' sample 0 has 3 input_ids but 1 labels"):
        trainer.evaluate(Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [5]}]))
    # auto trains samples over the cap of 256 as dependent chunks (chunkflow) up to a limit set by
    # the K/V state store; one token more is refused by name
    limit = trainer.cp_runtime.planner.max_sample_tokens
    assert limit > 256
    with pytest.raises(ValueError, match=f"eval dataset 'eval': sample 1 has {limit + 1} tokens; balancer 'auto'"):
        trainer.evaluate(Dataset.from_list(synthetic_rows([5, limit + 1])))
    cached = trainer._cp_eval_data[id(chat)][2]
    again = trainer.evaluate({"chat": chat})
    assert trainer._cp_eval_data[id(chat)][2] is cached, "a dataset is planned once per run"
    assert again["eval_chat_loss"] == pytest.approx(metrics["eval_chat_loss"], rel=1e-12)
    with pytest.raises(NotImplementedError, match="evaluate\\(\\) gives the planned eval loss"):
        trainer.predict(unlabeled)
    # evaluation starts no background planner; asking for the training data does (Planner.start)
    assert trainer.cp_runtime.planner._started is None
    trainer.get_train_dataloader()
    assert trainer.cp_runtime.planner._started is not None
    trainer.cp_runtime.planner.close()
