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


def tiny_chat_model(seed: int = 0, attn: str = "hf_cp"):
    """The tiny Llama of configs/models/tiny-llama.json with room for the special tokens."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_cp.attention.interface  # noqa: F401  registers attn_implementation="hf_cp"

    from helpers.harness.models import TINY_MODEL

    cfg = LlamaConfig(**dict(json.loads(TINY_MODEL.read_text()), vocab_size=VOCAB_SIZE))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(attn)
    model.config.use_cache = False
    return model
