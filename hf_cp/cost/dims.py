"""A model's dimensions as the cost model reads them: a transformers config.json, read without
importing transformers, and the parameter, FLOP and byte counts derived from it. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Union

from hf_cp.cost.config_files import ConfigError, resolve_config
from hf_cp.readers import brief, load_json

# the largest model dimension read from a config (hidden size, heads, layers, vocabulary, ...):
# far above any real model's (a 1M vocabulary, 128K intermediate), and small enough that the cost
# model's FLOP and byte counts stay exact integers and finite floats
MAX_MODEL_DIM = 2**24


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

    def __post_init__(self):
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate"):
            if int(getattr(self, f)) <= 0:
                raise ConfigError(f"model dimension {f} must be positive, got {getattr(self, f)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def linear_params_per_layer(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o, k, v
        mlp = 3 * h * self.intermediate  # gate, up, down
        return attn + mlp

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
        """Bytes of one token's keys and values over all layers (ChunkFlow's state store):
        2 (K and V) * kv heads * head dim * bytes * layers."""
        return 2 * self.num_kv_heads * self.head_dim * int(bytes_per_element) * self.num_layers

    @property
    def attention_flops_per_pair(self) -> float:
        """fwd + bwd FLOPs per causal query-key pair and layer: fwd 4*H*D, flash bwd 2.5x fwd."""
        return 14.0 * self.num_heads * self.head_dim

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
            return cls(
                num_layers=dim("num_hidden_layers"),
                hidden=hidden,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                intermediate=dim("intermediate_size"),
                vocab_size=dim("vocab_size", 0),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
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
