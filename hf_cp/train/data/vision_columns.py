"""A dataset's vision columns, read per sample into SampleVision (samples/vision.py) for the collator.

The columns are a Qwen2-VL-style processor's: `pixel_values` / `image_grid_thw` for images,
`pixel_values_videos` / `video_grid_thw` (and `second_per_grid_ts`) for clips; `mm_token_type_ids`
is accepted and recomputed from the placeholder tokens. Any other multimodal column (another
family's vision inputs, audio) is refused by name: its contents would not reach the model. The
M-RoPE positions of each sample come from `rope_positions`, the model's own rope-index function
over the whole sample, computed once and kept (a sample's rows are cut again in every step that
holds it). A shared-prompt sample ([prompt][answer 1]...[answer n], a DPO pair) is not one
sequence: each answer continues from the prompt alone, so the function runs on prompt+answer for
every answer and each answer's tail is spliced after the one before (`shared_prompt_rope`); its
images and clips must all sit in the prompt.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence

import numpy as np

from hf_cp.samples.masks import SampleMask
from hf_cp.samples.vision import KIND_COLUMNS, KINDS, SampleVision, VisionInputError, sample_vision
from hf_cp.train.data.vision_rows import VisionFn

# every column the reader takes
VISION_COLUMNS = tuple(c for kind in KINDS for c in KIND_COLUMNS[kind]) + ("second_per_grid_ts",)
ACCEPTED_COLUMNS = VISION_COLUMNS + ("mm_token_type_ids",)
# columns of other processors whose inputs hf_cp does not carry: refused by name
FOREIGN_COLUMNS = (
    "image_sizes",  # LLaVA-NeXT, Mistral-3
    "pixel_attention_mask",  # Idefics3, SmolVLM
    "image_attention_mask",
    "aspect_ratio_ids",  # Mllama
    "aspect_ratio_mask",
    "cross_attention_mask",
    "pixel_values_images",
    "image_position_ids",
    "token_type_ids",  # Gemma 3's image token types
    "input_features",  # audio (Whisper-style encoders, Qwen2-Audio, Qwen2.5-Omni)
    "feature_attention_mask",
    "input_values",
    "audio_values",
    "video_second_per_grid",
    "use_audio_in_video",
    # raw media, not yet through the model's processor
    "images",
    "image",
    "videos",
    "video",
    "audio",
)

RopeFn = Callable[[Sequence[int], Dict[str, np.ndarray], Optional[Sequence[float]]], np.ndarray]


def has_vision_columns(columns: Iterable[str]) -> bool:
    return any(c in VISION_COLUMNS for c in columns)


def refuse_foreign_columns(columns: Iterable[str], who: str) -> None:
    """ValueError naming a multimodal column hf_cp does not carry to the model."""
    foreign = [c for c in columns if c in FOREIGN_COLUMNS]
    if foreign:
        raise ValueError(
            f"{who}: the dataset has the column(s) {foreign}, multimodal inputs hf_cp does not carry to the model "
            f"(it carries {', '.join(VISION_COLUMNS)}, a Qwen2-VL-style processor's outputs); raw images or video "
            "go through the model's processor first (hf-cp preprocess); drop other columns, or train that model "
            "outside hf_cp"
        )


def shared_prompt_rope(
    sid: int,
    ids: Sequence[int],
    mask: SampleMask,
    items: SampleVision,
    rope_positions: RopeFn,
    grids: Dict[str, np.ndarray],
    seconds: Optional[Sequence[float]],
) -> np.ndarray:
    """The M-RoPE positions [3, L] of a shared-prompt sample: for each answer, the model's own
    rope-index function over prompt+answer alone, the answer's columns spliced after the previous
    answer's. So each answer's positions are the ones it would have as its own sequence. Every
    item's placeholders must lie in the prompt (VisionInputError naming the sample otherwise)."""
    p = mask.prompt
    outside = [k for k, it in enumerate(items.items) if len(it.token_positions) and int(it.token_positions.max()) >= p]
    if outside:
        it = items.items[outside[0]]
        raise VisionInputError(
            f"sample {sid}: its {it.kind} {outside[0]} has placeholder tokens after the shared prompt's {p} tokens; "
            "images and clips of a shared-prompt sample (a DPO pair) must sit in the prompt, which both answers attend"
        )
    ids = list(ids)
    parts = []
    start = p
    for n, length in enumerate(mask.answers):
        branch = np.asarray(rope_positions(ids[:p] + ids[start : start + length], grids, seconds), dtype=np.int64)
        parts.append(branch if n == 0 else branch[:, p:])
        start += length
    return np.concatenate(parts, axis=1)


def vision_reader(
    row_of: Callable[[int], Mapping[str, object]],
    token_ids: Dict[str, int],
    merge: int,
    rope_positions: RopeFn,
    cache_size: int = 64,
    masks: Optional[Mapping[int, SampleMask]] = None,
) -> VisionFn:
    """sample id -> its SampleVision with its M-RoPE positions (None: a text-only sample).
    `row_of(sid)`: the sample's dataset row; `token_ids`: kind -> placeholder token id. The last
    `cache_size` samples are kept (their pixels included: a step reads each of its samples on
    several waves' and members' behalf; pixels are large, so the cache is small). `masks`: sample
    id -> its mask; a shared-prompt sample's positions are spliced per answer (shared_prompt_rope)."""
    masks = {} if masks is None else masks

    @lru_cache(maxsize=cache_size)
    def vision_of(sid: int) -> Optional[SampleVision]:
        row = row_of(sid)
        ids = row["input_ids"]
        pixels = {kind: row.get(KIND_COLUMNS[kind][0]) for kind in KINDS}
        grids = {kind: row.get(KIND_COLUMNS[kind][1]) for kind in KINDS}
        got = sample_vision(sid, ids, pixels, grids, token_ids, merge)
        if got is None:
            return None
        by_kind = {
            kind: np.asarray([it.grid_thw for it in got.items if it.kind == kind], dtype=np.int64).reshape(-1, 3)
            for kind in KINDS
        }
        seconds = row.get("second_per_grid_ts")
        mask = masks.get(sid)
        if mask is not None and mask.kind == "shared_prompt":
            rope = shared_prompt_rope(sid, ids, mask, got, rope_positions, by_kind, seconds)
        else:
            rope = np.asarray(rope_positions(ids, by_kind, seconds), dtype=np.int64)
        if rope.shape != (3, len(ids)):
            raise ValueError(f"sample {sid}: M-RoPE positions of shape {rope.shape}, expected (3, {len(ids)})")
        return replace(got, rope_positions=rope)

    return vision_of
