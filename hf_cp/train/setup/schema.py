"""The schema of a training config: which keys each section takes, what type each holds, and
which keys exclude each other. A typo is an error that names the key and the nearest valid one
(model.attn_implemention: did you mean model.attn_implementation?), not a setting silently
ignored; a value of the wrong type names the key, the type and the value
(training.cp_max_tokens_per_rank: expected an integer, got '8k'). The training section's keys and
their types are CPTrainingArguments' fields and annotations, read from the dataclass.

A key set to null is no setting: it reads as if it were absent, in every section (unset()).
A number key also takes the text PyYAML leaves a number without a dot as (1e-3), and no number
key takes .nan or .inf. The common numeric training keys transformers does not range-check have
their ranges here (TRAINING_RANGES: learning_rate >= 0, logging_steps > 0, ...), and a string key
typed `SomeEnum | str` (lr_scheduler_type, save_strategy, ...) takes only the enum's values.
An integer key holds a 64-bit integer at most (MAX_INT: max_steps: 10**20 was an OverflowError),
num_train_epochs at most MAX_EPOCHS, and an error message shows a value cut short (readers.brief),
never the whole repr of a huge one.
"""

from __future__ import annotations

import collections.abc
import difflib
import enum
import functools
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Literal, Mapping, Optional, Tuple, Union

from hf_cp.readers import brief
from hf_cp.train.checks.setup import check_parallelism


@dataclass(frozen=True)
class Key:
    """One key of a section: the types it accepts and what it means (for error messages)."""

    types: Tuple[type, ...]
    help: str
    check: Optional[Callable[[object], Optional[str]]] = None  # returns a problem, or None


def _non_negative(v) -> Optional[str]:
    return None if v >= 0 else "must be >= 0"


def _fraction(v) -> Optional[str]:
    return None if 0 < v < 1 else "must be a fraction in (0, 1)"


def _positive(v) -> Optional[str]:
    return None if v > 0 else "must be > 0"


def _unit_interval(v) -> Optional[str]:
    return None if 0 <= v < 1 else "must be in [0, 1)"


def _max_steps(v) -> Optional[str]:
    return None if v > 0 or v == -1 else "must be > 0 (or -1: num_train_epochs decides)"


def _seed(v) -> Optional[str]:
    return None if 0 <= v < 2**32 else "must be in [0, 2**32 - 1] (numpy's seed range)"


# most epochs a run may ask for: the sampler cuts every epoch's batches when the run starts (about
# 50 us per epoch of 240 samples), so 1e20 epochs never started; max_steps bounds a longer run
MAX_EPOCHS = 10_000


def _epochs(v) -> Optional[str]:
    if not v > 0:
        return "must be > 0"
    return None if v <= MAX_EPOCHS else f"must be at most {MAX_EPOCHS} (set max_steps for a longer run)"


# an integer key's range: what a 64-bit integer holds (torch, numpy and the Trainer's counters);
# Python's own integers are unbounded, and 1e20 steps died in an OverflowError (len() of the sampler)
MAX_INT = 2**63 - 1


def _out_of_int_range(section: str, key: str, value: object) -> Optional[str]:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        return f"{section}.{key}: {brief(value)} is out of range: an integer key holds at most 2**63 - 1 ({MAX_INT})"
    return None


_STR = (str,)
_INT = (int,)
_PATH = (str,)

MODEL_KEYS: Dict[str, Key] = {
    "config": Key(_STR, "a model config.json, or a built-in name such as tiny-llama (random weights)"),
    "pretrained": Key(_PATH, "a model folder (or a Hub name when a network is available)"),
    "tokenizer": Key(_PATH, "a tokenizer folder saved with the final model (default: the pretrained folder's)"),
    "attn_implementation": Key(_STR, "attention implementation (hf_cp for CP plans)"),
    "seed": Key(_INT, "seed of the random weights of `config`", _seed),
    "trust_remote_code": Key((bool,), "run Python shipped with a pretrained folder"),
    "model_class": Key(
        _STR,
        "the transformers model class to build or load, for a model no AutoModelForCausalLM builds "
        "(a vision-language model: Qwen2_5_VLForConditionalGeneration); default AutoModelForCausalLM",
    ),
}


