"""The single-process reference the trainer is checked against, built from torch and
transformers alone: nothing of hf_cp's data path (sampler, collator, token columns, loss,
attention) is used, so a bug there cannot hide by appearing on both sides.

It trains the same tiny model on the same global batches with plain torch, one sample at a
time (no packing, no CP, no DeepSpeed, SDPA attention): loss of a step = sum of token losses
/ valid targets of the global batch, global-norm clipping, AdamW. For every step it keeps the
loss, the gradients and their global norm before clipping, and the parameters after the
optimizer step.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .models import IGNORE_INDEX, eval_rows, spec_model, train_rows
from helpers.tiny_vlm import IMAGE_TOKEN, VIDEO_TOKEN

# a vision row's processor columns (the model's forward arguments)
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")

Tensors = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class ReferenceStep:
    index: int  # 0-based global step
    sample_ids: tuple
    loss: float  # sum of token losses / valid targets of the global batch
    valid_targets: int
    grad_norm: float  # global L2 norm of the gradients, before clipping
    grads: Tensors  # before clipping and the optimizer step
    params: Tensors  # after the optimizer step


def reference_batches(lengths: Sequence[int], tokens_per_step: int, steps: int) -> List[List[int]]:
    """The sample ids of the first `steps` global batches, unshuffled: samples in data order, a
    batch closes when the next sample would take it past `tokens_per_step` (a longer sample is
    a batch alone); every epoch cuts the data the same way."""
    epoch: List[List[int]] = []
    for sid, n in enumerate(lengths):
        if epoch and sum(lengths[s] for s in epoch[-1]) + n <= tokens_per_step:
            epoch[-1].append(sid)
        else:
            epoch.append([sid])
    return [list(epoch[k % len(epoch)]) for k in range(steps)]


def next_token_targets(labels: Sequence[int]) -> torch.Tensor:
    """Targets of positions 0..n-2 (the label of the next token); the last position predicts nothing."""
    return torch.tensor(list(labels[1:]), dtype=torch.long)


def sample_loss_sum(model, row: dict) -> torch.Tensor:
    """Sum of the sample's next-token cross-entropies (fp32), the sample run alone (a vision
    sample through the model's own forward: its processor columns, its own M-RoPE)."""
    ids = torch.tensor(row["input_ids"])[None]
    logits = model(input_ids=ids, use_cache=False, **vision_inputs(row, ids, model)).logits[0, :-1].float()
    return F.cross_entropy(logits, next_token_targets(row["labels"]), ignore_index=IGNORE_INDEX, reduction="sum")


def vision_inputs(row: dict, ids: torch.Tensor, model=None) -> dict:
    """A vision row's processor columns as the model's forward takes them (none for text).
    second_per_grid_ts only for Qwen2.5-VL: Qwen2-VL's and Qwen3-VL's M-RoPE take no seconds per
    patch (Qwen3-VL's forward would swallow it in **kwargs: dropped here, not silently ignored)."""
    keys = [
        k for k in VISION_KEYS if k != "second_per_grid_ts" or model is None or model.config.model_type == "qwen2_5_vl"
    ]
    got = {k: torch.as_tensor(np.asarray(row[k])) for k in keys if row.get(k) is not None}
    if got:
        types = torch.zeros_like(ids, dtype=torch.int32)
        types[ids == IMAGE_TOKEN] = 1
        types[ids == VIDEO_TOKEN] = 2
        got["mm_token_type_ids"] = types
    return got


