"""The training model built from a run config (hf_cp/train/config.py)."""

from __future__ import annotations

import torch


def test_a_model_built_from_a_config_keeps_fp32_master_weights_whatever_dtype_the_config_names(monkeypatch):
    """Qwen2.5-0.5B's config says bfloat16: built as it says, a run without DeepSpeed would update
    bf16 parameters with AdamW (seen on an H200 run, where the memory model read the states'
    dtype off the built model). The training model is built in fp32."""
    import transformers

    from hf_cp.train.config import build_model, model_config

    mcfg = {"config": "qwen2.5-0.5b"}
    assert model_config(mcfg, "test").dtype == torch.bfloat16  # what the config names
    original = transformers.AutoModelForCausalLM.from_config

    def small(config, **kwargs):  # one layer and a small vocabulary: only the dtype matters here
        config.num_hidden_layers, config.vocab_size = 1, 64
        return original(config, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", small)
    assert {p.dtype for p in build_model(mcfg, "test").parameters()} == {torch.float32}
