"""preprocess(): load -> tokenise with labels -> over-long policy -> save_to_disk -> length report.

Three kinds of samples: chat (`messages`), prompt-completion (TRL's `prompt` + `completion`,
strings or message lists) and text."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from hf_cp.data_prep.encode import EncodeError, SampleEncoder, truncate
from hf_cp.data_prep.group_answers import GroupAnswersEncoder, group_layout, truncate_group
from hf_cp.data_prep.inputs import InputError, load_input
from hf_cp.data_prep.vision_encode import VISION_OUTPUT_COLUMNS, VisionChatEncoder, output_features
from hf_cp.data_prep.vision_processor import DEFAULT_FPS, VisionProcessor
from hf_cp.samples.mask_column import MASK_COLUMN
from hf_cp.samples.packed_input import ONE_DOCUMENT_PER_ROW

OVERLONG_POLICIES = ("error", "drop", "truncate")
OUTPUT_COLUMNS = ("input_ids", "labels", "length")
GROUPED_COLUMNS = OUTPUT_COLUMNS + (MASK_COLUMN,)  # --group-answers adds the shared-prompt mask
VISION_COLUMNS = OUTPUT_COLUMNS + VISION_OUTPUT_COLUMNS  # --processor adds a Qwen2-VL processor's columns
# raw media columns the text path cannot read (they need --processor), and audio, which no path reads
MEDIA_COLUMNS = ("images", "image", "videos", "video")
AUDIO_COLUMNS = ("audio", "audios", "input_audio", "input_features")


@dataclass
class PreprocessResult:
    dataset: object  # the saved datasets.Dataset (input_ids, labels, length[, attn_mask])
    kind: str  # "text", "chat", or "grouped answers (...)"
    input_samples: int
    overlong: int  # samples longer than max_length (0 when no limit)
    dropped_overlong: int
    truncated: int
    dropped_empty: int
    untrained: int  # kept samples without any trained target
    trained_tokens: int  # targets that contribute to the loss, all kept samples
    longest_input: int  # longest sample before the policy
    out_dir: Optional[Path] = None
    overlong_examples: List[Tuple[int, int]] = field(default_factory=list)  # (input index, length)
    grouped: Optional[dict] = None  # --group-answers: answers, tokens as one sample vs as separate sequences
    prompt_not_prefix: int = 0  # prompt-completion samples whose prompt tokens change when the completion follows
    vision_tokens: Optional[dict] = None  # --processor: {"image": tokens, "video": tokens} of the kept samples
    vision_grids: Optional[List[List[List[int]]]] = None  # per kept sample its items' [t, h, w], images then clips

    def summary_lines(self, max_length: Optional[int], policy: str) -> List[str]:
        kept = len(self.dataset)
        lines = [f"{self.input_samples} input samples ({self.kind}), {kept} kept"]
        if max_length:
            what = {
                "drop": f"dropped {self.dropped_overlong}",
                "truncate": f"truncated {self.truncated}",
                "error": "none allowed",
            }[policy]
            lines.append(
                f"over-long (> --max-length {max_length}): {self.overlong} samples, policy {policy}: {what}"
                + (
                    "; e.g. " + ", ".join(f"sample {i} ({n} tokens)" for i, n in self.overlong_examples)
                    if self.overlong_examples
                    else ""
                )
            )
        else:
            lines.append(
                f"over-long: no --max-length given, nothing checked (longest sample {self.longest_input} tokens)"
            )
        if self.grouped:
            g = self.grouped
            saved = 1 - g["tokens"] / g["separate_tokens"] if g["separate_tokens"] else 0.0
            lines.append(
                f"grouped answers: {kept} shared-prompt samples of {g['answers']} answers "
                f"({g['answers'] / max(kept, 1):.1f} per prompt); {g['tokens']} tokens, {g['separate_tokens']} as "
                f"separate (prompt, answer) sequences: the prompt counted once saves {100 * saved:.1f}%"
            )
            if g.get("untrained"):
                lines.append(f"note: {g['untrained']}")
            if g.get("feeds"):
                lines.append(f"trains: {g['feeds']}")
        if self.vision_tokens is not None:
            v = self.vision_tokens
            items = sum(len(g) for g in self.vision_grids or [])
            lines.append(
                f"vision: {items} images and clips, {v['image']} image and {v['video']} video placeholder tokens "
                f"(counted in each sample's length, never trained)"
            )
        if self.dropped_empty:
            lines.append(f"dropped {self.dropped_empty} samples that encode to no tokens")
        if self.prompt_not_prefix:
            lines.append(
                f"warning: in {self.prompt_not_prefix} sample(s) the tokenised prompt is not a prefix of the tokenised "
                f"prompt + completion (a template that renders the prompt alone differently, or tokens merging across "
                f"the boundary); as TRL does, the completion starts where the two diverge"
            )
        if self.untrained:
            lines.append(
                f"warning: {self.untrained} kept samples have no trained token (all labels -100); "
                f"they cost compute but add nothing to the loss"
            )
        return lines


def grouped_data_feeds(layout) -> str:
    """Which trainer grouped data feeds, said plainly: preprocessing writes SFT data; preference
    pairs and GRPO prompts go to the TRL trainers raw."""
    sft = "SFT cross-entropy on the trained answers (CPTrainer: hf-cp train, or the Python API)"
    if "rejected" in layout.answers:
        return (
            f"{sft}, not DPO: these are preference pairs; for DPO give the raw prompt/chosen/rejected data to "
            f"hf_cp.train.objectives.dpo.CPDPOTrainer (recipes/trl_dpo.py), which builds the same shared-prompt samples itself"
        )
    return (
        f"{sft}; for GRPO, give the prompts to hf_cp.train.objectives.grpo.CPGRPOTrainer (recipes/trl_grpo.py), which groups "
        f"the completions it generates itself"
    )


def infer_kind(
    columns,
    text_field: Optional[str],
    messages_field: str,
    prompt_field: str = "prompt",
    completion_field: str = "completion",
) -> Tuple[str, str]:
    if text_field:
        if text_field not in columns:
            raise InputError(f"--text-field {text_field!r} is not a column of the input (columns: {columns})")
        return "text", text_field
    if messages_field in columns:
        return "chat", messages_field
    if prompt_field in columns and completion_field in columns:
        return "prompt-completion", prompt_field
    if prompt_field in columns and "chosen" in columns and "rejected" in columns:
        raise InputError(
            f"these are preference pairs ({prompt_field!r}, 'chosen', 'rejected'): for DPO give them raw to "
            f"hf_cp.train.objectives.dpo.CPDPOTrainer (recipes/trl_dpo.py); for SFT on the chosen answers, preprocess with "
            f"--group-answers"
        )
    if prompt_field in columns or completion_field in columns:
        missing = completion_field if prompt_field in columns else prompt_field
        grpo = (
            "; prompts without completions are GRPO data: give them raw to hf_cp.train.objectives.grpo.CPGRPOTrainer "
            "(recipes/trl_grpo.py), which generates and rewards the completions"
            if missing == completion_field
            else ""
        )
        raise InputError(
            f"prompt-completion samples need both a {prompt_field!r} and a {completion_field!r} column; "
            f"{missing!r} is missing (columns: {columns}); name them with --prompt-field / --completion-field{grpo}"
        )
    if "text" in columns:
        return "text", "text"
    raise InputError(
        f"cannot tell text, chat or prompt-completion samples apart: no {messages_field!r} column (chat), no "
        f"{prompt_field!r} and {completion_field!r} columns and no 'text' column (columns: {columns}); name the "
        f"fields with --text-field, --messages-field or --prompt-field/--completion-field"
    )


def refuse_media_columns(raw, source: str, with_processor: bool, images_field: str, videos_field: str) -> None:
    """InputError naming a column no preprocessing path reads: audio, datasets' `Video` feature (its
    decoder, torchcodec, is not installed), and raw media without --processor."""
    from datasets import Audio, Video  # datasets

    columns = raw.column_names
    audio = [c for c in columns if c in AUDIO_COLUMNS or isinstance(raw.features.get(c), Audio)]
    if audio:
        raise InputError(
            f"{source}: column(s) {audio} hold audio; hf_cp carries text, images and video (a Qwen2-VL processor's "
            f"columns), not audio: drop the column(s)"
        )
    videos = [c for c in columns if isinstance(raw.features.get(c), Video)]
    if videos:
        raise InputError(
            f"{source}: column(s) {videos} are datasets' Video feature, whose decoder (torchcodec) is not installed "
            f"here; give each clip as a list of frame images (datasets' Image feature in a list, or paths)"
        )
    media = [c for c in columns if c in MEDIA_COLUMNS or c in (images_field, videos_field)]
    if media and not with_processor:
        raise InputError(
            f"{source}: column(s) {media} hold images or video; they go through the model's processor: "
            f"give --processor FOLDER (a Qwen2-VL processor folder) instead of --tokenizer"
        )


def preprocess(
    source: str,
    tokenizer,
    out_dir=None,
    *,
    text_field: Optional[str] = None,
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    mask: str = "auto",
    max_length: Optional[int] = None,
    overlong: str = "error",
    num_proc: Optional[int] = None,
    split: str = "train",
    subset: Optional[str] = None,
    limit: Optional[int] = None,
    add_eos: bool = True,
    batch_size: int = 256,
    group_answers: bool = False,
    answers_field: Optional[str] = None,
    train_rejected: bool = False,
    processor: Optional[VisionProcessor] = None,
    images_field: str = "images",
    videos_field: str = "videos",
    fps: float = DEFAULT_FPS,
    raw=None,
) -> PreprocessResult:
    """Tokenise `source` for CPTrainer and save it to `out_dir` (when given).

    `group_answers`: records of a prompt and several answers become shared-prompt samples
    (group_answers.py), with their mask in the `attn_mask` column. `processor`: chat samples with
    images and video go through it (vision_encode.py); `tokenizer` is then unused. `raw`: the
    input already read (a datasets.Dataset; a training config's data section reads its own),
    `source` then only names it in messages."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"over-long policy must be one of {', '.join(OVERLONG_POLICIES)}, got {overlong!r}")
    if max_length is not None and max_length <= 0:
        raise ValueError(f"--max-length must be positive, got {max_length}")
    raw = load_input(source, split=split, subset=subset) if raw is None else raw
    if limit:
        raw = raw.select(range(min(limit, len(raw))))
    if len(raw) == 0:
        raise InputError(f"{source}: no samples")
    refuse_media_columns(raw, source, processor is not None, images_field, videos_field)
    features = None
    if processor is not None:
        if group_answers:
            raise ValueError("--group-answers with --processor: shared-prompt samples do not carry images or video yet")
        kind, fld = infer_kind(raw.column_names, text_field, messages_field, prompt_field, completion_field)
        if kind != "chat":
            raise InputError(
                f"{source}: --processor encodes chat samples (a {messages_field!r} column of messages with image and "
                f"video parts); these are {kind} samples"
            )
        if overlong == "truncate":
            raise ValueError(
                "--overlong truncate with --processor: cutting a sample could cut an image's or a clip's "
                "placeholder tokens apart from its pixels; use --overlong drop or --overlong error"
            )
        kind = "vision chat"
        base_dir = Path(source).parent if Path(source).is_file() else Path(source)
        encoder = VisionChatEncoder(
            processor, fld, mask=mask, base_dir=base_dir, images_field=images_field, videos_field=videos_field, fps=fps
        )
        columns, cut, features = VISION_COLUMNS, truncate, output_features()
    elif group_answers:
        layout = group_layout(raw.column_names, prompt_field, answers_field, train_rejected)
        kind = f"grouped answers ({layout.describe()})"
        encoder = GroupAnswersEncoder(tokenizer, layout, mask=mask, add_eos=add_eos)
        columns, cut = GROUPED_COLUMNS, truncate_group
    else:
        if MASK_COLUMN in raw.column_names:
            raise InputError(
                f"{source}: the input has an {MASK_COLUMN!r} column; masks are written by preprocessing in token "
                f"positions (--group-answers writes shared-prompt masks), so an input mask would be dropped: "
                f"rename or remove the column"
            )
        kind, fld = infer_kind(raw.column_names, text_field, messages_field, prompt_field, completion_field)
        encoder = SampleEncoder(tokenizer, kind, fld, mask=mask, add_eos=add_eos, completion_field=completion_field)
        columns, cut = OUTPUT_COLUMNS, truncate
    num_proc = num_proc if num_proc and num_proc > 1 else None
    try:
        ds = raw.map(
            encoder,
            batched=True,
            batch_size=batch_size,
            with_indices=True,
            num_proc=num_proc,
            remove_columns=raw.column_names,
            features=features,
            desc=f"tokenising {kind} samples",
        )
    except EncodeError as e:  # "sample 7: ..." of which input
        raise EncodeError(f"{source}: {e}") from None
    grouped = None
    if group_answers:
        answers = np.asarray(ds["answers"], dtype=np.int64)
        tokens = np.asarray(ds["length"], dtype=np.int64)
        prompts = np.asarray(
            [0 if m is None else json.loads(m)["prompt"] for m in ds[MASK_COLUMN]], dtype=np.int64
        )  # a one-answer group is stored causal; its prompt is not shared
        grouped = {
            "answers": int(answers.sum()),
            "tokens": int(tokens.sum()),
            "separate_tokens": int(tokens.sum() + ((answers - 1) * prompts).sum()),
        }
        if layout.untrained:
            grouped["untrained"] = (
                f"{' and '.join(layout.untrained)} answers carry no labels (hf_cp's loss is cross-entropy, which "
                f"would teach them); --train-rejected trains them"
            )
        grouped["feeds"] = grouped_data_feeds(layout)

    lengths = np.asarray(ds["length"], dtype=np.int64)
    longest = int(lengths.max())
    over = np.flatnonzero(lengths > max_length) if max_length else np.zeros(0, dtype=np.int64)
    examples = [(int(i), int(lengths[i])) for i in over[:5]]
    if len(over) and overlong == "error":
        i, n = examples[0]
        more = (
            f" ({len(over) - 1} more: "
            + ", ".join(f"sample {j} has {m}" for j, m in examples[1:])
            + (", ..." if len(over) > 5 else "")
            + ")"
            if len(over) > 1
            else ""
        )
        raise ValueError(
            f"sample {i} has {n} tokens, more than --max-length {max_length}{more}; "
            f"choose --overlong drop or --overlong truncate, or raise --max-length"
        )
    dropped_overlong = truncated = 0
    if len(over) and overlong == "drop":
        ds = ds.filter(
            lambda n: [x <= max_length for x in n],
            input_columns="length",
            batched=True,
            num_proc=num_proc,
            desc=f"dropping samples over {max_length} tokens",
        )
        dropped_overlong = len(over)
    elif len(over) and overlong == "truncate":
        ds = ds.map(
            lambda row: cut(row, max_length) if row["length"] > max_length else {},
            num_proc=num_proc,
            desc=f"truncating samples to {max_length} tokens",
        )
        truncated = len(over)
    n_before = len(ds)
    ds = ds.filter(
        lambda n: [x > 0 for x in n],
        input_columns="length",
        batched=True,
        num_proc=num_proc,
        desc="dropping empty samples",
    )
    dropped_empty = n_before - len(ds)
    if len(ds) == 0:
        raise ValueError(f"{source}: no samples left after the over-long policy and dropping empty samples")
    trained = np.asarray(ds["trained_tokens"], dtype=np.int64)
    not_prefix = int(np.sum(ds["prompt_not_prefix"])) if "prompt_not_prefix" in ds.column_names else 0
    vision_tokens = vision_grids = None
    if processor is not None:
        vision_tokens = {"image": int(np.sum(ds["image_tokens"])), "video": int(np.sum(ds["video_tokens"]))}
        vision_grids = [list(i) + list(v) for i, v in zip(ds["image_grid_thw"], ds["video_grid_thw"])]
        # a kind no sample has: its columns dropped (a dataset of images alone has no video columns)
        for media, names in (("image", ("pixel_values", "image_grid_thw")), ("video", VISION_OUTPUT_COLUMNS[2:])):
            if vision_tokens[media] == 0:
                columns = tuple(c for c in columns if c not in names)
    ds = ds.remove_columns([c for c in ds.column_names if c not in columns])
    # one document per row: a chat's turns end with EOS inside it, which is no packing
    ds.info.description = ONE_DOCUMENT_PER_ROW
    result = PreprocessResult(
        dataset=ds,
        kind=kind,
        input_samples=len(raw),
        overlong=len(over),
        dropped_overlong=dropped_overlong,
        truncated=truncated,
        dropped_empty=dropped_empty,
        untrained=int((trained == 0).sum()),
        trained_tokens=int(trained.sum()),
        longest_input=longest,
        overlong_examples=examples,
        grouped=grouped,
        prompt_not_prefix=not_prefix,
        vision_tokens=vision_tokens,
        vision_grids=vision_grids,
    )
    if out_dir is not None:
        out_dir = Path(out_dir)
        ds.save_to_disk(str(out_dir))
        result.out_dir = out_dir
    return result