def _one_of(*choices: str) -> Callable[[object], Optional[str]]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


DATA_KEYS: Dict[str, Key] = {
    "bundled": Key(
        _STR,
        "a bundled dataset: longtail_sample (token ids), chat_sample (raw chat), toy_preferences (preference "
        "pairs), toy_prompts (prompts) or vlm_sample (images and a clip, for configs/models/tiny-qwen2.5-vl.json)",
    ),
    "path": Key(
        _PATH,
        "a saved `datasets` folder, a .json/.jsonl/.parquet/.csv file (optionally compressed) or a folder of "
        "them: token ids (input_ids, labels) or raw chat / prompt-completion / text rows",
    ),
    "name": Key(_STR, "a Hugging Face Hub dataset (from the datasets cache when offline)"),
    "split": Key(_STR, "the split to read (default train)"),
    "subset": Key(_STR, "the Hub dataset's configuration"),
    "limit": Key(_INT, "keep the first N training samples (0: all)", _non_negative),
    "eval_path": Key(_PATH, "evaluation data, same formats as path"),
    "eval_split": Key((float,), "a held-out fraction of the training samples", _fraction),
    "eval_seed": Key(_INT, "seed of the eval_split draw", _seed),
    "template": Key(_PATH, "a Jinja chat template file for the run's tokenizer (default: the tokenizer's own)"),
    # hf_cp's preprocessing of raw rows (trainer cp; setup/data_section.py)
    "format": Key(
        _STR,
        "auto (token ids when the rows hold input_ids, else chat, prompt-completion or text by their columns), "
        "tokens, chat, prompt-completion or text",
        _one_of("auto", "tokens", "chat", "prompt-completion", "text"),
    ),
    "max_length": Key(
        _INT, "longest sample in tokens (default: no limit; the planner refuses what no group holds)", _positive
    ),
    "overlong": Key(_STR, "samples over max_length: error, drop or truncate", _one_of("error", "drop", "truncate")),
    "mask": Key(
        _STR,
        "tokens without a loss: auto, assistant, last-assistant, completion or none (hf-cp preprocess --mask)",
        _one_of("auto", "assistant", "last-assistant", "completion", "none"),
    ),
    "text_field": Key(_STR, "text rows: the column of the text"),
    "messages_field": Key(_STR, "chat rows: the column of the messages (default messages)"),
    "prompt_field": Key(_STR, "prompt-completion rows: the prompt column (default prompt)"),
    "completion_field": Key(_STR, "prompt-completion rows: the completion column (default completion)"),
    "add_eos": Key((bool,), "text rows: append the tokenizer's EOS token (default true)"),
    "num_proc": Key(_INT, "processes for datasets' map and filter", _positive),
}
# the data keys of hf_cp's own preprocessing: trainer cp only (the TRL trainers tokenise their rows)
PREPROCESS_KEYS = (
    "format", "max_length", "overlong", "mask", "text_field", "messages_field", "prompt_field",
    "completion_field", "add_eos", "num_proc",
)  # fmt: skip

# keys of one section that must not be set together: (a, b, why)
EXCLUSIVE = {
    "model": [("config", "pretrained", "a model is built from a config or loaded from a folder, not both")],
    "data": [
        ("bundled", "path", "data.path would be ignored: train on the bundled dataset or on your own, not both"),
        ("bundled", "name", "data.name would be ignored: train on the bundled dataset or on a Hub one, not both"),
        ("path", "name", "choose one source: a local path or a Hub dataset name"),
        ("eval_path", "eval_split", "choose one source of evaluation data"),
    ],
}


