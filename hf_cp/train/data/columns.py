"""The token columns of a tokenised dataset, read and checked once: lengths for planning,
valid-target counts for the loss normaliser, masks, and sample lookup for the collator.

A *sample* is one document. A dataset row is one sample, except a pre-packed row (one with
document boundaries: packed_input.py), which is unpacked into its documents: sample ids then
number the documents in row order. A row may carry an attention mask in the `attn_mask`
column (hf_cp/mask_column.py; absent or null = causal), validated here against its length.

input_ids and labels must be integers: a float (even an integral one, 2.0) or a string is
refused naming the row, the column and the value, before numpy would truncate or choke on it.
Rows of a dataset without boundary columns that hold the EOS token before their last token look
packed: a warning (TokenColumns.warnings) names them (packed_input.interior_eos).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hf_cp.samples.mask_column import MASK_COLUMN, decode_mask_column, masks_digest_items
from hf_cp.samples.masks import MaskError, SampleMask
from hf_cp.samples.packed_input import (
    PackedInputError,
    boundary_columns,
    interior_eos,
    interior_eos_warning,
    row_documents,
    rows_are_documents,
)
from hf_cp.samples.targets import sample_valid_targets
from hf_cp.train.data.collator import IGNORE_INDEX, valid_targets
from hf_cp.train.data.vision_rows import VisionFn


@dataclass
class TokenColumns:
    lengths: List[int]
    valid_counts: np.ndarray  # per sample: targets that carry loss
    input_ids: Sequence
    labels: Sequence  # None entries: every next token is a target
    masks: Dict[int, SampleMask] = field(default_factory=dict)  # sample id -> non-causal mask
    # pre-packed rows: per sample (document), its row and first token in the row; None when
    # every row is one sample
    doc_rows: Optional[np.ndarray] = None
    doc_starts: Optional[np.ndarray] = None
    # set-up warnings about the data (rows that look packed but carry no boundaries), for the
    # caller to log once
    warnings: List[str] = field(default_factory=list)
    # a vision-language dataset: sample id -> its images and clips (setup/vision_setup.py); None: text only
    vision: Optional[VisionFn] = None

    _digest: Optional[str] = field(default=None, repr=False)

    # rows whose tokens enter the digest: enough to tell another tokeniser, template or order
    # apart, few enough to cost nothing on a billion-token dataset
    DIGEST_ROWS = 256

    def fetch(self, sid: int):
        if self.doc_rows is None:
            return self.input_ids[sid], self.labels[sid]
        row, start = int(self.doc_rows[sid]), int(self.doc_starts[sid])
        end = start + self.lengths[sid]
        labels = self.labels[row]
        return self.input_ids[row][start:end], None if labels is None else labels[start:end]

    def digest(self) -> str:
        """Fingerprint of the training data as the loss sees it: every sample's length and
        number of loss-carrying targets, its mask, plus the tokens and labels of DIGEST_ROWS
        evenly spaced samples. Ranks compare it at start-up; checkpoints keep it (re-masked prompts keep
        the lengths but change the targets)."""
        if self._digest is None:
            h = hashlib.sha256()
            h.update(np.asarray(self.lengths, dtype=np.int64).tobytes())
            h.update(np.asarray(self.valid_counts, dtype=np.int64).tobytes())
            n = len(self.lengths)
            for i in sorted({int(k) for k in np.linspace(0, n - 1, min(n, self.DIGEST_ROWS))}):
                ids, labels = self.fetch(i)
                h.update(np.asarray(ids, dtype=np.int64).tobytes())
                if labels is not None:
                    h.update(np.asarray(labels, dtype=np.int64).tobytes())
            for sid, text in masks_digest_items(self.masks):  # nothing for mask-free data: digests unchanged
                h.update(f"{sid}:{text};".encode())
            self._digest = h.hexdigest()
        return self._digest

    def __len__(self) -> int:
        return len(self.lengths)


def model_vocab_size(model=None, model_config=None) -> Optional[int]:
    """The number of token ids `model` (or `model_config`) embeds: its input embedding's rows
    (a resized embedding included; nn.Embedding keeps num_embeddings under ZeRO-3's
    partitioning), else the config's vocab_size (of its text config for a multimodal one)."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        emb = None
    n = getattr(emb, "num_embeddings", None)
    if isinstance(n, int) and n > 0:
        return n
    config = model_config if model_config is not None else getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        v = getattr(c, "vocab_size", None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def eos_token_ids(tokenizer=None, model_config=None) -> Tuple[int, ...]:
    """The EOS ids a packed row's documents end with: the tokenizer's (what tokenisation appends),
    else the model config's eos_token_id (an id or a list of ids); () when neither names one."""
    for source in (tokenizer, model_config):
        value = getattr(source, "eos_token_id", None)
        values = value if isinstance(value, (list, tuple)) else [value]
        ids = tuple(int(v) for v in values if isinstance(v, (int, np.integer)) and not isinstance(v, bool))
        if ids:
            return ids
    return ()


# ----------------------------------------------------------------------------- token batches
BATCH_ROWS = 4096  # rows per vectorised batch: bounds the memory of a scan, not its speed


def _arrow_lists(ds, column: str):
    """The column as a pyarrow ChunkedArray of lists in row order, or None (no arrow storage, or
    not one list per row)."""
    with_format = getattr(ds, "with_format", None)
    if with_format is None:
        return None
    import pyarrow as pa  # datasets' storage (a datasets dependency), only for an arrow-backed dataset

    try:
        col = with_format("arrow")[column]
    except Exception:  # noqa: BLE001 - any dataset that cannot give its column as arrow is read row by row
        return None
    if isinstance(col, pa.Array):
        col = pa.chunked_array([col])
    if not isinstance(col, pa.ChunkedArray) or not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        return None
    return col


def row_name(ds, name: str, row: int) -> str:
    """`name row N`, and the row it was read from when `ds` is a split or a selection of other
    data (data.eval_split): there row N is not the file's row N."""
    indices = getattr(ds, "_indices", None)  # a datasets.Dataset's map from its rows to its table's
    if indices is None or row >= indices.num_rows:
        return f"{name} row {row}"
    return f"{name} row {row} (row {indices.column(0)[row].as_py()} of the data it was split from)"


def _token_batches(ds, column: str, rows: Sequence, name: str) -> Iterator[Tuple[int, np.ndarray, np.ndarray]]:
    """(first row, offsets from 0, the rows' tokens back to back) per batch of BATCH_ROWS rows of
    `column`; read from arrow buffers when the dataset has them, else from `rows` (its values;
    None = no tokens)."""
    col = _arrow_lists(ds, column)
    n = len(rows) if col is None else len(col)
    for start in range(0, n, BATCH_ROWS):
        if col is not None:
            part = col.slice(start, BATCH_ROWS).combine_chunks()
            offsets = np.asarray(part.offsets, dtype=np.int64)
            values = part.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
            yield start, offsets - offsets[0], values.to_numpy(zero_copy_only=False)
            continue
        batch = [rows[i] for i in range(start, min(start + BATCH_ROWS, n))]
        for i, r in enumerate(batch):
            if r is not None and (isinstance(r, (str, bytes)) or not hasattr(r, "__len__")):
                raise ValueError(
                    f"CPTrainer: {row_name(ds, name, start + i)}, column {column!r}: expected a list of integers per row, "
                    f"got {r!r:.60}"
                )
        lengths = [0 if r is None else len(r) for r in batch]
        items = list(itertools.chain.from_iterable(r for r in batch if r is not None))
        flat = np.asarray(items)
        if flat.dtype.kind not in "iu":  # not all integers: keep each value as it was, to name the first
            flat = np.array(items, dtype=object)
        yield start, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]), flat


