"""A model's dimensions as the cost model reads them: a transformers config.json, read without
importing transformers, and the parameter, FLOP and byte counts derived from it. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple, Union

from hf_cp.cost.config_files import ConfigError, resolve_config
from hf_cp.readers import brief, load_json
from hf_cp.samples.vision_grids import GridTHW

# the largest model dimension read from a config (hidden size, heads, layers, vocabulary, ...):
# far above any real model's (a 1M vocabulary, 128K intermediate), and small enough that the cost
# model's FLOP and byte counts stay exact integers and finite floats
MAX_MODEL_DIM = 2**24


# layer kinds of a config's `layer_types` whose token mixer is softmax attention; the others
# (linear_attention, mamba, conv, ...) are a hybrid's linear-time mixers
SOFTMAX_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "chunked_attention"})


# model types whose linear layers are Gated DeltaNet, which hf_cp runs across a CP group by state
# passing (attention/state_passing.STATE_PASSING_MIXERS: each member its own rows); the other
# hybrids' linear layers (Mamba, Mamba2, convolutions) gather a spread document on every member
STATE_PASSING_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


def linear_state_of(cfg: Mapping) -> Dict[str, int]:
    """A Gated DeltaNet hybrid's per-layer state sizes (ModelDims' fields; all 0 for a config of
    another kind): the recurrent state (value heads x key dim x value dim), which ChunkFlow
    carries from chunk to chunk; the [B | P] one piece of a spread document hands on under state
    passing (key dim x (value dim + key dim) per value head, state_passing.py); and the rows
    before a piece its convolution reads."""
    if cfg.get("model_type") not in STATE_PASSING_MODEL_TYPES:
        return {}
    keys = ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    heads, dk, dv = (int(cfg.get(k) or 0) for k in keys)
    return dict(
        recurrent_state_elements=heads * dk * dv,
        passed_state_elements=heads * dk * (dv + dk),
        conv_window=max(0, int(cfg.get("linear_conv_kernel_dim") or 1) - 1),
    )


def softmax_layers_of(cfg: Mapping, layers: int, source: str = "config") -> Optional[int]:
    """How many of a config's `layers` decoder layers are softmax attention, from the ways
    hybrids state it (None: all, a plain transformer): `layer_types` (Qwen3-Next, Qwen3.5,
    Kimi Linear, LFM2, Granite 4), `layers_block_type` (Zamba2), `attn_layer_indices` (Bamba;
    null: none), `attn_layer_period` and
    `attn_layer_offset` (Jamba). Falcon-H1 runs attention and Mamba side by side in every
    layer: all softmax (its Mamba share is not priced)."""
    for key, softmax in (("layer_types", SOFTMAX_LAYER_TYPES), ("layers_block_type", SOFTMAX_LAYER_TYPES | {"hybrid"})):
        types = cfg.get(key)  # (Zamba2's "hybrid" blocks hold an attention layer beside Mamba)
        if isinstance(types, (list, tuple)) and types:
            if len(types) != layers or not all(isinstance(t, str) for t in types):
                raise ConfigError(f"{source}: {key} must name each of the {layers} layers, got {brief(types)}")
            return sum(t in softmax for t in types)
    indices = cfg.get("attn_layer_indices", ())
    if indices is None:  # Bamba without attention layers: every layer Mamba
        return 0
    if isinstance(indices, (list, tuple)) and indices:
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers]
        if bad:
            raise ConfigError(f"{source}: attn_layer_indices must be layer numbers below {layers}, got {brief(bad)}")
        return len(set(indices))
    period, offset = cfg.get("attn_layer_period"), cfg.get("attn_layer_offset")
    if isinstance(period, int) and isinstance(offset, int) and period > 0:
        return sum(1 for i in range(layers) if i % period == offset)
    return None


@dataclass(frozen=True)
class ModelDims:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    # layers whose token mixer is softmax attention (full or sliding); the others of a hybrid
    # (Gated DeltaNet, Mamba) mix tokens in time linear in them, with no attended pairs and no
    # K/V to exchange (None: every layer, as in a plain transformer)
    attention_layers: Optional[int] = None
    # how the linear layers run a document spread over a CP group: by state passing, each member
    # handing `passed_state_elements` per piece and reading `conv_window` rows before it
    # (Gated DeltaNet, linear_state_of); 0: gathered whole on every member (Mamba, convolutions)
    passed_state_elements: int = 0
    conv_window: int = 0
    # the recurrent state of one such layer (linear_state_of), kept per chunk by ChunkFlow
    recurrent_state_elements: int = 0

    def __post_init__(self):
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate"):
            if int(getattr(self, f)) <= 0:
                raise ConfigError(f"model dimension {f} must be positive, got {getattr(self, f)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        a = self.attention_layers
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= self.num_layers):
            raise ConfigError(f"attention_layers {a!r} must be a whole number from 0 to num_layers {self.num_layers}")

    @property
    def softmax_layers(self) -> int:
        """Layers with softmax attention: all of them but a hybrid's linear-attention and
        state-space layers."""
        return self.num_layers if self.attention_layers is None else self.attention_layers

    @property
    def softmax_share(self) -> float:
        """softmax_layers / num_layers: the cost model's per-layer attention time and K/V traffic
        are averages over the layers, so a hybrid's are this share of a transformer's (its linear
        layers' own state hand-off under CP is not priced: a few MB a layer, not per token)."""
        return self.softmax_layers / self.num_layers

    @property
    def linear_layers(self) -> int:
        """A hybrid's layers whose token mixer is linear-time (Gated DeltaNet, Mamba)."""
        return self.num_layers - self.softmax_layers

    @property
    def mixer_share(self) -> float:
        """The token mixer's share of a layer's per-token matmul time: its projections, sized as
        the attention projections (q, k, v, o) against those and the MLP's."""
        return self.attention_params_per_layer / self.linear_params_per_layer

    def with_layers(self, layers: int, **changes) -> ModelDims:
        """These dimensions with `layers` decoder layers (and `changes`), a hybrid keeping its
        softmax share (rounded, at least one softmax layer where it had any)."""
        a = self.attention_layers
        if a is not None:
            a = min(layers, max(1 if a else 0, round(layers * self.softmax_share)))
        return replace(self, num_layers=layers, attention_layers=a, **changes)

    def exchanged(self, nbytes):
        """`nbytes` that a softmax layer exchanges under CP (K/V, Q/O), averaged over the layers
        as the cost model's per-layer numbers are: the same integer for a plain transformer, a
        fraction of it for a hybrid (not rounded: the vectorised pricer multiplies alike)."""
        return nbytes if self.attention_layers is None else nbytes * self.softmax_share

    def layer_mix(self) -> str:
        """The layer mix in words, for reports."""
        if self.attention_layers is None or self.attention_layers == self.num_layers:
            return f"{self.num_layers} softmax attention layers"
        spread = "passing state across a CP group" if self.passed_state_elements else "gathering a spread document"
        return (
            f"{self.softmax_layers} softmax attention and {self.num_layers - self.softmax_layers} linear-attention or "
            f"state-space layers of {self.num_layers} (attention and K/V exchange priced on the softmax ones; the "
            f"linear ones {spread})"
        )

    @property
    def attention_params_per_layer(self) -> int:
        """The attention projections' matrices: q, o, k, v."""
        h, d = self.hidden, self.head_dim
        return h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2

    @property
    def linear_params_per_layer(self) -> int:
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        return self.attention_params_per_layer + mlp

    @property
    def embedding_parameters(self) -> int:
        """The embedding and the LM head (one matrix when tied): what FSDP2's root group holds."""
        return self.vocab_size * self.hidden * (1 if self.tie_word_embeddings else 2)

    @property
    def parameters(self) -> int:
        """Trained parameters, to the precision the gradient reduction needs: the decoder layers'
        matrices and the embedding (and the LM head unless tied); norms are negligible."""
        return self.num_layers * self.linear_params_per_layer + self.embedding_parameters

    @property
    def linear_flops_per_token(self) -> float:
        """fwd + bwd matmul FLOPs per token and layer (2 fwd + 4 bwd per parameter)."""
        return 6.0 * self.linear_params_per_layer

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """Bytes of one token's keys and values over the softmax layers (ChunkFlow's state
        store): 2 (K and V) * kv heads * head dim * bytes * softmax layers."""
        return 2 * self.num_kv_heads * self.head_dim * int(bytes_per_element) * self.softmax_layers

    @property
    def attention_flops_per_pair(self) -> float:
        """fwd + bwd FLOPs per causal query-key pair, averaged over the layers: fwd 4*H*D, flash
        bwd 2.5x fwd, on the softmax share of them (softmax_share)."""
        return 14.0 * self.num_heads * self.head_dim * self.softmax_share

    @classmethod
    def from_hf_config(cls, cfg: Mapping, source: str = "config") -> ModelDims:
        """Read a transformers config dict (config.json) without importing transformers."""
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{source}: expected a transformers config (a JSON object), got {type(cfg).__name__}")
        cfg = dict(cfg)
        if isinstance(cfg.get("text_config"), Mapping) and "hidden_size" not in cfg:
            cfg = dict(cfg["text_config"])

        def dim(key: str, default=None) -> int:
            """A whole number of the config (null or absent: `default`); never rounded."""
            v = cfg[key] if default is None else cfg.get(key)
            if v is None and default is not None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (isinstance(v, int) or v.is_integer()):
                raise ConfigError(f"{source}: field {key!r} must be a whole number, got {brief(v)}")
            if abs(v) > MAX_MODEL_DIM:
                raise ConfigError(f"{source}: field {key!r} must be at most {MAX_MODEL_DIM:,}, got {brief(v)}")
            return int(v)

        try:
            hidden = dim("hidden_size")
            heads = dim("num_attention_heads")
            if heads <= 0:
                raise ConfigError(f"{source}: field 'num_attention_heads' must be positive, got {heads}")
            if dim("vocab_size", 0) < 0:
                raise ConfigError(f"{source}: field 'vocab_size' must not be negative, got {cfg['vocab_size']}")
            if "v_head_dim" in cfg and "qk_nope_head_dim" in cfg:
                # MLA (DeepSeek-V2/V3): hf_cp pads q/k/v to the larger of the q/k and v head dims
                # (interface.hf_cp_attention), and the keys and values it exchanges are per head
                kv_heads = heads
                head_dim = max(dim("qk_nope_head_dim") + dim("qk_rope_head_dim"), dim("v_head_dim"))
            else:
                kv_heads, head_dim = dim("num_key_value_heads", heads), dim("head_dim", hidden // heads)
            layers = dim("num_hidden_layers")
            return cls(
                num_layers=layers,
                hidden=hidden,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                intermediate=dim("intermediate_size"),
                vocab_size=dim("vocab_size", 0),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_layers=softmax_layers_of(cfg, layers, source),
                **linear_state_of(cfg),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing field {e.args[0]!r} (expected a transformers config.json)") from None
        except ConfigError as e:
            raise ConfigError(str(e) if str(e).startswith(f"{source}:") else f"{source}: {e}") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def load(cls, name_or_path: Union[str, Path]) -> ModelDims:
        """A config.json path, a folder holding one, or a model name (hf_cp.resources: the user's
        configs/models/ under the working directory, then the package's built-ins)."""
        cfg, source = _config_file(name_or_path)
        return cls.from_hf_config(cfg, source=source)


# a vision encoder's fwd + bwd FLOPs per forward FLOP: a matmul's backward is twice its forward
# (input and weight gradients), flash attention's 2.5 times (the LLM's own factors, ModelDims)
MATMUL_FWD_BWD = 3.0
ATTENTION_FWD_BWD = 3.5


# VisionDims' fields that are sizes (positive whole numbers)
VISION_DIMENSIONS = (
    "depth",
    "hidden",
    "intermediate",
    "num_heads",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "window_size",
    "out_hidden",
    "in_channels",
)


@dataclass(frozen=True)
class VisionDims:
    """A Qwen2.5-VL-style vision tower (transformers' Qwen2_5_VisionTransformerPretrainedModel) as
    the cost model reads it: `depth` blocks of bidirectional attention (qkv, proj) and a gated
    MLP, a Conv3d patch embedding, and a merger MLP over spatial_merge_size^2 patches. Blocks
    in `fullatt_block_indexes` attend within each temporal frame of an item (its h*w patches);
    the others within windows of window_size // spatial_merge_size // patch_size merged cells a
    side, cut per frame (transformers' get_vision_window_index). Qwen3-VL's DeepStack: after each
    block in `deepstack_visual_indexes`, one more merger of the same shape (Qwen3VLVisionPatchMerger)
    turns that block's output into rows the language model adds to its hidden states at the
    placeholder tokens, one of its first layers per merger."""

    depth: int
    hidden: int
    intermediate: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int
    out_hidden: int
    fullatt_block_indexes: Tuple[int, ...] = ()
    in_channels: int = 3
    gated_mlp: bool = True  # gate, up, down (Qwen2.5-VL); False: fc1, fc2 (Qwen2-VL, Qwen3-VL)
    deepstack_visual_indexes: Tuple[int, ...] = ()  # Qwen3-VL's DeepStack blocks (one merger each)

    def __post_init__(self):
        for f in VISION_DIMENSIONS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_MODEL_DIM:
                raise ConfigError(f"vision dimension {f} must be a positive whole number, got {v!r}")
        bad = [i for i in self.fullatt_block_indexes if isinstance(i, bool) or not isinstance(i, int)]
        bad += [i for i in self.fullatt_block_indexes if isinstance(i, int) and not 0 <= i < self.depth]
        if bad:
            raise ConfigError(f"vision fullatt_block_indexes must be block numbers below depth {self.depth}, got {bad}")
        bad = [i for i in self.deepstack_visual_indexes if isinstance(i, bool) or not isinstance(i, int)]
        bad += [i for i in self.deepstack_visual_indexes if isinstance(i, int) and not 0 <= i < self.depth]
        if bad:
            raise ConfigError(
                f"vision deepstack_visual_indexes must be block numbers below depth {self.depth}, got {bad}"
            )
        if self.window_cells < 1:
            raise ConfigError(
                f"vision window_size {self.window_size} is under one merged cell "
                f"(patch_size {self.patch_size} x spatial_merge_size {self.spatial_merge_size})"
            )

    @property
    def merge_unit(self) -> int:
        """Patches per merged cell (one LLM token): spatial_merge_size^2."""
        return self.spatial_merge_size**2

    @property
    def window_cells(self) -> int:
        """Merged cells per window side (transformers: vit_merger_window_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def full_attention_layers(self) -> int:
        return len(set(self.fullatt_block_indexes))

    @property
    def window_attention_layers(self) -> int:
        return self.depth - self.full_attention_layers

    @property
    def block_params(self) -> int:
        """One block's matmul parameters: qkv (3 h^2), proj (h^2), the MLP's gate, up and down
        (fc1 and fc2 for a two-matrix MLP)."""
        return 4 * self.hidden * self.hidden + (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    @property
    def patch_embed_params(self) -> int:
        """The Conv3d patch embedding: one (channels x temporal x patch x patch) -> hidden matmul per patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2 * self.hidden

    @property
    def merger_params(self) -> int:
        """The merger's two linears, run once per merged cell: (h m^2)^2 and h m^2 x out_hidden."""
        wide = self.hidden * self.merge_unit
        return wide * wide + wide * self.out_hidden

    @property
    def deepstack_mergers(self) -> int:
        """DeepStack mergers (Qwen3-VL): one per entry of deepstack_visual_indexes, as transformers
        builds them (0 for the other towers)."""
        return len(self.deepstack_visual_indexes)

    @property
    def forward_flops_per_patch(self) -> float:
        """Forward matmul FLOPs per patch, the whole tower: 2 per parameter of every block and of
        the patch embedding, and the mergers' share (each runs once per merge_unit patches): the
        final merger and each DeepStack merger, all of merger_params."""
        mergers = (1 + self.deepstack_mergers) * self.merger_params
        return 2.0 * (self.depth * self.block_params + self.patch_embed_params + mergers / self.merge_unit)

    @property
    def deepstack_add_flops_per_patch(self) -> float:
        """FLOPs per patch of adding the DeepStack rows into the language model's hidden states:
        one addition per element of an out_hidden row, per merged cell and merger, in forward
        (its backward passes the gradient on unchanged: no FLOPs). It runs where the placeholder
        tokens are and is priced with the item (about 2e-5 of the mergers' FLOPs for Qwen3-VL)."""
        return self.deepstack_mergers * self.out_hidden / self.merge_unit

    @property
    def forward_flops_per_pair(self) -> float:
        """Forward attention FLOPs per attended (query, key) pair and layer: Q K^T and P V, 2 each
        per head dimension, over all heads (heads x head dim = hidden)."""
        return 4.0 * self.hidden

    def window_lengths(self, grid: GridTHW) -> List[Tuple[int, int]]:
        """(patches, how many) of the windows a window-attention block attends within, for an
        item of patch grid `grid`: per frame, the merged grid (h/m, w/m) cut into windows of
        window_cells a side, the last row and column of windows smaller."""
        t, h, w = grid
        m, c = self.spatial_merge_size, self.window_cells
        rows = _window_sides(h // m, c)
        cols = _window_sides(w // m, c)
        out: Dict[int, int] = {}
        for r, nr in rows:
            for k, nk in cols:
                n = r * k * self.merge_unit
                out[n] = out.get(n, 0) + nr * nk * t
        return sorted(out.items())

    def frame_lengths(self, grid: GridTHW) -> List[Tuple[int, int]]:
        """(patches, how many) of the sequences a full-attention block attends within: one per
        temporal frame of h*w patches (transformers' cu_seqlens)."""
        t, h, w = grid
        return [(h * w, t)]

    def attention_runs(self, grid: GridTHW) -> List[Tuple[int, int]]:
        """(patches, how many) of every sequence one item's attention runs over the whole tower:
        each window block's windows and each full block's frames (what the cost model prices
        by kernel efficiency per length)."""
        runs: Dict[int, int] = {}
        for lengths, layers in (
            (self.window_lengths(grid), self.window_attention_layers),
            (self.frame_lengths(grid), self.full_attention_layers),
        ):
            for n, k in lengths:
                if layers:
                    runs[n] = runs.get(n, 0) + k * layers
        return sorted(runs.items())

    def attention_pairs(self, grid: GridTHW) -> int:
        """Attended pairs of one item over the whole tower: every block attends all pairs of its
        windows (window blocks) or frames (full blocks), both directions."""
        return sum(n * n * k for n, k in self.attention_runs(grid))

    @classmethod
    def from_hf_config(cls, cfg: Mapping, source: str = "config") -> VisionDims:
        """A vision-language config's `vision_config` (or a vision config itself: it has `depth`),
        read without importing transformers. A tower without `window_size` (Qwen2-VL's, Qwen3-VL's,
        Qwen3.5's) attends each frame in every block and has a two-matrix MLP; Qwen2-VL's gives
        its width as `embed_dim` and its MLP as `mlp_ratio` (its `hidden_size` is the merger's
        output). Qwen3-VL's `deepstack_visual_indexes` name its DeepStack blocks (a merger each)."""
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{source}: expected a transformers config (a JSON object), got {type(cfg).__name__}")
        vc = cfg.get("vision_config", cfg) if "depth" not in cfg else cfg
        if not isinstance(vc, Mapping) or "depth" not in vc:
            raise ConfigError(
                f"{source}: no vision tower dimensions (a 'vision_config' with 'depth', 'hidden_size', ...); give a "
                "vision-language model's config.json, e.g. Qwen2.5-VL's"
            )

        def whole(key: str, default=None) -> int:
            v = vc.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{source}: vision_config field {key!r} must be a whole number, got {brief(v)}")
            return v

        windowed = vc.get("window_size") is not None
        qwen2_vl = "embed_dim" in vc  # width embed_dim, MLP embed_dim x mlp_ratio, hidden_size the output
        width = whole("embed_dim") if qwen2_vl else whole("hidden_size")
        ratio = vc.get("mlp_ratio", 4)
        if qwen2_vl and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0):
            raise ConfigError(
                f"{source}: vision_config field 'mlp_ratio' must be a positive number, got {brief(ratio)}"
            )
        intermediate = int(width * ratio) if qwen2_vl else whole("intermediate_size")
        # a tower without windows (Qwen3-VL's, Qwen3.5's) attends each frame in every block
        full = vc.get("fullatt_block_indexes", []) if windowed else list(range(whole("depth")))
        if not isinstance(full, (list, tuple)):
            raise ConfigError(
                f"{source}: vision_config field 'fullatt_block_indexes' must be a list, got {brief(full)}"
            )
        deepstack = vc.get("deepstack_visual_indexes") or []
        if not isinstance(deepstack, (list, tuple)):
            raise ConfigError(
                f"{source}: vision_config field 'deepstack_visual_indexes' must be a list, got {brief(deepstack)}"
            )
        try:
            return cls(
                depth=whole("depth"),
                hidden=width,
                intermediate=intermediate,
                num_heads=whole("num_heads"),
                patch_size=whole("patch_size"),
                spatial_merge_size=whole("spatial_merge_size", 2),
                temporal_patch_size=whole("temporal_patch_size", 2),
                window_size=whole("window_size") if windowed else whole("patch_size") * whole("spatial_merge_size", 2),
                out_hidden=whole("out_hidden_size", whole("hidden_size")) if not qwen2_vl else whole("hidden_size"),
                fullatt_block_indexes=tuple(full),
                in_channels=whole("in_channels", whole("in_chans", 3)),
                gated_mlp=windowed,
                deepstack_visual_indexes=tuple(deepstack),
            )
        except ConfigError as e:
            raise ConfigError(str(e) if str(e).startswith(f"{source}:") else f"{source}: {e}") from None

    @classmethod
    def load(cls, name_or_path: Union[str, Path]) -> VisionDims:
        """From a config.json path, a folder holding one, or a model name (as ModelDims.load)."""
        return cls.from_hf_config(*_config_file(name_or_path))


def vision_activation_tokens(vision: VisionDims, dims: ModelDims, patches):
    """The tower's activations held until backward for `patches` patches encoded on one rank, in
    tokens of the language model's activation memory (the unit of the cap and of
    CostModel.memory_bytes): the language model holds about `num_layers x hidden` elements per
    token (the memory model's alpha), the tower `depth x hidden` of its own per patch, so
    patches x (depth x hidden) / (num_layers x hidden), rounded up. The one count of the
    encoder's memory that the validator, the simulator and the balancers use. An estimate (not
    measured on a tower); the mergers' (DeepStack's too) are not counted. Integers, or integer
    numpy arrays elementwise."""
    return -(-patches * (vision.depth * vision.hidden) // (dims.num_layers * dims.hidden))


def vision_dims_in(name_or_path: Union[str, Path]) -> Optional[VisionDims]:
    """The vision tower of the config at `name_or_path` (as ModelDims.load finds it); None when
    that config has no vision_config (a text-only model)."""
    cfg, source = _config_file(name_or_path)
    return VisionDims.from_hf_config(cfg, source=source) if has_vision_tower(cfg) else None


def has_vision_tower(cfg: Mapping) -> bool:
    """Whether a transformers config describes a vision tower (a `vision_config` with `depth`)."""
    vc = cfg.get("vision_config") if isinstance(cfg, Mapping) else None
    return isinstance(vc, Mapping) and "depth" in vc


def _window_sides(cells: int, side: int) -> List[Tuple[int, int]]:
    """(cells, how many) of the window sides cutting `cells` merged cells into runs of `side`."""
    out = [(side, cells // side)] if cells >= side else []
    if cells % side:
        out.append((cells % side, 1))
    return out


def _config_file(name_or_path: Union[str, Path]) -> Tuple[dict, str]:
    """(the config dict, its path) of a config.json path, a folder holding one, or a model name."""
    p = resolve_config(name_or_path, "models", (".json",))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"model config {p}: a directory without a config.json; expected a config.json file")
        p = p / "config.json"
    try:
        return load_json(p.read_text()), str(p)
    except (OSError, ValueError) as e:  # JSONDecodeError (nested too deep too), UnicodeDecodeError
        raise ConfigError(f"model config {p}: {e}") from None
