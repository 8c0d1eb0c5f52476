"""Training configs: one YAML file with model, data and training sections, read and checked.

    accelerate launch --config_file recipes/cpu-2proc-zero2.yaml -m hf_cp.train configs/tiny-cpu.yaml

Sections:
    model:    config (a config.json path or a model name, hf_cp.resources), attn_implementation
              (default hf_cp), seed (weights are initialised from it), or pretrained: a folder;
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
              a job restartable (torchrun --max-restarts, see hf_cp.train.resume)
The launch itself (processes, the Trainer, the summary) is hf_cp.train.launch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import yaml

from ..cost import read_yaml_mapping
from ..resources import input_path, shipped_training_configs

DEFAULT_DDP_TIMEOUT_S = 1800  # TrainingArguments.ddp_timeout's default


class TrainConfigError(ValueError):
    """The training config is malformed; the message names the file and field."""


def _resolve(p: str) -> str:
    return str(input_path(p))


def load_config(path: str, overrides: Optional[List[str]] = None) -> dict:
    p = input_path(path)
    if not p.exists():
        raise TrainConfigError(
            f"training config {path}: no such file here, and hf_cp ships none at that path; it ships "
            f"{shipped_training_configs()}"
        )
    cfg = read_yaml_mapping(p, "training config", "a mapping with model/data/training sections", TrainConfigError)
    unknown = set(cfg) - {"model", "data", "training"}
    if unknown:
        raise TrainConfigError(
            f"training config {path}: unknown section(s) {sorted(unknown)}; expected model, data, training"
        )
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise TrainConfigError(f"override {item!r}: expected section.key=value, e.g. training.max_steps=5")
        key, value = item.split("=", 1)
        section, field = key.split(".", 1)
        cfg.setdefault(section, {})[field] = yaml.safe_load(value)
    cfg["_source"] = str(p)
    return cfg


def trust_remote_code(mcfg: dict, source: str) -> bool:
    """model.trust_remote_code, off unless the config says `true`: Python shipped with a model
    folder runs only when the user asks for it."""
    value = mcfg.get("trust_remote_code", False)
    if not isinstance(value, bool):
        raise TrainConfigError(f"{source}: model.trust_remote_code must be true or false, got {value!r}")
    return value


def model_config(mcfg: dict, source: str):
    """The model's transformers config, without building the model or reading weights."""
    from transformers import AutoConfig

    trusted = trust_remote_code(mcfg, source)
    if "pretrained" in mcfg:
        return AutoConfig.from_pretrained(_resolve(mcfg["pretrained"]), trust_remote_code=trusted)
    if "config" not in mcfg:
        raise TrainConfigError(f"{source}: model needs `config` (a config.json) or `pretrained` (a folder)")
    from ..cost import resolve_config

    cpath = resolve_config(mcfg["config"], "models", (".json",))
    d = json.loads(Path(cpath).read_text())
    d.pop("architectures", None)
    mtype = d.pop("model_type", None)
    if mtype is None:
        raise TrainConfigError(f"{source}: model config {cpath} has no model_type")
    return AutoConfig.for_model(mtype, **d)


def build_model(mcfg: dict, source: str):
    import torch
    from transformers import AutoModelForCausalLM

    import hf_cp.attention.interface  # noqa: F401  registers attn_implementation="hf_cp"

    attn = mcfg.get("attn_implementation", "hf_cp")
    if "pretrained" in mcfg:
        model = AutoModelForCausalLM.from_pretrained(
            _resolve(mcfg["pretrained"]), attn_implementation=attn, trust_remote_code=trust_remote_code(mcfg, source)
        )
    else:
        config = model_config(mcfg, source)
        torch.manual_seed(int(mcfg.get("seed", 0)))
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model.config.use_cache = False
    return model


def _read_dataset(path: str, field: str, source: str):
    from datasets import Dataset, load_from_disk

    p = Path(_resolve(path))
    if p.is_dir():
        ds = load_from_disk(str(p))
        if hasattr(ds, "keys"):
            ds = ds["train"]
        return ds
    if p.suffix in (".jsonl", ".gz"):
        import gzip

        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as f:
            return Dataset.from_list([json.loads(line) for line in f if line.strip()])
    raise TrainConfigError(f"{source}: data.{field} {p} is neither a saved dataset folder nor a .jsonl[.gz]")


def load_datasets(dcfg: dict, source: str):
    """(train, eval or None). Evaluation data: data.eval_path (same formats as path), or
    data.eval_split: a fraction of the samples held out (seeded by data.eval_seed, default 0)."""
    from ..data import load_sample_dataset

    limit = int(dcfg.get("limit", 0) or 0)
    if dcfg.get("bundled"):
        if dcfg["bundled"] != "longtail_sample":
            raise TrainConfigError(
                f"{source}: data.bundled {dcfg['bundled']!r}: the bundled dataset is longtail_sample"
            )
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


def training_arguments(tcfg: dict, source: str):
    from .args import CPTrainingArguments

    t = dict(tcfg)
    for k, v in t.items():
        # YAML 1.1 reads an unquoted `no` as False: `eval_strategy: no`, `--set training.save_strategy=no`
        if v is False and (k.endswith("_strategy") or k == "report_to"):
            t[k] = "no"
    if t.get("report_to") == "tensorboard_if_installed":
        try:
            import tensorboard  # noqa: F401

            t["report_to"] = ["tensorboard"]
        except ImportError:
            t["report_to"] = "none"
    try:
        return CPTrainingArguments(**t)
    except TypeError as e:
        raise TrainConfigError(f"{source}: training: {e}") from None