# ------------------------------------------------------------------------------ integer check
def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_integral_float(v) -> bool:
    return isinstance(v, (float, np.floating)) and bool(np.isfinite(v)) and float(v).is_integer()


def _first_non_integer(flat: np.ndarray) -> Tuple[Optional[int], Optional[int]]:
    """(index of the first value that is no integer, index of the first integral float) in `flat`."""
    if flat.dtype.kind in "iu":
        return None, None
    if flat.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(flat) | (flat != np.floor(flat)))
        return (int(bad[0]) if len(bad) else None), (0 if len(flat) else None)
    bad = integral = None
    for i, v in enumerate(flat.tolist() if flat.dtype != object else flat):
        if _is_int(v):
            continue
        if _is_integral_float(v):
            integral = i if integral is None else integral
            continue
        bad = i
        break
    return bad, integral


INTEGER_FIX = (
    "cast the column to integers, e.g. ds = ds.cast_column({column!r}, Sequence(Value('int64'))) "
    "(Sequence, Value from datasets), or fix the tokenisation that wrote it"
)


def _declared_integers(ds, column: str) -> bool:
    """Whether a `datasets` dataset declares `column` a list of integers (its features), so that
    its values need no reading."""
    features = getattr(ds, "features", None)
    feature = features.get(column) if hasattr(features, "get") else None
    inner = feature[0] if isinstance(feature, list) and len(feature) == 1 else getattr(feature, "feature", None)
    dtype = str(getattr(inner, "dtype", ""))
    return dtype == "null" or dtype.startswith(("int", "uint"))


