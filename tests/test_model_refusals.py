"""hf_cp attention refuses, by name, every model feature it does not implement, instead of
silently computing plain causal attention.

Each case builds a tiny real transformers model whose own config flag (or call argument) turns
the feature on, and runs it with attn_implementation="hf_cp": with the feature on the forward
raises the refusal; the same model with the feature off runs. So each test fails if its
refusal is removed, and cannot pass because of some other error.
"""

from __future__ import annotations

import pytest
import torch

import hf_cp.attention.interface  # noqa: F401  (registers attn_implementation "hf_cp")

SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=128,
    use_cache=False,
)
IDS = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
POS = torch.arange(16)[None]


def _build(model_cls, config, train: bool = True):
    torch.manual_seed(0)
    model = model_cls._from_config(config, attn_implementation="hf_cp")
    return model.train(train)


def _qwen2(on: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # max_window_layers=0: every layer slides (the flag alone decides)
    cfg = Qwen2Config(**SMALL, use_sliding_window=on, sliding_window=4, max_window_layers=0)
    return _build(Qwen2ForCausalLM, cfg)


def _gemma2(on: bool):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # full attention in every layer, so that the softcapping, not Gemma 2's sliding layers, is refused
    cfg = Gemma2Config(
        **SMALL,
        layer_types=["full_attention"] * SMALL["num_hidden_layers"],
        attn_logit_softcapping=50.0 if on else None,
        final_logit_softcapping=None,
    )
    return _build(Gemma2ForCausalLM, cfg)


def _llama(train: bool = True, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(LlamaForCausalLM, LlamaConfig(**{**SMALL, **extra}), train)


def _bert(on: bool):
    from transformers import BertConfig, BertModel

    # an encoder attends both ways; the same layers as a decoder attend causally
    cfg = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        is_decoder=not on,
        use_cache=False,
    )
    return _build(BertModel, cfg)


def _run_lm(model):
    return model(input_ids=IDS, position_ids=POS).logits


# Sliding windows are no longer refused: hf_cp honours them on every layer they apply to, checked
# against the models' own attention in tests/test_attention_model_features.py.


def test_attention_logit_softcapping_runs_rather_than_being_refused():
    # honoured since 2026-12-04 (the capping kernel; exactness in test_attention_model_features.py):
    # the capped model runs, as does the uncapped one
    capped, plain = _run_lm(_gemma2(on=True)), _run_lm(_gemma2(on=False))
    assert torch.isfinite(capped).all() and torch.isfinite(plain).all()


def test_attention_dropout_is_refused_in_training():
    model = _llama(attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"hf_cp attention \(LlamaAttention\): attention dropout 0.1 is not supported"):
        _run_lm(model)
    model.eval()  # transformers passes dropout 0 outside training: nothing to refuse
    assert torch.isfinite(_run_lm(model)).all()
    assert torch.isfinite(_run_lm(_llama(attention_dropout=0.0))).all()


def test_non_causal_attention_is_refused():
    with pytest.raises(ValueError, match=r"hf_cp attention \(BertSelfAttention\): non-causal attention"):
        _bert(on=True)(input_ids=IDS)
    assert torch.isfinite(_bert(on=False)(input_ids=IDS).last_hidden_state).all()


def test_use_cache_in_training_is_refused():
    model = _llama()
    with pytest.raises(ValueError, match=r"hf_cp attention \(LlamaAttention\): use_cache=True in training"):
        model(input_ids=IDS, position_ids=POS, use_cache=True)
    assert torch.isfinite(model(input_ids=IDS, position_ids=POS, use_cache=False).logits).all()


def test_kv_cache_decoding_is_refused():
    model = _llama(train=False)
    with torch.no_grad():
        prefill = model(input_ids=IDS, use_cache=True)  # queries and keys of the same 16 tokens: allowed
        assert prefill.cache is not None and torch.isfinite(prefill.logits).all()
        with pytest.raises(ValueError, match=r"1 queries against 17 keys, i.e. KV-cache decoding"):
            model(input_ids=IDS[:, :1], cache=prefill.cache, use_cache=True)


def test_padded_batch_is_refused():
    model = _llama()
    padded = torch.tensor([[1] * 12 + [0] * 4])
    with pytest.raises(ValueError, match="hf_cp attention does not take padded batches"):
        model(input_ids=IDS, attention_mask=padded)
    assert torch.isfinite(model(input_ids=IDS, attention_mask=torch.ones_like(padded)).logits).all()
