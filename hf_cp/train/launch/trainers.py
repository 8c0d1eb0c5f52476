"""The trainers a training config names with `trainer:`, and how `hf-cp train` builds each.

    trainer: cp     CPTrainer on token ids (input_ids, labels; hf-cp preprocess, the bundled sample)
    trainer: sft    CPSFTTrainer: TRL tokenises prompt/completion, messages or text rows
    trainer: dpo    CPDPOTrainer: prompt/chosen/rejected rows
    trainer: kto    CPKTOTrainer: prompt/completion/label rows (or pairs, which TRL unpairs)
    trainer: grpo   CPGRPOTrainer: prompt rows and a reward section
    trainer: rloo   CPRLOOTrainer: prompt rows and a reward section

The training section is checked against the chosen trainer's config class (CPDPOConfig's
`beta`, CPGRPOConfig's `num_generations`, ...); a key of another trainer is refused naming it.
TRL's trainers are imported when named (the `trl` extra).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, fields
from typing import Callable, Dict, List, Sequence, Tuple

from hf_cp.train.setup.config import TrainConfigError, TrainerTable
from hf_cp.train.setup.peft_section import peft_config_of


@dataclass(frozen=True)
class TrainerSpec:
    module: str  # under hf_cp.train
    trainer: str
    config: str
    columns: Tuple[Tuple[str, ...], ...]  # the data must hold one of these column sets
    reference: bool = False  # takes a reference model (a copy of the initial policy when none is given)


SPECS: Dict[str, TrainerSpec] = {
    "cp": TrainerSpec("trainer", "CPTrainer", "CPTrainingArguments", (("input_ids",),)),
    "sft": TrainerSpec(
        "objectives.sft",
        "CPSFTTrainer",
        "CPSFTConfig",
        (("prompt", "completion"), ("messages",), ("text",), ("input_ids",)),
    ),
    "dpo": TrainerSpec("objectives.dpo", "CPDPOTrainer", "CPDPOConfig", (("chosen", "rejected"),), reference=True),
    "kto": TrainerSpec(
        "objectives.kto",
        "CPKTOTrainer",
        "CPKTOConfig",
        (("prompt", "completion", "label"), ("chosen", "rejected")),
        reference=True,
    ),
    "grpo": TrainerSpec("objectives.grpo", "CPGRPOTrainer", "CPGRPOConfig", (("prompt",),)),
    "rloo": TrainerSpec("objectives.rloo", "CPRLOOTrainer", "CPRLOOConfig", (("prompt",),)),
}
CONFIG_MODULES = {"cp": "setup.args"}  # where a trainer's config class lives, when not beside it


def _import(name: str):
    """hf_cp.train.<name>: TRL's trainers load TRL (the `trl` extra), so only when a config names one."""
    try:
        return importlib.import_module(f"hf_cp.train.{name}")
    except ImportError as e:
        raise TrainConfigError(f"this trainer needs TRL: pip install 'hf_cp[trl]' ({e})") from None


class Trainers(TrainerTable):
    names = tuple(SPECS)

    def config_class(self, name: str) -> type:
        spec = SPECS[name]
        return getattr(_import(CONFIG_MODULES.get(name, spec.module)), spec.config)

    def trainer_class(self, name: str) -> type:
        spec = SPECS[name]
        return getattr(_import(spec.module), spec.trainer)

    def having(self, key: str, besides: str) -> List[str]:
        """The trainers (other than `besides`) whose config has `key`, TRL's trainers only where
        TRL is installed."""
        out = []
        for name in SPECS:
            if name == besides:
                continue
            try:
                if key in {f.name for f in fields(self.config_class(name))}:
                    out.append(name)
            except TrainConfigError:  # TRL absent
                continue
        return out


TRAINERS = Trainers()


def check_columns(name: str, dataset, source: str) -> None:
    """The data holds one of the column sets the trainer takes, or the error names them all."""
    have = set(getattr(dataset, "column_names", None) or [])
    sets = SPECS[name].columns
    if not any(set(cols) <= have for cols in sets):
        wanted = " or ".join("/".join(cols) for cols in sets)
        raise TrainConfigError(
            f"{source}: trainer: {name} trains on rows with {wanted}; the data has columns {sorted(have)}"
        )


def reward_functions(functions: Sequence[str], source: str) -> List[Callable]:
    """The reward section's "module:callable" names, imported (the user's own module)."""
    out = []
    for item in functions:
        module, _, attr = item.partition(":")
        try:
            func = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise TrainConfigError(f"{source}: reward.functions: {item!r} does not import: {e}") from None
        if not callable(func):
            raise TrainConfigError(f"{source}: reward.functions: {item!r} is not callable")
        out.append(func)
    return out


def build_trainer(cfg: dict, args, model, tokenizer, dataset, eval_dataset):
    """The config's trainer over the built pieces."""
    name, src = cfg["trainer"], cfg["_source"]
    check_columns(name, dataset, src)
    if name != "cp" and tokenizer is None:
        raise TrainConfigError(
            f"{src}: trainer: {name} tokenises text: give model.tokenizer (a folder) or a model.pretrained folder "
            "that holds its tokenizer"
        )
    kwargs = dict(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset, processing_class=tokenizer)
    lora = peft_config_of(cfg)
    if lora is not None and name != "cp":  # trainer: cp gets a model already wrapped (entry.py)
        kwargs["peft_config"] = lora
    # the initial policy: TRL would load it again from a path the model may not have; under PEFT
    # the policy with its adapter disabled is the reference, and a copy would only cost memory
    if SPECS[name].reference and lora is None:
        kwargs["ref_model"] = copy.deepcopy(model)
    if cfg.get("reward"):
        kwargs["reward_funcs"] = reward_functions(cfg["reward"]["functions"], src)
    return TRAINERS.trainer_class(name)(**kwargs)
