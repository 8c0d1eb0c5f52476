"""The `peft:` section of a training config: a LoRA adapter, as peft.LoraConfig takes it.

    peft: {r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj], lora_dropout: 0.0}

Its keys are LoraConfig's own fields (a key it lacks is refused naming the valid ones);
task_type defaults to CAUSAL_LM. With the section, `trainer: cp` wraps the model in
peft.get_peft_model (launch/entry.py) and the TRL trainers take it as `peft_config` (DPO and KTO
then use the policy with its adapter disabled as the reference, not a copy). The dry run wraps
its meta-device model too, so target_modules that name no module are refused before launch.
peft is the optional `peft` extra, imported only when a config has the section.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import List, Mapping, Optional

from hf_cp.readers import brief
from hf_cp.train.setup.schema import TrainConfigError, nearest, unset

DEFAULT_TASK_TYPE = "CAUSAL_LM"  # get_peft_model then builds a PeftModelForCausalLM, as TRL does


def _peft():
    """peft, or the error naming its extra (only a config with a `peft:` section needs it)."""
    try:
        return importlib.import_module("peft")
    except ImportError as e:
        raise TrainConfigError(f"a peft: section needs peft: pip install 'hf_cp[peft]' ({e})") from None


def lora_keys() -> List[str]:
    """The keys a `peft:` section may set: LoraConfig's constructor fields."""
    return sorted(f.name for f in dataclasses.fields(_peft().LoraConfig) if f.init)


def check_peft(section, source: str) -> dict:
    """The `peft:` section, its keys checked against LoraConfig's fields and built once (so a bad
    value is refused when the config is read, naming peft.KEY); {} without a section."""
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise TrainConfigError(f"{source}: section `peft` must be a mapping of LoraConfig keys, got {brief(section)}")
    values = unset(section)
    valid = lora_keys()
    for key in values:
        if key not in valid:
            guess = nearest(str(key), valid)
            hint = f"did you mean peft.{guess}? " if guess else ""
            raise TrainConfigError(
                f"{source}: unknown key peft.{key}: {hint}the peft section takes peft.LoraConfig's fields: "
                + ", ".join(valid)
            )
    values.setdefault("task_type", DEFAULT_TASK_TYPE)
    lora_config(values, source)  # LoraConfig's own checks (r > 0, ...), now rather than at launch
    return values


def lora_config(values: Mapping, source: str):
    """The LoraConfig of a checked `peft:` section (check_peft's result)."""
    try:
        return _peft().LoraConfig(**values)
    except (TypeError, ValueError) as e:
        raise TrainConfigError(f"{source}: peft: LoraConfig refused the section: {e}") from None


def peft_config_of(cfg: Mapping) -> Optional[object]:
    """The LoraConfig a loaded config asks for, or None."""
    values = cfg.get("peft") or {}
    return lora_config(values, cfg["_source"]) if values else None


def wrap_model(model, cfg: Mapping):
    """`model` wrapped by peft.get_peft_model with the config's LoraConfig (the model as it is
    without a `peft:` section); target_modules that match no module are refused naming them."""
    lora = peft_config_of(cfg)
    if lora is None:
        return model
    try:
        return _peft().get_peft_model(model, lora)
    except ValueError as e:  # peft's NoMatchingPeftModuleError is one
        raise TrainConfigError(f"{cfg['_source']}: peft: {e}") from None


def adapter_line(wrapped, cfg: Mapping) -> str:
    """What the adapter trains, for the dry run's report (`wrapped`: wrap_model's result)."""
    values = cfg["peft"]
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    targets = values.get("target_modules")
    targets = ", ".join(targets) if isinstance(targets, (list, tuple)) else (targets or "peft's default modules")
    return (
        f"peft: LoRA r={values.get('r', 'default')} on {targets}: {trainable:,} trainable parameters of "
        f"{total:,} (the base model frozen)"
    )
