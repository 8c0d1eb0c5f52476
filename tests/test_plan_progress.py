"""`hf-cp plan` on large inputs says what it is doing (on stderr, stdout keeps the report), and
reads a plain one-length-per-line trace at numpy speed with the same result and the same errors."""

from __future__ import annotations

import pytest

import hf_cp.cli.plan as plan_cli
from hf_cp.cli import main
from hf_cp.samples.lengths import LengthsError, read_lengths

ARGS = ["--world", "4", "--max-tokens-per-rank", "4096", "--tokens-per-step", "8192", "--steps", "2"]


def lengths_file(tmp_path, n=300):
    p = tmp_path / "lengths.txt"
    p.write_text("".join(f"{(i * 37) % 3000 + 1}\n" for i in range(n)))
    return p


def test_large_inputs_report_progress_on_stderr(tmp_path, capsys, monkeypatch):
    p = lengths_file(tmp_path)
    monkeypatch.setattr(plan_cli, "PROGRESS_MIN_SAMPLES", 200)  # "large", for a test
    assert main(["plan", "--lengths", str(p), *ARGS, "--balancer", "dynamic_cp"]) == 0
    got = capsys.readouterr()
    assert "300 samples; cutting the epoch into steps" in got.err
    assert "steps in the epoch; planning with dynamic_cp (and static)" in got.err
    assert "planning steps" in got.err, "a progress bar over the planned steps"
    assert "simulating and reporting" in got.err
    assert "predicted time / lower bound" in got.out and "planning steps" not in got.out
    monkeypatch.setattr(plan_cli, "PROGRESS_MIN_SAMPLES", 301)  # small inputs stay quiet
    assert main(["plan", "--lengths", str(p), *ARGS]) == 0
    assert capsys.readouterr().err == ""
    assert main(["plan", "--lengths", str(p), *ARGS, "--progress", "on"]) == 0
    assert "reading lengths from" in capsys.readouterr().err


def test_fast_and_line_by_line_readers_agree(tmp_path):
    p = lengths_file(tmp_path, 1000)
    fast = read_lengths(p)
    q = tmp_path / "commented.txt"
    q.write_text("# a comment sends the file through the line-by-line reader\n" + p.read_text())
    assert fast == read_lengths(q) == [(i * 37) % 3000 + 1 for i in range(1000)]
    for text, message in [
        ("5\n7\n0\n", "line 3: length 0 must be positive"),
        ("5\n7 8\n", r"line 2: '7 8' is not an integer"),
        ("5\n-1\n", "line 2: length -1 must be positive"),
    ]:
        bad = tmp_path / "bad.txt"
        bad.write_text(text)
        with pytest.raises(LengthsError, match=message):
            read_lengths(bad)
