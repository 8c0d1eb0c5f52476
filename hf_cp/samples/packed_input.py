"""Pre-packed rows: a dataset row that holds several documents back to back is unpacked into
its documents, so the balancer plans real documents and no document attends to another.

A row says where its documents begin in one of these columns (several may be present; they
must agree):
    seq_lengths    the documents' lengths (TRL's `packing=True`, strategies bfd / bfd_split)
    cu_seqlens     cumulative boundaries [0, l1, l1 + l2, ..., row length]
                   (also read under the names cu_seq_lens_q and cu_seq_lens)
    position_ids   positions that restart at 0 where a document begins and count up by one
                   inside it (DataCollatorWithFlattening's convention)
A row without any of them is one document, as before. A row whose boundaries cannot be read
(lengths that do not add up to the row, positions that jump) is refused with the fix. Rows of a
dataset without any of them that hold the EOS token before their last token look packed
(interior_eos): the reader warns, naming them, since each trains as one document.

Targets never cross a boundary: every document's last token predicts nothing (TRL sets the
label of every document's first token to -100 for the same reason).
Pure Python and numpy.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

# column name -> how its value reads
BOUNDARY_COLUMNS = ("seq_lengths", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens", "position_ids")

FIX = (
    "give each packed row its documents' lengths in a 'seq_lengths' column (what TRL's packing writes), or "
    "cumulative boundaries in 'cu_seqlens', or position_ids that restart at 0 for every document; or pass "
    "the documents unpacked, one per row (CPTrainer packs them itself)"
)


class PackedInputError(ValueError):
    """A packed row's document boundaries cannot be read; the message names the row and the fix."""


def boundary_columns(column_names: Optional[Sequence[str]]) -> List[str]:
    """The boundary columns a dataset has, in BOUNDARY_COLUMNS order."""
    return [c for c in BOUNDARY_COLUMNS if column_names is not None and c in column_names]


def _as_ints(value, row: object, column: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError):
        raise PackedInputError(
            f"row {row}: column {column!r} must be a list of integers, got {value!r:.80}; {FIX}"
        ) from None
    if arr.ndim == 2 and arr.shape[0] == 1:  # a [1, n] tensor saved as a nested list
        arr = arr[0]
    if arr.ndim != 1:
        raise PackedInputError(
            f"row {row}: column {column!r} must be a flat list of integers, got shape {arr.shape}; {FIX}"
        )
    return arr


def _from_seq_lengths(value, n: int, row: object, column: str) -> List[int]:
    lens = _as_ints(value, row, column)
    if len(lens) == 0 or (lens <= 0).any() or int(lens.sum()) != n:
        raise PackedInputError(
            f"row {row}: {column} {lens.tolist()[:20]} must be positive document lengths adding up to the row's "
            f"{n} input_ids (they add up to {int(lens.sum())}); {FIX}"
        )
    return lens.tolist()


def _from_cu_seqlens(value, n: int, row: object, column: str) -> List[int]:
    cu = _as_ints(value, row, column)
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or (np.diff(cu) <= 0).any():
        raise PackedInputError(
            f"row {row}: {column} {cu.tolist()[:20]} must rise strictly from 0 to the row's {n} input_ids; {FIX}"
        )
    return np.diff(cu).tolist()


def _from_position_ids(value, n: int, row: object, column: str) -> List[int]:
    pos = _as_ints(value, row, column)
    if len(pos) != n:
        raise PackedInputError(f"row {row}: {len(pos)} position_ids for {n} input_ids; {FIX}")
    if n == 0:
        return []
    starts = np.flatnonzero(pos == 0)
    ok = pos[0] == 0 and bool((np.diff(pos)[pos[1:] != 0] == 1).all())
    if not ok:
        bad = 0 if pos[0] != 0 else 1 + int(np.flatnonzero((np.diff(pos) != 1) & (pos[1:] != 0))[0])
        raise PackedInputError(
            f"row {row}: position_ids neither count up by one nor restart at 0 at token {bad} "
            f"(... {pos[max(0, bad - 2) : bad + 2].tolist()} ...), so hf_cp cannot tell where its documents begin; {FIX}"
        )
    return np.diff(np.append(starts, n)).tolist()


_READERS = {
    "seq_lengths": _from_seq_lengths,
    "cu_seqlens": _from_cu_seqlens,
    "cu_seq_lens_q": _from_cu_seqlens,
    "cu_seq_lens": _from_cu_seqlens,
    "position_ids": _from_position_ids,
}


def row_documents(n_tokens: int, boundaries: dict, row: object = "?") -> List[int]:
    """The document lengths of one row of `n_tokens` tokens; `boundaries` maps boundary column
    names to the row's values (None = not given for this row). Several columns must agree."""
    found = {c: _READERS[c](v, n_tokens, row, c) for c, v in boundaries.items() if v is not None}
    if not found:
        return [n_tokens]
    (first, docs), *rest = found.items()
    for c, other in rest:
        if other != docs:
            raise PackedInputError(
                f"row {row}: {first} gives documents {docs[:10]} but {c} gives {other[:10]}; they must agree ({FIX})"
            )
    return docs


EOS_ROWS_NAMED = 5  # rows named in the interior-EOS warning before "and N more"


def interior_eos(offsets: np.ndarray, flat: np.ndarray, eos_ids: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Rows that hold an EOS token before their last token (ascending), and how many each.
    `flat` holds the rows' tokens back to back, row r at flat[offsets[r]:offsets[r + 1]].
    Vectorised: one pass over the tokens, then work only for the EOS tokens found."""
    pos = np.flatnonzero(np.isin(flat, np.asarray(list(eos_ids))))
    if len(pos) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    rows = np.searchsorted(offsets, pos, side="right") - 1  # the row each EOS token sits in
    inside = pos < offsets[rows + 1] - 1  # not the row's last token
    return np.unique(rows[inside], return_counts=True)


# written into a dataset's info.description by `hf-cp preprocess`: each row is one document (a
# chat's turns may end with EOS inside it), so an interior EOS is no sign of packing
ONE_DOCUMENT_PER_ROW = "hf_cp preprocess: one document per row"


def rows_are_documents(ds) -> bool:
    """Whether `ds` says its rows are one document each (ONE_DOCUMENT_PER_ROW in its info)."""
    info = getattr(ds, "info", None)
    return ONE_DOCUMENT_PER_ROW in (getattr(info, "description", None) or "")


def interior_eos_warning(
    name: str, rows: np.ndarray, counts: np.ndarray, n_rows: int, eos_ids: Sequence[int]
) -> Optional[str]:
    """The set-up warning for rows that look packed but say nothing of their documents (None: no such row)."""
    if len(rows) == 0:
        return None
    k = EOS_ROWS_NAMED
    named = ", ".join(f"row {int(r)}: {int(c)}" for r, c in zip(rows[:k], counts[:k]))
    more = f" and {len(rows) - k} more rows" if len(rows) > k else ""
    return (
        f"{name}: {len(rows)} of {n_rows} rows hold the EOS token (id {' or '.join(str(i) for i in eos_ids)}) "
        f"before their last token ({int(counts.sum())} in all: {named}{more}), and the dataset has no document "
        f"boundaries, so each such row trains as ONE document whose parts attend to each other. If the rows are "
        f"packed documents, {FIX}. If EOS belongs inside them (chat turns that end with it), nothing to do"
    )
