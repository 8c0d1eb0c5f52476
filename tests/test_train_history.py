"""Per-rank history files (hf_cp/train/measure/step_record.py): a line torn by a kill is skipped with a
warning when it is the last one; a bad line anywhere else is an error naming file and line."""

import json

import pytest

from hf_cp.train.measure.step_record import HistoryError, append_record, history_path, latest_records, read_history

from helpers.step_records import records


def _write_two_steps(tmp_path):
    for rec in records(world=2, steps=2):
        append_record(tmp_path, rec.for_rank(0, [0], [0.0, 1.0]))
    return history_path(tmp_path, 0)


def test_a_torn_last_line_is_skipped_with_a_warning_naming_it(tmp_path):
    path = _write_two_steps(tmp_path)
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[0][:37])  # a kill in the middle of the third append
    with pytest.warns(UserWarning, match=rf"{path}, line 3: skipped a torn last line"):
        recs = latest_records(path)
    assert [r.index for r in recs] == [0, 1]


def test_a_bad_line_that_is_not_the_torn_tail_is_an_error_naming_file_and_line(tmp_path):
    path = _write_two_steps(tmp_path)
    lines = path.read_text().splitlines()
    path.write_text(lines[0][:20] + "\n" + lines[1] + "\n")  # complete lines, the first one broken
    with pytest.raises(HistoryError, match=rf"{path}, line 1: not a JSON step record"):
        list(read_history(path))
    # a broken last line that did end with a newline was written whole: not a torn append
    path.write_text(lines[0] + "\n" + lines[1][:20] + "\n")
    with pytest.raises(HistoryError, match=rf"{path}, line 2"):
        list(read_history(path))


def test_whole_files_read_back_every_record(tmp_path):
    path = _write_two_steps(tmp_path)
    assert [json.loads(ln)["index"] for ln in path.read_text().splitlines()] == [0, 1]
    assert [r.index for _, r in read_history(path)] == [0, 1]


def test_a_resume_drops_the_torn_line_so_new_records_start_on_a_line_of_their_own(tmp_path):
    from hf_cp.train.measure.step_record import truncate_history

    path = _write_two_steps(tmp_path)
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[0][:37])
    with pytest.warns(UserWarning, match="torn last line"):
        assert truncate_history(path, steps_done=2) == 1  # the torn line goes; both whole steps stay
    assert path.read_text() == whole
    for rec in records(world=2, steps=3)[2:]:
        append_record(tmp_path, rec.for_rank(0, [0], [0.0, 1.0]))
    assert [r.index for _, r in read_history(path)] == [0, 1, 2]
