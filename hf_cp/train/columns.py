"""The token columns of a tokenised dataset, read and checked once: lengths for planning,
valid-target counts for the loss normaliser, masks, and sample lookup for the collator.

A *sample* is one document. A dataset row is one sample, except a pre-packed row (one with
document boundaries: packed_input.py), which is unpacked into its documents: sample ids then
number the documents in row order. A row may carry an attention mask in the `attn_mask`
column (hf_cp/mask_column.py; absent or null = causal), validated here against its length.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from hf_cp.samples.mask_column import MASK_COLUMN, decode_mask_column, masks_digest_items
from hf_cp.samples.masks import MaskError, SampleMask
from hf_cp.samples.packed_input import PackedInputError, boundary_columns, row_documents
from hf_cp.samples.targets import sample_valid_targets
from hf_cp.train.collator import valid_targets


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


def read_token_columns(ds, name: str = "train_dataset") -> TokenColumns:
    """`ds` needs input_ids per row; optional labels (-100 = no loss), length, attn_mask, and
    document boundaries of pre-packed rows (packed_input.py). Errors name `name` and the
    sample (or the row)."""
    cols = getattr(ds, "column_names", None)
    if cols is not None and "input_ids" not in cols:
        raise ValueError(f"CPTrainer: {name} has no 'input_ids' column (columns: {cols}); tokenise it first")
    n = len(ds)
    if n == 0:
        raise ValueError(f"CPTrainer: {name} is empty")
    has_labels = cols is not None and "labels" in cols
    ids_col = ds["input_ids"]
    labels_col: Sequence[Optional[Sequence[int]]] = ds["labels"] if has_labels else [None] * n
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
        return _unpacked(ds, name, ids_col, labels_col, row_lengths, packed)
    try:
        masks = decode_mask_column(mask_values, row_lengths, name) if mask_values is not None else {}
    except MaskError as e:
        raise ValueError(f"CPTrainer: {e}") from None
    valid = [
        sample_valid_targets(ids_col[i], labels_col[i], masks[i])
        if i in masks
        else valid_targets(ids_col[i], labels_col[i])
        for i in range(n)
    ]
    return TokenColumns(row_lengths, np.asarray(valid, dtype=np.int64), ids_col, labels_col, masks)


def _unpacked(ds, name: str, ids_col, labels_col, row_lengths: List[int], packed: List[str]) -> TokenColumns:
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
    return TokenColumns(
        lengths,
        np.asarray(valid, dtype=np.int64),
        ids_col,
        labels_col,
        doc_rows=np.asarray(doc_rows, dtype=np.int64),
        doc_starts=np.asarray(doc_starts, dtype=np.int64),
    )
