"""The tiny models and the synthetic data every trainer exactness test trains on.

The tiny Llama is built from hf_cp/configs/models/tiny-llama.json, the tiny Qwen2 from
TINY_QWEN2 (grouped-query attention with 4 query heads per KV head, and the q/k/v biases Qwen2
has), each with a fixed seed, so the distributed job and the single-process reference start
from bit-identical parameters without sharing a file. A job spec picks one with `model`
("llama", the default, "qwen2", "qwen3_next": a Gated DeltaNet hybrid, "qwen3_moe": MoE MLPs
whose router's load-balancing loss is on, or the vision-language "qwen2_5_vl" and "qwen3_vl":
tests/helpers/tiny_vlm.py's, on vision_rows' random images and clips).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence

import numpy as np
import torch

from helpers.tiny_vlm import MERGE, make_sample, qwen3_vl_config, vlm_config

ROOT = Path(__file__).resolve().parents[3]
TINY_MODEL = ROOT / "hf_cp" / "configs" / "models" / "tiny-llama.json"

# the tiny Llama's size, which the other families share
TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=65536,
)

# Qwen2 at the tiny Llama's size, one KV head for four query heads (the Llama has two); a
# byte-level vocabulary like the Llama's, full attention in every layer (no sliding window)
TINY_QWEN2 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=65536,
    rope_theta=10000.0,
    rms_norm_eps=1e-06,
    use_sliding_window=False,
    tie_word_embeddings=False,
    use_cache=False,
)
QWEN2_BIAS_STD = 0.25

# Qwen3-Next at the same size: a Gated DeltaNet layer, then a gated full-attention layer, MoE
# MLPs (4 experts, 2 a token, a shared expert; no router auxiliary loss). The recurrent layers'
# decay starts slow (A_log, dt_bias below) so that their state carries across many tokens: with
# transformers' random init it forgets within a token or two, and a state leaking across a
# document start or a rank would hardly show.
TINY_QWEN3_NEXT = dict(
    **TINY_DIMS,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    output_router_logits=False,
    tie_word_embeddings=False,
    use_cache=False,
)
# Qwen3.5's text model: Gated DeltaNet beside gated attention, dense MLPs
TINY_QWEN3_5_TEXT = {
    k: v for k, v in TINY_QWEN3_NEXT.items()
    if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "output_router_logits")
}  # fmt: skip
# Qwen3-MoE at the same size with the router's auxiliary loss on (output_router_logits): its
# load-balancing term couples every token of a step. A large coefficient, so that the term is a
# visible share of the gradient (the router's weights get most of theirs from it).
TINY_QWEN3_MOE = dict(
    **TINY_DIMS,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    output_router_logits=True,
    router_aux_loss_coef=0.5,
    tie_word_embeddings=False,
    use_cache=False,
)
MODELS = ("llama", "qwen2", "qwen3_next", "qwen3_5_text", "qwen3_moe", "qwen2_5_vl", "qwen3_vl")
# the vision-language families: their rows carry random images and clips (vision_rows)
VISION_MODELS = ("qwen2_5_vl", "qwen3_vl")

# transformers' convention for "no loss at this position"; spelled out here rather than taken
# from hf_cp's collator, which these tests check
IGNORE_INDEX = -100


def tiny_config(family: str = "llama"):
    """The transformers config of the tiny `family` model ("llama" or "qwen2")."""
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**json.loads(TINY_MODEL.read_text()))
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**TINY_QWEN2)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**TINY_QWEN3_NEXT)
    if family == "qwen3_5_text":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**TINY_QWEN3_5_TEXT)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**TINY_QWEN3_MOE)
    if family == "qwen2_5_vl":  # a vision-language model: random images and clips (vision_rows)
        return vlm_config()
    if family == "qwen3_vl":  # DeepStack: the tower's layer features added after the first decoder layers
        return qwen3_vl_config()
    raise ValueError(f"harness model {family!r}: expected one of {list(MODELS)}")


def tiny_model(seed: int = 0, attn: str = "hf_cp", family: str = "llama"):
    """The tiny `family` model (tiny_config), initialised from `seed`, in fp32, without a KV
    cache, with attention implementation `attn` (the reference uses "sdpa")."""
    from transformers import (
        LlamaForCausalLM,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2ForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3MoeForCausalLM,
        Qwen3NextForCausalLM,
        Qwen3VLForConditionalGeneration,
    )

    if attn == "hf_cp":
        import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")
    cfg = tiny_config(family)
    torch.manual_seed(seed)
    classes = {
        "llama": LlamaForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "qwen3_next": Qwen3NextForCausalLM,
        "qwen3_5_text": Qwen3_5ForCausalLM,
        "qwen3_moe": Qwen3MoeForCausalLM,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
    }
    model = classes[family](cfg)
    if family in ("qwen3_next", "qwen3_5_text"):
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.fill_(-3.0)  # exp(-3) * softplus(-2 + a): about 0.006 of decay a token
                    module.dt_bias.fill_(-2.0)
    if family == "qwen2":
        # Qwen2's q/k/v biases start from the seed (normal, QWEN2_BIAS_STD), not at zero as
        # transformers initialises them (a pretrained Qwen2's are far from zero). The check
        # compares each parameter after AdamW relative to its norm; a zero-initialised one is
        # its Adam updates alone, which normalise every entry's gradient, so the rounding of
        # its smallest gradient entries becomes a relative error of the whole parameter
        # (measured with zero biases: 7.3e-6 on a k_proj bias after 2 steps at AdamW eps 1e-6,
        # 1.3e-5 at 1e-8, its gradient within 1.3e-6; with these biases <= 6.1e-7).
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("_proj.bias"):
                    param.normal_(0.0, QWEN2_BIAS_STD)
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


def item_tokens(kind: str, grid: Sequence[int], frames_apart: bool = False) -> int:
    """The tokens make_sample writes for one image or clip: its placeholders between a vision
    start/end pair, or (`frames_apart`, a Qwen3-VL clip) per frame two timestamp tokens and the
    frame's placeholders between its own start/end pair."""
    t, h, w = grid
    if kind == "video" and frames_apart:
        return t * (2 + 2 + h * w // MERGE**2)
    return 2 + t * h * w // MERGE**2


def vision_rows(lengths: Sequence[int], seed: int = 0, family: str = "qwen2_5_vl") -> List[dict]:
    """synthetic_rows' samples, every other one with a random image a quarter in, and from 100
    tokens a random two-frame clip half-way too: the same lengths, placeholders in place of text.
    `family`'s processor layout: Qwen3-VL writes each clip frame apart (make_sample frames_apart)
    and no second_per_grid_ts (its frames' times are the timestamp tokens)."""
    apart = family == "qwen3_vl"
    rows = []
    for i, row in enumerate(synthetic_rows(lengths, seed)):
        n = len(row["input_ids"])
        items = []
        if i % 2 == 0 and n >= 30:
            items.append((n // 4, "image", (1, 4, 4)))
        if i % 2 == 0 and n >= 100:
            items.append((n // 2, "video", (2, 4, 8)))
        layout, at = [], 0
        for start, kind, grid in items:
            layout += [("text", start - at), (kind, grid)]
            at = start + item_tokens(kind, grid, apart)
        layout.append(("text", n - at))
        got = make_sample(seed * 1000 + i, layout, frames_apart=apart)
        if apart:
            got.pop("second_per_grid_ts", None)
        if len(got["input_ids"]) != n:
            raise AssertionError(f"vision row {i}: {len(got['input_ids'])} tokens for length {n}")
        labels = [IGNORE_INDEX if y == IGNORE_INDEX else x for x, y in zip(got["input_ids"], row["labels"])]
        rows.append(dict(got, labels=labels, length=n))
    return rows


def spec_model(spec: dict, attn: str = "hf_cp"):
    """The model a job spec trains (`model`, `model_seed`), with attention `attn`."""
    return tiny_model(spec.get("model_seed") or 0, attn=attn, family=spec.get("model") or "llama")


def train_rows(spec: dict) -> List[dict]:
    if spec.get("model") in VISION_MODELS:
        return vision_rows(spec["lengths"], spec.get("data_seed", 0), spec["model"])
    return synthetic_rows(spec["lengths"], spec.get("data_seed", 0))


def eval_rows(spec: dict) -> List[dict]:
    if spec.get("model") in VISION_MODELS:
        return vision_rows(spec["eval_lengths"], spec.get("data_seed", 0) + 1, spec["model"])
    return synthetic_rows(spec["eval_lengths"], spec.get("data_seed", 0) + 1)
