"""Every section of a training config is checked against a schema when it is read: a typo names
the key and the nearest valid one, conflicting keys are refused, and a path that is not there
is reported as missing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_cp.cli import main as cli_main
from hf_cp.train.launch.trainers import TRAINERS
from hf_cp.train.setup.config import TrainConfigError, load_config, load_datasets, model_config, training_arguments
from hf_cp.train.setup.schema import training_keys

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
            r"unknown key data\.colour: valid keys: add_eos, bundled, completion_field, eval_path",
        ),
        (
            "model: {config: tiny-llama}\ndata: {bundled: longtail_sample, limit: many}\n",
            r"data\.limit: expected an integer",
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
    (tmp_path / "x.txt").write_text("a,b\n")
    with pytest.raises(TrainConfigError, match=r"data\.path: .*x\.txt: unsupported file type \.txt.*a \.json/\.jsonl"):
        load_datasets({"path": str(tmp_path / "x.txt")}, "cfg.yaml")


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_passes_the_schema(config):
    from hf_cp.train.launch.trainers import TRAINERS

    cfg = load_config(str(ROOT / "configs" / config), [], TRAINERS)
    assert set(cfg) >= {"model", "data", "training"} and cfg["trainer"] in TRAINERS.names


@pytest.mark.parametrize(
    "override, message",
    [
        (
            'training.cp_max_tokens_per_rank="8k"',
            "training.cp_max_tokens_per_rank: expected an integer or 'auto', got '8k'",
        ),
        ("training.learning_rate=fast", "training.learning_rate: expected a number, got 'fast'"),
        ("training.max_steps=5.5", "training.max_steps: expected an integer, got 5.5"),
        ("training.use_cpu=maybe", "training.use_cpu: expected true or false, got 'maybe'"),
        ("training.cp_plan_lookahead=true", "training.cp_plan_lookahead: expected an integer, got True"),
        ("training.eval_strategy=5", "training.eval_strategy: expected a string (no, steps, epoch), got 5"),
        ("training.cp_profile=[1, 2]", "training.cp_profile: expected a mapping or a string, got [1, 2]"),
        ("training.label_names=[1, 2]", "training.label_names: expected a list of strings, got [1, 2]"),
        ("training.report_to={a: 1}", "training.report_to: expected a string or a list of strings, got {'a': 1}"),
        ("model.seed=abc", "model.seed: expected an integer (seed of the random weights of `config`), got 'abc'"),
        ("model.trust_remote_code=1", "model.trust_remote_code: expected true or false"),
        ("data.eval_split=much", "data.eval_split: expected a number (a held-out fraction"),
        ("data.limit=many", "data.limit: expected an integer"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_key_the_type_and_the_value(override, message):
    """Issue 27: `cp_max_tokens_per_rank: "8k"` failed deep inside planning with `'<=' not supported
    between 'str' and 'int'`, no key named. Every section's values are typed when the config is read."""
    with pytest.raises(TrainConfigError, match=re.escape(message)):
        load_config(TINY, [override])


def test_training_values_are_typed_from_the_dataclass_fields_when_built_directly_too():
    with pytest.raises(TrainConfigError, match=re.escape("cfg.yaml: training.cp_tokens_per_step: expected an integer")):
        training_arguments({"cp_tokens_per_step": "16k", "use_cpu": True}, "cfg.yaml")
    # several wrong values: all named at once
    with pytest.raises(TrainConfigError, match=r"training\.seed: expected an integer.*training\.warmup_steps"):
        training_arguments({"seed": "x", "warmup_steps": "y", "use_cpu": True}, "cfg.yaml")


def test_every_training_field_type_is_read_from_the_dataclass():
    """No hand-written list: each init field of CPTrainingArguments has a readable expected type."""
    from hf_cp.train.setup.schema import training_types

    types = training_types()
    assert set(types) == set(training_keys())
    assert types["cp_max_tokens_per_rank"].describe() == "an integer or 'auto'"
    assert types["learning_rate"].describe() == "a number"
    assert types["cp_balancer_options"].describe() == "a mapping or a string"
    # each field's default passes its own type (the check refuses nothing the dataclass gives itself)
    from dataclasses import MISSING, fields

    from hf_cp.train.setup.args import CPTrainingArguments

    for f in fields(CPTrainingArguments):
        if f.init and f.default is not MISSING and f.default is not None:
            assert types[f.name].accepts(f.default), (f.name, f.default)


