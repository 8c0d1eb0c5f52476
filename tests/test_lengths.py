import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_cp.samples.lengths import LengthsError, read_lengths, step_batches


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=300), st.integers(1, 20000), st.integers(0, 99))
def test_step_batches_cover_each_sample_once_and_respect_budget(lengths, tps, seed):
    batches = step_batches(lengths, tps, seed=seed)
    flat = [s for b in batches for s in b]
    assert sorted(flat) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or sum(lengths[s] for s in b) <= tps
    assert step_batches(lengths, tps, seed=seed) == batches
    if len(set(lengths)) > 5:
        assert step_batches(lengths, tps, seed=seed, epoch=1) != batches or len(batches) == 1


def test_read_lengths_errors_name_the_line(tmp_path):
    p = tmp_path / "l.txt"
    p.write_text("12\n7\nabc\n")
    with pytest.raises(LengthsError, match=r"line 3: 'abc' is not an integer"):
        read_lengths(p)
    p.write_text("12\n0\n")
    with pytest.raises(LengthsError, match="line 2: length 0 must be positive"):
        read_lengths(p)
    p.write_text("\n")
    with pytest.raises(LengthsError, match="no lengths"):
        read_lengths(p)
    with pytest.raises(LengthsError, match="does not exist"):
        read_lengths(tmp_path / "missing.txt")


def test_read_lengths_from_saved_dataset(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"length": [3, 9, 27], "input_ids": [[1] * 3, [1] * 9, [1] * 27]}).save_to_disk(tmp_path / "ds")
    assert read_lengths(tmp_path / "ds") == [3, 9, 27]
    Dataset.from_dict({"input_ids": [[1]]}).save_to_disk(tmp_path / "nolen")
    with pytest.raises(LengthsError, match="no 'length' column"):
        read_lengths(tmp_path / "nolen")
