"""A vision-language run's set-up: the dataset's vision columns read per sample, the model's tower
found, and what hf_cp does not yet carry refused by name before anything trains.

Refused with vision columns: a model without a tower hf_cp runs (step/vision_tower.py), a
streaming or pre-packed dataset (a sample's pixels belong to one row), sharded parameters
(FSDP2, ZeRO-3: the tower runs at the embedding, not as its own sharded pass), the shared-prompt
samples of the preference and RL trainers other than DPO's, and another processor's multimodal
columns. DPO's pairs carry their images in the prompt, and each answer's M-RoPE positions are the
ones of prompt+answer alone (data/vision_columns.shared_prompt_rope).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from hf_cp.train.data.columns import TokenColumns
from hf_cp.train.data.streaming import is_streaming
from hf_cp.train.data.vision_columns import has_vision_columns, refuse_foreign_columns, vision_reader
from hf_cp.train.step.vision_tower import VisionTower, vision_tower_of


def _row_of(dataset):
    def row(sid: int):
        got = dataset[int(sid)]
        # nested lists of a datasets row -> arrays (pixel rows are regular)
        return {k: (np.asarray(v) if k != "input_ids" and isinstance(v, list) else v) for k, v in got.items()}

    return row


def attach_vision(
    dataset,
    data: TokenColumns,
    model: torch.nn.Module,
    who: str,
    name: str = "train_dataset",
    sharding: Optional[str] = None,
    shared_prompts: bool = False,
    tower: Optional[VisionTower] = None,
    vision_pairs: bool = False,
) -> Optional[VisionTower]:
    """The model's VisionTower when `dataset` has vision columns (data.vision set to read them),
    else None (a text-only run: nothing changes). `tower`: the one built for the training data
    (evaluation reuses it). `shared_prompts`: the trainer's samples share a prompt between answers,
    refused with vision columns unless `vision_pairs` (DPO's pairs, whose images sit in the prompt)."""
    columns = list(getattr(dataset, "column_names", None) or [])
    refuse_foreign_columns(columns, f"{who}: {name}")
    if not has_vision_columns(columns):
        return None
    where = f"{who}: {name} has vision columns ({', '.join(c for c in columns if has_vision_columns([c]))})"
    if is_streaming(dataset):
        raise ValueError(f"{where}, and it is a stream; vision samples train from a map-style dataset")
    if data.doc_rows is not None:
        raise ValueError(f"{where}, and pre-packed rows; give one vision sample per row")
    if sharding is not None:
        raise ValueError(
            f"{where}, and parameters sharded by {sharding}; the vision tower runs inside the language model's "
            "embedding pass, which sharded parameters would gather out of order: train it under ZeRO-2 or DDP"
        )
    if shared_prompts and not vision_pairs:
        raise ValueError(
            f"{where}; this trainer's samples share a prompt between answers, which does not carry images or "
            "video yet (CPDPOTrainer's pairs do): train vision-language data with CPTrainer, CPSFTTrainer or "
            "CPDPOTrainer"
        )
    tower = tower or vision_tower_of(model, who)
    data.vision = vision_reader(
        _row_of(dataset), tower.token_ids, tower.merge, tower.rope_positions, masks=data.masks
    )
    return tower