# ranges of the common numeric training keys that TrainingArguments does not check itself (a null
# key is unset and not checked: eval_steps: null takes logging_steps)
TRAINING_RANGES: Dict[str, Callable[[object], Optional[str]]] = {
    "learning_rate": _non_negative,
    "weight_decay": _non_negative,
    "num_train_epochs": _epochs,
    "max_steps": _max_steps,
    "warmup_steps": _non_negative,
    "logging_steps": _positive,
    "save_steps": _positive,
    "eval_steps": _positive,
    "eval_delay": _non_negative,
    "max_grad_norm": _non_negative,
    "adam_beta1": _unit_interval,
    "adam_beta2": _unit_interval,
    "adam_epsilon": _non_negative,
    "label_smoothing_factor": _unit_interval,
    "neftune_noise_alpha": _positive,
    "per_device_eval_batch_size": _positive,
    "dataloader_num_workers": _non_negative,
    "seed": _seed,
    "data_seed": _seed,
}


class TrainConfigError(ValueError):
    """The training config is malformed; the message names the file and field."""


class SchemaError(TrainConfigError):
    """A config key is unknown, mistyped or conflicts with another; the message names it."""


def nearest(key: str, valid: Iterable[str]) -> Optional[str]:
    """The valid key closest to `key` (a typo, another case, a missing underscore), if any is close."""
    valid = list(valid)
    by_folded = {v.lower().replace("-", "_"): v for v in valid}
    folded = key.lower().replace("-", "_")
    if folded in by_folded:
        return by_folded[folded]
    got = difflib.get_close_matches(folded, list(by_folded), n=1, cutoff=0.6)
    return by_folded[got[0]] if got else None


_PACKING = (
    "hf_cp always packs, per step: a step holds cp_tokens_per_step tokens, packed per rank (at most "
    "cp_max_tokens_per_rank) and wave, balanced by predicted time, and documents never attend to each "
    "other: remove it and give the data unpacked"
)
_DEGREE = (
    "hf_cp has no fixed CP degree: set cp_max_tokens_per_rank (what one rank holds) and cp_max_group_size "
    "(the largest group); a sample that fits one rank stays there, a longer one gets the group the planner "
    "finds fastest"
)
_LENGTH = (
    "hf_cp never truncates in training: cap lengths in the data (data.max_length: N with data.overlong: "
    "error|drop|truncate, or hf-cp preprocess --max-length N); a sample longer than the largest group holds is refused by name, unless "
    "cp_balancer: chunkflow (or auto) trains it as dependent chunks"
)
# training keys of TRL, axolotl, LLaMA-Factory, ms-swift, verl and ALST set-ups, with what hf_cp
# does instead (docs/coming_from.md): one line each, not "unknown key" and the list of ~190 names
FOREIGN_TRAINING_KEYS = {
    "packing": _PACKING,
    "sample_packing": _PACKING,
    "padding_free": _PACKING,
    "max_seq_length": _LENGTH,
    "max_length": _LENGTH,
    "sequence_len": _LENGTH,
    "cutoff_len": _LENGTH,
    "sequence_parallel_degree": _DEGREE,
    "sequence_parallel_size": _DEGREE,
    "ulysses_sequence_parallel_size": _DEGREE,
    "context_parallel_size": _DEGREE,
    "cp_size": _DEGREE,
    "sp_size": _DEGREE,
    "ring_attn_func": "hf_cp picks ring or Ulysses attention per CP group (the balancer's shard modes: cp_balancer)",
    "micro_batch_size": (
        "a step holds cp_tokens_per_step tokens (or cp_tokens_per_rank_per_step per rank), planned into waves; "
        "leave per_device_train_batch_size at 1"
    ),
}


# data keys of TRL, axolotl and LLaMA-Factory set-ups, with the data key that does the same here
FOREIGN_DATA_KEYS = {
    "dataset_name": "data.name (a Hub dataset; data.path for a local file or folder)",
    "dataset": "data.name (a Hub dataset) or data.path (a local file or folder)",
    "data_files": "data.path (a .json/.jsonl/.parquet/.csv file or a folder of them)",
    "chat_template": "data.template (a Jinja file; the tokenizer's own by default)",
    "type": "data.format (auto, tokens, chat, prompt-completion or text)",
    "max_seq_length": "data.max_length (with data.overlong: error, drop or truncate)",
    "sequence_len": "data.max_length (with data.overlong: error, drop or truncate)",
    "cutoff_len": "data.max_length (with data.overlong: error, drop or truncate)",
    "field_messages": "data.messages_field",
    "dataset_text_field": "data.text_field",
    "train_on_inputs": "data.mask: none (every token trained; the default trains the answers only)",
    "assistant_only_loss": "data.mask: assistant (the default for chat rows)",
    "completion_only_loss": "data.mask: completion (the default for prompt-completion rows)",
    "dataset_num_proc": "data.num_proc",
}

