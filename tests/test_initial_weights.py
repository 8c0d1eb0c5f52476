"""The same seed gives the same initial weights under every engine: a model built from its config
while a ZeRO-3 DeepSpeed config is set (as `hf-cp train` does after reading the training section)
is built whole, not under deepspeed.zero.Init, whose per-partition initialisation drew other
random numbers (the main job's step-1 loss was 5.530 under ZeRO-3 against 5.581 under ZeRO-2)."""

from __future__ import annotations

import torch
from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

from hf_cp.train.setup.config import build_model

MODEL = {"config": "tiny-llama", "seed": 3}


def test_a_zero3_config_does_not_change_the_initial_weights():
    plain = build_model(dict(MODEL), "test")
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    sharded = build_model(dict(MODEL), "test")
    assert is_deepspeed_zero3_enabled(), "the run's ZeRO-3 setting is back for DeepSpeed's own use"
    a, b = dict(plain.named_parameters()), dict(sharded.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert b[name].shape == a[name].shape and torch.equal(a[name], b[name]), name
    del zero3
