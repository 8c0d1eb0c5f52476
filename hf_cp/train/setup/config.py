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
              a config that needs it is an error)
    data:     bundled: longtail_sample | path: a saved `datasets` folder or a .jsonl[.gz] with
              input_ids (and labels) per line; limit: keep the first N samples;
              eval_path (same formats) or eval_split (a held-out fraction) for evaluation
              with training.eval_strategy / eval_steps
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

import contextlib
import re
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

import yaml

from hf_cp.balance.registry import available_balancers
from hf_cp.cost.config_files import read_yaml_mapping, resolve_config
from hf_cp.cost.dims import MAX_MODEL_DIM
from hf_cp.cost.hardware import HardwareProfile
from hf_cp.data.toy_preferences import toy_preference_rows
from hf_cp.data.toy_prompts import toy_prompts
from hf_cp.readers import brief, load_json, load_yaml
from hf_cp.resources import input_path, shipped_training_configs, training_config_path
from hf_cp.train.setup.schema import (
    DATA_KEYS,
    MODEL_KEYS,
    TrainConfigError,
    check_section,
    check_training_keys,
    training_keys,
    unset,
)

__all__ = ["TrainConfigError", "load_config", "load_datasets", "model_config", "build_model", "training_arguments"]

DEFAULT_DDP_TIMEOUT_S = 1800  # TrainingArguments.ddp_timeout's default
LOOKED = "looked in the working directory, then among the files hf_cp ships"


def _resolve(p: str) -> str:
    return str(input_path(p))


SECTIONS = ("trainer", "model", "data", "training", "reward")
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
            "(and optionally trainer, reward)"
        )
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise TrainConfigError(f"override {item!r}: expected section.key=value, e.g. training.max_steps=5")
        key, value = item.split("=", 1)
        section, field = key.split(".", 1)
        if section not in ("model", "data", "training", "reward"):
            raise TrainConfigError(
                f"override {item!r}: unknown section {section!r}; expected model, data, training or reward"
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
    if cfg.get("training") is not None and not isinstance(cfg["training"], dict):
        raise TrainConfigError(f"{p}: section `training` must be a mapping of keys to values")
    cfg["training"] = check_training_keys(cfg.get("training") or {}, str(p), config_class, elsewhere)
    cfg["reward"] = check_reward(cfg.get("reward"), name, str(p))
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
# longtail_sample: token ids (trainer cp); toy_preferences: prompt/chosen/rejected text (dpo, kto);
# toy_prompts: prompts (grpo, rloo; the reward hf_cp.data.toy_prompts:share_of_a)
BUNDLED = ("longtail_sample", "toy_preferences", "toy_prompts")


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


def _key_named(message: str, keys: Iterable[str], preferred: Iterable[str] = ()) -> Optional[str]:
    """The first of `keys` the message names as a word (a key the config set first, the longest
    at a position: cp_max_tokens_per_rank, not max_tokens_per_rank)."""
    for candidates in (list(preferred), list(keys)):
        found = [
            (m.start(), -len(k), k)
            for k in candidates
            for m in [re.search(rf"(?<![A-Za-z0-9_]){re.escape(k)}(?![A-Za-z0-9_])", message)]
            if m
        ]
        if found:
            return min(found)[2]
    return None


@contextlib.contextmanager
def named_errors(source: str, section: str, keys: Iterable[str], preferred: Iterable[str] = ()) -> Iterator[None]:
    """Errors raised inside (building CPTrainingArguments, the model config, a name's file) come
    out as the same exception type with the config file and `section.key` before the message, the
    key being the first of `keys` the message names (`section` alone when it names none; a
    `section` such as "training.cp_profile" names the key itself); the message itself is kept."""
    try:
        yield
    except (ValueError, KeyError, TypeError, ArithmeticError) as e:
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if text.startswith(f"{source}: "):  # already named (a TrainConfigError of the schema)
            raise
        key = _key_named(text, keys, preferred)
        where = f"{section}.{key}" if key else section
        message = f"{source}: {where}: {text}"
        if isinstance(e, ArithmeticError):  # a division by a zero the file gave (a user error, not a crash)
            raise TrainConfigError(f"{message} ({type(e).__name__}: a count in it is zero or out of range)") from None
        try:
            error = type(e)(message)
        except Exception:  # noqa: BLE001 (an exception type that takes other arguments)
            error = TrainConfigError(message)
        raise error from None


def trust_remote_code(mcfg: dict, source: str) -> bool:
    """model.trust_remote_code, off unless the config says `true`: Python shipped with a model
    folder runs only when the user asks for it."""
    value = unset(mcfg).get("trust_remote_code", False)
    if not isinstance(value, bool):
        raise TrainConfigError(f"{source}: model.trust_remote_code must be true or false, got {value!r}")
    return value


def looks_like_a_path(name: str) -> bool:
    """A Hub model name is `org/name` or `name`; anything else (./x, /x, ~/x, a/b/c) is a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or name.endswith(".json")


def pretrained_path(mcfg: dict, source: str) -> str:
    """model.pretrained resolved; a path that does not exist is reported as missing (not as a
    Hub download that failed)."""
    name = mcfg["pretrained"]
    if not isinstance(name, str):
        raise TrainConfigError(f"{source}: model.pretrained: expected a string (a model folder), got {name!r}")
    path = _resolve(name)
    if not Path(path).exists() and looks_like_a_path(name):
        raise TrainConfigError(f"{source}: model.pretrained {name} does not exist ({LOOKED})")
    return path


def _from_pretrained(load, path: str, source: str, **kwargs):
    """`load(path, **kwargs)`; when `path` is no local folder and the Hub cannot give it either,
    the error says first that the folder does not exist."""
    try:
        return load(path, **kwargs)
    except OSError as e:
        if Path(path).exists():
            raise
        raise TrainConfigError(
            f"{source}: model.pretrained {path} does not exist ({LOOKED}), and it "
            f"could not be loaded as a Hugging Face Hub model either: {str(e).splitlines()[0]}"
        ) from None


def model_config(mcfg: dict, source: str):
    """The model's transformers config, without building the model or reading weights."""
    from transformers import AutoConfig

    mcfg = unset(mcfg)  # `pretrained: null` is no pretrained model, not one named 'None'
    trusted = trust_remote_code(mcfg, source)
    if "pretrained" in mcfg:
        path = pretrained_path(mcfg, source)
        own = Path(path) / "config.json"
        if own.is_file():  # its counts checked first: transformers divides by the head count
            try:
                check_model_counts(load_json(own.read_text()), f"{source}: model.pretrained {own}")
            except (OSError, ValueError) as e:
                if isinstance(e, TrainConfigError):
                    raise
                raise TrainConfigError(f"{source}: model.pretrained {own} is not a readable JSON file: {e}") from None
        with named_errors(source, "model.pretrained", []):
            return _from_pretrained(AutoConfig.from_pretrained, path, source, trust_remote_code=trusted)
    if "config" not in mcfg:
        raise TrainConfigError(f"{source}: model needs `config` (a config.json) or `pretrained` (a folder)")

    with named_errors(source, "model.config", []):
        cpath = resolve_config(mcfg["config"], "models", (".json",))
    if Path(cpath).is_dir():
        raise TrainConfigError(f"{source}: model.config {cpath} is a directory; expected a config.json file")
    try:
        d = load_json(Path(cpath).read_text())
    except (OSError, ValueError) as e:
        raise TrainConfigError(f"{source}: model.config {cpath} is not a readable JSON file: {e}") from None
    if not isinstance(d, dict):
        raise TrainConfigError(f"{source}: model.config {cpath} must hold a JSON object, got {type(d).__name__}")
    check_model_counts(d, f"{source}: model.config {cpath}")
    d.pop("architectures", None)
    mtype = d.pop("model_type", None)
    if mtype is None:
        raise TrainConfigError(f"{source}: model config {cpath} has no model_type")
    with named_errors(source, f"model.config {cpath}", []):
        return AutoConfig.for_model(mtype, **d)


# the counts of a transformers config the model's shapes divide by or multiply out (a head count of
# 0: ZeroDivisionError inside transformers' validation; 1e12 layers: a model never built)
MODEL_COUNT_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "head_dim",
    "hidden_size",
    "num_hidden_layers",
)


