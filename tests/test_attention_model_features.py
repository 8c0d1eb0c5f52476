"""A model's own attention features under attn_implementation="hf_cp" (one process).

Sliding windows reach the attention in three ways and each is converted to a mask on the
layers it applies to: the `sliding_window` kwarg (Qwen2 with use_sliding_window and
max_window_layers, Mistral), the mask alone (Qwen2-MoE, PhiMoE: transformers builds a
sliding-window mask but the attention gets no kwarg), and layer_types alternation (Qwen2,
Qwen2-MoE, GPT-OSS, Gemma 3). GPT-OSS attention sinks go through the log-sum-exp merge. Logits and
gradients must equal the model's own sdpa/eager attention run on each document separately,
and each feature must change the logits (so ignoring it would fail the comparison).
Gemma 2's logit soft-capping runs the capping kernel. A user's attention mask tensor, chunked
attention and extra mask functions are refused by name.
"""

from __future__ import annotations

import pytest
import torch

TOL = 1e-5

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    use_cache=False,
    attention_dropout=0.0,
)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# model type, config, reference attention, how the window reaches attention
FEATURES = {
    "qwen2_layer_types": ("qwen2", dict(use_sliding_window=True, max_window_layers=1, sliding_window=5), "sdpa"),
    "qwen2_moe_mask_only": (
        "qwen2_moe",
        dict(
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        "sdpa",
    ),
    "mistral_every_layer": ("mistral", dict(sliding_window=5), "sdpa"),
    "phimoe_mask_only": (
        "phimoe",
        dict(sliding_window=5, router_jitter_noise=0.0, input_jitter_noise=0.0, **MOE),
        "sdpa",
    ),
    "gpt_oss_sinks_and_windows": ("gpt_oss", dict(sliding_window=5, **MOE), "eager"),
    "gemma3_alternation": (
        "gemma3_text",
        dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16),
        "eager",
    ),
    # Gemma 2's attention logit soft-capping, at a cap its scores reach, beside its window alternation
    "gemma2_softcap_and_alternation": (
        "gemma2",
        dict(
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            attn_logit_softcapping=0.05,
            final_logit_softcapping=None,
        ),
        "eager",
    ),
}
LENGTHS = [20, 3, 17]


def build(model_type, attn, seed=0, **cfg):
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_cp.attention.interface  # noqa: F401  (registers "hf_cp")

    config = AutoConfig.for_model(model_type, **{**COMMON, **cfg})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).train()


def _batch():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (1, sum(LENGTHS)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return ids, pos


def _separately(model, ids):
    """Logits of every document run on its own (transformers' packed path is not the
    reference: its GPT-OSS eager attention differs from separate documents by 0.25 here)."""
    out, start = [], 0
    for n in LENGTHS:
        out.append(model(input_ids=ids[:, start : start + n]).logits)
        start += n
    return torch.cat(out, 1)


def _loss(logits, ids):
    targets = ids.clone()
    targets[:, :-1] = ids[:, 1:]
    start = 0
    for n in LENGTHS:
        targets[:, start + n - 1] = -100  # no target across documents
        start += n
    return torch.nn.functional.cross_entropy(logits[0], targets[0], ignore_index=-100, reduction="sum")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_model_attention_features_match_the_model_on_separate_documents(name):
    model_type, cfg, ref_attn = FEATURES[name]
    ids, pos = _batch()
    mine, ref = build(model_type, "hf_cp", **cfg), build(model_type, ref_attn, **cfg)
    out = mine(input_ids=ids, position_ids=pos).logits
    want = _separately(ref, ids)
    assert (out - want).abs().max() <= TOL
    _loss(out, ids).backward()
    _loss(want, ids).backward()
    for (n, p), (_, r) in zip(mine.named_parameters(), ref.named_parameters()):
        if r.grad is None:
            assert p.grad is None or not p.grad.any(), n
            continue
        assert (p.grad - r.grad).abs().max() <= TOL * max(1.0, r.grad.abs().max().item()), n
    # the features matter here: without the window (or without sinks) the model's logits move
    no_window = build(model_type, ref_attn, **{**cfg, "sliding_window": 1000})
    assert (_separately(no_window, ids) - want).abs().max() > 1e-3
    if model_type == "gemma2":  # and without the cap they move too
        no_cap = build(model_type, ref_attn, **{**cfg, "attn_logit_softcapping": None})
        assert (_separately(no_cap, ids) - want).abs().max() > 1e-3
    if model_type == "gpt_oss":
        with torch.no_grad():
            for layer in ref.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        assert (_separately(ref, ids) - want).abs().max() > 1e-3
        assert any(layer.self_attn.sinks.grad.abs().max() > 0 for layer in mine.model.layers)


def test_a_user_attention_mask_tensor_is_refused_by_name():
    model = build("llama", "hf_cp")
    ids = torch.randint(0, 128, (1, 6))
    mask4d = torch.zeros(1, 1, 6, 6)
    with pytest.raises(ValueError, match=r"user-supplied \(4D\) attention mask is not supported"):
        model(input_ids=ids, attention_mask=mask4d)


def test_chunked_attention_and_mask_overlays_are_refused_by_name():
    from types import SimpleNamespace

    from hf_cp.attention.interface import hf_cp_mask

    with pytest.raises(ValueError, match="chunked attention"):
        hf_cp_mask(local_size=8, config=SimpleNamespace(attention_chunk_size=8, sliding_window=None))
    with pytest.raises(ValueError, match="adds its own mask function"):
        hf_cp_mask(use_vmap=True)
    assert hf_cp_mask(local_size=5, config=SimpleNamespace(sliding_window=5)).sliding_window == 5
    assert hf_cp_mask(config=SimpleNamespace(sliding_window=5)) is None


@pytest.mark.parametrize(
    "name",
    [
        "mistral_every_layer",
        "gpt_oss_sinks_and_windows",
        "gemma3_alternation",
        "qwen2_moe_mask_only",
        "phimoe_mask_only",
    ],
)
def test_chunkflow_refuses_windows_and_sinks_by_name(name):
    """ChunkFlow's dependent chunks attend causally over the whole K/V state store: a model's
    sliding window or attention sinks would be dropped (measured before the refusal: a
    24-token Mistral sample with window 5 in 3 chunks gave loss 112.379 against the model's
    112.432), so such a layer is refused by name. A model without them still runs chunked."""
    from hf_cp.train.step.chunkflow import run_chunked_sample, sample_chunks

    model_type, cfg, _ = FEATURES[name]
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([ids[0, 1:], torch.tensor([-100])])
    feature = (
        r"a sliding window of 5 and attention sinks \(s_aux\)" if model_type == "gpt_oss" else "a sliding window of 5"
    )
    with pytest.raises(ValueError, match=rf"layer 0\): the model's layer has {feature}, which ChunkFlow"):
        run_chunked_sample(build(model_type, "hf_cp", **cfg), sample_chunks(ids[0], targets, [8, 8, 8]), 3, 1.0)
    plain = build("llama", "hf_cp")
    assert run_chunked_sample(plain, sample_chunks(ids[0], targets, [8, 8, 8]), 3, 1.0) > 0
