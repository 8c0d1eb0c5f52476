"""A tiny Qwen2.5-VL (random weights) and vision-language samples with random images and clips,
for the vision exactness tests; the reference is the model's own forward on each sample alone."""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 290, 291, 292, 293
VOCAB = 300
PATCH_DIM = 3 * 2 * 4 * 4  # channels * temporal patch * patch^2
MERGE = 2


def vlm_config(**text) -> Qwen2_5_VLConfig:
    text_config = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        attention_dropout=0.0,
    )
    text_config.update(text)
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=4,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            window_size=16,
            fullatt_block_indexes=[1],
            in_channels=3,
            tokens_per_second=2,
        ),
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=VISION_END + 1,
        eos_token_id=VISION_END + 2,
        pad_token_id=0,
    )


def build_vlm(attn: str, seed: int = 1234) -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration._from_config(
        vlm_config(), attn_implementation=attn, dtype=torch.float32
    ).train()


# a sample: text runs and items between them: ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w))
Layout = List[Tuple[str, object]]


def make_sample(sid: int, layout: Layout) -> Dict[str, object]:
    """Token ids with each item's placeholders between vision start/end tokens, and its processor
    columns (random pixels): the shape a Qwen2.5-VL processor writes."""
    gen = np.random.default_rng(500 + sid)
    ids: List[int] = []
    pix = {"image": [], "video": []}
    grids = {"image": [], "video": []}
    for kind, what in layout:
        if kind == "text":
            ids += gen.integers(0, 280, int(what)).tolist()
            continue
        t, h, w = what
        ids += [VISION_START] + [IMAGE_TOKEN if kind == "image" else VIDEO_TOKEN] * (t * h * w // MERGE**2)
        ids += [VISION_END]
        pix[kind].append(gen.standard_normal((t * h * w, PATCH_DIM)).astype(np.float32))
        grids[kind].append([t, h, w])
    row: Dict[str, object] = {"input_ids": ids}
    if grids["image"]:
        row["pixel_values"] = np.concatenate(pix["image"])
        row["image_grid_thw"] = np.asarray(grids["image"], dtype=np.int64)
    if grids["video"]:
        row["pixel_values_videos"] = np.concatenate(pix["video"])
        row["video_grid_thw"] = np.asarray(grids["video"], dtype=np.int64)
        row["second_per_grid_ts"] = [1.0] * len(grids["video"])
    return row


def reference_sample_loss(model, row: Dict[str, object], global_valid: int) -> float:
    """The model's own forward on one sample (its own M-RoPE, its own vision scatter): summed
    next-token loss / global_valid, backward run."""
    ids = torch.tensor(row["input_ids"])[None]
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == IMAGE_TOKEN] = 1
    types[ids == VIDEO_TOKEN] = 2
    kw = dict(input_ids=ids, mm_token_type_ids=types, use_cache=False)
    if "pixel_values" in row:
        kw.update(
            pixel_values=torch.as_tensor(row["pixel_values"]), image_grid_thw=torch.as_tensor(row["image_grid_thw"])
        )
    if "pixel_values_videos" in row:
        kw.update(
            pixel_values_videos=torch.as_tensor(row["pixel_values_videos"]),
            video_grid_thw=torch.as_tensor(row["video_grid_thw"]),
            second_per_grid_ts=torch.as_tensor(row["second_per_grid_ts"]),
        )
    logits = model(**kw).logits[0]
    labels = ids[0, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:-1].float(), labels, reduction="sum") / global_valid
    loss.backward()
    return loss.item()
