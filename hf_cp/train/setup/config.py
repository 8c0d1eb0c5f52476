"""Training configs: one YAML file with model, data and training sections, read and checked.

    accelerate launch --config_file recipes/cpu-2proc-zero2.yaml -m hf_cp.train configs/tiny-cpu.yaml
    accelerate launch --config_file "$(hf-cp recipe cpu-2proc-zero2)" -m hf_cp.train tiny-cpu   # from a wheel

CONFIG is a path, or the name of a config hf_cp ships (tiny-cpu: configs/tiny-cpu.yaml, the user's
configs/ first, then the package's; hf_cp.resources).

Sections:
    model:    config (a config.json path or a model name, hf_cp.resources), attn_implementation
              (default hf_cp), seed (weights are initialised from it), or pretrained: a folder;
              tokenizer: a folder saved with the final model (default: the pretrained folder's);
              trust_remote_code: true runs the modelling code a pretrained folder ships (off:
              a config that needs it is an error); model_class: the transformers class to build
              or load when AutoModelForCausalLM builds none (Qwen2_5_VLForConditionalGeneration)
    data:     where the samples come from: bundled: longtail_sample | chat_sample | toy_preferences |
              toy_prompts | vlm_sample, path: (a saved `datasets` folder, a .json/.jsonl/.parquet/.csv
              file, a folder of them) or name: (a Hub dataset; split, subset); limit: keep the first N;
              eval_path (same formats) or eval_split (a held-out fraction) for evaluation with
              training.eval_strategy / eval_steps; template: a Jinja chat template for the tokenizer.
              Raw chat, prompt-completion or text rows are preprocessed by the run itself for
              trainer cp (format, max_length, overlong, mask, *_field: hf-cp preprocess's options),
              cached under output_dir/preprocessed (setup/data_section.py); the TRL trainers take
              the rows as they are
    peft:     a LoRA adapter: peft.LoraConfig's keys (r, lora_alpha, target_modules, ...;
              setup/peft_section.py); trainer cp wraps the model, the TRL trainers take it
              as peft_config
    training: CPTrainingArguments fields (TrainingArguments + cp_*); the config file and the
              inputs it names (deepspeed, data paths, pretrained) resolve against the working
              directory, then the package's shipped configs/ and recipes/ (hf_cp.resources);
              output_dir and logging_dir stay relative to the working directory.
              ddp_timeout (s) bounds every collective; resume_from_checkpoint: latest makes
              a job restartable (torchrun --max-restarts, see hf_cp.train.checkpoint.resolve); the final
              model (and tokenizer) is saved to output_dir/final (cp_save_final_model: false: not)
The file is read as yaml.safe_load reads it, except that a key given twice (two `training:`
sections, a key twice in one) is an error naming the key and both lines, and so are aliases that
expand past 100,000 nodes and nesting past 100 levels (hf_cp.readers); `--set` values too.
A key a section does not know is an error naming the nearest valid key, and a value of the wrong
type one naming the key, the type and the value (setup/schema.py); a name that resolves to
nothing (model.config, training.cp_profile, cp_balancer, cp_compare_balancer) is refused when the
config is read, naming the key and the names available; an error raised while the training
arguments or the model config are built from the file is prefixed with the file and the
section.key it concerns (named_errors). A key set to null is no
setting, in every section: as if the key were absent (its default applies; an override
`--set training.deepspeed=null` removes the key).
The launch itself (processes, the Trainer, the summary) is hf_cp.train.launch.entry.
"""

from __future__ import annotations

from typing import List, Optional

import yaml

from hf_cp.balance.registry import available_balancers
from hf_cp.cost.config_files import read_yaml_mapping, resolve_config
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.readers import brief, load_yaml
from hf_cp.resources import input_path, shipped_training_configs, training_config_path
from hf_cp.train.setup.config_names import LOOKED, named_errors
from hf_cp.train.setup.data_section import DataPreparation, apply_template, check_data_section, load_datasets
from hf_cp.train.setup.model_section import (
    build_model,
    load_run_tokenizer,
    model_class,
    model_config,
    pretrained_path,
    trust_remote_code,
    whole_weights_init,
)
from hf_cp.train.setup.peft_section import check_peft
from hf_cp.train.setup.schema import (
    DATA_KEYS,
    MODEL_KEYS,
    TrainConfigError,
    check_section,
    check_training_keys,
    training_keys,
)

