"""The tiny Llama and Qwen2 (GQA) of the CP model tests, tiny DeepSeek-V3 (MLA: the value head dim
unlike the query/key one), and packed batches for them."""

from __future__ import annotations

import torch

CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=128,
    ),
}

# MLA: q/k head dim qk_nope + qk_rope = 24 against v 16 (and 32); both layers dense (first_k_dense_replace=2)
_MLA = dict(
    model_type="deepseek_v3",
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=2,
    vocab_size=64,
)
CONFIGS["deepseek_v3"] = dict(_MLA, q_lora_rank=None, v_head_dim=16)
CONFIGS["deepseek_v3_wide_v"] = dict(_MLA, q_lora_rank=16, v_head_dim=32)


def build_model(name: str, attn: str):
    """CONFIGS[name] with attn_implementation `attn`, fixed seed, in train mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_cp.attention.interface  # noqa: F401  (registers "hf_cp")

    cfg = dict(CONFIGS[name])
    config = AutoConfig.for_model(
        cfg.pop("model_type"), **cfg, use_cache=False, attention_dropout=0.0, tie_word_embeddings=False
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.train()


def packed_batch(lengths, vocab, seed):
    """token ids, position ids and next-token labels (-100 at each document's end)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.full_like(ids, -100)
    o = 0
    for n in lengths:
        labels[o : o + n - 1] = ids[o + 1 : o + n]
        o += n
    return ids, pos, labels
