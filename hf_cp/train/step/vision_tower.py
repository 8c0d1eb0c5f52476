"""A vision-language model's vision tower, as the step executor runs it: each image or clip
encoded once, on the rank the plan's placement chose, its embedding rows sent to the ranks that
hold its placeholder tokens (an all-to-all-v whose backward brings their gradients back).

Honoured families encode an item alone: their encoder's attention runs within each image or
clip (window and full layers alike), so encoding several items in one call, or each on another
rank, gives the same rows as the model's own forward. The tower's `pooler_output` rows replace
the placeholder tokens' embeddings (a forward hook on the input embedding, inside the model's
forward). Qwen3-VL's DeepStack features (the tower's intermediate layers, merged) travel in the
same exchange, beside the rows, and enter the language model's first layers through its own
`visual_pos_masks` / `deepstack_visual_embeds` arguments (a forward pre-hook fills them in), so
its own code adds them. The tower's own attention is not the language model's: it runs in
PyTorch's sdpa, over whole items on one rank, never under a CP context.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from hf_cp.attention.comm import all_to_all
from hf_cp.samples.vision import IMAGE, VIDEO
from hf_cp.train.checks.setup import SetupError
from hf_cp.train.data.vision_rows import WaveVision

logger = logging.getLogger(__name__)

DUMMY = "dummy pass"  # placing(None): a zero-weight pass that still runs the tower

# families whose tower encodes each item alone; their language model takes the merged rows at the
# placeholders (and Qwen3-VL's the DeepStack rows too)
HONOURED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
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
        self.hidden = int(getattr(vision_config, "out_hidden_size", None) or config.text_config.hidden_size)
        # Qwen3-VL: merged features of these tower layers are added after the decoder's first layers
        self.deepstack_layers = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
        self._accepts_seconds = "second_per_grid_ts" in inspect.signature(self._rope_index).parameters
        # the micro-batch being placed (placing()): its vision rows, or DUMMY; None outside a forward
        self._pending: Union[None, str, tuple] = None
        self._deepstack_rows: Optional[List[torch.Tensor]] = None
        self._deepstack_at: Optional[torch.Tensor] = None  # [1, T] bool: the placeholders of the pass
        self._hooks = [top.get_input_embeddings().register_forward_hook(self._place_rows)]
        if self.deepstack_layers:
            self._hooks.append(inner.language_model.register_forward_pre_hook(self._pass_deepstack, with_kwargs=True))

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
        if second_per_grid_ts is not None and self._accepts_seconds:
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
        """Embedding rows of the items of `grid_thw`, back to back: [tokens, hidden x (1 + DeepStack
        layers)] (the merged rows, then each DeepStack layer's: one exchange carries them all)."""
        dtype = next(self.visual.parameters()).dtype
        out = self.visual(pixels.to(dtype), grid_thw=grid_thw)
        if not self.deepstack_layers:
            return out.pooler_output
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=1)

    def dummy_rows(self, device: torch.device) -> torch.Tensor:
        """The rows of one zero image of the smallest grid, times 0: a rank that encodes nothing
        still passes every tower parameter (a data-parallel reduction expects each rank's
        gradient of each) and still joins the exchange's backward."""
        m = self.merge
        pixels = torch.zeros(m * m, self.patch_dim, device=device)
        grid = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
        return self.encode(pixels, grid) * 0.0

    def placeholder_rows(self, vision: WaveVision, group, member: int, device: torch.device):
        """(this rank's placeholder rows in its row order, a zero scalar on the tower's graph):
        the items it encodes sent to their holders (send_index, send_rows), the rows of every other
        encoder received. The scalar keeps every tower parameter in this rank's backward even when
        it neither encodes nor holds an item (a data-parallel reduction expects each one's gradient)."""
        rows = self.encode(vision.pixels.to(device), vision.grid_thw.to(device)) if vision.encodes else None
        if rows is None:
            rows = self.dummy_rows(device)
        send = rows[vision.send_index.to(device)] if vision.encodes else rows[:0]
        if group is not None and len(vision.send_rows) > 1:
            got = all_to_all(send, vision.send_rows, vision.recv_rows, group, member)
        else:
            got = send
        return got[vision.recv_order.to(device)], rows.sum() * 0.0

    # ------------------------------------------------------------------ inside the model's forward
    @contextlib.contextmanager
    def placing(self, vision: Optional[WaveVision], group=None, member: int = 0) -> Iterator[None]:
        """Around one forward of the model: its embedding takes `vision`'s rows at the placeholder
        tokens (None: a dummy pass, the tower's zero-weighted rows only)."""
        self._pending = DUMMY if vision is None else (vision, group, member)
        try:
            yield
        finally:
            self._pending, self._deepstack_rows, self._deepstack_at = None, None, None

    @contextlib.contextmanager
    def placing_rows(self, make: Callable[[torch.device], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        """Around one forward of the model: its embedding takes the rows `make(device)` gives, called
        inside the embedding's forward hook: (rows [n, hidden x (1 + DeepStack layers)] as `encode`
        gives them, their positions in the row, a zero scalar to add: on the tower's graph where the
        pass must reach every tower parameter). Any tower work `make` does is then recorded after the
        embedding, as in placing(): autograd's order of gradients, which a bucketed data-parallel
        reduction (ZeRO-2) relies on being the same on every rank, is the same for every kind of
        pass. ChunkFlow's dependent chunks (step/chunk_vision.py) place their rows so."""
        self._pending = make
        try:
            yield
        finally:
            self._pending, self._deepstack_rows, self._deepstack_at = None, None, None

    def _place_rows(self, module, inputs, output):
        pending, self._pending = self._pending, None
        if pending is None:  # a forward outside placing(): not a planned pass
            return None
        if pending is DUMMY:
            zero = self.dummy_rows(output.device).sum()
            self._deepstack_rows = [output.new_zeros(0, self.hidden)] * self.deepstack_layers
            self._deepstack_at = torch.zeros(output.shape[:2], dtype=torch.bool, device=output.device)
            return output + zero.to(output.dtype)
        if callable(pending):  # placing_rows
            rows, at, zero = pending(output.device)
            at = at.to(output.device)
        else:
            vision, group, member = pending
            rows, zero = self.placeholder_rows(vision, group, member, output.device)
            at = vision.token_positions.to(output.device)
        rows = rows.to(output.dtype)
        if self.deepstack_layers:
            h = self.hidden
            self._deepstack_rows = [rows[:, h * (k + 1) : h * (k + 2)] for k in range(self.deepstack_layers)]
            mask = torch.zeros(output.shape[:2], dtype=torch.bool, device=output.device)
            mask[0, at] = True
            self._deepstack_at = mask
            rows = rows[:, :h]
        # out of place: the placeholder tokens' own embeddings get no gradient, as in the model's forward
        return output.index_put((torch.zeros_like(at), at), rows) + zero.to(output.dtype)

    def _pass_deepstack(self, module, args, kwargs):
        rows, self._deepstack_rows = self._deepstack_rows, None
        if rows is None:
            return None
        kwargs = dict(kwargs, visual_pos_masks=self._deepstack_at, deepstack_visual_embeds=rows)
        return args, kwargs


def vision_tower_of(model: torch.nn.Module, who: str) -> VisionTower:
    """The tower of a model trained on vision inputs, or SetupError naming why not."""
    family = model_family(model)
    if family not in HONOURED:
        raise SetupError(
            f"{who}: the dataset has vision columns, but the {family} model has no vision tower hf_cp runs "
            f"({', '.join(HONOURED)}); the placeholder tokens would train as text. Drop the columns or use a "
            f"vision-language model of those families"
        )
    return VisionTower(model)