def test_a_number_in_exponent_notation_is_read_as_a_number():
    """PyYAML reads `1e-3` (no dot) as a string: a float key takes it as the number it spells."""
    cfg = load_config(TINY, ["training.learning_rate=1e-3", "training.weight_decay=1E-2"])
    assert cfg["training"]["learning_rate"] == pytest.approx(1e-3)
    assert training_arguments(dict(cfg["training"], use_cpu=True), "cfg.yaml").weight_decay == pytest.approx(1e-2)
    with pytest.raises(TrainConfigError, match=re.escape("training.max_steps: expected an integer, got '1e3'")):
        load_config(TINY, ["training.max_steps=1e3"])  # an integer key stays strict


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.learning_rate=.nan", "training.learning_rate: expected a finite number, got nan"),
        ("training.learning_rate=.inf", "training.learning_rate: expected a finite number, got inf"),
        ("training.weight_decay=-.inf", "training.weight_decay: expected a finite number, got -inf"),
        ("training.max_grad_norm=.nan", "training.max_grad_norm: expected a finite number, got nan"),
        ("data.eval_split=.nan", "data.eval_split: expected a finite number (a held-out fraction"),
        ("training.learning_rate=-1.0", "training.learning_rate must be >= 0, got -1.0"),
        ("training.weight_decay=-1.0", "training.weight_decay must be >= 0, got -1.0"),
        ("training.logging_steps=-5", "training.logging_steps must be > 0, got -5"),
        ("training.save_steps=0", "training.save_steps must be > 0, got 0"),
        ("training.eval_steps=-1", "training.eval_steps must be > 0, got -1"),
        ("training.num_train_epochs=-1", "training.num_train_epochs must be > 0, got -1"),
        ("training.max_steps=0", "training.max_steps must be > 0 (or -1: num_train_epochs decides), got 0"),
        ("training.warmup_steps=-2", "training.warmup_steps must be >= 0, got -2"),
        ("training.adam_beta2=1.5", "training.adam_beta2 must be in [0, 1), got 1.5"),
        ("training.seed=-1", "training.seed must be in [0, 2**32 - 1]"),
    ],
)
def test_a_number_out_of_range_or_not_finite_is_refused_naming_the_file_and_key(override, message):
    """The fuzz (test_fuzz_inputs, configs) found learning_rate -1, nan and inf, weight_decay nan and
    -1 and logging_steps -5 accepted without a word: no float key takes .nan or .inf, and the common
    numeric keys TrainingArguments does not check have their ranges (TRAINING_RANGES)."""
    with pytest.raises(TrainConfigError, match=re.escape(f"{TINY}: ") + ".*" + re.escape(message)):
        load_config(TINY, [override])


def test_null_steps_and_the_defaults_pass_the_ranges():
    cfg = load_config(TINY, ["training.eval_steps=null", "training.max_steps=-1", "training.learning_rate=0"])
    assert "eval_steps" not in cfg["training"] and cfg["training"]["max_steps"] == -1


@pytest.mark.parametrize(
    "override, error, message",
    [
        (
            "training.lr_scheduler_type=sometimes",
            TrainConfigError,
            "training.lr_scheduler_type: expected one of linear, cosine, cosine_with_restarts, polynomial, constant, "
            "constant_with_warmup, inverse_sqrt, reduce_lr_on_plateau, ",
        ),
        (
            "training.save_strategy=sometimes",
            TrainConfigError,
            "training.save_strategy: expected one of no, steps, epoch, best (SaveStrategy), got 'sometimes'",
        ),
        (
            "training.eval_strategy=sometimes",
            TrainConfigError,
            "training.eval_strategy: expected one of no, steps, epoch",
        ),
        ("training.optim=fastest", TrainConfigError, "training.optim: expected one of adamw_torch"),
        ("training.cp_profile=nope", Exception, "training.cp_profile: no profile named 'nope'"),
        ("training.cp_profile={c1_ms_per_token: 1}", Exception, "training.cp_profile: profile: "),
        ("training.cp_balancer=nope", KeyError, "training.cp_balancer: unknown balancer 'nope'; available: "),
        ("training.cp_compare_balancer=nope", KeyError, "training.cp_compare_balancer: unknown balancer 'nope'"),
        ("model.config=nope", Exception, "model.config: no model named 'nope'"),
    ],
)
def test_a_name_that_resolves_to_nothing_is_refused_when_read_naming_the_file_and_key(override, error, message):
    """A profile, balancer or model name, or a string of a Trainer enum, that means nothing was
    refused later without naming the key (`no profile named 'nope'`, `sometimes is not a valid
    SaveStrategy`); it is refused when the config is read, with the names available."""
    with pytest.raises(error, match=re.escape(f"{TINY}: ") + ".*" + re.escape(message)):
        load_config(TINY, [override])


