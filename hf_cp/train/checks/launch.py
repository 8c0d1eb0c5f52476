"""What a launch would trip over in its settings, checked at set-up by CPTrainer and, before any
launch, by the dry run: the DeepSpeed JSON against the training arguments (transformers' own
consistency check, for the target world size and precision) and against DeepSpeed's own
validation; the collective timeout; the output folder; the reporting integrations.

Before, each of these passed the dry run and failed the launch on every rank: DeepSpeed's
"Check batch related parameters" assertion, transformers' "Please correct the following
DeepSpeed config values", a pydantic error for `"stage": 7`, `ddp_timeout: 0` in the process
group, an `output_dir` that is a file, an unknown `report_to`.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Optional, Set

from hf_cp.readers import load_json  # nesting bounded (readers.py)
from hf_cp.train.checks.setup import SetupError

# DeepSpeed keys read outside DeepSpeedConfig's parse (by the engine, the profiler, the aio and
# activation checkpointing set-up), on top of those the parse reads (_keys_deepspeed_reads)
DEEPSPEED_KEYS_READ_LATER = frozenset(
    {
        "flops_profiler",
        "activation_checkpointing",
        "aio",
        "checkpoint_engine",
        "sequence_parallel_size",
        "use_data_before_expert_parallel_",
        "zero_allow_untested_optimizer",
    }
)
# what HfTrainerDeepSpeedConfig.trainer_config_process reads of the training arguments
_DEEPSPEED_RULE_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_grad_norm",
    "learning_rate",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "weight_decay",
    "save_on_each_node",
    "fp16",
    "bf16",
    "fp16_full_eval",
    "bf16_full_eval",
)
# transformers' reporting integrations are looked up by these names; "all" and "none" are its own
REPORT_TO_SPECIAL = ("all", "none")


def _deepspeed_dict(deepspeed: Any, where: str) -> Optional[dict]:
    """The DeepSpeed config as the user wrote it (a path or a dict), None without DeepSpeed."""
    if not deepspeed:
        return None
    if isinstance(deepspeed, Mapping):
        return copy.deepcopy(dict(deepspeed))
    path = Path(str(deepspeed))
    try:
        data = load_json(path.read_text())
    except (OSError, ValueError) as e:
        raise SetupError(f"{where}: deepspeed {str(path)!r} cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise SetupError(f"{where}: deepspeed {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


class _ReadKeys(dict):
    """A dict that records which keys are read: what DeepSpeed's config parse looks at."""

    def __init__(self, data: dict, read: Set[str]):
        super().__init__(data)
        self._read = read

    def __getitem__(self, k):
        self._read.add(k)
        return super().__getitem__(k)

    def get(self, k, default=None):
        self._read.add(k)
        return super().get(k, default)

    def __contains__(self, k):
        self._read.add(k)
        return super().__contains__(k)

    def pop(self, k, *default):
        self._read.add(k)
        return super().pop(k, *default)

    def setdefault(self, k, default=None):
        self._read.add(k)
        return super().setdefault(k, default)


def _deepspeed_validation(filled: dict, where: str) -> Set[str]:
    """DeepSpeed's own parse of `filled` (every "auto" replaced): its pydantic models refuse an
    unknown ZeRO stage or an unknown key inside a section. Returns the top-level keys it read.
    The batch sizes are checked by transformers' rule for the target world size, so the parse
    here is given the one a single process would compute."""
    from deepspeed.runtime.config import DeepSpeedConfig  # deepspeed, only for a DeepSpeed run

    cfg = dict(filled)
    cfg.pop("train_batch_size", None)  # DeepSpeed derives it: micro-batch x accumulation x world
    read: Set[str] = set()
    try:
        DeepSpeedConfig(_ReadKeys(cfg, read))
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError, DeepSpeed's assertions
        text = " ".join(str(e).split())
        raise SetupError(f"{where}: DeepSpeed refuses its config: {text[:600]}") from None
    return read


def check_optimizer_choice(args, raw: Mapping, where: str) -> None:
    """A DeepSpeed config with an `optimizer` section replaces the Trainer's `optim` without a
    word (transformers builds DeepSpeed's optimizer instead): refused by name when `optim` asks
    for another kind than the section's (an Adam-family optim beside an Adam/AdamW section is
    the same choice, and the section's hyper-parameters are checked against the arguments)."""
    section = raw.get("optimizer")
    if not isinstance(section, Mapping):
        return
    kind = str(section.get("type", "")).lower()
    optim = str(getattr(getattr(args, "optim", ""), "value", getattr(args, "optim", "")))
    if optim.lower().startswith("adam") and kind.startswith("adam"):
        return
    raise SetupError(
        f"{where}: optim={optim!r} is not what would run: the DeepSpeed config's optimizer section "
        f"(type {section.get('type')!r}) replaces the Trainer's optimizer. Remove the section to train with "
        f"optim={optim!r} (DeepSpeed then wraps the Trainer's), or drop optim to keep the section's"
    )


