"""Which model's dimensions the length report prices a dataset with.

The cost shares (tokens vs attention time per length bucket) depend on the model: attention
overtakes the linear layers at far shorter documents in a small model than in a 7B one. When
`--model` is not given, the model whose tokenizer was given is the one the data is for: its
config.json beside the tokenizer (a model folder), or the config stored in a GGUF file. Only
when neither exists does the report fall back to a named default, and it says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

from hf_cp.cost.dims import ModelDims

DEFAULT_MODEL = "qwen2.5-7b"


def report_model_dims(model: Optional[str], tokenizer: str) -> Tuple[ModelDims, str]:
    """(dimensions, where they came from) for `--model` (when given) or the tokenizer's model."""
    if model:
        return ModelDims.load(model), str(model)
    p = Path(tokenizer)
    if p.is_file() and p.suffix.lower() == ".gguf":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        return ModelDims.from_hf_config(cfg.to_dict(), source=str(p)), f"{p} (the model config in the GGUF file)"
    if p.is_dir() and (p / "config.json").is_file():
        return ModelDims.load(p), f"{p / 'config.json'} (the tokenizer's model)"
    return (
        ModelDims.load(DEFAULT_MODEL),
        f"{DEFAULT_MODEL} (no model config beside the tokenizer; pass --model for your model's dimensions)",
    )
