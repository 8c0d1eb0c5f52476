"""Pre-packed rows are unpacked into their documents: from seq_lengths (TRL), cu_seqlens or
restarting position_ids; rows whose boundaries cannot be read are refused with the fix; TRL's
BFD-packed output trains exactly like the same documents given one per row."""

from collections import Counter

import pytest
from helpers.packed_docs import docs_dataset

from hf_cp.samples.packed_input import PackedInputError, row_documents
from hf_cp.train.columns import read_token_columns


def test_each_boundary_column_reads_the_same_documents():
    n = 9
    assert row_documents(n, {"seq_lengths": [4, 2, 3]}) == [4, 2, 3]
    assert row_documents(n, {"cu_seqlens": [0, 4, 6, 9]}) == [4, 2, 3]
    assert row_documents(n, {"cu_seq_lens_q": [[0, 4, 6, 9]]}) == [4, 2, 3]  # a [1, k] tensor as a nested list
    assert row_documents(n, {"position_ids": [0, 1, 2, 3, 0, 1, 0, 1, 2]}) == [4, 2, 3]
    both = {"seq_lengths": [4, 2, 3], "position_ids": [0, 1, 2, 3, 0, 1, 0, 1, 2]}
    assert row_documents(n, both) == [4, 2, 3]
    assert row_documents(n, {"seq_lengths": None}) == [9]  # not given for this row: one document
    assert row_documents(n, {"position_ids": list(range(9))}) == [9]


@pytest.mark.parametrize(
    "boundaries, message",
    [
        ({"seq_lengths": [4, 2, 2]}, r"row 3: seq_lengths \[4, 2, 2\] must be positive document lengths adding up"),
        ({"seq_lengths": [4, 0, 5]}, r"must be positive document lengths"),
        ({"cu_seqlens": [0, 4, 4, 9]}, r"row 3: cu_seqlens \[0, 4, 4, 9\] must rise strictly from 0"),
        ({"cu_seqlens": [1, 4, 9]}, r"must rise strictly from 0"),
        (
            {"position_ids": [0, 1, 2, 3, 5, 6, 0, 1, 2]},
            r"row 3: position_ids neither count up by one nor restart at 0 at token 4",
        ),
        ({"position_ids": [3, 4, 5, 6, 7, 8, 9, 10, 11]}, r"restart at 0 at token 0"),
        ({"position_ids": [0, 1, 2]}, r"row 3: 3 position_ids for 9 input_ids"),
        ({"seq_lengths": "abc"}, r"row 3: column 'seq_lengths' must be a list of integers"),
        (
            {"seq_lengths": [4, 5], "position_ids": [0, 1, 2, 3, 0, 1, 0, 1, 2]},
            r"row 3: seq_lengths gives documents \[4, 5\] but position_ids gives \[4, 2, 3\]",
        ),
    ],
)
def test_unreadable_boundaries_are_refused_with_the_fix(boundaries, message):
    with pytest.raises(PackedInputError, match=message) as e:
        row_documents(9, boundaries, row=3)
    assert "seq_lengths" in str(e.value) and "one per row" in str(e.value)  # says how to fix it


def doc_multiset(cols):
    out = Counter()
    for s in range(len(cols)):
        x, y = cols.fetch(s)
        out[(tuple(x), tuple(y))] += 1
    return out


def test_trl_bfd_packed_rows_unpack_into_the_original_documents():
    trl = pytest.importorskip("trl", reason="TRL is an optional extra (pip install 'hf_cp[trl]')")
    docs = docs_dataset()
    packed = trl.pack_dataset(docs, seq_length=64, strategy="bfd")
    assert "seq_lengths" in packed.column_names and len(packed) < len(docs)
    assert any(len(s) > 1 for s in packed["seq_lengths"])  # rows really hold several documents
    got, ref = read_token_columns(packed), read_token_columns(docs)
    assert sorted(got.lengths) == sorted(ref.lengths) and len(got) == len(docs)
    assert doc_multiset(got) == doc_multiset(ref)
    assert int(got.valid_counts.sum()) == int(ref.valid_counts.sum())
    # as one document per row the same data would train other targets (documents would see each other)
    from datasets import Dataset

    as_rows = Dataset.from_dict({"input_ids": packed["input_ids"], "labels": packed["labels"]})
    assert int(read_token_columns(as_rows).valid_counts.sum()) != int(ref.valid_counts.sum())


def test_position_ids_and_cu_seqlens_columns_unpack_too_and_bad_rows_name_the_row():
    from datasets import Dataset

    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "position_ids": [0, 1, 2, 0, 1]},
        {"input_ids": [6, 7, 8], "position_ids": [0, 1, 2]},
    ]
    cols = read_token_columns(Dataset.from_list(rows))
    assert cols.lengths == [3, 2, 3] and [list(cols.fetch(s)[0]) for s in range(3)] == [[1, 2, 3], [4, 5], [6, 7, 8]]
    assert cols.valid_counts.tolist() == [2, 1, 2]
    cu = read_token_columns(Dataset.from_list([{"input_ids": [1, 2, 3, 4, 5], "cu_seqlens": [0, 2, 5]}]))
    assert cu.lengths == [2, 3]
    bad = rows + [{"input_ids": [1, 2, 3, 4], "position_ids": [0, 1, 3, 4]}]
    with pytest.raises(ValueError, match=r"row 2 of train_dataset: position_ids neither count up"):
        read_token_columns(Dataset.from_list(bad))
    masked = [dict(rows[0], attn_mask='{"kind": "prefix_lm", "length": 5, "prefix": 2}'), dict(rows[1], attn_mask=None)]
    with pytest.raises(ValueError, match=r"pre-packed rows \(column 'position_ids'\) and an 'attn_mask' column"):
        read_token_columns(Dataset.from_list(masked))