# hf_cp's own keys under an earlier name: old name -> new name (same meaning)
RENAMED_TRAINING_KEYS = {
    "cp_plan_in_process": "cp_plan_in_subprocess",  # it always meant a forked worker process
}


def unknown_key_message(section: str, key: str, valid: Iterable[str]) -> str:
    if section == "training" and key in RENAMED_TRAINING_KEYS:
        return f"training.{key} was renamed training.{RENAMED_TRAINING_KEYS[key]} (same meaning)"
    if section == "training" and key in FOREIGN_TRAINING_KEYS:
        return f"training.{key} is another trainer's setting: {FOREIGN_TRAINING_KEYS[key]} (docs/coming_from.md)"
    if section == "data" and key in FOREIGN_DATA_KEYS:
        return f"data.{key} is another trainer's setting: here it is {FOREIGN_DATA_KEYS[key]} (docs/commands.md)"
    guess = nearest(key, valid)
    hint = f"did you mean {section}.{guess}?" if guess else "valid keys: " + ", ".join(sorted(valid))
    return f"unknown key {section}.{key}: {hint}"


def unset(values: Optional[Mapping]) -> dict:
    """A section without its null keys: `key: null` is no setting, exactly as if the key were absent."""
    return {k: v for k, v in (values or {}).items() if v is not None}


# a number as PyYAML 1.1 leaves it a string: an exponent without a dot (1e-3, 5E4)
_NUMBER_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _as_number(value: object) -> object:
    """`value`, or the float a number text spells (for a key whose type is a number)."""
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):
        return float(value)
    return value


def _wrong_type(section: str, key: str, expected: str, value: object, help: str = "") -> str:
    if isinstance(value, float) and not math.isfinite(value) and "a number" in expected:
        expected = expected.replace("a number", "a finite number", 1)  # .nan, .inf
    return f"{section}.{key}: expected {expected}{f' ({help})' if help else ''}, got {brief(value)}"