__all__ = [
    "TrainConfigError",
    "load_config",
    "load_datasets",
    "DataPreparation",
    "apply_template",
    "model_config",
    "build_model",
    "load_run_tokenizer",
    "model_class",
    "pretrained_path",
    "trust_remote_code",
    "whole_weights_init",
    "training_arguments",
]

DEFAULT_DDP_TIMEOUT_S = 1800  # TrainingArguments.ddp_timeout's default


SECTIONS = ("trainer", "model", "data", "training", "reward", "peft")
DEFAULT_TRAINER = "cp"  # CPTrainer on token ids (input_ids, labels)


def load_config(path: str, overrides: Optional[List[str]] = None, trainers: Optional[TrainerTable] = None) -> dict:
    """The config at `path` (or a shipped config's name), with `--set` overrides, every section
    checked. `trainers` (hf_cp.train.launch.trainers.TRAINERS' view): the trainers a `trainer:`
    key may name, for the training section's keys; without it only CPTrainer's."""
    p = training_config_path(path)  # a path, or a shipped config's name (tiny-cpu)
    if not p.exists():
        raise TrainConfigError(
            f"training config {path}: no such file here, and hf_cp ships none at that path; it ships "
            f"{shipped_training_configs()}, each also by name (tiny-cpu)"
        )
    cfg = read_yaml_mapping(p, "training config", "a mapping with model/data/training sections", TrainConfigError)
    unknown = set(cfg) - set(SECTIONS)
    if unknown:
        raise TrainConfigError(
            f"training config {path}: unknown section(s) {sorted(map(str, unknown))}; expected model, data, training "
            "(and optionally trainer, reward, peft)"
        )
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise TrainConfigError(f"override {item!r}: expected section.key=value, e.g. training.max_steps=5")
        key, value = item.split("=", 1)
        section, field = key.split(".", 1)
        if section not in ("model", "data", "training", "reward", "peft"):
            raise TrainConfigError(
                f"override {item!r}: unknown section {section!r}; expected model, data, training, reward or peft"
            )
        if cfg.get(section) is None:  # `data:` with nothing under it
            cfg[section] = {}
        if isinstance(cfg[section], dict):  # otherwise the schema check below names the section
            cfg[section][field] = override_value(item, value)
    name = cfg.get("trainer")
    name = DEFAULT_TRAINER if name is None else name
    known = trainers.names if trainers is not None else (DEFAULT_TRAINER,)
    if not isinstance(name, str) or name not in known:
        where = "" if trainers is not None else " (trainers other than cp are built by `hf-cp train`)"
        raise TrainConfigError(f"{p}: trainer: {brief(name)} is not one of {', '.join(known)}{where}")
    cfg["trainer"] = name
    config_class = trainers.config_class(name) if trainers is not None else None
    elsewhere = (lambda key: trainers.having(key, besides=name)) if trainers is not None else None
    # every section against its schema: a typo names the key and the nearest valid one, a value
    # of the wrong type the key, the type and the value; null keys are left out (unset)
    cfg["model"] = check_section("model", cfg.get("model"), MODEL_KEYS, str(p))
    cfg["data"] = check_section("data", cfg.get("data"), DATA_KEYS, str(p))
    check_data_section(cfg["data"], name, str(p))
    if cfg.get("training") is not None and not isinstance(cfg["training"], dict):
        raise TrainConfigError(f"{p}: section `training` must be a mapping of keys to values")
    cfg["training"] = check_training_keys(cfg.get("training") or {}, str(p), config_class, elsewhere)
    cfg["reward"] = check_reward(cfg.get("reward"), name, str(p))
    cfg["peft"] = check_peft(cfg.get("peft"), str(p))
    check_names(cfg, str(p))
    cfg["_source"] = str(p)
    return cfg


class TrainerTable:
    """What load_config needs to know of the trainers a config may name (the launch's table)."""

    names: tuple = ()

    def config_class(self, name: str) -> type:
        raise NotImplementedError

    def having(self, key: str, besides: str) -> List[str]:
        raise NotImplementedError


REWARD_TRAINERS = ("grpo", "rloo")


