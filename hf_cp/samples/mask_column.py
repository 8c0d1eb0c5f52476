"""The dataset column that carries a sample's attention mask.

Column `attn_mask`: per row, the mask as JSON text (`SampleMask.to_dict()` dumped), or null /
absent for a causal sample. JSON text rather than a nested column, because Arrow turns a column
of dicts into one struct type whose fields are the union of every row's keys (a causal row would
read back with `prompt: None, answers: None, ...`), and explicit slices mix integers and strings
in one list, which Arrow cannot store. Readers accept both forms: JSON text, and a mapping
(a struct row; keys whose value is null are dropped first).

`hf-cp preprocess --group-answers` writes the column; the trainer's column reader, the global
batch sampler and `hf-cp plan` read it. Torch-free and datasets-free.
"""

from __future__ import annotations

import json
from typing import Dict, Mapping, Optional, Sequence

from hf_cp.samples.masks import MaskError, SampleMask

MASK_COLUMN = "attn_mask"


def encode_mask(mask: Optional[SampleMask]) -> Optional[str]:
    """The column value of a mask: None for a causal one (the default needs no data)."""
    if mask is None or mask.is_causal:
        return None
    return json.dumps(mask.to_dict(), sort_keys=True, separators=(",", ":"))


def decode_mask(value, sample: object, length: int) -> Optional[SampleMask]:
    """A column value -> a validated mask, or None for a causal sample (including a window at
    least as long as the sample). MaskError names the sample (and the slice, for a malformed one)."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise MaskError(f"sample {sample}: column {MASK_COLUMN!r} is not JSON ({e}): {value[:80]!r}") from None
        if value is None:
            return None
    if not isinstance(value, Mapping):
        raise MaskError(
            f"sample {sample}: column {MASK_COLUMN!r} must hold a mask object (SampleMask.to_dict(), as JSON text) "
            f"or null, got {type(value).__name__} {value!r:.80}"
        )
    value = {k: v for k, v in value.items() if v is not None}  # an Arrow struct row fills absent keys with null
    mask = SampleMask.from_dict(value, sample).validate(sample, length)
    return None if mask.is_causal else mask


def decode_mask_column(values: Sequence, lengths: Sequence[int], what: str = "dataset") -> Dict[int, SampleMask]:
    """Sample id -> mask for the rows that carry a non-causal one (causal rows are left out)."""
    if len(values) != len(lengths):
        raise MaskError(f"{what}: column {MASK_COLUMN!r} has {len(values)} rows but there are {len(lengths)} samples")
    out: Dict[int, SampleMask] = {}
    for i, (v, n) in enumerate(zip(values, lengths)):
        m = decode_mask(v, f"{i} of {what}", int(n))
        if m is not None:
            out[i] = m
    return out


def masks_digest_items(masks: Mapping[int, SampleMask]):
    """(sample id, canonical JSON) pairs in id order: what a data digest hashes of the masks."""
    for sid in sorted(masks):
        yield sid, encode_mask(masks[sid])
