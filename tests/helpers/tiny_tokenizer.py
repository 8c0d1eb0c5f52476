"""A byte-level tokenizer with ChatML special tokens and a chat template, built in memory: what
the TRL and preprocessing tests need from a real tokenizer (fast, offsets, a chat template,
EOS), with no download and a vocabulary a tiny model can hold (256 bytes + 4 specials)."""

from __future__ import annotations

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<pad>"]
VOCAB_SIZE = 256 + len(SPECIALS)


def tiny_chat_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte characters
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 20)
    fast.add_special_tokens(
        {"eos_token": "<|endoftext|>", "pad_token": "<pad>", "additional_special_tokens": SPECIALS[:2]}
    )
    fast.chat_template = CHATML
    assert len(fast) == VOCAB_SIZE, len(fast)
    return fast


# a tiny Qwen3-Next (a Gated DeltaNet layer, then a gated attention layer; MoE MLPs), for the
# preference trainers on a hybrid
TINY_DEEPSEEK_V3 = dict(
    hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2,
    max_position_embeddings=512, attention_dropout=0.0, tie_word_embeddings=False,
)  # fmt: skip
TINY_QWEN3_NEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, max_position_embeddings=512, layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    router_aux_loss_coef=0.0,
)  # fmt: skip


def tiny_chat_model(seed: int = 0, attn: str = "hf_cp", family: str = "llama"):
    """The tiny Llama of configs/models/tiny-llama.json with room for the special tokens, or
    (family "qwen3_next") TINY_QWEN3_NEXT, its recurrent state decaying slowly, or (family
    "deepseek_v3") TINY_DEEPSEEK_V3, MLA with unequal query/key and value head dims, or a tiny
    vision-language model of helpers.tiny_vlm (family "qwen2_5_vl", "qwen3_5", ...: its vocabulary
    of 300 holds this tokenizer's)."""
    import json
    import math

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import hf_cp.attention.interface  # noqa: F401  registers attn_implementation="hf_cp"

    from helpers.harness.models import TINY_MODEL
    from helpers.tiny_vlm import FAMILIES as VLM_FAMILIES
    from helpers.tiny_vlm import build_vlm

    torch.manual_seed(seed)
    if family in VLM_FAMILIES:
        return build_vlm(attn, seed=1234 + seed, family=family)
    if family == "deepseek_v3":  # MLA: value head dim 16 against query/key 16 + 8
        cfg = AutoConfig.for_model("deepseek_v3", vocab_size=VOCAB_SIZE, use_cache=False, **TINY_DEEPSEEK_V3)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    if family == "qwen3_next":
        cfg = AutoConfig.for_model("qwen3_next", vocab_size=VOCAB_SIZE, use_cache=False, **TINY_QWEN3_NEXT)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
        with torch.no_grad():  # random init forgets within a token or two: the state must carry far
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.fill_(math.log(0.05))
                if hasattr(module, "dt_bias"):
                    module.dt_bias.fill_(-2.0)
        return model
    cfg = LlamaConfig(**dict(json.loads(TINY_MODEL.read_text()), vocab_size=VOCAB_SIZE))
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(attn)
    model.config.use_cache = False
    return model