def check_model_counts(d: object, where: str) -> None:
    """Every count of MODEL_COUNT_KEYS a config dict (or its text_config) sets is a whole number
    from 1 to MAX_MODEL_DIM; null is unset. TrainConfigError naming `where` and the field."""
    if not isinstance(d, dict):
        return
    for part, sub in (("", d), ("text_config.", d.get("text_config"))):
        if not isinstance(sub, dict):
            continue
        for k in MODEL_COUNT_KEYS:
            v = sub.get(k)
            if v is None:
                continue
            whole = not isinstance(v, bool) and isinstance(v, (int, float)) and (isinstance(v, int) or v.is_integer())
            if not whole or not 1 <= v <= MAX_MODEL_DIM:
                raise TrainConfigError(
                    f"{where}: field {(part + k)!r} must be a whole number from 1 to {MAX_MODEL_DIM:,}, got {brief(v)}"
                )


def build_model(mcfg: dict, source: str):
    import torch
    from transformers import AutoModelForCausalLM

    import hf_cp.attention.interface  # noqa: F401  torch, transformers: registers attn_implementation="hf_cp"

    mcfg = unset(mcfg)
    attn = mcfg.get("attn_implementation", "hf_cp")
    if "pretrained" in mcfg:
        model = _from_pretrained(
            AutoModelForCausalLM.from_pretrained,
            pretrained_path(mcfg, source),
            source,
            attn_implementation=attn,
            trust_remote_code=trust_remote_code(mcfg, source),
        )
    else:
        config = model_config(mcfg, source)
        torch.manual_seed(int(mcfg.get("seed", 0)))
        # fp32 whatever dtype the config names (Qwen2.5's says bfloat16): these are the master
        # weights; bf16 compute comes from autocast or DeepSpeed. Built in bf16, a run without
        # DeepSpeed would apply AdamW to bf16 parameters and lose the small updates.
        with whole_weights_init():
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def whole_weights_init() -> Iterator[None]:
    """A model built from its config inside gets the same initial weights under every engine: with
    a ZeRO-3 DeepSpeed config set, transformers would build it under deepspeed.zero.Init, which
    initialises each rank's partition with other random draws (the main job's step-1 loss was
    5.530 under ZeRO-3 against 5.581 under ZeRO-2 and FSDP2). DeepSpeed partitions the whole model
    when it wraps it. A pretrained model loads its weights either way."""
    from transformers.integrations import deepspeed as hf_deepspeed  # transformers

    kept = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None  # is_deepspeed_zero3_enabled() is False meanwhile
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = kept


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_run_tokenizer(mcfg: dict, source: str):
    """The run's tokenizer, saved with the final model: model.tokenizer (a folder), else the one
    in the model.pretrained folder; None when the run has none (a model built from a config)."""
    mcfg = unset(mcfg)
    name = mcfg.get("tokenizer")
    if name is None and "pretrained" in mcfg:
        folder = Path(pretrained_path(mcfg, source))
        if not any((folder / f).exists() for f in TOKENIZER_FILES):
            return None
        name = str(folder)
    if name is None:
        return None
    path = Path(_resolve(str(name)))
    if not path.exists():
        raise TrainConfigError(f"{source}: model.tokenizer {name} does not exist ({LOOKED})")
    from hf_cp.data_prep.tokenizer import load_tokenizer  # transformers, loaded only for a tokenizer

    return load_tokenizer(str(path), trust_remote_code=trust_remote_code(mcfg, source))