def router_term(model, rows: Sequence[dict]) -> Optional[torch.Tensor]:
    """The MoE router's load-balancing term of a global batch, as transformers computes it over
    one batch holding all of its tokens: coef x the family's own load_balancing_loss_func on every
    layer's router logits of every sample (each sample run alone: its tokens route as in any
    batch). None when the model has no such term."""
    cfg = model.config
    if not getattr(cfg, "output_router_logits", False) or not getattr(cfg, "router_aux_loss_coef", 0.0):
        return None
    func = sys.modules[type(model).__module__].load_balancing_loss_func
    per_layer: List[List[torch.Tensor]] = []
    for row in rows:
        out = model(input_ids=torch.tensor(row["input_ids"])[None], use_cache=False, output_router_logits=True)
        per_layer = per_layer or [[] for _ in out.router_logits]
        for layer, x in zip(per_layer, out.router_logits):
            layer.append(x)
    logits = tuple(torch.cat(layer) for layer in per_layer)
    return cfg.router_aux_loss_coef * func(logits, cfg.num_experts, cfg.num_experts_per_tok, None)


def sample_valid_targets(row: dict) -> int:
    return int((next_token_targets(row["labels"]) != IGNORE_INDEX).sum())


def _key(spec: dict) -> str:
    if spec.get("shuffle"):
        raise ValueError("the reference reproduces unshuffled global batches only (spec shuffle=True)")
    keys = ("lengths", "tokens_per_step", "model", "model_seed", "data_seed", "lr", "adam_epsilon", "max_grad_norm")
    return json.dumps({k: spec.get(k) for k in keys}, sort_keys=True)


@lru_cache(maxsize=16)
def _reference_run(key: str, steps: int) -> tuple:
    spec = json.loads(key)
    rows = train_rows({k: v for k, v in spec.items() if v is not None})
    model = spec_model(spec, attn="sdpa")
    model.train()
    lr = spec["lr"] if spec["lr"] is not None else 1e-3
    max_norm = spec["max_grad_norm"] if spec["max_grad_norm"] is not None else 1.0
    eps = spec["adam_epsilon"] if spec["adam_epsilon"] is not None else 1e-8
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.0)
    out = []
    for k, batch in enumerate(reference_batches(spec["lengths"], spec["tokens_per_step"], steps)):
        opt.zero_grad()
        valid = sum(sample_valid_targets(rows[s]) for s in batch)
        # a batch without targets (one-token samples) has loss 0 and zero gradients; the
        # optimizer still steps (Adam's step count, and so its bias correction, moves on)
        weight = 1.0 / valid if valid else 0.0
        total = 0.0
        for s in batch:
            part = sample_loss_sum(model, rows[s])
            (part * weight).backward()
            total += float(part.detach())
        router = router_term(model, [rows[s] for s in batch])  # couples the batch's tokens: one backward
        if router is not None:
            router.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = total * weight + (float(router.detach()) if router is not None else 0.0)
        out.append(ReferenceStep(k, tuple(batch), loss, valid, norm, grads, params))
    return tuple(out)


def reference_steps(spec: dict, steps: Optional[int] = None) -> List[ReferenceStep]:
    """The first `steps` (default spec['steps']) reference steps of the job described by `spec`."""
    return list(_reference_run(_key(spec), spec["steps"] if steps is None else steps))


def initial_params(spec: dict) -> Tensors:
    return {n: p.detach().clone() for n, p in spec_model(spec, attn="sdpa").named_parameters()}


def reference_params(spec: dict) -> Tensors:
    """Parameters after spec['steps'] optimizer steps, trained on one process, sample by sample."""
    steps = reference_steps(spec)
    return dict(steps[-1].params) if steps else initial_params(spec)


def reference_eval_loss(spec: dict, steps: int) -> float:
    """Loss over spec['eval_lengths'] rows (sum of token losses / valid targets) of the reference
    model after `steps` optimizer steps, one sample at a time."""
    model = spec_model(spec, attn="sdpa")
    if steps:
        trained = reference_steps(spec, steps)[-1].params  # trains (with gradients) unless cached
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(trained[n])
    model.eval()
    total, valid = 0.0, 0
    with torch.no_grad():
        for row in eval_rows(spec):
            total += float(sample_loss_sum(model, row))
            valid += sample_valid_targets(row)
    return total / valid
