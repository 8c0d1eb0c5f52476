"""The training model built from a run config (hf_cp/train/setup/config.py)."""

from __future__ import annotations

import torch


def test_a_model_built_from_a_config_keeps_fp32_master_weights_whatever_dtype_the_config_names(monkeypatch):
    """Qwen2.5-0.5B's config says bfloat16: built as it says, a run without DeepSpeed would update
    bf16 parameters with AdamW (seen on an H200 run, where the memory model read the states'
    dtype off the built model). The training model is built in fp32."""
    import transformers

    from hf_cp.train.setup.config import build_model, model_config

    mcfg = {"config": "qwen2.5-0.5b"}
    assert model_config(mcfg, "test").dtype == torch.bfloat16  # what the config names
    original = transformers.AutoModelForCausalLM.from_config

    def small(config, **kwargs):  # one layer and a small vocabulary: only the dtype matters here
        config.num_hidden_layers, config.vocab_size = 1, 64
        return original(config, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", small)
    assert {p.dtype for p in build_model(mcfg, "test").parameters()} == {torch.float32}


def _config(tmp_path, text: str) -> str:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


NULLS = """\
model:
  config: tiny-llama
  pretrained: null
  tokenizer: null
  seed: null
  attn_implementation: null
  trust_remote_code: null
data:
  bundled: longtail_sample
  path: null
  limit: null
  eval_path: null
  eval_split: null
  eval_seed: null
training:
  use_cpu: true
  output_dir: null
  deepspeed: null
  learning_rate: null
  ddp_timeout: null
  cp_compare_balancer: null
  cp_max_tokens_per_rank: null
  cp_profile: null
  report_to: null
  eval_strategy: null
"""


def test_a_key_set_to_null_is_read_as_if_it_were_absent_in_every_section(tmp_path):
    """Issue 27: `model.pretrained: null` was read as the string 'None' and looked up on the Hub;
    `null` now means unset everywhere, the same as leaving the key out."""
    from hf_cp.train.setup.config import (
        load_config,
        load_datasets,
        load_run_tokenizer,
        model_config,
        training_arguments,
    )

    cfg = load_config(_config(tmp_path, NULLS))
    bare = load_config(_config(tmp_path, "model: {config: tiny-llama}\ndata: {bundled: longtail_sample}\n"))
    assert cfg["model"] == bare["model"] == {"config": "tiny-llama"}
    assert cfg["data"] == bare["data"] == {"bundled": "longtail_sample"}
    assert cfg["training"] == {"use_cpu": True}
    assert model_config(cfg["model"], "cfg").model_type == "llama"  # no Hub lookup of 'None'
    assert load_run_tokenizer(cfg["model"], "cfg") is None
    train, evaluation = load_datasets(cfg["data"], "cfg")
    assert evaluation is None and len(train) == 240
    args, default = training_arguments(cfg["training"], "cfg"), training_arguments({"use_cpu": True}, "cfg")
    for name in ("learning_rate", "ddp_timeout", "cp_compare_balancer", "cp_max_tokens_per_rank", "cp_profile"):
        assert getattr(args, name) == getattr(default, name), name
    assert args.cp_compare_balancer == "static"  # null is the default; `none` turns the comparison off
    assert training_arguments({"use_cpu": True, "cp_compare_balancer": "none"}, "cfg").cp_compare_balancer is None


def test_null_is_unset_when_the_sections_are_passed_directly_too(tmp_path):
    """The readers take sections built in code (dry run, launch): a None value is no setting there either."""
    from hf_cp.train.setup.config import load_datasets, load_run_tokenizer, model_config, training_arguments

    mcfg = {"config": "tiny-llama", "pretrained": None, "tokenizer": None, "trust_remote_code": None}
    assert model_config(mcfg, "cfg").model_type == "llama"
    assert load_run_tokenizer(mcfg, "cfg") is None
    _, evaluation = load_datasets({"bundled": "longtail_sample", "path": None, "eval_split": None}, "cfg")
    assert evaluation is None
    args = training_arguments({"use_cpu": True, "learning_rate": None, "cp_compare_balancer": None}, "cfg")
    assert args.learning_rate == 5e-5 and args.cp_compare_balancer == "static"


def test_an_override_to_null_removes_the_key():
    from pathlib import Path

    from hf_cp.train.setup.config import load_config

    tiny = str(Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml")
    cfg = load_config(tiny, ["training.deepspeed=null", "data.eval_split=null", "model.seed=~"])
    assert "deepspeed" not in cfg["training"] and "eval_split" not in cfg["data"] and "seed" not in cfg["model"]