def test_valid_names_and_the_no_comparison_spellings_pass():
    cfg = load_config(
        TINY,
        ["training.cp_balancer=static", "training.cp_compare_balancer=none", "training.lr_scheduler_type=linear"],
    )
    assert cfg["training"]["cp_balancer"] == "static"
    load_config(TINY, ["training.cp_profile=h200-qwen2.5-7b", "training.save_strategy=epoch"])


def test_errors_of_building_the_arguments_or_the_model_config_name_the_file_and_key():
    """CPTrainingArguments' and transformers' own checks, and the model config's, come out as the
    same exception type with the file and section.key before the message (which is kept)."""
    with pytest.raises(ValueError, match=r"^cfg\.yaml: training\.cp_max_tokens_per_rank: CPTrainingArguments: "):
        training_arguments({"cp_max_tokens_per_rank": 0, "use_cpu": True}, "cfg.yaml")
    with pytest.raises(ValueError, match=r"^cfg\.yaml: training\.cp_plan_lookahead: .*must be >= 0, got -1"):
        training_arguments({"cp_plan_lookahead": -1, "use_cpu": True}, "cfg.yaml")
    with pytest.raises(ValueError, match=r"^cfg\.yaml: training\.lr_scheduler_type: .*requires an eval strategy"):
        training_arguments({"lr_scheduler_type": "reduce_lr_on_plateau", "use_cpu": True}, "cfg.yaml")
    with pytest.raises(Exception, match=r"^cfg\.yaml: model\.config: no model named 'nope'"):
        model_config({"config": "nope"}, "cfg.yaml")


@pytest.mark.parametrize(
    "override, words",
    [
        ("training.packing=true", "hf_cp always packs"),
        ("training.sample_packing=true", "hf_cp always packs"),
        ("training.padding_free=true", "hf_cp always packs"),
        ("training.max_seq_length=4096", "hf_cp never truncates in training: cap lengths in the data (data.max_length"),
        ("training.max_length=4096", "hf_cp never truncates in training: cap lengths in the data (data.max_length"),
        ("training.sequence_parallel_degree=4", "hf_cp has no fixed CP degree: set cp_max_tokens_per_rank"),
        ("training.micro_batch_size=2", "a step holds cp_tokens_per_step tokens"),
    ],
)
def test_other_trainers_keys_get_their_hf_cp_equivalent_in_one_line(override, words, tmp_path, capsys):
    """Through `hf-cp train --dry-run` (the trainers' table: packing, padding_free and max_length are
    keys of TRL's configs), the refusal is the hf_cp translation, not "set `trainer: sft`", which
    would lead into CPSFTConfig's own refusal of packing."""
    # before: "unknown key training.packing: valid keys: " and about 190 names; then, with the
    # trainers' table, "training.packing is a setting of trainer: sft ... set `trainer: sft`"
    key = override.split("=")[0]
    assert cli_main(["train", TINY, "--dry-run", "--set", override, "--set", f"training.output_dir={tmp_path}"]) == 2
    text = capsys.readouterr().err
    assert f"{key} is another trainer's setting: {words}" in text, text
    assert "valid keys" not in text and "trainer: sft" not in text and len(text) < 600
    with pytest.raises(TrainConfigError, match=re.escape(f"{key} is another trainer's setting: {words}")):
        load_config(TINY, [override], TRAINERS)  # what `hf-cp train` (entry) reads the config with


def test_a_renamed_key_names_its_new_name():
    # cp_plan_in_process meant a forked worker *process*: now cp_plan_in_subprocess
    with pytest.raises(TrainConfigError) as err:
        load_config(TINY, ["training.cp_plan_in_process=false"])
    assert "training.cp_plan_in_process was renamed training.cp_plan_in_subprocess (same meaning)" in str(err.value)
    config = load_config(TINY, ["training.cp_plan_in_subprocess=false"])
    assert config["training"]["cp_plan_in_subprocess"] is False
