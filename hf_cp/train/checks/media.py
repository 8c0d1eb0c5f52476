"""TRL's vision-language rows (an `image` or `images` column of raw images, turned into pixels
by TRL's collator per padded batch) refused by name by the TRL mixin trainers that do not
tokenise them themselves (CPSFTTrainer, CPKTOTrainer; CPDPOTrainer does, objectives/dpo_vision.py,
and CPGRPOTrainer / CPRLOOTrainer let TRL generate from them, objectives/rollout_vision.py),
before TRL builds anything: hf_cp's planned steps read a processor's columns (input_ids,
pixel_values, image_grid_thw, ...; train/data/vision_columns.py), and TRL's vision rows carry none
of them.
Measured before this check (issue 38): CPDPOTrainer and CPSFTTrainer failed at set-up with
"train_dataset has no 'input_ids' column ... tokenise it first", which names neither the images
nor what trains them; a DPO eval dataset with images beside text training pairs went through
TRL's text pipeline, which failed with "Number of images provided (0) does not match number of
image placeholders (1)". Torch- and TRL-free."""

from __future__ import annotations

from typing import List, Mapping

RAW_IMAGE_COLUMNS = ("image", "images")  # TRL's `_is_vision_dataset` keys
# KTO: TRL's KTOTrainer takes them (its vision collator), but hf_cp's KTO samples are built by
# TRL's text pipeline (each prompt+completion, and the KL term's prompts with another row's
# completion), whose rows carry no images
SHARED_PROMPT_IMAGES_WHY = (
    "TRL's KTOTrainer turns them into pixels in its collator, but hf_cp's KTO samples (each prompt with its "
    "completion, and the KL term's prompts with another row's completion, planned as shared-prompt samples) are "
    "built from TRL's text pipeline and carry no images yet"
)
SHARED_PROMPT_IMAGES_INSTEAD = (
    "Train preference pairs with images with CPDPOTrainer, or prompts with images with CPGRPOTrainer or "
    "CPRLOOTrainer (the model's processor as processing_class), or train "
    "supervised on the images with CPTrainer: `hf-cp preprocess DATA --processor DIR --images-field images` "
    "(docs/vision.md)"
)


def dataset_columns(dataset) -> List[str]:
    """The columns of `dataset` as TRL reads them: a map-style dataset's column names, or a
    stream's first row's keys (none for no dataset, or a name)."""
    if dataset is None or isinstance(dataset, str):
        return []
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        try:
            columns = list(next(iter(dataset)).keys())
        except (StopIteration, TypeError, AttributeError):
            return []
    return list(columns)


def raw_image_columns(dataset) -> List[str]:
    """The raw image columns of `dataset` (dataset_columns)."""
    return [c for c in dataset_columns(dataset) if c in RAW_IMAGE_COLUMNS]


def refuse_raw_images(datasets: Mapping[str, object], trainer: str, why: str, instead: str) -> None:
    """ValueError naming the trainer, the dataset and its raw image column, `why` hf_cp does not
    train it, and `instead`, what does. `datasets`: name -> dataset, or a dict of them (TRL's
    several eval datasets)."""
    for name, dataset in datasets.items():
        if isinstance(dataset, Mapping):
            refuse_raw_images({f"{name}[{k!r}]": v for k, v in dataset.items()}, trainer, why, instead)
            continue
        found = raw_image_columns(dataset)
        if found:
            raise ValueError(
                f"{trainer}: {name} has the column {found[0]!r} (TRL's vision-language rows); {why}. {instead}"
            )