def check_integer_column(ds, column: str, rows: Sequence, name: str) -> None:
    """Every value of `column` (one list per row, or None) is an integer; otherwise a ValueError
    names `name`, the row, the column, the value and its position. A column the dataset declares
    integer (its features) is taken at its word, without reading its values."""
    if _declared_integers(ds, column):
        return
    what = "token ids, -100 for no loss" if column == "labels" else "token ids"
    integral = None  # (row, position, value) of the first integral float: refused if nothing worse is found
    for start, offsets, flat in _token_batches(ds, column, rows, name):
        bad, first_float = _first_non_integer(flat)
        for index, is_float in ((bad, False), (first_float, True)):
            if index is None or (is_float and integral is not None):
                continue
            row = int(np.searchsorted(offsets, index, side="right") - 1)
            where = (row_name(ds, name, start + row), index - int(offsets[row]), flat[index])
            if not is_float:
                raise ValueError(_integer_message(column, what, *where, integral=False))
            integral = where
    if integral is not None:
        raise ValueError(_integer_message(column, what, *integral, integral=True))


def _integer_message(column: str, what: str, row: str, pos: int, value, integral: bool) -> str:
    value = value.item() if isinstance(value, np.generic) else value
    note = (
        " (floats are refused even when integral, as here: a float column means the data went through a "
        "float conversion somewhere)"
        if integral
        else ""
    )
    return (
        f"CPTrainer: {row}, column {column!r}: expected integers ({what}), got {value!r:.60} at position "
        f"{pos}{note}; {INTEGER_FIX.format(column=column)}"
    )


def token_range_problem(flat: np.ndarray, vocab_size: int, labels: bool) -> Optional[int]:
    """Index in `flat` (integer tokens) of the first id outside the vocabulary [0, vocab_size)
    (labels may also be IGNORE_INDEX), or None."""
    if len(flat) == 0:
        return None
    bad = (flat < 0) | (flat >= vocab_size)
    if labels:
        bad &= flat != IGNORE_INDEX
    found = np.flatnonzero(bad)
    return int(found[0]) if len(found) else None


def token_range_message(where: str, column: str, pos: int, value: int, vocab_size: int) -> str:
    """`where`: the row or sample ("train_dataset row 3")."""
    allowed = f"0..{vocab_size - 1}" + (f" or {IGNORE_INDEX} for no loss" if column == "labels" else "")
    return (
        f"CPTrainer: {where}, column {column!r}: token id {value} at position {pos} is outside the model's "
        f"vocabulary ({allowed}; vocab_size {vocab_size}); the embedding lookup would fail with 'index out of "
        f"range'. Tokenise with the model's own tokenizer, or fix the model's vocab_size"
    )


