"""TRL's vision preference rows, tokenised for CPDPOTrainer through hf_cp's own processor path.

A row is TRL's vision DPO format: `prompt`, `chosen`, `rejected` (conversational or text) and an
`images` list (or one `image`). TRL's DPOTrainer turns such rows into pixels in its collator, per
padded batch, with the model's `ProcessorMixin`; hf_cp tokenises them once, up front, with the
processor's parts (data_prep/vision_processor.py: the tokenizer and its chat template, the
Qwen2-VL image processor; transformers 5.24's processor class itself needs torchvision):

- the text as TRL's vision collator (`DataCollatorForVisionPreference`) tokenises it: the images
  placed by `prepare_multimodal_messages` (before the first user turn's text, unless the prompt
  has image parts of its own), the conversation rendered by TRL's `apply_chat_template` (the
  prompt with the generation prompt, each answer the rest of prompt+answer), then the prompt and
  each answer tokenised apart without special tokens; a text pair as given (no EOS added, as
  there). The chat template renders one image pad token per image;
- each image pad of the prompt expanded into the image's grid.prod() / merge^2 placeholder
  tokens, and the images' `pixel_values` / `image_grid_thw` from the image processor.

Per pair: prompt_ids (placeholders expanded), chosen_ids, rejected_ids, pixel_values,
image_grid_thw; CPDPOTrainer then joins them into one shared-prompt sample (dpo.pair_sample).
Refused by name: an image in an answer (both answers attend the prompt's images, none their
own), video, a processor of another family, and a processing_class that is a bare tokenizer.
"""

from __future__ import annotations

import json
from typing import Dict, Sequence

import numpy as np
from datasets import Features, List, Value
from trl.data_utils import apply_chat_template, extract_prompt, is_conversational, prepare_multimodal_messages  # trl

from hf_cp.data_prep.vision_processor import (
    IMAGE_TOKEN,
    QWEN_IMAGE_PROCESSORS,
    VIDEO_TOKEN,
    VISION_TOKENS,
    VisionProcessor,
)
from hf_cp.train.checks.media import RAW_IMAGE_COLUMNS

VIDEO_COLUMNS = ("video", "videos")
# what the map writes per pair, beside the columns it keeps
PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids", "pixel_values", "image_grid_thw")


def has_image_rows(dataset) -> bool:
    columns = getattr(dataset, "column_names", None) or []
    return any(c in RAW_IMAGE_COLUMNS for c in columns)


def refuse_video_rows(dataset, name: str, trainer: str) -> None:
    """ValueError naming a video column: DPO pairs carry images only (TRL's vision DPO takes none)."""
    columns = getattr(dataset, "column_names", None) or []
    found = [c for c in columns if c in VIDEO_COLUMNS]
    if found:
        raise ValueError(
            f"{trainer}: {name} has the column {found[0]!r}; DPO pairs with video are not built (TRL's DPO takes "
            "images only): train the clips supervised with CPTrainer (`hf-cp preprocess --processor --videos-field`)"
        )