def _read_dataset(path: str, field: str, source: str):
    from datasets import Dataset, load_from_disk

    p = Path(_resolve(path))
    if not p.exists():
        raise TrainConfigError(f"{source}: data.{field} {path} does not exist ({LOOKED})")
    if p.is_dir():
        try:
            ds = load_from_disk(str(p))
        except FileNotFoundError as e:  # a folder that is no saved dataset
            raise TrainConfigError(
                f"{source}: data.{field} {path} is a directory but not a saved `datasets` folder ({e}); expected "
                "a folder written by Dataset.save_to_disk (hf-cp preprocess) or a .jsonl[.gz] file"
            ) from None
        if hasattr(ds, "keys"):
            ds = ds["train"]
        return ds
    if p.suffix in (".jsonl", ".gz"):
        import gzip

        opener = gzip.open if p.suffix == ".gz" else open
        rows = []
        with opener(p, "rt") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(load_json(line))
                except ValueError as e:  # JSONDecodeError (nested too deep too), UnicodeDecodeError
                    raise TrainConfigError(
                        f"{source}: data.{field} {path}, line {lineno}: not a JSON record ({e})"
                    ) from None
        return Dataset.from_list(rows)
    raise TrainConfigError(f"{source}: data.{field} {p} is neither a saved dataset folder nor a .jsonl[.gz]")


def load_datasets(dcfg: dict, source: str):
    """(train, eval or None). Evaluation data: data.eval_path (same formats as path), or
    data.eval_split: a fraction of the samples held out (seeded by data.eval_seed, default 0)."""
    from hf_cp.data import load_sample_dataset  # datasets, loaded only when data is read

    dcfg = check_section("data", dcfg, DATA_KEYS, source)  # typed, null keys left out
    limit = int(dcfg.get("limit", 0) or 0)
    if dcfg.get("bundled"):
        if dcfg["bundled"] not in BUNDLED:
            raise TrainConfigError(
                f"{source}: data.bundled {dcfg['bundled']!r}: the bundled datasets are {', '.join(BUNDLED)}"
            )
        if dcfg["bundled"] in ("toy_preferences", "toy_prompts"):
            from datasets import Dataset  # datasets, loaded only when data is read

            rows = toy_preference_rows() if dcfg["bundled"] == "toy_preferences" else toy_prompts()
            ds = Dataset.from_list(rows[:limit] if limit else rows)
        else:
            ds = load_sample_dataset(limit=limit)
    elif "path" not in dcfg:
        raise TrainConfigError(f"{source}: data needs `bundled: longtail_sample` or `path:`")
    else:
        ds = _read_dataset(dcfg["path"], "path", source)
        ds = ds.select(range(min(limit, len(ds)))) if limit else ds
    if dcfg.get("eval_path") and dcfg.get("eval_split"):
        raise TrainConfigError(f"{source}: data.eval_path and data.eval_split both set; choose one")
    if dcfg.get("eval_path"):
        return ds, _read_dataset(dcfg["eval_path"], "eval_path", source)
    if dcfg.get("eval_split"):
        frac = dcfg["eval_split"]
        if not isinstance(frac, (int, float)) or not 0 < frac < 1:
            raise TrainConfigError(f"{source}: data.eval_split must be a fraction in (0, 1), got {frac!r}")
        parts = ds.train_test_split(test_size=float(frac), seed=int(dcfg.get("eval_seed", 0)))
        return parts["train"], parts["test"]
    return ds, None


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
