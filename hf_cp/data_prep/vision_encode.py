"""Encode chat samples with images and video through a Qwen2-VL processor (vision_processor.py).

A sample is a list of messages whose content is a string or a list of parts, Qwen2-VL's format:
{"type": "text", "text": ...}, {"type": "image", "image": X}, {"type": "video", "video": X,
"fps": F}. A part without its media ({"type": "image"}) takes the sample's next one from the
images / videos column (TRL's layout; datasets' `Image` feature decodes them to PIL images).
An image is a PIL image, a PNG/JPEG path (relative paths from the data file's folder), a
{"bytes", "path"} record (datasets' undecoded `Image`) or an [H, W, C] uint8 array. A clip is a
list of such frames or a [T, H, W, C] array: video files are refused by name, since no decoder
(torchcodec, PyAV, decord) is installed here.

Token ids: the chat template renders one <|image_pad|> / <|video_pad|> per item between
<|vision_start|> and <|vision_end|>; the text is tokenised and labelled as text chat is
(encode.py: prompt masking by --mask), then each pad token becomes its item's
t*h*w / merge^2 placeholder tokens. Placeholders are never targets (label -100): they are
replaced by the vision tower's embeddings, so there is no token to predict; the vision start and
end tokens keep the label their turn gives them. `length` counts every token, vision ones too.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

from hf_cp.data_prep.encode import IGNORE_INDEX, EncodeError, SampleEncoder, trained_tokens
from hf_cp.data_prep.vision_processor import DEFAULT_FPS, IMAGE_TOKEN, VIDEO_TOKEN, VisionProcessor, vision_token_ids
from hf_cp.samples.vision import IMAGE, KIND_COLUMNS, KINDS, VIDEO, VisionInputError, sample_vision

VIDEO_FILE_SUFFIXES = (".mp4", ".webm", ".mkv", ".avi", ".mov", ".gif", ".m4v", ".mpeg", ".mpg")
PART_KEYS = {"text": ("type", "text"), IMAGE: ("type", IMAGE), VIDEO: ("type", VIDEO, "fps")}
# the columns a vision sample writes beside input_ids, labels and length
VISION_OUTPUT_COLUMNS = tuple(c for kind in KINDS for c in KIND_COLUMNS[kind]) + ("second_per_grid_ts",)
NO_VIDEO_DECODER = (
    "decoding video files needs torchcodec, PyAV or decord, none of which is installed here; give the clip as a "
    "list of frame images (paths, PIL images) or a [frames, height, width, channels] uint8 array"
)


def output_features():
    """The map's output schema, fixed so that batches without images or video agree with the rest."""
    from datasets import Features, List, Value  # datasets

    rows = List(List(Value("float32")))
    grids = List(List(Value("int64")))
    return Features(
        {
            "input_ids": List(Value("int64")),
            "labels": List(Value("int64")),
            "length": Value("int64"),
            "trained_tokens": Value("int64"),
            "image_tokens": Value("int64"),
            "video_tokens": Value("int64"),
            "pixel_values": rows,
            "image_grid_thw": grids,
            "pixel_values_videos": rows,
            "video_grid_thw": grids,
            "second_per_grid_ts": List(Value("float32")),
        }
    )