def check_deepspeed_config(
    args, world_size: int, where: str, half_precision: Optional[Dict[str, bool]] = None
) -> List[str]:
    """Refuse a DeepSpeed JSON that contradicts the training arguments (micro-batch, gradient
    accumulation, train_batch_size at `world_size`, learning rate, betas, eps, weight decay,
    clipping, fp16/bf16: transformers' own rule, where "auto" takes the argument's value) or
    that DeepSpeed's parse refuses; warnings for top-level keys DeepSpeed never reads (ignored
    silently by it) and an NVMe path that does not exist. `half_precision`: {"bf16", "fp16"} as
    the launch will have them (the dry run builds its arguments in fp32)."""
    raw = _deepspeed_dict(getattr(args, "deepspeed", None), where)
    if raw is None:
        return []
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig  # the Trainer's own rule

    precision = half_precision or {}
    # the arguments transformers' rule reads, at the launch's world size and precision
    shim = SimpleNamespace(**{k: getattr(args, k) for k in _DEEPSPEED_RULE_FIELDS})
    shim.world_size = world_size
    shim.bf16 = bool(precision.get("bf16", args.bf16))
    shim.fp16 = bool(precision.get("fp16", args.fp16))
    hf = HfTrainerDeepSpeedConfig(raw)
    hf.trainer_config_process(shim)
    if hf.mismatches:
        raise SetupError(
            f"{where}: the DeepSpeed config contradicts the training arguments at {world_size} rank(s):\n"
            + "\n".join(hf.mismatches)
            + "\nSet these DeepSpeed values to 'auto' (they then take the training arguments'), or change the "
            "training arguments"
        )
    check_optimizer_choice(args, raw, where)
    warnings = []
    read = _deepspeed_validation(hf.config, where) | DEEPSPEED_KEYS_READ_LATER
    for key in sorted(set(raw) - read):
        close = difflib.get_close_matches(key, sorted(read), n=1)
        warnings.append(
            f"{where}: DeepSpeed config key {key!r} is not one DeepSpeed reads; it is ignored"
            + (f" (did you mean {close[0]!r}?)" if close else "")
        )
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), Mapping) else {}
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section) if isinstance(zero.get(section), Mapping) else {}
        path = offload.get("nvme_path")
        if offload.get("device") == "nvme" and (not path or not Path(str(path)).is_dir()):
            raise SetupError(
                f"{where}: zero_optimization.{section}.nvme_path {path!r} is not a folder: NVMe offload needs an "
                f"existing folder on a fast local disk"
            )
        if path and offload.get("device") != "nvme":
            warnings.append(
                f"{where}: zero_optimization.{section}.nvme_path is set but its device is "
                f"{offload.get('device')!r}, not 'nvme': the path is not used"
            )
    return warnings


def check_ddp_timeout(value, where: str) -> None:
    """ddp_timeout bounds every collective (groups.bound_every_group): a positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SetupError(
            f"{where}: ddp_timeout {value!r} must be a positive number of seconds (how long a collective waits "
            f"for a slow or stopped rank before the run fails; transformers' default is 1800)"
        )


def check_output_dir(output_dir, where: str) -> None:
    """output_dir must name a folder that exists and is writable, or can be created."""
    if output_dir is None or not str(output_dir).strip():
        raise SetupError(f"{where}: output_dir is empty: name the folder for checkpoints, logs and the final model")
    path = Path(str(output_dir)).expanduser()
    if path.exists() and not path.is_dir():
        raise SetupError(f"{where}: output_dir {str(path)!r} is a file, not a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():  # a file on the way: the folder cannot be made under it
        raise SetupError(
            f"{where}: output_dir {str(path)!r} cannot be created: {str(existing)!r} on its path is a file, not a folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "folder" if existing == path else f"folder {str(existing)!r}, where it would be created,"
        raise SetupError(f"{where}: output_dir {str(path)!r}: the {what} is not writable by this user")


def check_report_to(report_to, where: str) -> None:
    """Every name of report_to is one of transformers' reporting integrations (or all / none)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK  # transformers' registry

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    known = sorted(INTEGRATION_TO_CALLBACK)
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK and name not in REPORT_TO_SPECIAL:
            close = difflib.get_close_matches(str(name), known, n=1)
            raise SetupError(
                f"{where}: report_to {name!r} is not a reporting integration of transformers"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; it knows {', '.join(known)}, and 'all' or 'none'"
            )


def check_launch_settings(
    args, world_size: int, where: str, half_precision: Optional[Dict[str, bool]] = None
) -> List[str]:
    """Every check above, in the order a launch meets them; returns warnings."""
    check_ddp_timeout(args.ddp_timeout, where)
    check_output_dir(args.output_dir, where)
    check_report_to(args.report_to, where)
    return check_deepspeed_config(args, world_size, where, half_precision)