def vision_processor_of(processing_class, trainer: str) -> VisionProcessor:
    """The processor parts hf_cp tokenises image pairs with: hf_cp's VisionProcessor
    (`load_vision_processor(FOLDER)`), or a transformers processor of the Qwen2-VL family (its
    tokenizer and image processor). Anything else is refused, naming what was given."""
    if isinstance(processing_class, VisionProcessor):
        processor = processing_class
    else:
        tokenizer = getattr(processing_class, "tokenizer", None)
        image_processor = getattr(processing_class, "image_processor", None)
        if tokenizer is None or image_processor is None:
            given = "none" if processing_class is None else type(processing_class).__name__
            raise ValueError(
                f"{trainer}: pairs with images need the model's processor as processing_class, got {given} (a "
                "tokenizer has no image processor; `hf-cp train` passes the model's tokenizer): build the trainer in "
                "Python with processing_class=hf_cp.data_prep.vision_processor.load_vision_processor(PROCESSOR_FOLDER) "
                "or the model's transformers processor"
            )
        processor = VisionProcessor(tokenizer, image_processor, {}, type(processing_class).__name__)
    kind = type(processor.image_processor).__name__
    if kind not in QWEN_IMAGE_PROCESSORS:
        raise ValueError(
            f"{trainer}: the processor's image processor is {kind}; hf_cp carries a Qwen2-VL-family processor's "
            f"outputs (pixel_values, image_grid_thw; {', '.join(QWEN_IMAGE_PROCESSORS)}), not another family's"
        )
    tokenizer = processor.tokenizer
    missing = [t for t in VISION_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ValueError(f"{trainer}: the processor's tokenizer has no {', '.join(missing)} token(s)")
    return processor


class VisionPairEncoder:
    """Picklable map function (with indices): a TRL vision pair -> PAIR_COLUMNS (module doc)."""

    def __init__(self, processor: VisionProcessor, dataset_name: str):
        self.processor = processor
        self.name = dataset_name
        tok = processor.tokenizer
        self.image_id = int(tok.convert_tokens_to_ids(IMAGE_TOKEN))
        self.video_id = int(tok.convert_tokens_to_ids(VIDEO_TOKEN))

    def _where(self, index: int) -> str:
        return f"{self.name} pair {index}"

    def _messages(self, example: dict, images: list, index: int):
        """(prompt, chosen, rejected) messages with bare image parts, and the prompt's images in order."""
        where = self._where(index)
        for key in ("chosen", "rejected"):
            for m in example[key]:
                content = m.get("content")
                parts = content if isinstance(content, (list, tuple)) else ()
                kinds = {p.get("type") for p in parts if isinstance(p, dict)}
                if kinds & {"image", "video"}:
                    raise ValueError(
                        f"{where}: its {key} answer has an image or video part; images of a DPO pair sit in the "
                        "prompt, which both answers attend (an answer's own image is not built)"
                    )
        try:
            prompt = prepare_multimodal_messages(list(example["prompt"]), images=images)
        except ValueError as e:  # TRL's count check: images given against image parts
            raise ValueError(f"{where}: {e}") from None
        order, bare = [], []
        for m in prompt:
            parts = []
            for part in m.get("content") or ():
                if part.get("type") == "video":
                    raise ValueError(f"{where}: its prompt has a video part; DPO pairs with video are not built")
                if part.get("type") == "image":
                    order.append(part["image"])
                    part = {"type": "image"}
                parts.append(part)
            bare.append({**m, "content": parts})
        answers = [prepare_multimodal_messages(list(example[k])) for k in ("chosen", "rejected")]
        return bare, answers[0], answers[1], order

    def _token_ids(self, example: dict, images: list, index: int):
        """(prompt, chosen, rejected) token ids, one image pad token per image, and the images."""
        tok = self.processor.tokenizer
        texts = {k: example[k] for k in ("prompt", "chosen", "rejected")}
        if is_conversational(example):
            prompt, chosen, rejected, images = self._messages(example, images, index)
            tools = example.get("tools")
            tools = json.loads(tools) if isinstance(tools, str) else tools
            pair = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            if example.get("chat_template_kwargs"):
                pair["chat_template_kwargs"] = example["chat_template_kwargs"]
            texts = apply_chat_template(pair, tok, tools=tools)
        ids = [list(tok(texts[k], add_special_tokens=False)["input_ids"]) for k in ("prompt", "chosen", "rejected")]
        return ids[0], ids[1], ids[2], images

    def _expand(self, prompt: Sequence[int], tokens: list, index: int) -> list:
        """Each image pad of the prompt -> its image's placeholder tokens."""
        pads = sum(1 for t in prompt if t == self.image_id)
        if pads != len(tokens):
            raise ValueError(
                f"{self._where(index)}: its prompt renders {pads} {IMAGE_TOKEN} token(s) for {len(tokens)} image(s); "
                "the chat template (or a text prompt) must hold one per image"
            )
        out, k = [], 0
        for t in prompt:
            if t == self.image_id:
                out += [t] * tokens[k]
                k += 1
            else:
                out.append(t)
        return out

    def __call__(self, example: dict, index: int) -> Dict[str, object]:
        where = self._where(index)
        if "prompt" not in example:  # an implicit prompt, as TRL's pipeline extracts it
            example = {**example, **extract_prompt(example)}
        images = example.get("images")
        if images is None and example.get("image") is not None:
            images = [example["image"]]
        images = list(images or [])
        prompt, chosen, rejected, images = self._token_ids(example, images, index)
        for key, ids in (("chosen", chosen), ("rejected", rejected)):
            if self.image_id in ids or self.video_id in ids:
                raise ValueError(
                    f"{where}: its {key} answer holds an image or video pad token after the prompt; images of a DPO "
                    "pair sit in the prompt, which both answers attend"
                )
        if self.video_id in prompt:
            raise ValueError(f"{where}: its prompt holds a {VIDEO_TOKEN} token; DPO pairs with video are not built")
        out: Dict[str, object] = {"pixel_values": [], "image_grid_thw": []}
        tokens: list = []
        if images:
            got = self.processor.images([self._rgb(im, where) for im in images])
            grids = np.asarray(got["image_grid_thw"], dtype=np.int64)
            out = {"pixel_values": got["pixel_values"].tolist(), "image_grid_thw": grids.tolist()}
            tokens = [int(np.prod(g)) // self.processor.merge**2 for g in grids]
        return dict(out, prompt_ids=self._expand(prompt, tokens, index), chosen_ids=chosen, rejected_ids=rejected)

    @staticmethod
    def _rgb(image, where: str):
        convert = getattr(image, "convert", None)
        if convert is None:
            raise ValueError(
                f"{where}: an image is a {type(image).__name__}; give PIL images (datasets' Image feature)"
            )
        return convert("RGB")


def pair_features():
    """The map's output schema (pairs without images agree with the rest)."""
    ids = List(Value("int64"))
    return Features(
        {
            "prompt_ids": ids,
            "chosen_ids": ids,
            "rejected_ids": ids,
            "pixel_values": List(List(Value("float32"))),
            "image_grid_thw": List(List(Value("int64"))),
        }
    )


def tokenise_image_pairs(dataset, processor: VisionProcessor, dataset_name: str, num_proc=None):
    """TRL's vision pairs -> PAIR_COLUMNS per pair (the raw columns dropped), through `processor`."""
    kwargs = {"num_proc": num_proc} if num_proc else {}
    return dataset.map(
        VisionPairEncoder(processor, dataset_name),
        with_indices=True,
        remove_columns=list(dataset.column_names),
        features=pair_features(),
        desc=f"Tokenising {dataset_name} pairs with images",
        **kwargs,
    )
