"""The tiny model and the synthetic data every trainer exactness test trains on.

Built from hf_cp/configs/models/tiny-llama.json with a fixed seed, so the distributed job and the
single-process reference start from bit-identical parameters without sharing a file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "hf_cp" / "configs" / "models" / "tiny-llama.json"

# transformers' convention for "no loss at this position"; spelled out here rather than taken
# from hf_cp's collator, which these tests check
IGNORE_INDEX = -100


def tiny_model(seed: int = 0, attn: str = "hf_cp"):
    """The tiny Llama, initialised from `seed`, in fp32, without a KV cache, with attention
    implementation `attn` (the reference uses "sdpa")."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if attn == "hf_cp":
        import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")
    cfg = LlamaConfig(**json.loads(TINY_MODEL.read_text()))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(attn)
    model.config.use_cache = False
    return model


def synthetic_rows(lengths: Sequence[int], seed: int = 0, prompt_every: int = 3) -> List[dict]:
    """Random byte-level samples; every `prompt_every`-th one has a masked prompt (a third)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, 256, size=int(n)).tolist()
        labels = list(ids)
        if prompt_every and i % prompt_every == 0 and n > 3:
            for p in range(n // 3):
                labels[p] = IGNORE_INDEX
        rows.append({"input_ids": ids, "labels": labels, "length": int(n)})
    return rows


def train_rows(spec: dict) -> List[dict]:
    return synthetic_rows(spec["lengths"], spec.get("data_seed", 0))


def eval_rows(spec: dict) -> List[dict]:
    return synthetic_rows(spec["eval_lengths"], spec.get("data_seed", 0) + 1)
