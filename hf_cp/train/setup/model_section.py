"""A training config's `model` section: the model's config (a shipped name, a file, or a
pretrained folder), the model built from it, and the run's tokenizer. Heavy libraries (torch,
transformers) are imported where a model or tokenizer is built, so that reading a config stays
light (the dry run, `hf-cp train --help`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from hf_cp.cost.config_files import resolve_config
from hf_cp.cost.dims import MAX_MODEL_DIM
from hf_cp.readers import brief, load_json
from hf_cp.train.setup.config_names import LOOKED, named_errors, resolve_input
from hf_cp.train.setup.schema import TrainConfigError, unset


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
    path = resolve_input(name)
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


def model_class(mcfg: dict, source: str):
    """model.model_class as a transformers model class (default AutoModelForCausalLM); a name that
    is no model class of transformers is refused naming the key."""
    import transformers  # transformers
    from transformers import AutoModelForCausalLM, PreTrainedModel  # transformers

    name = unset(mcfg).get("model_class")
    if name is None:
        return AutoModelForCausalLM
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise TrainConfigError(
            f"{source}: model.model_class {brief(name)} is no model class of transformers (e.g. "
            "Qwen2_5_VLForConditionalGeneration for a Qwen2.5-VL config)"
        )
    return cls


def _from_config(cls, config, source: str, **kwargs):
    """`cls` built from `config`: an Auto class by its from_config, a model class by its own
    (refused naming model.model_class when the config is another model's)."""
    if not hasattr(cls, "config_class"):  # an Auto class
        return cls.from_config(config, **kwargs)
    if not isinstance(config, cls.config_class):
        raise TrainConfigError(
            f"{source}: model.model_class {cls.__name__} takes a {cls.config_class.__name__}, but the model config is "
            f"a {type(config).__name__} (model_type {config.model_type!r})"
        )
    return cls._from_config(config, **kwargs)


def build_model(mcfg: dict, source: str):
    import torch

    import hf_cp.attention.interface  # noqa: F401  torch, transformers: registers attn_implementation="hf_cp"

    mcfg = unset(mcfg)
    attn = mcfg.get("attn_implementation", "hf_cp")
    cls = model_class(mcfg, source)
    if "pretrained" in mcfg:
        model = _from_pretrained(
            cls.from_pretrained,
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
            model = _from_config(cls, config, source, attn_implementation=attn, dtype=torch.float32)
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
    path = Path(resolve_input(str(name)))
    if not path.exists():
        raise TrainConfigError(f"{source}: model.tokenizer {name} does not exist ({LOOKED})")
    from hf_cp.data_prep.tokenizer import load_tokenizer  # transformers, loaded only for a tokenizer

    return load_tokenizer(str(path), trust_remote_code=trust_remote_code(mcfg, source))