def check_section(section: str, values: object, schema: Mapping[str, Key], source: str) -> dict:
    """Every key of `values` is in `schema`, of an accepted type, and passes its check; returns the
    section as read: null keys left out (unset), number texts (1e-3) as numbers."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise SchemaError(f"{source}: section {section} must be a mapping of keys to values, got {brief(values, 60)}")
    problems, out = [], {}
    for key, value in unset(values).items():
        spec = schema.get(key)
        if spec is None:
            problems.append(unknown_key_message(section, str(key), schema))
            continue
        expected = _Type.of(spec.types[0] if len(spec.types) == 1 else typing.Union[spec.types])
        value = out[key] = expected.read(value)
        if not expected.accepts(value):
            problems.append(_wrong_type(section, key, expected.describe(), value, spec.help))
            continue
        huge = _out_of_int_range(section, key, value)
        if huge:
            problems.append(huge)
            continue
        bad = spec.check(value) if spec.check else None
        if bad:
            problems.append(f"{section}.{key} {bad}, got {brief(value)}")
    for a, b, why in EXCLUSIVE.get(section, []):
        if values.get(a) not in (None, False, "") and values.get(b) not in (None, False, ""):
            problems.append(f"{section}.{a} and {section}.{b} both set: {why}")
    if problems:
        raise SchemaError(f"{source}: " + "; ".join(problems))
    return out


# ---------------------------------------------------------------- types read from annotations
_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
_PLURALS = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}
_ENUM_SHOWN = 8  # enum values named in an error before "..."
_LISTS = (list, tuple, collections.abc.Sequence)
_MAPPINGS = (dict, collections.abc.Mapping)


@dataclass(frozen=True)
class _Type:
    """An annotation (int, `str | None`, `dict | str`, `list[str]`, `IntervalStrategy | str`,
    `Literal[False]`, ...) as a check of a YAML value and a description for its error."""

    annotation: Any

    @staticmethod
    def of(annotation: Any) -> _Type:
        return _Type(annotation)

    def _args(self) -> Tuple[Any, ...]:
        return typing.get_args(self.annotation)

    def _is_union(self) -> bool:
        return typing.get_origin(self.annotation) in (typing.Union, types.UnionType)

    def accepts(self, value: object) -> bool:
        tp, origin = self.annotation, typing.get_origin(self.annotation)
        if tp is Any:
            return True
        if self._is_union():
            return any(_Type(a).accepts(value) for a in self._args())
        if origin is typing.Literal:
            return any(type(value) is type(a) and value == a for a in self._args())
        if tp is type(None):
            return value is None
        if tp is bool:
            return isinstance(value, bool)
        if tp is int:
            return isinstance(value, int) and not isinstance(value, bool)
        if tp is float:  # YAML reads 1 as an int; .nan and .inf are no setting of any number key
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            return number and (isinstance(value, int) or math.isfinite(value))  # 10**400: no float, but finite
        if origin in _LISTS or tp in (list, tuple):
            item = self._args()[0] if self._args() else Any
            return isinstance(value, (list, tuple)) and all(_Type(item).accepts(v) for v in value)
        if origin in _MAPPINGS or tp is dict:
            return isinstance(value, Mapping)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return isinstance(value, tp) or value in {m.value for m in tp}
        if isinstance(tp, type):
            return isinstance(value, tp)
        return True  # an annotation this check cannot read: the dataclass judges the value

    def read(self, value: object) -> object:
        """`value`, with a number text read as the number, where this type takes a number and no string."""
        if isinstance(value, str) and self._takes(float) and not self._takes(str):
            return _as_number(value)
        return value

    def _takes(self, t: type) -> bool:
        if self._is_union():
            return any(_Type(a)._takes(t) for a in self._args())
        return self.annotation is t

    def enum_of_string(self) -> Optional[type]:
        """E for an `E | str` annotation (an enum whose values a string spells): the string must be
        one of E's values (TrainingArguments converts it: SchedulerType, SaveStrategy, ...)."""
        if not self._is_union():
            return None
        members = [a for a in self._args() if a is not type(None)]
        enums = [a for a in members if isinstance(a, type) and issubclass(a, enum.Enum)]
        return enums[0] if len(enums) == 1 and set(members) == {enums[0], str} else None

    def describe(self, plural: bool = False) -> str:
        tp, origin = self.annotation, typing.get_origin(self.annotation)
        if self._is_union():
            members = [a for a in self._args() if a is not type(None)]
            enums = [a for a in members if isinstance(a, type) and issubclass(a, enum.Enum)]
            if enums and str in members:  # `IntervalStrategy | str`: a string, one of the enum's values
                members = [a for a in members if a not in enums]
            names = []
            for a in members:
                name = _Type(a).describe(plural)
                if a is str and enums:
                    name += f" ({_enum_values(enums[0])})"
                if name not in names:
                    names.append(name)
            return " or ".join(names)
        if origin is typing.Literal:
            return " or ".join("true" if a is True else "false" if a is False else repr(a) for a in self._args())
        if tp in _NAMES:
            return _PLURALS.get(tp, _NAMES[tp]) if plural else _NAMES[tp]
        if origin in _LISTS or tp in (list, tuple):
            item = self._args()[0] if self._args() else Any
            return ("lists" if plural else "a list") + (f" of {_Type(item).describe(True)}" if item is not Any else "")
        if origin in _MAPPINGS or tp is dict:
            return "mappings" if plural else "a mapping"
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return ("strings" if plural else "a string") + f" ({_enum_values(tp)})"
        if isinstance(tp, type):
            return f"{tp.__name__} objects" if plural else f"a {tp.__name__}"
        return str(tp)


def _enum_values(e: type) -> str:
    values = [str(m.value) for m in e]
    return ", ".join(values[:_ENUM_SHOWN]) + (", ..." if len(values) > _ENUM_SHOWN else "")


def _config_class(config_class):
    from hf_cp.train.setup.args import CPTrainingArguments  # transformers (TrainingArguments)

    return config_class or CPTrainingArguments