def check_token_range(ds, column: str, rows: Sequence, name: str, vocab_size: Optional[int]) -> None:
    """Every id of `column` is in the model's vocabulary (labels: or IGNORE_INDEX); a ValueError
    names the row, the position and the id. Vectorised over batches; None checks nothing."""
    if not vocab_size:
        return
    for start, offsets, flat in _token_batches(ds, column, rows, name):
        index = token_range_problem(np.asarray(flat, dtype=np.int64), vocab_size, column == "labels")
        if index is not None:
            row = int(np.searchsorted(offsets, index, side="right") - 1)
            pos = index - int(offsets[row])
            raise ValueError(
                token_range_message(row_name(ds, name, start + row), column, pos, int(flat[index]), vocab_size)
            )


def check_interior_eos(
    ds, rows: Sequence, eos_ids: Sequence[int], name: str, masked: Sequence[int] = ()
) -> Optional[str]:
    """The warning for rows whose input_ids hold an EOS token before their last token (rows that
    look packed, in a dataset without boundary columns), or None. Rows in `masked` carry their
    own segments (a shared-prompt sample's answers each end with EOS) and are not counted.
    Vectorised over batches. None for data that says its rows are documents (hf-cp preprocess's)."""
    if not eos_ids or rows_are_documents(ds):
        return None
    found_rows, found_counts = [], []
    for start, offsets, flat in _token_batches(ds, "input_ids", rows, name):
        r, c = interior_eos(offsets, flat, eos_ids)
        found_rows.append(r + start)
        found_counts.append(c)
    if not found_rows:
        return None
    found, counts = np.concatenate(found_rows), np.concatenate(found_counts)
    keep = ~np.isin(found, np.asarray(list(masked), dtype=np.int64))
    if not keep.any():
        return None
    return interior_eos_warning(name, found[keep], counts[keep], len(rows), eos_ids)


def check_some_loss(valid_counts: Sequence[int], name: str) -> None:
    """Refuse data in which no token carries loss: every label -100 (or masked) trains at loss 0,
    silently, and an evaluation of it would report nothing."""
    if len(valid_counts) and int(np.sum(valid_counts)) == 0:
        raise ValueError(
            f"CPTrainer: no token of {name} carries loss: every label is {IGNORE_INDEX} (or masked) in all "
            f"{len(valid_counts)} samples, so training would run at loss 0 and learn nothing. Check the prompt "
            f"masking of the preprocessing (hf-cp preprocess masks the prompt, not the answer)"
        )


def check_token_ids(ds, name: str, vocab_size: Optional[int]):
    """Every value of input_ids (and of labels, where the rows have them) is an integer id in the
    vocabulary (check_integer_column, check_token_range). Returns (input_ids, labels) as read,
    labels None per row without the column."""
    cols = getattr(ds, "column_names", None)
    has_labels = cols is not None and "labels" in cols
    ids_col = ds["input_ids"]
    labels_col: Sequence[Optional[Sequence[int]]] = ds["labels"] if has_labels else [None] * len(ds)
    check_integer_column(ds, "input_ids", ids_col, name)
    check_token_range(ds, "input_ids", ids_col, name, vocab_size)
    if has_labels:
        check_integer_column(ds, "labels", labels_col, name)
        check_token_range(ds, "labels", labels_col, name, vocab_size)
    return ids_col, labels_col


