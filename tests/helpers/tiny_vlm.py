"""A tiny Qwen2.5-VL (random weights) and vision-language samples with random images and clips,
for the vision exactness tests; the reference is the model's own forward on each sample alone."""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from hf_cp.attention.recurrent import attach_recurrent_layers

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 290, 291, 292, 293
VOCAB = 300
PATCH_DIM = 3 * 2 * 4 * 4  # channels * temporal patch * patch^2
MERGE = 2


# every tiny family's special tokens (the placeholders above) and output settings
TOKENS = dict(
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
# the language model's and the tower's sizes every family shares
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
    attention_dropout=0.0,
)
TOWER = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=MERGE,
    temporal_patch_size=2,
    in_channels=3,
)
# Qwen3-VL's and Qwen3.5's tower (learned position grid of 4x4, no windows)
QWEN3_TOWER = dict(TOWER, num_position_embeddings=16)


def vlm_config(**text) -> Qwen2_5_VLConfig:
    text_config = dict(
        TEXT,
        num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    text_config.update(text)
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=dict(TOWER, window_size=16, fullatt_block_indexes=[1], tokens_per_second=2),
        **TOKENS,
    )


def qwen2_vl_config() -> Qwen2VLConfig:
    """A tiny Qwen2-VL: its tower attends over whole items (no windows); its merger outputs the text width."""
    base = vlm_config().to_dict()
    for key in ("model_type", "architectures", "transformers_version", "vision_config"):
        base.pop(key, None)
    base["text_config"].pop("model_type", None)
    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=64,
        mlp_ratio=2,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        in_channels=3,
    )
    return Qwen2VLConfig(**base, vision_config=vision)


def qwen3_vl_config() -> Qwen3VLConfig:
    """A tiny Qwen3-VL: DeepStack features of both tower layers added after the first two decoder layers."""
    return Qwen3VLConfig(
        text_config=dict(
            TEXT,
            num_hidden_layers=3,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
                "rope_theta": 10000.0,
            },
        ),
        vision_config=dict(QWEN3_TOWER, deepstack_visual_indexes=[0, 1]),
        **TOKENS,
    )


def qwen3_5_config() -> Qwen3_5Config:
    """A tiny Qwen3.5: a Gated DeltaNet layer beside an attention layer, M-RoPE on half of each head."""
    return Qwen3_5Config(
        text_config=dict(
            TEXT,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
                "partial_rotary_factor": 0.5,
                "rope_theta": 10000.0,
            },
        ),
        vision_config=QWEN3_TOWER,
        **TOKENS,
    )


def qwen3_vl_moe_config() -> Qwen3VLMoeConfig:
    """qwen3_vl_config with a mixture-of-experts language model (4 experts, 2 a token)."""
    base = qwen3_vl_config().to_dict()
    text = dict(base["text_config"], num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    base.update(text_config=text, vision_config=base["vision_config"])
    for key in ("model_type", "architectures", "transformers_version"):
        base.pop(key, None)
        text.pop(key, None)
        base["vision_config"].pop(key, None)
    return Qwen3VLMoeConfig(**base)


def qwen3_5_moe_config() -> Qwen3_5MoeConfig:
    """qwen3_5_config with a mixture-of-experts language model (4 experts, 2 a token, a shared one)."""
    base = qwen3_5_config().to_dict()
    text = dict(
        base["text_config"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    base.update(text_config=text)
    for key in ("model_type", "architectures", "transformers_version"):
        base.pop(key, None)
        text.pop(key, None)
        base["vision_config"].pop(key, None)
    return Qwen3_5MoeConfig(**base)


FAMILIES = {
    "qwen2_vl": (qwen2_vl_config, Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (vlm_config, Qwen2_5_VLForConditionalGeneration),
    "qwen3_vl": (qwen3_vl_config, Qwen3VLForConditionalGeneration),
    "qwen3_5": (qwen3_5_config, Qwen3_5ForConditionalGeneration),
    "qwen3_vl_moe": (qwen3_vl_moe_config, Qwen3VLMoeForConditionalGeneration),
    "qwen3_5_moe": (qwen3_5_moe_config, Qwen3_5MoeForConditionalGeneration),
}


def build_vlm(attn: str, seed: int = 1234, family: str = "qwen2_5_vl"):
    config, cls = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls._from_config(config(), attn_implementation=attn, dtype=torch.float32).train()
    with torch.no_grad():
        for module in model.modules():
            # Gated DeltaNet: a decay of about 0.006 a token, as the harness's models; at transformers'
            # initialisation A_log's gradient nearly vanishes and its rounding is the largest relative error
            if hasattr(module, "A_log"):
                module.A_log.fill_(-3.0)
                module.dt_bias.fill_(-2.0)
    if attn == "hf_cp":
        attach_recurrent_layers(model)  # a hybrid's Gated DeltaNet layers run per document, as CPTrainer sets up
    return model


# a sample: text runs and items between them: ("text", n) | ("image", (t, h, w)) | ("video", (t, h, w))
Layout = List[Tuple[str, object]]


def make_sample(sid: int, layout: Layout, frames_apart: bool = False) -> Dict[str, object]:
    """Token ids with each item's placeholders between vision start/end tokens, and its processor
    columns (random pixels): the shape a Qwen2.5-VL processor writes. `frames_apart`: each frame of
    a clip in its own start/end pair after two timestamp tokens, as Qwen3-VL's processor writes it."""
    gen = np.random.default_rng(500 + sid)
    ids: List[int] = []
    pix = {"image": [], "video": []}
    grids = {"image": [], "video": []}
    for kind, what in layout:
        if kind == "text":
            ids += gen.integers(0, 280, int(what)).tolist()
            continue
        t, h, w = what
        token = IMAGE_TOKEN if kind == "image" else VIDEO_TOKEN
        if kind == "video" and frames_apart:
            for _ in range(t):
                ids += gen.integers(0, 280, 2).tolist() + [VISION_START] + [token] * (h * w // MERGE**2) + [VISION_END]
        else:
            ids += [VISION_START] + [token] * (t * h * w // MERGE**2) + [VISION_END]
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
        )
        if model.config.model_type == "qwen2_5_vl":  # Qwen2-VL's M-RoPE takes no seconds per patch
            kw["second_per_grid_ts"] = torch.as_tensor(row["second_per_grid_ts"])
    logits = model(**kw).logits[0]
    labels = ids[0, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:-1].float(), labels, reduction="sum") / global_valid
    loss.backward()
    return loss.item()
