"""Tiny models under the block engine with masked samples: the models, the cases, the
single-process reference and the check, shared by test_attention_models_blocks.py and
test_solvers_exact.py.

The reference is built independently of hf_cp's attention:
- a causal sample runs alone;
- a shared-prompt sample runs as one sequence per answer, (prompt, answer_i), with the prompt's
  targets counted once (its logits are the same in every run);
- any other masked sample runs alone with a dense 4D mask written from the mask's definition
  (mask_reference.py), per layer type for a model with sliding-window layers (the window in
  rotary positions).
"""

from __future__ import annotations

import torch

from helpers.mask_reference import dense_mask

TOL = 1e-5

MODELS = {
    "llama": dict(model_type="llama", num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=1),
    "qwen2_sliding": dict(
        model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=6, max_window_layers=1
    ),
}

CASES = {
    2: dict(
        distributed=[("shared_prompt", 0, 5, [6, 4, 7]), ("prefix_lm", 21, 6), ("slices", 15), ("causal", 13)],
        locals=[[("block_causal", 9, 3)], [("sliding_window", 11, 4), ("causal", 3)]],
    ),
    4: dict(
        distributed=[
            ("causal", 27),
            ("shared_prompt", 0, 4, [5, 8]),
            ("block_causal", 17, 5),
            ("sliding_window", 19, 5),
        ],
        locals=[[("prefix_lm", 8, 3)], [], [("slices", 12)], [("shared_prompt", 0, 2, [3, 3])]],
    ),
}


def build_model(name, attn):
    """MODELS[name] at the tiny size, attn_implementation `attn`, fixed seed, in train mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_cp.attention.interface  # noqa: F401  (registers "hf_cp")

    cfg = dict(MODELS[name])
    config = AutoConfig.for_model(
        cfg.pop("model_type"),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        vocab_size=128,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        **cfg,
    )
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).train()


def layer_windows(config):
    """Per layer: its sliding window, or None for full attention."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


def sample_data(mask, n, gen):
    """ids, rotary positions and targets (next token within the sample's segment, else -100)."""
    ids = torch.randint(0, 128, (n,), generator=gen)
    pos = torch.tensor(mask.position_ids()) if mask is not None else torch.arange(n)
    segments = mask.segments() if mask is not None else [(0, n)]
    tgt = torch.full((n,), -100)
    for a, b in segments:
        tgt[a : b - 1] = ids[a + 1 : b]
    return ids, pos, tgt


def loss_sum(logits, targets):
    return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def reference_sample(model, mask, n, ids, tgt, n_valid):
    """Logits [n, V] of one sample by the reference rules above; backpropagates loss / n_valid."""
    if mask is None:
        logits = model(input_ids=ids[None]).logits[0]
        (loss_sum(logits, tgt) / n_valid).backward()
        return logits.detach()
    if mask.kind == "shared_prompt":
        p = mask.prompt
        out, start = torch.zeros(n, model.config.vocab_size), p
        for i, a in enumerate(mask.answers):
            seq = torch.cat([ids[:p], ids[start : start + a]])
            logits = model(input_ids=seq[None]).logits[0]
            loss = loss_sum(logits[p:], tgt[start : start + a])
            if i == 0:  # the prompt's targets once
                loss = loss + loss_sum(logits[:p], tgt[:p])
                out[:p] = logits[:p].detach()
            (loss / n_valid).backward()
            out[start : start + a] = logits[p:].detach()
            start += a
        return out

    def additive(window):
        allowed = torch.from_numpy(dense_mask(mask, n, window))
        return torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)

    windows = layer_windows(model.config)
    if any(w is not None for w in windows):
        w = next(x for x in windows if x is not None)
        attn = {"full_attention": additive(None), "sliding_attention": additive(w)}
    else:
        attn = additive(None)
    logits = model(input_ids=ids[None], attention_mask=attn).logits[0]
    (loss_sum(logits, tgt) / n_valid).backward()
    return logits.detach()


def check_rows(rows):
    """Every rank's loss, logits, gradients (within TOL) and bytes sent (exactly) against the reference."""
    assert rows
    for r in rows:
        assert abs(r["loss"] - r["ref_loss"]) <= TOL, r
        assert r["logits_err"] <= TOL, r
        assert r["grad_err"] <= TOL, r
        assert r["grad_scale"] > 1e-3, "reference gradients vanish: the comparison would prove nothing"
        assert r["bytes_sent"] == r["expected_bytes"], f"bytes sent differ from block_cost's model: {r}"
