"""A model's dimensions as the cost model reads them: a transformers config.json, read without
importing transformers, and the parameter, FLOP and byte counts derived from it. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional, Union

from hf_cp.cost.config_files import ConfigError, resolve_config
from hf_cp.readers import brief, load_json

# the largest model dimension read from a config (hidden size, heads, layers, vocabulary, ...):
# far above any real model's (a 1M vocabulary, 128K intermediate), and small enough that the cost
# model's FLOP and byte counts stay exact integers and finite floats
MAX_MODEL_DIM = 2**24


# layer kinds of a config's `layer_types` whose token mixer is softmax attention; the others
# (linear_attention, mamba, conv, ...) are a hybrid's linear-time mixers
SOFTMAX_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "chunked_attention"})


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
        return (
            f"{self.softmax_layers} softmax attention and {self.num_layers - self.softmax_layers} linear-attention or "
            f"state-space layers of {self.num_layers} (attention and K/V exchange priced on the softmax ones)"
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
        p = resolve_config(name_or_path, "models", (".json",))
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ConfigError(f"model config {p}: a directory without a config.json; expected a config.json file")
            p = p / "config.json"
        try:
            cfg = load_json(p.read_text())
        except (OSError, ValueError) as e:  # JSONDecodeError (nested too deep too), UnicodeDecodeError
            raise ConfigError(f"model config {p}: {e}") from None
        return cls.from_hf_config(cfg, source=str(p))
