#!/usr/bin/env python
"""Vision tower forward time per rank: hf_cp's placement (each image or clip encoded once, on one
member of the CP group that holds its tokens, train/data/vision_rows.py) against every member
encoding every item of its group (what a CP integration does that gives each rank the whole
sample's pixels, e.g. verl #3998).

One CP group of `--group` members holds a wave: `--videos` samples with a clip each spread over
the group (the long tail) beside one local sample with an image on every member. Each member's
items are encoded by a Qwen2.5-VL-style tower (random weights, sdpa, forward only; default a
4-layer tower of width 256, patch 14) in this one process, one member after another: the ms are
this machine's, the ratios are what the placement saves. An item is encoded whole on one member (its
full-attention layers span a frame): the slowest member is bounded below by the largest item. The embedding rows each member then
sends are counted too (hf_cp's exchange; the baseline sends nothing but encodes everything).

    python scripts/bench_vision_tower.py                 # group 4, 2 clips of 8 frames at 224x224
    python scripts/bench_vision_tower.py --group 8 --videos 3 --frames 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import numpy as np
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from hf_cp.modes.segments import ShardMode
from hf_cp.plan.step_plan import Group
from hf_cp.samples.vision import sample_vision
from hf_cp.train.data.vision_rows import wave_vision
from hf_cp.train.step.vision_tower import VisionTower

IMAGE, VIDEO, START, END = 1000, 1001, 1002, 1003
MERGE = 2


def tower(width: int, depth: int, patch: int) -> VisionTower:
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=1100,
            rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4},
        ),
        vision_config=dict(
            depth=depth,
            hidden_size=width,
            intermediate_size=2 * width,
            num_heads=max(1, width // 64),
            out_hidden_size=64,
            patch_size=patch,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            window_size=8 * patch,
            fullatt_block_indexes=[depth - 1],
            in_channels=3,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    return VisionTower(model)


def sample(sid: int, kind: str, grid, patch_dim: int, text: int = 64):
    """A sample: `text` text tokens, then one item of `grid` (t, h, w patches)."""
    rng = np.random.default_rng(sid)
    t, h, w = grid
    token = IMAGE if kind == "image" else VIDEO
    ids = rng.integers(3, 900, text).tolist() + [START] + [token] * (t * h * w // MERGE**2) + [END]
    pixels = rng.standard_normal((t * h * w, patch_dim)).astype(np.float32)
    return sample_vision(sid, ids, {kind: pixels}, {kind: [list(grid)]}, {"image": IMAGE, "video": VIDEO}, MERGE), ids


def encode_ms(tw: VisionTower, pixels: torch.Tensor, grids: torch.Tensor, repeats: int) -> float:
    if grids.shape[0] == 0:
        return 0.0
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            tw.encode(pixels, grids)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=4, help="members of the CP group")
    ap.add_argument("--videos", type=int, default=2, help="samples with a clip, spread over the group")
    ap.add_argument("--frames", type=int, default=8, help="frames per clip (two per temporal patch)")
    ap.add_argument("--side", type=int, default=224, help="frame and image side in pixels")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--patch", type=int, default=14)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tw = tower(a.width, a.depth, a.patch)
    side = a.side // a.patch // MERGE * MERGE
    vis: Dict[int, object] = {}
    ids: Dict[int, List[int]] = {}
    for v in range(a.videos):
        vis[v], ids[v] = sample(v, "video", (a.frames // 2, side, side), tw.patch_dim)
    local = {}
    for m in range(a.group):
        sid = a.videos + m
        vis[sid], ids[sid] = sample(sid, "image", (1, side, side), tw.patch_dim)
        local[m] = [sid]
    group = Group(
        ranks=tuple(range(a.group)), distributed=list(range(a.videos)), mode=ShardMode.RING_ZIGZAG, local=local
    )
    lengths = {s: len(x) for s, x in ids.items()}
    positions = {s: np.arange(n) for s, n in lengths.items()}
    every = [s for s in vis]  # the baseline: each member encodes the group's every item
    all_pixels = torch.from_numpy(np.concatenate([vis[s].pixels[it.kind] for s in every for it in vis[s].items]))
    all_grids = torch.tensor([it.grid_thw for s in every for it in vis[s].items])
    encode_ms(tw, all_pixels, all_grids, 1)  # warm-up: first calls pay allocation and kernel selection
    baseline = encode_ms(tw, all_pixels, all_grids, a.repeats)
    rows = []
    for m in range(a.group):
        wv = wave_vision(group, m, lengths, vis.get, positions, 0)
        ms = encode_ms(tw, wv.pixels, wv.grid_thw, a.repeats)
        sent = sum(n for k, n in enumerate(wv.send_rows) if k != m)
        rows.append((m, wv.encoded_patches, ms, sent, baseline))
    print(
        f"CP group of {a.group}; {a.videos} clip(s) of {a.frames} frames at {a.side}px spread over it, one "
        f"{a.side}px image local to each member; tower depth {a.depth}, width {a.width}, patch {a.patch}, "
        f"forward only, median of {a.repeats}, one process"
    )
    print(
        f"{'member':>6} | {'patches (hf_cp)':>15} | {'ms (hf_cp)':>10} | {'rows sent':>9} | "
        f"{'patches (every item)':>20} | {'ms (every item)':>15}"
    )
    for m, p, ms, sent, base in rows:
        print(f"{m:>6} | {p:>15} | {ms:>10.1f} | {sent:>9} | {all_pixels.shape[0]:>20} | {base:>15.1f}")
    worst = max(r[2] for r in rows)
    total = sum(r[2] for r in rows)
    print(
        f"slowest member: {worst:.1f} ms (hf_cp) vs {baseline:.1f} ms (every item): {baseline / worst:.2f}x; "
        f"group total {total:.1f} vs {a.group * baseline:.1f} ms: {a.group * baseline / total:.2f}x less tower work"
    )


if __name__ == "__main__":
    main()