def read_token_columns(
    ds,
    name: str = "train_dataset",
    eos_token_ids: Sequence[int] | int = (),
    vocab_size: Optional[int] = None,
    training: bool = True,
) -> TokenColumns:
    """`ds` needs input_ids per row; optional labels (-100 = no loss), length, attn_mask, and
    document boundaries of pre-packed rows (packed_input.py). Errors name `name` and the
    sample (or the row). `eos_token_ids` (eos_token_ids(): the tokenizer's or the model
    config's): rows holding one before their last token, without boundaries, are warned about
    (TokenColumns.warnings); () checks nothing. `vocab_size` (model_vocab_size()): every id
    must be below it (check_token_range). `training`: some token must carry loss (check_some_loss;
    evaluation data has its own check, per batch)."""
    cols = getattr(ds, "column_names", None)
    if cols is not None and "input_ids" not in cols:
        raise ValueError(f"CPTrainer: {name} has no 'input_ids' column (columns: {cols}); tokenise it first")
    n = len(ds)
    if n == 0:
        raise ValueError(f"CPTrainer: {name} is empty")
    ids_col, labels_col = check_token_ids(ds, name, vocab_size)
    row_lengths = []
    for i in range(n):
        x, y = ids_col[i], labels_col[i]
        if len(x) == 0:
            raise ValueError(f"CPTrainer: {name} sample {i} has no tokens (empty input_ids)")
        if y is not None and len(y) != len(x):
            raise ValueError(f"CPTrainer: {name} sample {i} has {len(x)} input_ids but {len(y)} labels")
        row_lengths.append(len(x))
    if cols is not None and "length" in cols:
        given = ds["length"]
        bad = next((i for i in range(n) if int(given[i]) != row_lengths[i]), None)
        if bad is not None:
            raise ValueError(
                f"CPTrainer: {name} sample {bad} has length column {given[bad]} but {row_lengths[bad]} input_ids"
            )
    packed = boundary_columns(cols)
    mask_values = ds[MASK_COLUMN] if cols is not None and MASK_COLUMN in cols else None
    if packed:
        if mask_values is not None and any(v is not None for v in mask_values):
            raise ValueError(
                f"CPTrainer: {name} has pre-packed rows (column {packed[0]!r}) and an {MASK_COLUMN!r} column; "
                f"a mask belongs to one sample, not to a packed row: give masked samples unpacked, one per row"
            )
        return _unpacked(ds, name, ids_col, labels_col, row_lengths, packed, training)
    eos = (eos_token_ids,) if isinstance(eos_token_ids, (int, np.integer)) else tuple(eos_token_ids)
    try:
        masks = decode_mask_column(mask_values, row_lengths, name) if mask_values is not None else {}
    except MaskError as e:
        raise ValueError(f"CPTrainer: {e}") from None
    warning = check_interior_eos(ds, ids_col, eos, name, masked=list(masks))
    valid = [
        sample_valid_targets(ids_col[i], labels_col[i], masks[i])
        if i in masks
        else valid_targets(ids_col[i], labels_col[i])
        for i in range(n)
    ]
    if training:
        check_some_loss(valid, name)
    return TokenColumns(
        row_lengths,
        np.asarray(valid, dtype=np.int64),
        ids_col,
        labels_col,
        masks,
        warnings=[warning] if warning else [],
    )


def _unpacked(
    ds, name: str, ids_col, labels_col, row_lengths: List[int], packed: List[str], training: bool
) -> TokenColumns:
    """Pre-packed rows -> one sample per document."""
    values = {c: ds[c] for c in packed}
    lengths, doc_rows, doc_starts, valid = [], [], [], []
    for i, n in enumerate(row_lengths):
        try:
            docs = row_documents(n, {c: values[c][i] for c in packed}, row=f"{i} of {name}")
        except PackedInputError as e:
            raise ValueError(f"CPTrainer: {e}") from None
        x, y = ids_col[i], labels_col[i]
        start = 0
        for d in docs:
            lengths.append(d)
            doc_rows.append(i)
            doc_starts.append(start)
            valid.append(valid_targets(x[start : start + d], None if y is None else y[start : start + d]))
            start += d
    if training:
        check_some_loss(valid, name)
    return TokenColumns(
        lengths,
        np.asarray(valid, dtype=np.int64),
        ids_col,
        labels_col,
        doc_rows=np.asarray(doc_rows, dtype=np.int64),
        doc_starts=np.asarray(doc_starts, dtype=np.int64),
    )