class VisionChatEncoder:
    """Picklable batched map function: chat samples with media -> token ids, labels, length and the
    processor's vision columns (module doc)."""

    def __init__(
        self,
        processor: VisionProcessor,
        field: str,
        mask: str = "auto",
        base_dir: Optional[Path] = None,
        images_field: str = "images",
        videos_field: str = "videos",
        fps: float = DEFAULT_FPS,
    ):
        self.processor = processor
        self.chat = SampleEncoder(processor.tokenizer, "chat", field, mask=mask)
        self.field, self.base_dir = field, base_dir
        self.images_field, self.videos_field, self.fps = images_field, videos_field, float(fps)
        self.token_ids = vision_token_ids(processor)

    # ---------------------------------------------------------------- media
    def _image(self, value, where: str):
        try:
            if isinstance(value, Image.Image):
                return value.convert("RGB")
            if isinstance(value, dict) and ("bytes" in value or "path" in value):
                if value.get("bytes"):
                    return Image.open(io.BytesIO(value["bytes"])).convert("RGB")
                value = value.get("path")
            if isinstance(value, (str, Path)):
                path = Path(value)
                if path.suffix.lower() in VIDEO_FILE_SUFFIXES:
                    raise EncodeError(f"{where}: {path} is a video file, not an image")
                if not path.is_absolute() and self.base_dir is not None:
                    path = self.base_dir / path
                with Image.open(path) as im:
                    return im.convert("RGB")
            arr = np.asarray(value)
            if arr.ndim == 3 and arr.shape[-1] in (1, 3, 4) and arr.dtype == np.uint8:
                return Image.fromarray(arr.squeeze(-1) if arr.shape[-1] == 1 else arr).convert("RGB")
        except (OSError, ValueError) as e:
            if isinstance(e, EncodeError):
                raise
            raise EncodeError(f"{where}: cannot read the image {str(value)[:120]!r}: {e}") from None
        raise EncodeError(
            f"{where}: an image must be a PIL image, a PNG/JPEG path, a {{bytes, path}} record or an [H, W, C] uint8 "
            f"array, got {type(value).__name__}"
        )

    def _frames(self, value, where: str) -> list:
        if isinstance(value, (str, Path)) or (isinstance(value, dict) and not {"bytes", "path"} >= set(value)):
            raise EncodeError(f"{where}: the clip is {str(value)[:120]!r}: {NO_VIDEO_DECODER}")
        if isinstance(value, np.ndarray) and value.ndim == 4:
            value = list(value)
        if not isinstance(value, (list, tuple)) or not value:
            raise EncodeError(f"{where}: a clip must be a non-empty list of frames, got {type(value).__name__}")
        return [self._image(f, f"{where} frame {k}") for k, f in enumerate(value)]

    # ---------------------------------------------------------------- one sample
    def _parts(self, messages, index: int, column_media: Dict[str, list]) -> Tuple[List[dict], List[tuple]]:
        """The messages as the template renders them (media parts as bare type markers) and the
        sample's media in order: (kind, value, fps, where)."""
        taken = {IMAGE: 0, VIDEO: 0}
        media, rendered = [], []
        for k, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, (list, tuple)):
                rendered.append(m)
                continue
            parts = []
            for j, part in enumerate(content):
                where = f"sample {index}: {self.field}[{k}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in PART_KEYS:
                    raise EncodeError(
                        f"{where}: part type {kind!r}; hf_cp carries text, image and video parts (audio and other "
                        f"media are refused: a Qwen2-VL model has no encoder for them)"
                    )
                unknown = sorted(set(part) - set(PART_KEYS[kind]))
                if unknown:
                    raise EncodeError(
                        f"{where}: unknown media field(s) {unknown} in a {kind} part; it takes "
                        f"{', '.join(PART_KEYS[kind][1:])}"
                    )
                if kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                    continue
                value = part.get(kind)
                if value is None:  # the next one of the sample's images / videos column
                    column = column_media.get(kind)
                    name = self.images_field if kind == IMAGE else self.videos_field
                    if column is None or taken[kind] >= len(column):
                        raise EncodeError(
                            f"{where}: a {kind} part without its {kind!r} field, and the sample's {name!r} column has "
                            f"no {kind} left for it ({0 if column is None else len(column)} given)"
                        )
                    value = column[taken[kind]]
                    taken[kind] += 1
                media.append((kind, value, float(part.get("fps", self.fps)), where))
                parts.append({"type": kind})
            rendered.append({**m, "content": parts})
        for kind, column in column_media.items():
            if column is not None and taken[kind] < len(column):
                raise EncodeError(
                    f"sample {index}: its {self.images_field if kind == IMAGE else self.videos_field!r} column holds "
                    f"{len(column)} {kind}(s) but its messages have {taken[kind]} {kind} part(s) for them"
                )
        return rendered, media

    def encode(self, value, index: int, column_media: Dict[str, list]) -> Dict[str, object]:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise EncodeError(f"sample {index}: field {self.field!r} is a string but not JSON: {e}") from None
        if not isinstance(value, (list, tuple)):
            raise EncodeError(f"sample {index}: field {self.field!r} must be a list of messages, got {value!r:.80}")
        rendered, media = self._parts(list(value), index, column_media)
        ids, labels = self.chat._encode_chat(rendered, index)
        images = [self._image(v, w) for kind, v, _, w in media if kind == IMAGE]
        out = {c: [] for c in VISION_OUTPUT_COLUMNS}
        tokens = {IMAGE: [], VIDEO: []}
        merge = self.processor.merge
        if images:
            got = self.processor.images(images)
            out["pixel_values"] = got["pixel_values"].tolist()
            out["image_grid_thw"] = np.asarray(got["image_grid_thw"]).tolist()
            tokens[IMAGE] = [int(np.prod(g)) // merge**2 for g in out["image_grid_thw"]]
        clips = [(v, fps, w) for kind, v, fps, w in media if kind == VIDEO]
        pixels = []
        for v, fps, where in clips:
            if not fps > 0:
                raise EncodeError(f"{where}: fps must be positive, got {fps}")
            patches, grid = self.processor.video(self._frames(v, where))
            pixels.append(patches)
            out["video_grid_thw"].append(list(grid))
            out["second_per_grid_ts"].append(self.processor.temporal_patch / fps)
            tokens[VIDEO].append(int(np.prod(grid)) // merge**2)
        if pixels:
            out["pixel_values_videos"] = np.concatenate(pixels).tolist()
        ids, labels = self._expand(ids, labels, tokens, index)
        try:  # the rows must read back as the trainer reads them
            sample_vision(
                index,
                ids,
                {k: np.asarray(out[KIND_COLUMNS[k][0]]) for k in KINDS},
                {k: out[KIND_COLUMNS[k][1]] for k in KINDS},
                self.token_ids,
                merge,
            )
        except VisionInputError as e:
            raise EncodeError(str(e)) from None
        return dict(
            out,
            input_ids=ids,
            labels=labels,
            length=len(ids),
            trained_tokens=trained_tokens(labels),
            image_tokens=sum(tokens[IMAGE]),
            video_tokens=sum(tokens[VIDEO]),
        )

    def _expand(self, ids, labels, tokens: Dict[str, List[int]], index: int):
        """Each pad token -> its item's placeholder tokens, labelled -100."""
        pad = {self.token_ids[IMAGE]: IMAGE, self.token_ids[VIDEO]: VIDEO}
        found = {IMAGE: 0, VIDEO: 0}
        out_ids, out_labels = [], []
        for t, y in zip(ids, labels):
            kind = pad.get(t)
            if kind is None:
                out_ids.append(t)
                out_labels.append(y)
                continue
            if found[kind] < len(tokens[kind]):
                n = tokens[kind][found[kind]]
                out_ids += [t] * n
                out_labels += [IGNORE_INDEX] * n
            found[kind] += 1
        for kind, name in ((IMAGE, IMAGE_TOKEN), (VIDEO, VIDEO_TOKEN)):
            if found[kind] != len(tokens[kind]):
                raise EncodeError(
                    f"sample {index}: the rendered text has {found[kind]} {name} token(s) for {len(tokens[kind])} "
                    f"{kind}(s); the chat template must render one per {kind} part (and the text hold none itself)"
                )
        return out_ids, out_labels

    def __call__(self, batch: Dict[str, list], indices: Sequence[int]) -> Dict[str, list]:
        if self.field not in batch:
            raise EncodeError(f"samples have no field {self.field!r} (fields: {sorted(batch)})")
        rows = []
        for k, (value, index) in enumerate(zip(batch[self.field], indices)):
            column_media = {
                IMAGE: batch[self.images_field][k] if self.images_field in batch else None,
                VIDEO: batch[self.videos_field][k] if self.videos_field in batch else None,
            }
            rows.append(self.encode(value, index, column_media))
        return {c: [r[c] for r in rows] for c in output_features()}
