"""The single-process reference of the ChunkFlow tests: whole samples in the sdpa model."""

from __future__ import annotations

import torch

from helpers.attention_models import CONFIGS, build_model, packed_batch


def reference(model_name, docs, scale, seed):
    """(summed token loss, gradients) of the sdpa model on `docs` (a list of token-id/label pairs),
    each a whole sample in its own forward, loss scaled by `scale`."""
    model = build_model(model_name, "sdpa")
    total = 0.0
    for ids, labels in docs:
        logits = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None]).logits[0]
        loss = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
        (loss * scale).backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def sample(n, seed, model_name):
    """Token ids and next-token labels of one sample of `n` tokens."""
    ids, _, labels = packed_batch([n], CONFIGS[model_name]["vocab_size"], seed)
    return ids, labels


def grad_errors(model, ref_grads):
    """Per parameter: max |grad - reference| / max |reference|."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        scale = ref_grads[n].abs().max().item()
        assert scale > 0, f"reference gradient of {n} vanishes: the comparison would prove nothing"
        out[n] = (g - ref_grads[n]).abs().max().item() / scale
    return out
