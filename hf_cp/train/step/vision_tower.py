"""A vision-language model's vision tower, as the step executor runs it: each image or clip
encoded once, on the rank the plan's placement chose, its embedding rows sent to the ranks that
hold its placeholder tokens (an all-to-all-v whose backward brings their gradients back).

Honoured families encode an item alone: their encoder's attention runs within each image or
clip (window and full layers alike), so encoding several items in one call, or each on another
rank, gives the same rows as the model's own forward. Qwen2-VL and Qwen2.5-VL qualify: the
tower's `pooler_output` is the merged rows the language model scatters into its placeholders.
A family whose vision inputs reach the language model otherwise (Qwen3-VL's DeepStack features
enter inside its decoder layers) is refused by name, as are vision inputs with a model without a
tower. The tower's own attention is not the language model's: it runs in PyTorch's sdpa, over
whole items on one rank, never under a CP context.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from hf_cp.attention.comm import all_to_all
from hf_cp.samples.vision import IMAGE, KIND_COLUMNS, VIDEO
from hf_cp.train.checks.setup import SetupError
from hf_cp.train.data.vision_rows import WaveVision

logger = logging.getLogger(__name__)

# families whose tower encodes each item alone and whose language model takes only the merged rows
HONOURED = ("qwen2_vl", "qwen2_5_vl")
# families with a vision tower whose outputs reach the language model some other way
REFUSED = {
    "qwen3_vl": "its DeepStack features enter the decoder's first layers at the placeholder tokens",
    "qwen3_vl_moe": "its DeepStack features enter the decoder's first layers at the placeholder tokens",
    "qwen3_5": "its DeepStack features enter the decoder's first layers at the placeholder tokens",
    "qwen3_5_moe": "its DeepStack features enter the decoder's first layers at the placeholder tokens",
}
# the token types of transformers' rope-index functions (mm_token_type_ids)
_TOKEN_TYPE = {IMAGE: 1, VIDEO: 2}


def _top(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT


def model_family(model: torch.nn.Module) -> str:
    return str(getattr(getattr(_top(model), "config", None), "model_type", type(model).__name__))


class VisionTower:
    """The tower of an honoured family (HONOURED); `vision_tower_of` builds one or refuses."""

    def __init__(self, model: torch.nn.Module):
        top = _top(model)
        self.family = model_family(model)
        inner = top.model  # Qwen2(.5)-VL: ForConditionalGeneration.model holds visual and language_model
        self.visual: torch.nn.Module = inner.visual
        self._rope_index = inner.get_rope_index
        config = top.config
        self.merge = int(config.vision_config.spatial_merge_size)
        self.token_ids: Dict[str, int] = {IMAGE: int(config.image_token_id), VIDEO: int(config.video_token_id)}
        self.patch_dim = int(
            config.vision_config.in_channels
            * config.vision_config.temporal_patch_size
            * config.vision_config.patch_size**2
        )
        vision_config = config.vision_config
        if getattr(vision_config, "_attn_implementation", None) not in ("sdpa", "eager"):
            # attn_implementation="hf_cp" reaches the tower too, whose attention is not causal: the
            # tower attends within whole items on one rank, which sdpa computes exactly
            logger.info("hf_cp: the %s vision tower's attention runs in sdpa (it encodes whole items)", self.family)
            vision_config._attn_implementation = "sdpa"

    # ------------------------------------------------------------------ data side (CPU, numpy)
    def rope_positions(
        self, input_ids: Sequence[int], grids: Dict[str, np.ndarray], second_per_grid_ts: Optional[Sequence[float]]
    ) -> np.ndarray:
        """The M-RoPE positions [3, L] of a whole sample, by the model's own rope-index function."""
        ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
        types = torch.zeros_like(ids, dtype=torch.int32)
        for kind, t in _TOKEN_TYPE.items():
            types[ids == self.token_ids[kind]] = t
        kwargs = {}
        if second_per_grid_ts is not None and self.family == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.as_tensor(np.asarray(second_per_grid_ts, dtype=np.float64))
        image, video = grids.get(IMAGE), grids.get(VIDEO)
        with torch.no_grad():
            pos, _ = self._rope_index(
                ids,
                types,
                image_grid_thw=torch.as_tensor(image) if image is not None and len(image) else None,
                video_grid_thw=torch.as_tensor(video) if video is not None and len(video) else None,
                **kwargs,
            )
        return pos[:, 0].numpy().astype(np.int64)

    # ------------------------------------------------------------------ step side
    def encode(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged embedding rows of the items of `grid_thw`, back to back: [tokens, hidden]."""
        dtype = next(self.visual.parameters()).dtype
        return self.visual(pixels.to(dtype), grid_thw=grid_thw).pooler_output

    def dummy_rows(self, device: torch.device) -> torch.Tensor:
        """The rows of one zero image of the smallest grid, times 0: a rank that encodes nothing
        still passes every tower parameter (a data-parallel reduction expects each rank's
        gradient of each) and still joins the exchange's backward."""
        m = self.merge
        pixels = torch.zeros(m * m, self.patch_dim, device=device)
        grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
        return self.encode(pixels, grid) * 0.0

    def placeholder_rows(self, vision: WaveVision, group, member: int, device: torch.device) -> torch.Tensor:
        """This rank's placeholder rows, in its row order: the items it encodes, sent to their
        holders (send_index, send_rows) and the rows of every other encoder received."""
        if vision.encodes:
            rows = self.encode(vision.pixels.to(device), vision.grid_thw.to(device))
        else:
            rows = self.dummy_rows(device)
        send = rows[vision.send_index.to(device)]
        if group is not None and len(vision.send_rows) > 1:
            got = all_to_all(send, vision.send_rows, vision.recv_rows, group, member)
        else:
            got = send
        # the dummy's zero rows stay in the graph (a zero gradient) when none of them is sent
        anchor = rows.sum() * 0.0 if not vision.encodes else 0.0
        return got[vision.recv_order.to(device)] + anchor


def vision_tower_of(model: torch.nn.Module, who: str) -> VisionTower:
    """The tower of a model trained on vision inputs, or SetupError naming why not."""
    family = model_family(model)
    if family in REFUSED:
        raise SetupError(
            f"{who}: the dataset has images or video ({', '.join(c for p in KIND_COLUMNS.values() for c in p)}), "
            f"and the {family} model's vision inputs are not yet carried by hf_cp: {REFUSED[family]}, which hf_cp "
            f"does not shard. Train it on text, or use a family whose tower hf_cp runs ({', '.join(HONOURED)})"
        )
    if family not in HONOURED:
        raise SetupError(
            f"{who}: the dataset has vision columns, but the {family} model has no vision tower hf_cp runs "
            f"({', '.join(HONOURED)}); the placeholder tokens would train as text. Drop the columns or use a "
            f"vision-language model of those families"
        )
    return VisionTower(model)
