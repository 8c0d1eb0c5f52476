"""The token columns CPTrainer reads from a dataset (hf_cp/train/data/columns.py)."""

from __future__ import annotations

import re

import pytest

from helpers.harness.models import synthetic_rows


def test_data_digest_sees_tokens_targets_and_order():
    from datasets import Dataset

    from hf_cp.train.data.columns import read_token_columns

    rows = synthetic_rows([40, 40, 33, 40, 7], seed=1)
    base = read_token_columns(Dataset.from_list(rows)).digest()
    assert base == read_token_columns(Dataset.from_list([dict(r) for r in rows])).digest()
    remasked = [dict(r, labels=list(r["input_ids"])) for r in rows]  # prompts now carry loss
    assert read_token_columns(Dataset.from_list(remasked)).digest() != base
    swapped = [rows[1], rows[0]] + rows[2:]  # same lengths, another order
    assert read_token_columns(Dataset.from_list(swapped)).digest() != base
    retokenised = [dict(rows[0], input_ids=[(t + 1) % 256 for t in rows[0]["input_ids"]])] + rows[1:]
    assert read_token_columns(Dataset.from_list(retokenised)).digest() != base


class _Columns:
    """A dataset that is not arrow-backed: column access and length only."""

    def __init__(self, rows):
        self.rows = rows
        self.column_names = list(rows[0])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, column):
        return [r.get(column) for r in self.rows]


def _datasets(rows):
    from datasets import Dataset

    return [Dataset.from_list(rows), _Columns(rows)]


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [5, 6, 7], "labels": [-100, 1.5, 7]}],
            "train_dataset row 1, column 'labels': expected integers (token ids, -100 for no loss), got 1.5 at "
            "position 1",
        ),
        (
            [{"input_ids": [5, 6, 7], "labels": ["a", "b", "c"]}],
            "train_dataset row 0, column 'labels': expected integers (token ids, -100 for no loss), got 'a'",
        ),
        (
            [{"input_ids": [5, 6, 7], "labels": None}, {"input_ids": [5, 6, 7], "labels": [2.0, 3.0, 4.0]}],
            "train_dataset row 1, column 'labels': expected integers (token ids, -100 for no loss), got 2.0 at "
            "position 0 (floats are refused even when integral",
        ),
        (
            [{"input_ids": [5, 6.5, 7]}],
            "train_dataset row 0, column 'input_ids': expected integers (token ids), got 6.5 at position 1",
        ),
    ],
)
def test_non_integer_token_columns_are_refused_naming_the_row_and_column(rows, message):
    """Issue 27: float labels were truncated (1.5 -> 1) or failed inside numpy without a row named."""
    from hf_cp.train.data.columns import read_token_columns

    for ds in _datasets(rows):
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            read_token_columns(ds)
        assert "cast" in str(e.value)  # says how to fix it


def test_integer_columns_of_any_width_and_null_labels_are_read():
    from hf_cp.train.data.columns import read_token_columns

    rows = [{"input_ids": [5, 6, 7], "labels": None}, {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}]
    for ds in _datasets(rows):
        assert read_token_columns(ds).valid_counts.tolist() == [2, 2]
