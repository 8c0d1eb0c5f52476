"""A data_collator given to CPTrainer is never silently unused: the ones whose effect hf_cp
reproduces are accepted with a warning that says so (and are not called), the others are
refused by name."""

from __future__ import annotations

import logging

import pytest

from hf_cp.train.data.user_collator import UnsupportedCollatorError, check_data_collator

from helpers.harness.models import synthetic_rows, tiny_model
from helpers.tiny_tokenizer import tiny_chat_tokenizer


def trainer_with(tmp_path, collator, rows=None, **kw):
    from datasets import Dataset

    from hf_cp.train import CPTrainer, CPTrainingArguments

    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        max_steps=1,
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=500,
        cp_compare_balancer=None,
        cp_profile="cpu",
    )
    ds = Dataset.from_list(rows or synthetic_rows([100, 80, 120]))
    return CPTrainer(model=tiny_model(0), args=args, train_dataset=ds, data_collator=collator, **kw)


def test_a_flattening_collator_is_accepted_with_a_warning_and_never_called(tmp_path, caplog, monkeypatch):
    from transformers import DataCollatorWithFlattening

    calls = []
    original = DataCollatorWithFlattening.__call__
    monkeypatch.setattr(
        DataCollatorWithFlattening, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    with caplog.at_level(logging.WARNING, logger="hf_cp.train.trainer"):
        trainer = trainer_with(tmp_path, DataCollatorWithFlattening())
    warned = [r.getMessage() for r in caplog.records if "DataCollatorWithFlattening" in r.getMessage()]
    assert len(warned) == 1 and "is not called" in warned[0] and "position ids restarting per document" in warned[0]
    trainer.train()
    assert calls == [], "hf_cp builds micro-batches from the plan"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tok: lambda features: features, r"data_collator .*<lambda> is not used by CPTrainer.*datasets\.map"),
        (
            lambda tok: __import__("transformers").DataCollatorForLanguageModeling(tok, mlm=True),
            r"DataCollatorForLanguageModeling is not used by CPTrainer.*mlm=True",
        ),
        (
            lambda tok: __import__("transformers").DataCollatorForLanguageModeling(tok, mlm=False),
            r"replacing the dataset's labels column",
        ),
        (
            lambda tok: __import__("transformers").DataCollatorWithFlattening(position_ids_start=2),
            r"numbers positions from 2",
        ),
    ],
)
def test_collators_whose_effect_is_lost_are_refused_by_name(tmp_path, make, message):
    tok = tiny_chat_tokenizer()
    tok.mask_token = "<pad>"
    with pytest.raises(UnsupportedCollatorError, match=message):
        trainer_with(tmp_path, make(tok))


def test_collators_that_only_pad_are_reproduced():
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, default_data_collator

    tok = tiny_chat_tokenizer()
    assert check_data_collator(None, True) is None
    for c in (default_data_collator, DataCollatorWithPadding(tok)):
        assert "is not called" in check_data_collator(c, has_labels=True)
    # labels = input_ids is what hf_cp trains when the data has no labels column
    assert "as hf_cp does without a labels column" in check_data_collator(
        DataCollatorForLanguageModeling(tok, mlm=False), has_labels=False
    )

    class MyPadding(DataCollatorWithPadding):  # a subclass may do anything: not assumed to only pad
        pass

    with pytest.raises(UnsupportedCollatorError, match="MyPadding"):
        check_data_collator(MyPadding(tok), has_labels=True)


def test_trl_collator_copies_the_labels_trl_built():
    sft = pytest.importorskip("trl.trainer.sft_trainer")  # the optional `trl` extra
    for padding_free in (False, True):
        collator = sft.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free)
        assert "copies their labels" in check_data_collator(collator, has_labels=True)
