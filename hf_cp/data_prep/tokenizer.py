"""Load a tokenizer from a folder, a Hub name, or a GGUF file (transformers reads GGUF offline)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """`AutoTokenizer` for a model folder or Hub name; for a `.gguf` file, the tokenizer stored in it.
    Tokeniser code shipped with a model folder runs only with `trust_remote_code`."""
    from transformers import AutoTokenizer

    p = Path(name_or_path)
    try:
        if p.suffix.lower() == ".gguf":
            if not p.is_file():
                raise FileNotFoundError(f"tokenizer GGUF file {p} does not exist")
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"could not load a tokenizer from {name_or_path!r}: {e}") from None
