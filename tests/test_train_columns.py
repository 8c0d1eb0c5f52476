"""The token columns CPTrainer reads from a dataset (hf_cp/train/columns.py)."""

from __future__ import annotations

from helpers.harness.models import synthetic_rows


def test_data_digest_sees_tokens_targets_and_order():
    from datasets import Dataset

    from hf_cp.train.columns import read_token_columns

    rows = synthetic_rows([40, 40, 33, 40, 7], seed=1)
    base = read_token_columns(Dataset.from_list(rows)).digest()
    assert base == read_token_columns(Dataset.from_list([dict(r) for r in rows])).digest()
    remasked = [dict(r, labels=list(r["input_ids"])) for r in rows]  # prompts now carry loss
    assert read_token_columns(Dataset.from_list(remasked)).digest() != base
    swapped = [rows[1], rows[0]] + rows[2:]  # same lengths, another order
    assert read_token_columns(Dataset.from_list(swapped)).digest() != base
    retokenised = [dict(rows[0], input_ids=[(t + 1) % 256 for t in rows[0]["input_ids"]])] + rows[1:]
    assert read_token_columns(Dataset.from_list(retokenised)).digest() != base
