"""CPTrainingArguments (hf_cp/train/setup/args.py)."""

from __future__ import annotations

import pytest


def test_arguments_reject_trainer_batching_knobs():
    from hf_cp.train import CPTrainingArguments

    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        CPTrainingArguments(output_dir="/tmp/x", gradient_accumulation_steps=2, use_cpu=True)
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        CPTrainingArguments(output_dir="/tmp/x", per_device_train_batch_size=4, use_cpu=True)
    a = CPTrainingArguments(output_dir="/tmp/x", use_cpu=True, cp_tokens_per_rank_per_step=1000)
    assert a.per_device_train_batch_size == 1 and a.tokens_per_step(4) == 4000
