"""Pre-packed rows are unpacked into their documents: from seq_lengths (TRL), cu_seqlens or
restarting position_ids; rows whose boundaries cannot be read are refused with the fix; TRL's
BFD-packed output trains exactly like the same documents given one per row."""

from collections import Counter

import pytest

from hf_cp.samples.packed_input import PackedInputError, row_documents
from hf_cp.train.data.columns import read_token_columns

from helpers.packed_docs import docs_dataset


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


EOS_ROWS = [
    {"input_ids": [5, 2, 6, 7, 2]},  # one EOS inside, one at the end
    {"input_ids": [5, 6, 2]},  # EOS only at the end: one document
    {"input_ids": [2, 9, 2, 2, 9]},  # three inside
    {"input_ids": [8, 9]},
]


def test_interior_eos_rows_are_found_per_row():
    import numpy as np

    from hf_cp.samples.packed_input import interior_eos

    flat = np.array([r for row in EOS_ROWS for r in row["input_ids"]])
    offsets = np.cumsum([0] + [len(r["input_ids"]) for r in EOS_ROWS])
    rows, counts = interior_eos(offsets, flat, [2])
    assert rows.tolist() == [0, 2] and counts.tolist() == [1, 3]
    rows, counts = interior_eos(offsets, flat, [9, 7])  # several EOS ids (a model config's list)
    assert rows.tolist() == [0, 2] and counts.tolist() == [1, 1]


def test_rows_with_interior_eos_and_no_boundaries_warn_once_naming_the_rows():
    """Issue 27: pre-packed rows without a boundary column trained as one document each, with no
    word; EOS tokens inside a row now say that it looks packed, and how to give its boundaries."""
    from datasets import Dataset

    cols = read_token_columns(Dataset.from_list(EOS_ROWS), "train_dataset", eos_token_ids=2)
    assert cols.lengths == [5, 3, 5, 2]  # still one sample per row: a warning, not a guess
    assert len(cols.warnings) == 1
    warning = cols.warnings[0]
    assert (
        "train_dataset: 2 of 4 rows hold the EOS token (id 2) before their last token (4 in all: row 0: 1, row 2: 3)"
        in warning
    )
    assert "each such row trains as ONE document" in warning and "seq_lengths" in warning and "cu_seqlens" in warning
    # a model config's list of EOS ids; many rows: the first few named, then how many more
    many = Dataset.from_list([{"input_ids": [5, 2, 6]}] * 12)
    (warning,) = read_token_columns(many, "eval_dataset", eos_token_ids=[2, 3]).warnings
    assert "eval_dataset: 12 of 12 rows hold the EOS token (id 2 or 3)" in warning
    assert "row 0: 1, row 1: 1, row 2: 1, row 3: 1, row 4: 1 and 7 more rows" in warning


def test_no_eos_warning_with_boundaries_eos_only_at_row_ends_or_no_eos_id():
    from datasets import Dataset

    assert read_token_columns(Dataset.from_list(EOS_ROWS)).warnings == []  # no EOS id known: no check
    assert read_token_columns(Dataset.from_list(EOS_ROWS[1:2] + EOS_ROWS[3:]), eos_token_ids=2).warnings == []
    packed = [{"input_ids": [5, 2, 6, 7, 2], "seq_lengths": [2, 3]}, {"input_ids": [2, 9], "seq_lengths": [1, 1]}]
    cols = read_token_columns(Dataset.from_list(packed), eos_token_ids=2)
    assert cols.warnings == [] and cols.lengths == [2, 3, 1, 1]
    # a dataset that is not arrow-backed is checked the same way
    plain = type(
        "Rows",
        (),
        {"column_names": ["input_ids"], "__len__": lambda s: 4, "__getitem__": lambda s, c: [r[c] for r in EOS_ROWS]},
    )()
    assert len(read_token_columns(plain, eos_token_ids=2).warnings) == 1


def test_eos_ids_come_from_the_tokenizer_else_the_model_config():
    from types import SimpleNamespace

    from hf_cp.train.data.columns import eos_token_ids

    assert eos_token_ids(SimpleNamespace(eos_token_id=7), SimpleNamespace(eos_token_id=[1, 2])) == (7,)
    assert eos_token_ids(None, SimpleNamespace(eos_token_id=[1, 2])) == (1, 2)
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace(eos_token_id=3)) == (3,)
    assert eos_token_ids(None, SimpleNamespace()) == ()


def test_the_dry_run_reports_interior_eos_rows(tmp_path):
    """tiny-llama's config has eos_token_id 2: packed rows in a .jsonl are named before a launch."""
    import json
    from pathlib import Path

    from hf_cp.train.launch.dry_run import dry_run

    data = tmp_path / "packed.jsonl"
    rows = [{"input_ids": ([5] * 40 + [2]) * 3} for _ in range(8)] + [{"input_ids": [5] * 100 + [2]}] * 8
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tiny = str(Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml")
    overrides = [f"training.output_dir={tmp_path}", "data.bundled=null", f"data.path={data}", "data.eval_split=null"]
    text = "\n".join(dry_run(tiny, overrides, world_size=2, steps=2))
    assert "warning: train_dataset: 8 of 16 rows hold the EOS token (id 2) before their last token (16 in all" in text
