"""Every section of a training config is checked against a schema when it is read: a typo names
the key and the nearest valid one, conflicting keys are refused, and a path that is not there
is reported as missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_cp.train.config import TrainConfigError, load_config, load_datasets, model_config, training_arguments

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny-cpu.yaml")


def config_file(tmp_path, text: str) -> str:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "model: {config: tiny-llama, attn_implemention: hf_cp}\ndata: {bundled: longtail_sample}\n",
            r"unknown key model\.attn_implemention: did you mean model\.attn_implementation\?",
        ),
        (
            "model: {config: tiny-llama}\ndata: {bundeld: longtail_sample}\n",
            r"unknown key data\.bundeld: did you mean data\.bundled\?",
        ),
        (
            "model: {config: tiny-llama}\ndata: {bundled: longtail_sample}\ntraining: {learnign_rate: 0.1}\n",
            r"unknown key training\.learnign_rate: did you mean training\.learning_rate\?",
        ),
        (
            "model: {config: tiny-llama}\ndata: {bundled: longtail_sample, eval-split: 0.1}\n",
            r"did you mean data\.eval_split\?",
        ),
        (
            "model: {config: tiny-llama}\ndata: {bundled: longtail_sample, colour: red}\n",
            r"unknown key data\.colour: valid keys: bundled, eval_path",
        ),
        (
            "model: {config: tiny-llama}\ndata: {bundled: longtail_sample, limit: many}\n",
            r"data\.limit must be an integer",
        ),
        (
            "model: {config: tiny-llama}\ndata: {bundled: longtail_sample, limit: -3}\n",
            r"data\.limit must be >= 0, got -3",
        ),
        ("model: tiny-llama\n", r"section model must be a mapping"),
        (
            "model: {config: tiny-llama, pretrained: outputs/x}\n",
            r"model\.config and model\.pretrained both set: a model is built from a config or loaded from a folder",
        ),
        (
            "model: {config: tiny-llama}\ndata: {bundled: longtail_sample, path: mine.jsonl}\n",
            r"data\.bundled and data\.path both set: data\.path would be ignored",
        ),
    ],
)
def test_config_sections_are_checked_against_their_schema(tmp_path, text, message):
    with pytest.raises(TrainConfigError, match=message):
        load_config(config_file(tmp_path, text))


def test_overrides_are_checked_too():
    with pytest.raises(TrainConfigError, match=r"unknown key training\.max_step: did you mean training\.max_steps\?"):
        load_config(TINY, ["training.max_step=3"])
    with pytest.raises(TrainConfigError, match=r"unknown section 'train'"):
        load_config(TINY, ["train.max_steps=3"])
    with pytest.raises(TrainConfigError, match=r"did you mean training\.cp_balancer\?"):
        training_arguments({"cp_balancr": "auto", "use_cpu": True}, "cfg.yaml")


def test_missing_paths_are_reported_as_missing(tmp_path, monkeypatch):
    with pytest.raises(TrainConfigError, match=r"training config .*nope\.yaml: no such file here"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(TrainConfigError, match=r"cfg\.yaml: data\.path outputs/no-such-data does not exist"):
        load_datasets({"path": "outputs/no-such-data"}, "cfg.yaml")
    with pytest.raises(TrainConfigError, match=r"data\.eval_path .*gone\.jsonl does not exist"):
        load_datasets({"bundled": "longtail_sample", "eval_path": str(tmp_path / "gone.jsonl")}, "cfg.yaml")
    with pytest.raises(TrainConfigError, match=r"model\.pretrained \./outputs/no-such-model does not exist"):
        model_config({"pretrained": "./outputs/no-such-model"}, "cfg.yaml")
    # `outputs/x` could also name a Hub model: it is tried there (offline here), and reported missing first
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TrainConfigError, match=r"model\.pretrained outputs/no-such-model does not exist .*Hub"):
        model_config({"pretrained": "outputs/no-such-model"}, "cfg.yaml")
    with pytest.raises(TrainConfigError, match=r"training\.deepspeed .*ds\.json does not exist"):
        training_arguments({"deepspeed": str(tmp_path / "ds.json"), "use_cpu": True}, "cfg.yaml")
    # an existing file of the wrong kind is still a format error
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(TrainConfigError, match=r"x\.csv is neither a saved dataset folder nor a \.jsonl"):
        load_datasets({"path": str(tmp_path / "x.csv")}, "cfg.yaml")


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_passes_the_schema(config):
    cfg = load_config(str(ROOT / "configs" / config))
    assert set(cfg) >= {"model", "data", "training"}
