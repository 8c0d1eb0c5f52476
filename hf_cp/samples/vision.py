"""A vision-language sample's images and video clips, read from its processor outputs.

A processor (Qwen2.5-VL's, for example) writes, per sample, the token ids with every image or
clip expanded into its placeholder tokens, the pixel patches (`pixel_values`,
`pixel_values_videos`: one row per patch, items back to back) and each item's patch grid
(`image_grid_thw`, `video_grid_thw`: temporal, height, width). An item of grid (t, h, w) has
t*h*w patches and t*h*w / merge^2 placeholder tokens (merge: the encoder's spatial merge size);
its placeholders are the next ones of its kind in the sample, in order.

`VisionItem` is one image or clip: where its patches and its placeholder tokens are. Everything
here is pure numpy, the same on every rank, so the collator can cut an item's embedding rows
along any shard of its sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

IMAGE, VIDEO = "image", "video"
KINDS = (IMAGE, VIDEO)
# the processor columns of each kind: (pixel patches, patch grid)
KIND_COLUMNS = {IMAGE: ("pixel_values", "image_grid_thw"), VIDEO: ("pixel_values_videos", "video_grid_thw")}


class VisionInputError(ValueError):
    """A sample's vision inputs contradict its tokens; the message names the sample and the field."""


@dataclass(frozen=True)
class VisionItem:
    """One image or clip of a sample: its kind, patch grid, rows of the sample's patch array of
    its kind, and the positions of its placeholder tokens in the sample."""

    kind: str
    grid_thw: Tuple[int, int, int]
    patch_start: int
    patch_stop: int
    token_positions: np.ndarray = field(compare=False, repr=False)

    @property
    def patches(self) -> int:
        return self.patch_stop - self.patch_start

    @property
    def tokens(self) -> int:
        return int(len(self.token_positions))


@dataclass(frozen=True)
class SampleVision:
    """A sample's vision items (images first, then clips, each in order) with their pixels, and
    the M-RoPE positions [3, L] of the whole sample (the model's own rope-index function)."""

    sample: int
    items: Tuple[VisionItem, ...]
    pixels: Dict[str, np.ndarray] = field(compare=False, repr=False)  # kind -> [patches, patch_dim]
    rope_positions: Optional[np.ndarray] = field(default=None, compare=False, repr=False)  # [3, L]

    @property
    def patches(self) -> int:
        return sum(it.patches for it in self.items)

    @property
    def vision_tokens(self) -> int:
        return sum(it.tokens for it in self.items)

    def item_of_token(self, length: int) -> Tuple[np.ndarray, np.ndarray]:
        """Per token of the sample: its item's index (-1: a text token) and its row in that item's embedding."""
        item = np.full(length, -1, dtype=np.int64)
        row = np.full(length, -1, dtype=np.int64)
        for k, it in enumerate(self.items):
            item[it.token_positions] = k
            row[it.token_positions] = np.arange(it.tokens)
        return item, row


def _grids(value, sample: int, column: str) -> np.ndarray:
    if value is None:
        return np.zeros((0, 3), dtype=np.int64)
    arr = np.asarray(value)
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3 or not np.issubdtype(arr.dtype, np.integer) or (arr <= 0).any():
        raise VisionInputError(
            f"sample {sample}: {column} must hold one (temporal, height, width) triple of positive integers per "
            f"item, got {np.asarray(value).tolist()!r:.120}"
        )
    return arr.astype(np.int64)


def sample_vision(
    sample: int,
    input_ids: Sequence[int],
    pixels: Dict[str, Optional[np.ndarray]],
    grids: Dict[str, object],
    token_ids: Dict[str, int],
    merge: int,
) -> Optional[SampleVision]:
    """The sample's vision items (None: it has none), checked against its tokens: every item's
    patches are rows of its kind's pixel array, and each kind's placeholder tokens number exactly
    its items' tokens. `pixels`/`grids`: kind -> the sample's processor outputs (None: absent);
    `token_ids`: kind -> placeholder token id; `merge`: the encoder's spatial merge size."""
    ids = np.asarray(input_ids, dtype=np.int64)
    items = []
    arrays: Dict[str, np.ndarray] = {}
    for kind in KINDS:
        pix_col, grid_col = KIND_COLUMNS[kind]
        grid = _grids(grids.get(kind), sample, grid_col)
        positions = np.flatnonzero(ids == token_ids[kind])
        per_item = grid.prod(axis=1) if len(grid) else np.zeros(0, dtype=np.int64)
        if (per_item % (merge * merge)).any():
            bad = int(np.flatnonzero(per_item % (merge * merge))[0])
            raise VisionInputError(
                f"sample {sample}: {grid_col}[{bad}] = {grid[bad].tolist()} has {int(per_item[bad])} patches, not a "
                f"multiple of the encoder's spatial merge ({merge}x{merge})"
            )
        tokens = per_item // (merge * merge)
        if int(tokens.sum()) != len(positions):
            raise VisionInputError(
                f"sample {sample}: {len(positions)} {kind} placeholder tokens (id {token_ids[kind]}) in input_ids, but "
                f"{grid_col} gives {len(grid)} {kind}s of {int(tokens.sum())} tokens; the processor's outputs and the "
                f"token ids must come from the same call"
            )
        pix = pixels.get(kind)
        if len(grid) == 0:
            if pix is not None and np.asarray(pix).size:
                raise VisionInputError(f"sample {sample}: {pix_col} holds patches but {grid_col} is empty")
            continue
        if pix is None:
            raise VisionInputError(f"sample {sample}: {grid_col} gives {len(grid)} {kind}s but {pix_col} is missing")
        pix = np.asarray(pix, dtype=np.float32)
        if pix.ndim != 2 or pix.shape[0] != int(per_item.sum()):
            raise VisionInputError(
                f"sample {sample}: {pix_col} has shape {tuple(pix.shape)}, but {grid_col} gives "
                f"{int(per_item.sum())} patches (one row each)"
            )
        arrays[kind] = pix
        starts = np.concatenate([[0], np.cumsum(per_item)])
        tok = np.concatenate([[0], np.cumsum(tokens)])
        for k in range(len(grid)):
            items.append(
                VisionItem(
                    kind,
                    tuple(int(x) for x in grid[k]),
                    int(starts[k]),
                    int(starts[k + 1]),
                    positions[tok[k] : tok[k + 1]],
                )
            )
    if not items:
        return None
    return SampleVision(sample, tuple(items), arrays)