def training_keys(config_class=None) -> Dict[str, str]:
    """The init fields of `config_class` (CPTrainingArguments, or a trainer's config: CPDPOConfig,
    ...) -> their help text."""
    from dataclasses import fields

    return {f.name: str(f.metadata.get("help", "")) for f in fields(_config_class(config_class)) if f.init}


@functools.lru_cache(maxsize=8)
def training_types(config_class=None) -> Dict[str, _Type]:
    """The init fields of `config_class` -> their types, from the dataclass's annotations (as
    transformers' HfArgumentParser reads them)."""
    from dataclasses import fields

    cls = _config_class(config_class)
    hints = dict(typing.get_type_hints(cls), **TRAINING_TYPE_OVERRIDES)
    return {f.name: _Type.of(hints.get(f.name, Any)) for f in fields(cls) if f.init}


# keys whose annotation is wider than what they take, because HfArgumentParser reads no Literal in
# a Union: cp_max_tokens_per_rank is a number or "auto" (the cap that fits the device's memory)
TRAINING_TYPE_OVERRIDES = {"cp_max_tokens_per_rank": Union[int, Literal["auto"]]}


# keys TrainingArguments annotates as text but documents as a switch too (`fsdp=True` turns FSDP on;
# the old option strings "full_shard ..." are deprecated in transformers 5)
BOOL_TRAINING_KEYS = frozenset({"fsdp"})


def check_training_keys(values: Mapping, source: str, config_class=None, elsewhere=None) -> dict:
    """The training section as `config_class` (default CPTrainingArguments; a trainer's config
    for `trainer:`) will take it: its keys are the dataclass's fields and each value is of its
    field's type (null keys left out: unset; an unquoted `no`, which YAML 1.1 reads as false, is
    "no" for the *_strategy keys and report_to; 1e-3 a number). `elsewhere(key)`: the trainers
    whose config has a key this one lacks, named in its refusal."""
    valid, typed = training_keys(config_class), training_types(config_class)
    problems, out = [], {}
    values = unset(values)
    # a mapping cannot become accelerate's ParallelismConfig; the refusal says why and what to do
    check_parallelism(values.get("parallelism_config"))
    for key, value in values.items():
        if key not in valid:
            # a TRL/axolotl habit gets its hf_cp translation even where a TRL config has the key
            # (packing, max_length, padding_free): sending the user to `trainer: sft` or `dpo` would
            # lead into that trainer's own refusal of the same setting
            translated = key in FOREIGN_TRAINING_KEYS or key in RENAMED_TRAINING_KEYS
            owners = elsewhere(str(key)) if elsewhere is not None and not translated else []
            if owners:
                problems.append(
                    f"training.{key} is a setting of trainer: {' / '.join(owners)}, not of this config's trainer; "
                    f"set `trainer: {owners[0]}` at the top of the file (or drop the key)"
                )
                continue
            problems.append(unknown_key_message("training", str(key), valid))
            continue
        # YAML 1.1 reads an unquoted `no` as False: `eval_strategy: no`, `--set training.save_strategy=no`
        if value is False and (key.endswith("_strategy") or key == "report_to"):
            value = "no"
        if key in BOOL_TRAINING_KEYS and isinstance(value, bool):
            out[key] = value
            continue
        expected = typed[key]
        value = out[key] = expected.read(value)
        if not expected.accepts(value):
            problems.append(_wrong_type("training", key, expected.describe(), value))
            continue
        choices = expected.enum_of_string()
        if choices is not None and isinstance(value, str) and value not in {m.value for m in choices}:
            valid_values = ", ".join(str(m.value) for m in choices)
            problems.append(f"training.{key}: expected one of {valid_values} ({choices.__name__}), got {brief(value)}")
            continue
        huge = _out_of_int_range("training", key, value)
        if huge:
            problems.append(huge)
            continue
        check = TRAINING_RANGES.get(key)
        bad = check(value) if check and isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if bad:
            problems.append(f"training.{key} {bad}, got {brief(value)}")
    if problems:
        raise SchemaError(f"{source}: " + "; ".join(problems))
    return out
