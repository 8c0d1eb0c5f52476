"""Token ids and labels outside the model's vocabulary are refused at set-up, naming the sample
(before: the launch died on every rank with torch's "IndexError: index out of range in self" at
the first embedding lookup, no sample named). The same check runs in CPTrainer, on streams, on
evaluation data and in `hf-cp train --dry-run`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datasets import Dataset

from hf_cp.train.data.columns import model_vocab_size, read_token_columns
from hf_cp.train.data.streaming import stream_sample
from hf_cp.train.launch.dry_run import dry_run

from helpers.harness.models import ROOT, synthetic_rows, tiny_model

TINY = str(ROOT / "configs" / "tiny-cpu.yaml")
VOCAB = 256  # the tiny llama's byte-level vocabulary


def _rows(bad_row: int, column: str, value: int, at: int = 5):
    rows = synthetic_rows([40, 30, 50, 20])
    rows[bad_row][column] = list(rows[bad_row][column])
    rows[bad_row][column][at] = value
    return rows


@pytest.mark.parametrize(
    "column, value",
    [("input_ids", VOCAB), ("input_ids", -1), ("labels", VOCAB + 7), ("labels", -5)],
)
def test_an_id_outside_the_vocabulary_is_named_by_row_position_and_value(column, value):
    ds = Dataset.from_list(_rows(2, column, value))
    with pytest.raises(ValueError) as err:
        read_token_columns(ds, "train_dataset", vocab_size=VOCAB)
    text = str(err.value)
    assert f"train_dataset row 2, column {column!r}: token id {value} at position 5 is outside" in text, text
    assert "vocab_size 256" in text
    # without a vocabulary nothing is checked (what a tokenizer-less caller gets)
    assert len(read_token_columns(ds, "train_dataset")) == 4


def test_the_ignored_label_and_the_last_id_are_in_range():
    rows = _rows(1, "labels", -100)
    rows[3]["input_ids"] = list(rows[3]["input_ids"])
    rows[3]["input_ids"][0] = VOCAB - 1
    assert len(read_token_columns(Dataset.from_list(rows), vocab_size=VOCAB)) == 4


def test_stream_samples_are_checked_as_they_are_read():
    row = _rows(0, "input_ids", 999)[0]
    with pytest.raises(ValueError, match=r"train_dataset stream sample 7, column 'input_ids': token id 999"):
        stream_sample({k: np.asarray(v) for k, v in row.items()}, 7, vocab_size=VOCAB)
    assert stream_sample(_rows(0, "input_ids", 3)[0], 7, vocab_size=VOCAB).length == 40


def test_the_vocabulary_is_the_models_embedding_even_when_resized():
    model = tiny_model(0)
    assert model_vocab_size(model) == model.config.vocab_size == VOCAB
    model.resize_token_embeddings(300)
    assert model_vocab_size(model) == 300
    assert model_vocab_size(None, model.config) == 300


def test_cptrainer_refuses_the_sample_at_set_up(tmp_path):
    from hf_cp.train import CPTrainer, CPTrainingArguments

    args = CPTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        max_steps=1,
        cp_max_tokens_per_rank=256,
        cp_tokens_per_step=200,
        cp_compare_balancer=None,
    )
    with pytest.raises(ValueError, match=r"train_dataset row 3, column 'input_ids': token id 256 at position 5"):
        CPTrainer(model=tiny_model(0), args=args, train_dataset=Dataset.from_list(_rows(3, "input_ids", VOCAB)))


def test_the_dry_run_refuses_it_naming_the_row(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _rows(1, "labels", 4096)) + "\n")
    out = [f"training.output_dir={tmp_path}", "data.bundled=null", f"data.path={data}", "data.eval_split=null"]
    with pytest.raises(ValueError, match=r"train_dataset row 1, column 'labels': token id 4096 at position 5"):
        dry_run(TINY, out, world_size=2, steps=1)


def test_after_an_eval_split_the_error_also_names_the_files_row(tmp_path):
    """data.eval_split shuffles rows out: the row of the split is named with the file's row (before:
    only the index after the split, which is not the file's row)."""
    rows = [dict(r, input_ids=list(r["input_ids"])) for r in synthetic_rows([20 + i for i in range(10)])]
    rows[7]["input_ids"][3] = 4096
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = [f"training.output_dir={tmp_path}", "data.bundled=null", f"data.path={data}", "data.eval_split=0.2"]
    with pytest.raises(
        ValueError, match=r"train_dataset row (\d+) \(row 7 of the data it was split from\), column"
    ) as err:
        dry_run(TINY, out, world_size=2, steps=1)
    assert "train_dataset row 7 " not in str(err.value)  # the split moved it (seed 0)
    # a dataset of its own rows says only its row
    with pytest.raises(ValueError, match=r"train_dataset row 7, column 'input_ids'"):
        read_token_columns(Dataset.from_list(rows), "train_dataset", vocab_size=VOCAB)


def test_data_in_which_no_token_carries_loss_is_refused():
    rows = synthetic_rows([40, 30, 50])
    for r in rows:
        r["labels"] = [-100] * len(r["input_ids"])
    with pytest.raises(ValueError, match=r"no token of train_dataset carries loss: every label is -100 .* all 3"):
        read_token_columns(Dataset.from_list(rows), "train_dataset", vocab_size=VOCAB)
    rows[1]["labels"][-1] = 7  # one target is enough
    assert read_token_columns(Dataset.from_list(rows), vocab_size=VOCAB).valid_counts.sum() == 1
