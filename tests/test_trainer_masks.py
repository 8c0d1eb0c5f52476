"""Trainer-level exactness of the data paths: pre-packed rows train like their documents given
one per row (TRL's BFD packing), in one process and in two."""

import pytest
from masked_training import max_relative_error, one_step, run_processes
from test_packed_input import docs_dataset


def packed_and_plain_rows(n_docs=23, seq_length=64):
    trl = pytest.importorskip("trl", reason="TRL is an optional extra (pip install 'hf_cp[trl]')")
    docs = docs_dataset(n_docs)
    packed = trl.pack_dataset(docs, seq_length=seq_length, strategy="bfd")
    return [dict(r) for r in packed], [dict(r) for r in docs]


def test_trl_packed_rows_train_like_their_documents_one_process(tmp_path):
    packed, plain = packed_and_plain_rows()
    a = one_step(packed, str(tmp_path / "packed"), cap=256)
    b = one_step(plain, str(tmp_path / "plain"), cap=256)
    assert a["history"][0]["num_samples"] == b["history"][0]["num_samples"] == len(plain)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert max_relative_error(a["grads"], b["grads"]) < 1e-5
    # the check can fail: the same rows read as one document each give another loss
    as_rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in packed]
    c = one_step(as_rows, str(tmp_path / "rows"), cap=256)
    assert abs(c["loss"] - b["loss"]) > 100 * abs(a["loss"] - b["loss"]) + 1e-5
    assert max_relative_error(c["grads"], b["grads"]) > 1e-2


@pytest.mark.slow
def test_trl_packed_rows_train_like_their_documents_two_processes(tmp_path):
    packed, plain = packed_and_plain_rows(n_docs=31)
    # a cap below the longest document: static zigzag-splits every pack over both ranks
    a = run_processes(dict(rows=packed, out=str(tmp_path / "packed"), cap=32), nproc=2)
    assert a["history"][0]["cp_size_samples"] == {"2": len(plain)}
    b = one_step(plain, str(tmp_path / "plain"), cap=4096)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert max_relative_error(a["grads"], b["grads"]) < 1e-5
