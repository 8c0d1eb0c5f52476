"""The token columns of a tokenised dataset, read and checked once: lengths for planning,
valid-target counts for the loss normaliser, and sample lookup for the collator."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from .collator import valid_targets


@dataclass
class TokenColumns:
    lengths: List[int]
    valid_counts: np.ndarray  # per sample: targets that carry loss
    input_ids: Sequence
    labels: Sequence  # None entries: every next token is a target

    _digest: Optional[str] = field(default=None, repr=False)

    # rows whose tokens enter the digest: enough to tell another tokeniser, template or order
    # apart, few enough to cost nothing on a billion-token dataset
    DIGEST_ROWS = 256

    def fetch(self, sid: int):
        return self.input_ids[sid], self.labels[sid]

    def digest(self) -> str:
        """Fingerprint of the training data as the loss sees it: every sample's length and
        number of loss-carrying targets, plus the tokens and labels of DIGEST_ROWS evenly spaced
        samples. Ranks compare it at start-up; checkpoints keep it (re-masked prompts keep
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
            self._digest = h.hexdigest()
        return self._digest

    def __len__(self) -> int:
        return len(self.lengths)


def read_token_columns(ds, name: str = "train_dataset") -> TokenColumns:
    """`ds` needs input_ids per row; optional labels (-100 = no loss) and length. Errors name
    `name` and the sample."""
    cols = getattr(ds, "column_names", None)
    if cols is not None and "input_ids" not in cols:
        raise ValueError(f"CPTrainer: {name} has no 'input_ids' column (columns: {cols}); tokenise it first")
    n = len(ds)
    if n == 0:
        raise ValueError(f"CPTrainer: {name} is empty")
    has_labels = cols is not None and "labels" in cols
    ids_col = ds["input_ids"]
    labels_col: Sequence[Optional[Sequence[int]]] = ds["labels"] if has_labels else [None] * n
    lengths, valid = [], []
    for i in range(n):
        x, y = ids_col[i], labels_col[i]
        if len(x) == 0:
            raise ValueError(f"CPTrainer: {name} sample {i} has no tokens (empty input_ids)")
        if y is not None and len(y) != len(x):
            raise ValueError(f"CPTrainer: {name} sample {i} has {len(x)} input_ids but {len(y)} labels")
        lengths.append(len(x))
        valid.append(valid_targets(x, y))
    if cols is not None and "length" in cols:
        given = ds["length"]
        bad = next((i for i in range(n) if int(given[i]) != lengths[i]), None)
        if bad is not None:
            raise ValueError(
                f"CPTrainer: {name} sample {bad} has length column {given[bad]} but {lengths[bad]} input_ids"
            )
    return TokenColumns(lengths, np.asarray(valid, dtype=np.int64), ids_col, labels_col)