def check_reward(section, trainer: str, source: str) -> dict:
    """The reward section: `functions`, a list of "module:callable" names of TRL reward functions
    (imported when the trainer is built, never code from the file itself). Only the generation
    trainers take it, and they need it."""
    if section is None:
        if trainer in REWARD_TRAINERS:
            raise TrainConfigError(
                f"{source}: trainer: {trainer} needs a reward section: reward: {{functions: [my_module:my_reward]}} "
                "(a TRL reward function: completions and columns in, one float per completion out)"
            )
        return {}
    if trainer not in REWARD_TRAINERS:
        raise TrainConfigError(f"{source}: a reward section is for trainer: grpo or rloo, not trainer: {trainer}")
    if not isinstance(section, dict) or set(section) - {"functions"}:
        raise TrainConfigError(f"{source}: reward: expected a mapping with `functions` only, got {brief(section)}")
    functions = section.get("functions")
    if isinstance(functions, str):
        functions = [functions]
    if not functions or not all(isinstance(f, str) and ":" in f for f in functions):
        raise TrainConfigError(
            f'{source}: reward.functions: expected a list of "module:callable" names, got {brief(functions)}'
        )
    return {"functions": list(functions)}


def override_value(item: str, value: str):
    """The value of a `--set section.key=VALUE` override, read as YAML (hf_cp.readers.load_yaml:
    5 is a number, [1, 2] a list, text a string); text that is no YAML is refused naming the override."""
    try:
        return load_yaml(value)
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise TrainConfigError(
            f"override {brief(item)}: the value {brief(value)} is not valid YAML ({problem}); quote a string "
            f"that starts with [, {{, & or *: --set '{item.split('=', 1)[0]}=\"...\"'"
        ) from None


NO_BALANCER = ("", "none", "null")  # cp_compare_balancer: no comparison (CPTrainingArguments)


def check_names(cfg: dict, source: str) -> None:
    """The names a config gives that must resolve to something hf_cp knows, checked when the config
    is read: model.config (a config.json or a model name), training.cp_profile (a profile file or
    name, read and checked, or a mapping of its fields), training.cp_balancer and cp_compare_balancer (registered balancers). The error is the
    one the launch would raise later (ConfigError, KeyError), prefixed with the file and the key."""
    mcfg, tcfg = cfg.get("model") or {}, cfg.get("training") or {}
    if isinstance(mcfg.get("model_class"), str):
        model_class(mcfg, source)  # transformers: only for a config that names a class
    name = mcfg.get("config")
    if isinstance(name, str) and "pretrained" not in mcfg:
        with named_errors(source, "model.config", []):
            resolve_config(name, "models", (".json",))
    profile = tcfg.get("cp_profile")
    if isinstance(profile, dict) or (isinstance(profile, str) and not profile.lstrip().startswith("{")):
        with named_errors(source, "training.cp_profile", []):  # read as the planning setup reads it (load_profile)
            if isinstance(profile, dict):
                HardwareProfile.from_dict(profile, source="profile")
            else:
                HardwareProfile.load(profile)
    for key in ("cp_balancer", "cp_compare_balancer"):
        name = tcfg.get(key)
        if not isinstance(name, str) or (key == "cp_compare_balancer" and name.strip().lower() in NO_BALANCER):
            continue
        names = available_balancers()
        if name not in names:
            raise KeyError(f"{source}: training.{key}: unknown balancer {name!r}; available: {', '.join(names)}")


def training_arguments(tcfg: dict, source: str, config_class=None):
    """The training section as `config_class` (default CPTrainingArguments; a trainer's config)."""
    from hf_cp.train.setup.args import CPTrainingArguments  # transformers (TrainingArguments)

    config_class = config_class or CPTrainingArguments
    # the dataclass's fields, each of its type; null keys left out (unset); `no` read as "no"
    t = check_training_keys(tcfg, source, config_class)
    ds = t.get("deepspeed")
    if isinstance(ds, str) and not input_path(ds).exists():
        raise TrainConfigError(f"{source}: training.deepspeed {ds} does not exist ({LOOKED})")
    if t.get("report_to") == "tensorboard_if_installed":
        try:
            import tensorboard  # noqa: F401

            t["report_to"] = ["tensorboard"]
        except ImportError:
            t["report_to"] = "none"
    try:
        with named_errors(source, "training", training_keys(config_class), t):
            return config_class(**t)
    except TypeError as e:
        raise TrainConfigError(str(e)) from None


def add_config_arguments(parser) -> None:
    """The CONFIG positional and the repeatable --set override, shared by `hf-cp train` and
    `python -m hf_cp.train` (an argparse parser)."""
    parser.add_argument(
        "config", help="training config YAML, e.g. configs/tiny-cpu.yaml, or a shipped config's name (tiny-cpu)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set training.max_steps=5 (repeatable)",
    )
