#!/usr/bin/env python
"""Write benchmarks/traces/vision_videomme_mix.jsonl: a length trace of vision-language SFT
samples, `{"length": N, "vision": [[t, h, w], ...]}` per line (N in LLM tokens, vision
placeholders included; grids in Qwen2.5-VL patches), built from published statistics. No real
video trace is bundled; see benchmarks/traces/README.md ("Vision-language trace") for what is
measured data and what is an assumption. Deterministic (seeded numpy); rerun to regenerate:

    python scripts/make_video_trace.py [--out benchmarks/traces/vision_videomme_mix.jsonl]

Published numbers used (Video-MME, Fu et al., arXiv:2405.21075, CVPR 2025): 900 videos in three
duration buckets of 300 each, short 11 s - 2 min (mean 80.8 s), medium 4 - 15 min (mean 520.2
s), long 30 - 60 min (mean 2471.0 s); 254 hours in all. Each bucket's durations are drawn from a
Beta(a, b) on its range with a + b = 4 and the published mean (the paper gives no shape).

Text lengths: the bundled chat trace chat_alpaca_eval_outputs.txt (Llama-3 tokens; the first
samples of a seeded permutation), for text-only samples and for the text of image samples.

Assumptions (not from a dataset; change them here):
- the mix: per video, IMAGE_PER_VIDEO single-image samples and TEXT_PER_VIDEO text-only ones;
- video frames: FPS frames a second, FRAMES_MIN to FRAMES_MAX (Qwen2.5-VL's qwen-vl-utils caps a
  video at 768 frames), an even count, at VIDEO_PIXELS (w x h) -> grid (frames / 2, h / 14, w / 14);
- a video sample's text: a multiple-choice question and answer of 80 - 200 tokens (uniform);
- images: one of IMAGE_PIXELS (w x h), uniformly, -> grid (1, h / 14, w / 14).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "benchmarks" / "traces"
CHAT = TRACES / "chat_alpaca_eval_outputs.txt"
OUT = TRACES / "vision_videomme_mix.jsonl"
SEED = 38  # issue 38

# Video-MME (arXiv:2405.21075): (shortest s, longest s, mean s, videos)
VIDEO_MME_BUCKETS = ((11.0, 120.0, 80.8, 300), (240.0, 900.0, 520.2, 300), (1800.0, 3600.0, 2471.0, 300))
BETA_CONCENTRATION = 4.0  # a + b of each bucket's Beta (the paper gives means and ranges only)

PATCH, MERGE, TEMPORAL = 14, 2, 2  # Qwen2.5-VL's patch size, spatial merge, temporal patch
FPS, FRAMES_MIN, FRAMES_MAX = 1.0, 4, 768
VIDEO_PIXELS = (448, 252)  # w x h, 16:9
VIDEO_TEXT_TOKENS = (80, 200)
IMAGE_PIXELS = ((448, 448), (672, 448), (896, 672), (1344, 756))
IMAGE_PER_VIDEO, TEXT_PER_VIDEO = 3, 6


def video_durations(rng: np.random.Generator) -> np.ndarray:
    """Every video's duration in seconds, bucket by bucket (Beta on the range, the published mean)."""
    out = []
    for lo, hi, mean, n in VIDEO_MME_BUCKETS:
        a = BETA_CONCENTRATION * (mean - lo) / (hi - lo)
        out.append(lo + (hi - lo) * rng.beta(a, BETA_CONCENTRATION - a, size=n))
    return np.concatenate(out)


def video_grid(seconds: float):
    frames = int(np.clip(round(seconds * FPS), FRAMES_MIN, FRAMES_MAX)) // TEMPORAL * TEMPORAL
    w, h = VIDEO_PIXELS
    return [frames // TEMPORAL, h // PATCH, w // PATCH]


def image_grid(pixels):
    w, h = pixels
    return [1, h // PATCH, w // PATCH]


def tokens(grid) -> int:
    t, h, w = grid
    return t * h * w // (MERGE * MERGE)


def records(rng: np.random.Generator):
    chat = np.loadtxt(CHAT, dtype=np.int64)
    chat = chat[rng.permutation(len(chat))]
    durations = video_durations(rng)
    rng.shuffle(durations)
    k = 0  # next chat length
    out = []
    for seconds in durations:
        g = video_grid(float(seconds))
        out.append({"length": tokens(g) + int(rng.integers(*VIDEO_TEXT_TOKENS, endpoint=True)), "vision": [g]})
        for _ in range(IMAGE_PER_VIDEO):
            g = image_grid(IMAGE_PIXELS[int(rng.integers(len(IMAGE_PIXELS)))])
            out.append({"length": tokens(g) + int(chat[k]), "vision": [g]})
            k += 1
        for _ in range(TEXT_PER_VIDEO):
            out.append({"length": int(chat[k])})
            k += 1
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = records(np.random.default_rng(SEED))
    args.out.write_text("".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in rows))
    lens = np.asarray([r["length"] for r in rows])
    videos = [r for r in rows if r.get("vision") and r["vision"][0][0] > 1]
    print(
        f"wrote {len(rows)} samples ({len(videos)} videos) to {args.out}: tokens median {int(np.median(lens))}, "
        f"p90 {int(np.percentile(lens, 90))}, max {lens.max()}, total {lens.sum():,}"
    )


if __name__ == "__main__":
    main()
