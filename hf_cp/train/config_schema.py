"""The schema of a training config: which keys each section takes, what type each holds, and
which keys exclude each other. A typo is an error that names the key and the nearest valid one
(model.attn_implemention: did you mean model.attn_implementation?), not a setting silently
ignored. The training section's keys are CPTrainingArguments' fields, read from the dataclass.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple


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


_STR = (str,)
_INT = (int,)
_PATH = (str,)

MODEL_KEYS: Dict[str, Key] = {
    "config": Key(_STR, "a model config.json, or a built-in name such as tiny-llama (random weights)"),
    "pretrained": Key(_PATH, "a model folder (or a Hub name when a network is available)"),
    "tokenizer": Key(_PATH, "a tokenizer folder saved with the final model (default: the pretrained folder's)"),
    "attn_implementation": Key(_STR, "attention implementation (hf_cp for CP plans)"),
    "seed": Key(_INT, "seed of the random weights of `config`"),
    "trust_remote_code": Key((bool,), "run Python shipped with a pretrained folder"),
}

DATA_KEYS: Dict[str, Key] = {
    "bundled": Key(_STR, "a bundled dataset: longtail_sample"),
    "path": Key(_PATH, "a saved `datasets` folder or a .jsonl[.gz] of input_ids (and labels)"),
    "limit": Key(_INT, "keep the first N training samples (0: all)", _non_negative),
    "eval_path": Key(_PATH, "evaluation data, same formats as path"),
    "eval_split": Key((float,), "a held-out fraction of the training samples", _fraction),
    "eval_seed": Key(_INT, "seed of the eval_split draw"),
}

# keys of one section that must not be set together: (a, b, why)
EXCLUSIVE = {
    "model": [("config", "pretrained", "a model is built from a config or loaded from a folder, not both")],
    "data": [
        ("bundled", "path", "data.path would be ignored: train on the bundled dataset or on your own, not both"),
        ("eval_path", "eval_split", "choose one source of evaluation data"),
    ],
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


def unknown_key_message(section: str, key: str, valid: Iterable[str]) -> str:
    guess = nearest(key, valid)
    hint = f"did you mean {section}.{guess}?" if guess else "valid keys: " + ", ".join(sorted(valid))
    return f"unknown key {section}.{key}: {hint}"


def _type_name(types: Tuple[type, ...]) -> str:
    return " or ".join({str: "a string", int: "an integer", float: "a number", bool: "true/false"}[t] for t in types)


def check_section(section: str, values: object, schema: Mapping[str, Key], source: str) -> None:
    """Every key of `values` is in `schema`, of an accepted type, and passes its check."""
    if values is None:
        return
    if not isinstance(values, Mapping):
        raise SchemaError(f"{source}: section {section} must be a mapping of keys to values, got {values!r:.60}")
    problems = []
    for key, value in values.items():
        spec = schema.get(key)
        if spec is None:
            problems.append(unknown_key_message(section, str(key), schema))
            continue
        if value is None:
            continue
        types = spec.types + ((int,) if float in spec.types else ())  # YAML reads 1 as int
        if isinstance(value, bool) and bool not in spec.types or not isinstance(value, types):
            problems.append(f"{section}.{key} must be {_type_name(spec.types)} ({spec.help}), got {value!r:.60}")
            continue
        bad = spec.check(value) if spec.check else None
        if bad:
            problems.append(f"{section}.{key} {bad}, got {value!r}")
    for a, b, why in EXCLUSIVE.get(section, []):
        if values.get(a) not in (None, False, "") and values.get(b) not in (None, False, ""):
            problems.append(f"{section}.{a} and {section}.{b} both set: {why}")
    if problems:
        raise SchemaError(f"{source}: " + "; ".join(problems))


def training_keys() -> Dict[str, str]:
    """CPTrainingArguments' init fields -> their help text."""
    from dataclasses import fields

    from hf_cp.train.args import CPTrainingArguments  # transformers (TrainingArguments)

    return {f.name: str(f.metadata.get("help", "")) for f in fields(CPTrainingArguments) if f.init}


def check_training_keys(values: Mapping, source: str) -> None:
    """The training section's keys are CPTrainingArguments fields (types are the dataclass's to check)."""
    valid = training_keys()
    problems = [unknown_key_message("training", str(k), valid) for k in values if k not in valid]
    if problems:
        raise SchemaError(f"{source}: " + "; ".join(problems))
