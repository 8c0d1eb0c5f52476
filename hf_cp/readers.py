"""The YAML and JSON text hf_cp reads from users' files, read so that no input can hang or crash
the reader, and nothing a file says twice is silently dropped.

YAML (training configs, hardware profiles, `--set` and `--balancer-opt` values): yaml.safe_load's
semantics (the safe loader: no code from files, YAML 1.1 types), and besides

  * a mapping that gives a key twice is refused, naming the key and both lines (safe_load keeps
    the last one silently: two `training:` sections, or `seed:` twice in one);
  * collections nest at most MAX_YAML_DEPTH deep (PyYAML recurses once per level);
  * aliases may add at most MAX_YAML_ALIAS_NODES nodes to the document when expanded: a
    "billion laughs" (anchors of lists of aliases of anchors, 9^9 strings from a 1 KB file) is
    refused while it is read, before anything walks or prints the expanded value; an alias
    inside the node it names (a recursive structure) is refused too.

JSON (plan files, model config.json, JSON-lines inputs): json.loads, with arrays and objects
nested at most MAX_JSON_DEPTH deep (json.loads recurses once per level: 100,000 `[` end in a
RecursionError, and anything that walks a value a thousand levels deep may too).

The errors are the types the callers already handle, without the file's name (the caller names
its file): YAMLInputError is a yaml.YAMLError, a JSON one a json.JSONDecodeError (ValueError).
`brief(value)` is the repr of a value for an error message, cut to a width without building the
whole repr of a huge value first.
"""

from __future__ import annotations

import json
import re
import reprlib
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import yaml

__all__ = [
    "MAX_JSON_DEPTH",
    "check_json_file",
    "MAX_YAML_ALIAS_NODES",
    "YAMLInputError",
    "brief",
    "load_json",
    "load_yaml",
]

MAX_JSON_DEPTH = 100  # hf_cp's own files nest 8 levels (a plan's block layout); config.json files fewer
MAX_YAML_ALIAS_NODES = 100_000  # nodes aliases may add; a config or profile has a few hundred in all
MAX_YAML_DEPTH = 100  # nested collections (PyYAML composes them recursively: 100,000 `[` -> RecursionError)


class YAMLInputError(yaml.YAMLError):
    """A YAML text hf_cp refuses although PyYAML would read it (a duplicate key, an alias bomb)."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


class StrictSafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate mapping keys and oversized alias expansion.

    Both are checked while the document is composed into nodes (before any Python value is
    built): a mapping node's keys as written (a merge key `<<` and the keys it merges are YAML's
    own override, not duplicates), and the expanded size of every node, where an alias counts
    as the expanded size of the node it names."""

    def __init__(self, stream):
        super().__init__(stream)
        self._expanded: Dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded
        self._alias_nodes = 0  # nodes the aliases read so far add to the document
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event() if self.check_event(yaml.AliasEvent) else None
        alias = event.anchor if event is not None else None
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise YAMLInputError(
                f"collections nested deeper than {MAX_YAML_DEPTH} levels at {_where(self.peek_event().start_mark)} "
                "(the most hf_cp reads)"
            )
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if alias is not None:
            size = self._expanded.get(id(node))
            if size is None:  # the anchor's node is still being composed: the alias is inside it
                raise YAMLInputError(
                    f"alias *{alias} at {_where(event.start_mark)} refers to a node that contains it "
                    "(a recursive structure): hf_cp reads no recursive YAML"
                )
            self._alias_nodes += size
            if self._alias_nodes > MAX_YAML_ALIAS_NODES:
                raise YAMLInputError(
                    f"aliases expand to more than {MAX_YAML_ALIAS_NODES:,} nodes (alias *{alias} at "
                    f"{_where(event.start_mark)}): refused as an alias bomb; write the values out instead"
                )
            return node
        if isinstance(node, yaml.SequenceNode):
            size = 1 + sum(self._expanded[id(n)] for n in node.value)
        elif isinstance(node, yaml.MappingNode):
            size = 1 + sum(self._expanded[id(k)] + self._expanded[id(v)] for k, v in node.value)
        else:
            size = 1
        self._expanded[id(node)] = size
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        first: Dict[Any, yaml.Node] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
                continue
            seen = first.setdefault((key.tag, key.value), key)
            if seen is not key:
                raise YAMLInputError(
                    f"duplicate key {key.value!r} at {_where(key.start_mark)} (first at {_where(seen.start_mark)}): "
                    "a key may appear once in a mapping (YAML would keep the last one and drop the first "
                    "silently); remove or merge one of them"
                )
        return node


