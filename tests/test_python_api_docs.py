"""The Python snippets users copy run as they stand: every ```python block of the README and of
docs/python_api.md is executed literally (in a scratch folder), so that a renamed argument or a
missing import fails here, not on a user's first try. A block shared by both files runs once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = ("README.md", "docs/python_api.md")


def python_blocks(path: Path):
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)]


def distinct_blocks():
    seen = {}
    for name in FILES:
        for k, block in enumerate(python_blocks(ROOT / name)):
            seen.setdefault(block, f"{name}#{k + 1}")
    return [(where, block) for block, where in seen.items()]


def test_the_docs_have_python_snippets_and_the_readme_shows_the_documented_one():
    docs = python_blocks(ROOT / "docs" / "python_api.md")
    assert docs, "docs/python_api.md has a python block"
    assert docs[0] in python_blocks(ROOT / "README.md"), "the README shows the snippet the docs explain"


@pytest.mark.parametrize("where, block", distinct_blocks(), ids=[w for w, _ in distinct_blocks()])
def test_python_snippet_runs(where, block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative output folders land in the scratch folder
    exec(compile(block, where, "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    if "cp_summary" in block:
        assert re.search(r"steps \d+, samples \d+, tokens \d+", out), out[-2000:]
    if "save_model(" in block:
        saved = re.search(r'save_model\("([^"]+)"\)', block).group(1)
        assert (tmp_path / saved / "config.json").exists(), f"{where} saves the model to {saved}"