def _where(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"


def load_yaml(text: Union[str, bytes]) -> Any:
    """yaml.safe_load(text), refusing duplicate keys and alias bombs (YAMLInputError)."""
    loader = StrictSafeLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# ------------------------------------------------------------------ JSON
_JSON_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')  # a JSON string holds no raw line break
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[\[\]{}]')


def _too_deep_at(text: str, limit: int, carry: int = 0) -> Tuple[Optional[int], int]:
    """(the offset where `text` opens its (limit + 1)-th nested array or object, or None; the
    depth at its end), `text` starting at depth `carry`. Brackets inside strings do not count
    (a JSON string holds no raw line break, so text cut at line ends scans piece by piece); the
    scan runs in C (regular expressions, numpy), and looks for the offset only past the limit."""
    bare = _JSON_STRING.sub("", text)
    opens = bare.count("[") + bare.count("{")
    end = carry + opens - bare.count("]") - bare.count("}")
    if carry + opens <= limit:
        return None, end
    import numpy as np

    codes = np.frombuffer(_NOT_BRACKET.sub("", bare).encode("ascii"), dtype=np.uint8)
    depth = carry + np.cumsum(np.where((codes == ord("[")) | (codes == ord("{")), 1, -1))
    if not len(depth) or int(depth.max()) <= limit:
        return None, end
    level = carry
    for m in _TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            level += 1
            if level > limit:
                return m.start(), end
        elif c in "]}":
            level -= 1
    return 0, end


def _too_deep_message(limit: int) -> str:
    return f"arrays and objects nested deeper than {limit} levels (the most hf_cp reads)"


def check_json_file(path: Union[str, Path], max_depth: int = MAX_JSON_DEPTH, chunk_bytes: int = 1 << 22) -> None:
    """ValueError naming the line where a JSON or JSON-lines file (gzip, bz2 or xz compressed
    too) nests arrays and objects deeper than `max_depth`, read in pieces of whole lines: for
    the files another reader parses (pyarrow's JSON reader, under `datasets`, crashes the
    process on 20,000 levels)."""
    import bz2
    import gzip
    import lzma

    p = Path(path)
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(p.suffix.lower(), open)
    depth, lineno = 0, 1
    with opener(p, "rt", encoding="utf-8", errors="replace") as f:
        rest = ""
        while True:
            piece = f.read(chunk_bytes)
            text = rest + piece
            cut = text.rfind("\n") + 1 if piece else len(text)
            text, rest = text[:cut], text[cut:]
            at, depth = _too_deep_at(text, max_depth, depth)
            if at is not None:
                raise ValueError(f"line {lineno + text.count(chr(10), 0, at)}: {_too_deep_message(max_depth)}")
            lineno += text.count("\n")
            if not piece:
                return


def load_json(text: Union[str, bytes, bytearray], max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads(text), refusing arrays and objects nested deeper than `max_depth` with a
    json.JSONDecodeError at the bracket that goes too deep."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode(json.detect_encoding(text), "surrogatepass")
    at, _ = _too_deep_at(text, max_depth)
    if at is not None:
        raise json.JSONDecodeError(_too_deep_message(max_depth), text, at)
    try:
        return json.loads(text)
    except RecursionError:  # a depth the scan let through but this interpreter cannot recurse to
        raise json.JSONDecodeError("arrays and objects nested too deep to read", text, 0) from None


# ------------------------------------------------------------------ values in messages
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxtuple, _BRIEF.maxdict, _BRIEF.maxset = 3, 8, 8, 8, 8
_BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 80, 80, 40


def brief(value: Any, width: int = 80) -> str:
    """repr(value) for an error message, at most about `width` characters: nested values beyond
    a few levels and items beyond the first few are elided as `...` before the repr is built,
    so a huge value (a list of a million items, an expanded alias) costs no more than a small one."""
    text = _BRIEF.repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
